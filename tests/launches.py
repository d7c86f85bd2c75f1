"""What a kernel's PrimFunc launches, for tests that check its grid, and how its
kernels begin in CUDA."""
import re

import tvm
import tvm_ffi

#: The prologue of a kernel launched as a programmatic dependent, in CUDA.
WAITS = ["tvm_builtin_ptx_griddepcontrol_wait();", "tvm_builtin_ptx_griddepcontrol_launch_dependents();"]


def grids(func):
    """The extents of ``func``'s ``blockIdx.x``, a kernel's each in launch order: ints,
    or expressions of its shapes."""
    extents = []

    def visit(node):
        if isinstance(node, tvm.tirx.AttrStmt) and node.attr_key == "thread_extent" and node.node.thread_tag == "blockIdx.x":
            extents.append(node.value)

    tvm_ffi.structural_walk(func.body, visit)
    return [int(extent) if isinstance(extent, tvm.tirx.IntImm) else extent for extent in extents]


def grid(func):
    """The extent of ``func``'s ``blockIdx.x``, where it launches one kernel."""
    (extent,) = grids(func)
    return extent


def kernel_prologues(source):
    """The first two statements of each kernel's body in CUDA ``source``."""
    bodies = re.findall(r'extern "C" __global__ void [^;{]*\{\n((?:.*\n){2})', source)
    return [[line.strip() for line in body.splitlines()] for body in bodies]
