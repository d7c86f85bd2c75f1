"""Programmatic dependent launch (Hopper) for functions of several kernels.

A split-k decode function launches its chunk kernel, then a short combine kernel. In
order, the combine's launch and ramp (2-4 µs) follow the chunks' last block. With
programmatic dependent launch a kernel may be launched while the kernel before it in the
stream still runs: its blocks take SMs as the earlier kernel's blocks leave and wait at
``griddepcontrol.wait`` until that kernel has completed and its writes are visible.

TVM 0.27 launches a kernel so (``cuLaunchKernelEx`` with programmatic stream
serialization) when its PrimFunc's ``tirx.kernel_launch_params`` names
:data:`LAUNCH_TAG`, which ``SplitHostDevice`` passes on to every kernel of the function.
Every such kernel, the first included (it may start before whatever kernel wrote its
inputs), must therefore wait before it touches global memory: :func:`wait_first` puts
``griddepcontrol.wait`` first in each kernel, then ``griddepcontrol.launch_dependents``,
which lets the next kernel launch once every block of this one has started; by then no
block of this kernel still needs an SM, so the next kernel's waiting blocks delay none.
A kernel that has work to do before it may read what the kernels before it write (an
L2 prefetch of its weights) places its own :func:`wait` after that work, before any
read or write of global memory: it is given only ``launch_dependents``.
"""
import re

import tvm_ffi
from tvm import tirx
from tvm.ir import expr as ir_expr

#: TVM 0.27's launch parameter for programmatic dependent launch (its spelling).
LAUNCH_TAG = "tirx.use_programtic_dependent_launch"
LAUNCH_PARAMS = "tirx.kernel_launch_params"
#: The first compute capability with ``griddepcontrol``.
MIN_ARCH = 90


def supported(target):
    """Whether ``target`` is a CUDA target of compute capability 9.0 or later."""
    arch = re.fullmatch(r"sm_(\d+)[a-z]?", str(target.attrs.get("arch", ""))) if target.kind.name == "cuda" else None
    return arch is not None and int(arch.group(1)) >= MIN_ARCH


def kernel_count(func):
    """The kernels ``func`` launches: its outermost ``blockIdx``-bound loops, or
    ``blockIdx`` launches (``T.launch_thread``) of a function written without them."""
    def bound(node):
        if isinstance(node, tirx.For):
            return node.thread_binding is not None and node.thread_binding.thread_tag.startswith("blockIdx")
        return (
            isinstance(node, tirx.AttrStmt) and node.attr_key == "thread_extent"
            and node.node.thread_tag.startswith("blockIdx")
        )

    grids, nested = [], []
    tvm_ffi.structural_walk(func.body, lambda node: grids.append(node) if bound(node) else None)
    for grid in grids:
        tvm_ffi.structural_walk(grid.body, lambda node: nested.append(node) if bound(node) else None)
    return len(grids) - len(nested)


def enable(func):
    """``func`` with its kernels launched as programmatic dependents."""
    params = _launch_params(func)
    return func if LAUNCH_TAG in params else func.with_attr(LAUNCH_PARAMS, params + [LAUNCH_TAG])


def _launch_params(func):
    return list(func.attrs.get(LAUNCH_PARAMS, [])) if func.attrs is not None else []


def _griddepcontrol(action):
    return tirx.Evaluate(tirx.call_intrin("", "tirx.ptx.griddepcontrol", action, ""))


def wait():
    """A kernel's own ``griddepcontrol.wait`` (see the module docstring), to evaluate."""
    return tirx.call_intrin("", "tirx.ptx.griddepcontrol", "wait", "")


def _waits(body):
    found = []
    tvm_ffi.structural_walk(body, lambda node: found.append(node) if (
        isinstance(node, ir_expr.Call) and getattr(node.op, "name", "") == "tirx.ptx.griddepcontrol"
        and str(node.args[0].value) == "wait") else None)
    return bool(found)


@tirx.transform.prim_func_pass(opt_level=0, name="tvm_cascade.WaitFirst")
def wait_first(func, _mod, _ctx):
    """Prefix each kernel launched as a programmatic dependent with
    ``griddepcontrol.wait`` (unless it places its own: :func:`wait`) and
    ``griddepcontrol.launch_dependents``; other functions unchanged. Runs on device
    functions (after ``SplitHostDevice``)."""
    if LAUNCH_TAG not in _launch_params(func):
        return func
    first = [] if _waits(func.body) else [_griddepcontrol("wait")]
    return func.with_body(tirx.SeqStmt(first + [_griddepcontrol("launch_dependents"), func.body]))
