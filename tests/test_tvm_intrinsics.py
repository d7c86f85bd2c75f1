"""TVM's tensor intrinsics imported with a cheap frame capture
(:mod:`tvm_cascade.tvm_intrinsics`): ``prim_func`` gets the frames and the one source
line it reads from ``inspect.stack()``, and the intrinsics it registers are TVM's."""
import importlib
import inspect
import subprocess
import sys

import tvm

from tvm_cascade import tvm_intrinsics


def _both():
    return tvm_intrinsics._stack(), inspect.stack()  # pylint: disable=protected-access


def test_the_stack_has_inspects_frames_and_the_line_prim_func_reads():
    cheap, full = _both()
    assert [f.frame for f in cheap] == [f.frame for f in full]
    assert [(f.filename, f.function) for f in cheap] == [(f.filename, f.function) for f in full]
    assert [f.lineno for f in cheap[1:]] == [f.lineno for f in full[1:]]
    read = tvm_intrinsics._READ_FRAME  # pylint: disable=protected-access
    assert cheap[read].code_context == full[read].code_context is not None
    assert all(f.code_context is None for i, f in enumerate(cheap) if i != read)


def test_imported_registers_the_intrinsics_and_restores_the_entry():
    """The CUDA intrinsics a schedule tensorizes with are registered, and the TVMScript
    entry takes ``inspect`` itself again afterwards."""
    cuda = tvm_intrinsics.imported("tvm.s_tir.tensor_intrin.cuda")
    assert tvm.s_tir.TensorIntrin.get(cuda.LDMATRIX_f16_A_INTRIN) is not None
    assert importlib.import_module(tvm_intrinsics._ENTRY).inspect is inspect  # pylint: disable=protected-access
    assert tvm_intrinsics.imported("tvm.s_tir.tensor_intrin.cuda") is cuda


_DIGEST = """
import hashlib, sys
import tvm
if sys.argv[1] == "cheap":
    from tvm_cascade.tvm_intrinsics import imported
    cuda = imported("tvm.s_tir.tensor_intrin.cuda")
else:
    from tvm.s_tir.tensor_intrin import cuda
digest = hashlib.sha256()
for name in sorted(n for n in dir(cuda) if n.endswith("_INTRIN")):
    intrin = tvm.s_tir.TensorIntrin.get(getattr(cuda, name), allow_missing=True)
    if intrin is not None:
        digest.update(name.encode() + intrin.desc.script().encode() + intrin.impl.script().encode())
print(digest.hexdigest())
"""


def test_the_intrinsics_are_tvms_own():
    """In fresh processes, the CUDA intrinsics registered by :func:`imported` and by
    TVM's own import print the same."""
    digests = [subprocess.run([sys.executable, "-c", _DIGEST, way], capture_output=True, text=True, check=True).stdout
               for way in ("cheap", "tvm")]
    assert digests[0] == digests[1] and len(digests[0].strip()) == 64
