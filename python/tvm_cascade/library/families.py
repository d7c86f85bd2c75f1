"""The kernel families that serve attention specs, asked in order: the first whose
``supports(spec)`` answers None builds the kernel.

A family is an object with ``name``, ``supports(spec) -> reason or None`` and
``build(spec) -> scheduled IRModule`` (its ``main`` takes the layout's tensors). Only
families whose kernels take runtime lengths belong here; :data:`FAMILIES` ends with
:class:`GenericFused`, which serves every spec.
"""
from __future__ import annotations

import logging

import tvm

from ..relax.gpu_schedule import schedule_fused_for_gpu
from ..transform import fuse_cascaded_reductions
from .compute import VIEW_BLOCKS, attention_chain
from .layouts import scatter_output
from .spec import AttentionSpec

logger = logging.getLogger("tvm_cascade.library")


class GenericFused:
    """Attention fused by the rolling update (:func:`~tvm_cascade.transform.fuse_cascaded_reductions`)
    over the layout's sequence view: on CPUs one query row per iteration of a parallel
    loop over (sequence, head), on GPUs :mod:`tvm_cascade.relax.gpu_schedule`'s one
    row of threads per query row. Correct for every spec, no tensor cores."""

    name = "generic"
    #: Keys per tile of the rolling update.
    TILE = 64

    def supports(self, spec: AttentionSpec):
        return None

    def build(self, spec: AttentionSpec) -> tvm.IRModule:
        sch = tvm.s_tir.Schedule(attention_chain(spec))
        for name in VIEW_BLOCKS if spec.layout != "bhsd" else ():
            sch.compute_inline(sch.get_sblock(name))
        chains = fuse_cascaded_reductions(sch, tile=self.TILE, method="rolling")
        if len(chains) != 1 or set(chains[0].blocks) != {"sum", "pv"}:
            raise RuntimeError(f"{spec.describe()}: the rolling update fused {chains}, not max/sum/pv")
        # The output of a row is stored by the row's own threads once its keys are done,
        # so that the row's state never leaves them.
        row = sch.get_loops(sch.get_sblock("max"))[2]
        sch.reverse_compute_at(sch.get_sblock("out"), row)
        if _on_gpu(spec):
            schedule_fused_for_gpu(sch, chains)
        else:
            _schedule_rows_on_cpu(sch)
        return tvm.IRModule({"main": scatter_output(sch.mod["main"], spec)})


def _schedule_rows_on_cpu(sch) -> None:
    """One query row per iteration of a parallel loop over (sequence, head): the row's
    running state and its tile of scores stay small."""
    sch.compute_inline(sch.get_sblock("exp"))
    batch, head = sch.get_loops(sch.get_sblock("max"))[:2]
    sch.parallel(sch.fuse(batch, head))


def _on_gpu(spec: AttentionSpec) -> bool:
    return tvm.target.Target(spec.target).kind.name == "cuda"


#: The families, asked in order.
FAMILIES = (GenericFused(),)


def choose(spec: AttentionSpec):
    """The first family of :data:`FAMILIES` that supports ``spec`` (the last supports
    every spec); the families passed over are logged with their reasons."""
    for family in FAMILIES[:-1]:
        reason = family.supports(spec)
        if reason is None:
            return family
        logger.info("%s: not the %s kernel: %s", spec.describe(), family.name, reason)
    return FAMILIES[-1]
