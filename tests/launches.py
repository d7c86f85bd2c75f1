"""What a kernel's PrimFunc launches, for tests that check its grid."""
import tvm
import tvm_ffi


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
