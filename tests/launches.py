"""What a kernel's PrimFunc launches, for tests that check its grid."""
import tvm
import tvm_ffi


def grid(func):
    """The extent of ``func``'s ``blockIdx.x``: an int, or an expression of its shapes."""
    extents = []

    def visit(node):
        if isinstance(node, tvm.tirx.AttrStmt) and node.attr_key == "thread_extent" and node.node.thread_tag == "blockIdx.x":
            extents.append(node.value)

    tvm_ffi.structural_walk(func.body, visit)
    (extent,) = extents
    return int(extent) if isinstance(extent, tvm.tirx.IntImm) else extent
