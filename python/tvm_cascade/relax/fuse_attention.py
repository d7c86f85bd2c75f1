"""``FuseAttention``: group attention in a Relax module into one PrimFunc and fuse its
cascaded reductions.

The pass groups every match of :func:`.patterns.attention_patterns` with
``FuseOpsByPattern`` (after rewriting ``torch.export``'s flattened batched matmuls and
safe softmax, :mod:`.canonicalize`), legalizes the module and merges each group into one
PrimFunc with ``FuseTIR``; :func:`tvm_cascade.transform.fuse_cascaded_reductions` then fuses the
softmax's max and sum and the probability-times-V matmul into one key loop (rolling
update for prefill, split-k for decode shapes). On a GPU target the fused PrimFunc is
given thread bindings (:mod:`.gpu_schedule`) and marked ``tirx.is_scheduled``, so that the
default pipeline's DLight rules leave it alone.

A module without a match, or whose groups TVM cannot lower to one PrimFunc each (logged),
is returned as it is, so the rest of a pipeline compiles it exactly as without this pass.
"""

import logging
from typing import Optional

import tvm
from tvm import relax
from tvm.s_tir.schedule import ScheduleError

from ..analysis.scope import buffer_accesses, collect_sites
from ..transform import fuse_cascaded_reductions
from ..transform.detect import find_candidates
from ..transform.pass_ import FUSED_ATTR
from .canonicalize import flip_masked_row_guards, fold_batched_matmuls
from .dispatch import OPAQUE
from .gpu_schedule import UnsupportedOnGpu, schedule_fused_for_gpu
from .patterns import attention_patterns, is_attention_group

logger = logging.getLogger("tvm_cascade.relax")

CPU_CHUNKS = 8
GPU_BLOCKS = 1024  # about 8 CUDA blocks per SM of an H100
MIN_CHUNK_KEYS = 64


@tvm.transform.module_pass(opt_level=0, name="FuseAttention")
class FuseAttention:
    """Fuse the attention of a Relax module into single fused-reduction kernels.

    Parameters
    ----------
    tile : int
        Keys per tile of the rolling update (prefill shapes).
    method : str
        ``"auto"`` (split-k when the rows are few next to the keys), ``"rolling"`` or
        ``"split_k"``; see :func:`tvm_cascade.transform.fuse_cascaded_reductions`.
    chunks : int, optional
        Chunks of the split-k update (decode shapes). By default :data:`CPU_CHUNKS` on the
        CPU; on a GPU, where each row and chunk is a CUDA block, enough chunks to make
        about :data:`GPU_BLOCKS` blocks, each of at least :data:`MIN_CHUNK_KEYS` keys.
    fuse : bool
        False: group each attention into one PrimFunc and leave it unfused, for
        MetaSchedule to tune (``tune_relax`` with
        :func:`tvm_cascade.meta_schedule.cascade_space`, whose proposals fuse it).
    """

    def __init__(self, tile: int = 64, method: str = "auto", chunks: Optional[int] = None, fuse: bool = True):
        self.tile, self.method, self.chunks, self.fuse = tile, method, chunks, fuse

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        grouped = relax.transform.FuseOpsByPattern(attention_patterns(), bind_constants=False)(
            flip_masked_row_guards(fold_batched_matmuls(mod))
        )
        groups = [gv.name_hint for gv, f in grouped.functions_items() if is_attention_group(f)]
        if not groups:
            return mod
        try:
            lowered = tvm.transform.Sequential([relax.transform.LegalizeOps(), relax.transform.FuseTIR()])(grouped)
        except tvm.error.InternalError as err:
            # (e.g. a GQA broadcast to a symbolic shape, which the group receives as a
            # parameter and LegalizeOps leaves as it is)
            logger.info("attention left unfused: TVM could not lower its group to one PrimFunc: %s",
                        str(err).strip().splitlines()[-1])
            return mod
        if not self.fuse:
            return lowered
        target = tvm.target.Target.current(allow_none=True)
        on_gpu = target is not None and "gpu" in target.keys
        for name in groups:
            gvar = lowered.get_global_var(name)
            fused = self._fuse(name, lowered[gvar], on_gpu)
            if fused is not None:
                lowered[gvar] = fused
        return lowered

    def _fuse(self, name: str, func: tvm.tirx.PrimFunc, on_gpu: bool):
        """The fused (and, for a GPU, scheduled) ``func``, or None where nothing fuses."""
        sch = tvm.s_tir.Schedule(tvm.IRModule({"main": func}))
        _inline_constant_blocks(sch)
        chunks = self.chunks or (_gpu_chunks(func) if on_gpu else CPU_CHUNKS)
        chains = fuse_cascaded_reductions(sch, self.tile, self.method, chunks)
        if not chains:
            logger.debug("'%s': attention matched but its reductions did not fuse", name)
            return None
        if on_gpu:
            try:
                schedule_fused_for_gpu(sch, chains)
            except UnsupportedOnGpu as err:
                logger.debug("'%s': left unfused for the default GPU schedule: %s", name, err)
                return None
        logger.debug(
            "'%s': fused %s",
            name,
            ", ".join(f"{c.root} <- {c.blocks} ({c.method})" for c in chains),
        )
        fused = sch.mod["main"]
        # Opaque: FuseTIR would rebuild a kernel merged with its neighbours and drop its schedule.
        attrs = {FUSED_ATTR: [b for c in chains for b in c.blocks], "op_pattern": OPAQUE}
        if on_gpu:
            attrs["tirx.is_scheduled"] = True
        return fused.with_attrs(attrs)


def _inline_constant_blocks(sch) -> None:
    """Inline the blocks that fill a buffer with a constant (``zeros_like`` of the safe
    softmax, :mod:`.canonicalize`), so that their readers see the literal value, a mask
    the fusion can see through."""
    for site in collect_sites(sch.mod["main"].body.block):
        store = site.block.body
        if (
            not site.is_reduction
            and isinstance(store, tvm.tirx.BufferStore)
            and not buffer_accesses(store.value)
        ):
            try:
                sch.compute_inline(sch.get_sblock(site.name))
            except ScheduleError as err:
                logger.debug("'%s' not inlined: %s", site.name, err)


def _gpu_chunks(func) -> int:
    """Split-k chunks for a GPU: about :data:`GPU_BLOCKS` (row, chunk) blocks over the
    first chain, chunks of at least :data:`MIN_CHUNK_KEYS` keys."""
    candidates = find_candidates(func)
    if not candidates or candidates[0].rows is None or candidates[0].length is None:
        return CPU_CHUNKS
    rows, length = candidates[0].rows, candidates[0].length
    wanted = -(-GPU_BLOCKS // rows)
    return max(1, min(wanted, length // MIN_CHUNK_KEYS))
