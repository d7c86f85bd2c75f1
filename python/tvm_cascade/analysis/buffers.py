"""The intermediate buffers a module allocates once TVM has compacted them."""
import tvm
import tvm_ffi
from tvm.s_tir.stmt import SBlock

_COMPACTION = [
    "CanonicalizeLoop",
    "LowerCrossThreadReduction",
    "LowerInitBlock",
    "PlanAndUpdateBufferAllocationLocation",
    "ConvertBlocksToOpaque",
    "CompactBufferAllocation",
]


def compacted_allocations(mod: tvm.IRModule, func_name: str = "main") -> dict:
    """Name → shape of every buffer ``func_name`` allocates after TVM's buffer
    compaction, the passes of its default pipeline that size each buffer to the region
    used where it is allocated."""
    passes = [getattr(tvm.s_tir.transform, name)() for name in _COMPACTION]
    lowered = tvm.transform.Sequential(passes)(mod)
    shapes = {}

    def visit(node):
        buffers = []
        if isinstance(node, SBlock):
            buffers = node.alloc_buffers
        elif isinstance(node, tvm.tirx.AllocBuffer):
            buffers = [node.buffer]
        for buf in buffers:
            shapes[buf.name] = tuple(int(x) for x in buf.shape)

    tvm_ffi.structural_walk(lowered[func_name], visit)
    return shapes
