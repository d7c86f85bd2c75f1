"""TVM's tensor intrinsics modules (``tvm.s_tir.tensor_intrin`` and its CUDA and ROCm
modules), imported with TVMScript's frame capture made cheap.

Importing one registers hundreds of TVMScript functions. Each ``T.prim_func`` takes
``inspect.stack()`` to find the scopes it was defined in, and inside an import that
stack holds the import system's frozen frames, whose source file ``inspect`` looks for
by scanning every loaded module, once a frame and function: half a minute a process
(more with torch loaded). The decorator reads the frames themselves and the source line
of the third (a class's decorator there means a method); :func:`imported` gives it
those frames, that line, and no other source lines while the import runs."""
import contextlib
import importlib
import inspect
import linecache
import sys
import types

#: The TVMScript entry whose ``prim_func`` takes ``inspect.stack()``.
_ENTRY = "tvm.tirx.script.parser.entry"
#: The frame whose source line ``prim_func`` reads (``utils.is_defined_in_class``).
_READ_FRAME = 2


def imported(name: str) -> types.ModuleType:
    """``importlib.import_module(name)`` for a module of ``tvm.s_tir.tensor_intrin``,
    ``prim_func``'s frame capture made cheap while it runs (module docstring)."""
    if name in sys.modules:
        return sys.modules[name]
    with _cheap_frames():
        return importlib.import_module(name)


def _stack(context=1):
    """``inspect.stack(context)``'s frames from its caller out, with the source line of
    frame :data:`_READ_FRAME` alone."""
    infos = []
    frame = sys._getframe(1)  # pylint: disable=protected-access
    while frame is not None:
        filename, lineno = frame.f_code.co_filename, frame.f_lineno
        line = linecache.getline(filename, lineno) if len(infos) == _READ_FRAME and context > 0 else ""
        infos.append(inspect.FrameInfo(frame, filename, lineno, frame.f_code.co_name, [line] if line else None,
                                       0 if line else None))
        frame = frame.f_back
    return infos


@contextlib.contextmanager
def _cheap_frames():
    entry = importlib.import_module(_ENTRY)
    cheap = types.ModuleType("inspect")
    cheap.__dict__.update(inspect.__dict__)
    cheap.stack = _stack
    entry.inspect = cheap
    try:
        yield
    finally:
        entry.inspect = inspect
