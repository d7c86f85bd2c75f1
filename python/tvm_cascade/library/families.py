"""The kernel families that serve attention specs.

A family has a ``name`` (its PrimFunc's name too), ``queries`` (the most query rows per
sequence it serves, None for any), ``supports(spec) -> reason or None``, ``build(spec)
-> PrimFunc`` taking the layout's tensors and scalars (:mod:`.layouts`), then the
family's own scalars, then ``out``, and ``plan(spec, batch, max_q, max_kv, device) ->
list`` giving those scalars for one call's lengths (ints; or PrimExprs of a graph's
symbolic shapes, :mod:`tvm_cascade.relax.dispatch`), and ``compile_target(target)``, the
target its function compiles for (a Hopper family asks for sm_90a's features). Every
kernel takes runtime lengths.

A family may also have a schedule of ``ops.attention`` of static lengths, what
:func:`tvm_cascade.kernels.compile_attention` compiles and tunes
(:mod:`.static_lengths`): :func:`schedule_families` asks the list for those that serve
a configuration, :func:`config_family` for the one a schedule's config belongs to, and
:func:`scheduled_by` for the one a scheduled module (a tuning record's) comes from.

:func:`choose` picks, in :data:`FAMILIES` order, the first family that supports a spec
for each range of query rows: a kernel holds one function per range (decode's few rows,
and any number), and a call runs the first whose range holds its longest sequence's
queries. :class:`GenericFused` supports every spec and ends the list.
"""
from __future__ import annotations

import logging
import numbers

import tvm

from ..analysis.chain import substitute
from ..relax.gpu_schedule import schedule_fused_for_gpu
from ..transform import fuse_cascaded_reductions
from .compute import VIEW_BLOCKS, attention_chain
from .layouts import scatter_output
from .spec import UNIFORM_LAYOUTS, AttentionSpec
from .split_k_decode import SplitKDecode
from .static_lengths import RuntimeLengthsOnly
from .tensor_core_decode import TensorCoreDecode
from .tensor_core_prefill import TensorCorePrefill
from .warp_specialized_prefill import WarpSpecializedPrefill

logger = logging.getLogger("tvm_cascade.library")


class GenericFused(RuntimeLengthsOnly):
    """Attention fused by the rolling update (:func:`~tvm_cascade.transform.fuse_cascaded_reductions`)
    over the layout's sequence view: on CPUs one query row per iteration of a parallel
    loop over (sequence, head), on GPUs :mod:`tvm_cascade.relax.gpu_schedule`'s one
    row of threads per query row. Correct for every spec, no tensor cores."""

    name = "generic"
    queries = None
    #: Keys per tile of the rolling update.
    TILE = 64

    def supports(self, spec: AttentionSpec):
        return None

    def build(self, spec: AttentionSpec) -> tvm.tirx.PrimFunc:
        sch = tvm.s_tir.Schedule(attention_chain(spec))
        for name in VIEW_BLOCKS if spec.layout not in UNIFORM_LAYOUTS else ():
            sch.compute_inline(sch.get_sblock(name))
        chains = fuse_cascaded_reductions(sch, tile=self.TILE, method="rolling")
        if len(chains) != 1 or set(chains[0].blocks) != {"sum", "pv"}:
            raise RuntimeError(f"{spec.describe()}: the rolling update fused {chains}, not max/sum/pv")
        # The output of a row is stored by the row's own threads once its keys are done,
        # so that the row's state never leaves them.
        row = sch.get_loops(sch.get_sblock("max"))[2]
        sch.reverse_compute_at(sch.get_sblock("out"), row)
        if spec.target_kind == "cuda":
            schedule_fused_for_gpu(sch, chains)
        else:
            _schedule_rows_on_cpu(sch)
        return scatter_output(sch.mod["main"], spec).with_attr("global_symbol", self.name)

    def plan(self, spec, batch, max_q, max_kv, device) -> list:
        return []

    def compile_target(self, target):
        return target


