"""The intermediate buffers a module allocates once TVM has compacted them."""
import tvm
import tvm_ffi
from tvm.s_tir.stmt import SBlock

_BEFORE_BINDINGS = [
    "CanonicalizeLoop",
    "LowerCrossThreadReduction",
    "LowerInitBlock",
    "PlanAndUpdateBufferAllocationLocation",
    "ConvertBlocksToOpaque",
]
# Thread-bound code: TVM's pipeline lifts the bindings and stages shared memory before
# compacting, so each buffer shrinks to what one thread block or thread uses.
_THREAD_BINDINGS = ["LiftThreadBinding", "ManifestSharedMemoryLocalStage"]


def compacted_buffers(mod: tvm.IRModule, func_name: str = "main", gpu: bool = False) -> list:
    """Every buffer ``func_name`` allocates after TVM's buffer compaction, the passes of
    its default pipeline (in its order; with ``gpu``, those of thread-bound code too) that
    size each buffer to the region used where it is allocated."""
    names = _BEFORE_BINDINGS + (_THREAD_BINDINGS if gpu else []) + ["CompactBufferAllocation"]
    passes = [getattr(tvm.s_tir.transform, name)() for name in names]
    lowered = tvm.transform.Sequential(passes)(mod)
    buffers = []

    def visit(node):
        if isinstance(node, SBlock):
            buffers.extend(node.alloc_buffers)
        elif isinstance(node, tvm.tirx.AllocBuffer):
            buffers.append(node.buffer)

    tvm_ffi.structural_walk(lowered[func_name], visit)
    return buffers


def compacted_allocations(mod: tvm.IRModule, func_name: str = "main") -> dict:
    """Name → shape of every buffer ``func_name`` allocates after TVM's buffer
    compaction (:func:`compacted_buffers`)."""
    return {buf.name: tuple(int(x) for x in buf.shape) for buf in compacted_buffers(mod, func_name)}
