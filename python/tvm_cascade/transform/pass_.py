"""``FuseCascadedReductions``: the fusion of :mod:`.fuse` as a ``tvm.transform`` pass."""
import tvm

from .fuse import METHODS, fuse_cascaded_reductions

FUSED_ATTR = "tvm_cascade.fused"


@tvm.transform.module_pass(opt_level=0, name="FuseCascadedReductions")
class FuseCascadedReductions:
    """Fuse the cascaded reductions of every PrimFunc in a module.

    Each PrimFunc not marked ``tirx.is_scheduled`` goes through
    :func:`tvm_cascade.transform.fuse_cascaded_reductions`; the fused ones carry the attribute
    ``tvm_cascade.fused``, the names of the blocks moved into a root's key loop. Other
    functions are returned as they are.

    Parameters
    ----------
    tile : int
        Keys per tile of the rolling update.
    method : str
        ``"rolling"``, ``"split_k"`` or ``"auto"`` (split-k for decode-like shapes).
    chunks : int
        Chunks of the split-k update.
    """

    def __init__(self, tile: int = 64, method: str = "auto", chunks: int = 8):
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        self.tile, self.method, self.chunks = tile, method, chunks

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updates = {}
        for gvar, func in mod.functions_items():
            if not isinstance(func, tvm.tirx.PrimFunc) or _is_scheduled(func):
                continue
            sch = tvm.s_tir.Schedule(tvm.IRModule({gvar.name_hint: func}))
            chains = fuse_cascaded_reductions(sch, self.tile, self.method, self.chunks)
            if chains:
                names = [name for chain in chains for name in chain.blocks]
                updates[gvar] = sch.mod[gvar.name_hint].with_attr(FUSED_ATTR, names)
        if not updates:
            return mod
        mod = mod.clone()  # the caller's module stays as it was
        for gvar, func in updates.items():
            mod[gvar] = func
        return mod


def _is_scheduled(func) -> bool:
    return func.attrs is not None and bool(func.attrs.get("tirx.is_scheduled", False))