def _schedule_rows_on_cpu(sch) -> None:
    """One query row per iteration of a parallel loop over (sequence, head): the row's
    running state and its tile of scores stay small."""
    sch.compute_inline(sch.get_sblock("exp"))
    batch, head = sch.get_loops(sch.get_sblock("max"))[:2]
    sch.parallel(sch.fuse(batch, head))


#: The families, asked in order.
FAMILIES = (TensorCoreDecode(), SplitKDecode(), WarpSpecializedPrefill(), TensorCorePrefill(), GenericFused())


def runtime_families() -> tuple:
    """The families of :data:`FAMILIES` with runtime-length kernels (all but those that
    set ``runtime = False``: a schedule of static lengths only), in order."""
    return tuple(family for family in FAMILIES if getattr(family, "runtime", True))


def planned_body(func: tvm.tirx.PrimFunc, family, spec: AttentionSpec, scalars, batch, max_q, max_kv, device):
    """``func``'s body (``family``'s function for ``spec``) with ``scalars``, the family's
    own parameters, given its plan for ``batch`` sequences of at most ``max_q`` query rows
    over ``max_kv`` keys on ``device``: ints as constants of the parameters' dtypes,
    PrimExprs (of a call's shapes) as they are."""
    plan = family.plan(spec, batch, max_q, max_kv, device)
    if len(plan) != len(scalars):
        raise AssertionError(f"{family.name} plans {len(plan)} scalars for its {len(scalars)}")
    values = {p: tvm.tirx.IntImm(p.ty.dtype, int(v)) if isinstance(v, numbers.Integral) else v for p, v in zip(scalars, plan)}
    return substitute(func.body, values)


def choose(spec: AttentionSpec) -> list:
    """The families that serve ``spec``, by range of query rows, narrowest first: for
    each range the first family of :data:`FAMILIES` that supports the spec (those passed
    over logged with their reasons), up to the first that serves any number of rows."""
    chosen = []
    for family in runtime_families():
        if chosen and family.queries is not None and family.queries <= chosen[-1].queries:
            continue
        reason = family.supports(spec)
        if reason is not None:
            logger.info("%s: not the %s kernel: %s", spec.describe(), family.name, reason)
            continue
        chosen.append(family)
        if family.queries is None:
            return chosen
    raise AssertionError(f"no family serves {spec.describe()}: the last of FAMILIES must serve every spec")


def families_of(kind: str) -> list:
    """The families of :data:`FAMILIES` with a schedule of static lengths of ``kind``
    (``"decode"`` or ``"prefill"``), in order."""
    return [family for family in FAMILIES if family.kind == kind]


def schedule_families(spec: AttentionSpec, kind: str, seq_q, seq_kv, with_variant: bool = True) -> list:
    """The families of :data:`FAMILIES` whose schedule of ``kind`` serves ``spec`` (a
    ``bhsd`` spec) at ``seq_q`` queries and ``seq_kv`` keys, in order (those passed over
    logged with their reasons). Without ``with_variant`` (a function whose variant is not
    known) the families whose schedules are made from the variant are left out."""
    served = []
    for family in families_of(kind):
        if family.needs_variant and not with_variant:
            continue
        reason = family.schedule_supports(spec, seq_q, seq_kv)
        if reason is None:
            served.append(family)
        else:
            logger.info("%s: not the %s schedule: %s", spec.describe(), family.name, reason)
    return served


def config_family(kind: str, config):
    """The family of :data:`FAMILIES` whose schedule of ``kind`` takes ``config``
    (``ValueError`` naming the configs of ``kind`` where none does)."""
    families = families_of(kind)
    for family in families:
        if isinstance(config, family.config_type):
            return family
    names = " or ".join(family.config_type.__name__ for family in families)
    raise ValueError(f"config must be a {names} for the {kind} schedules, not a {type(config).__name__}")


def scheduled_by(mod: tvm.IRModule, kind: str):
    """The family of :data:`FAMILIES` whose schedule of ``kind`` ``mod`` is, or None."""
    return next((f for f in families_of(kind) if f.scheduled(mod)), None)
