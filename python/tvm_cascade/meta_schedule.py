"""MetaSchedule finds the fusion of cascaded reductions itself.

:class:`CascadeFusion` is a schedule rule: on the root of each chain
:func:`~tvm_cascade.transform.detect.find_candidates` finds (a reduction, e.g. a row max,
whose later reductions over the same axis read it, e.g. the softmax's sum and P·V), it
moves the loop nests that do not depend on the root before it (``hoist_independent``:
a legalised Relax function transposes V after the softmax), then proposes, beside the schedule as it was (which the other rules then tile as ever; left
out with ``unfused=False``):

* the rolling update: the root's key loop split by a key tile sampled from ``tiles``
  (``sample_categorical``), each later reduction fused across it with
  ``rolling_update``, the blocks that feed the chain along the key axis (scores, Q·Kᵀ)
  computed inside the tile loop;
* the split-k update: the key loop split into a sampled number of ``chunks`` (of those
  that leave no chunk empty), the root and each later reduction split with
  ``split_k_update``.

A later reduction the primitives refuse (no repair exists) stays unfused, as
:func:`~tvm_cascade.transform.fuse_cascaded_reductions` leaves it (the reason logged at
DEBUG level on the ``tvm_cascade.meta_schedule`` logger). On a GPU target a
fused candidate is bound to blocks and threads by
:func:`~tvm_cascade.relax.gpu_schedule.schedule_fused_for_gpu`, the threads of a row
sampled from :data:`GPU_LANES`; the blocks of a fused
nest are then annotated ``schedule_rule = "None"``, so that the other rules leave them
alone. On a GPU target a chain that folds each row to values of its own (log-sum-exp,
cross-entropy, a softmax's statistics) is also proposed as one CUDA block per row
(:func:`~tvm_cascade.schedules.rows.schedule_rows`: split-k across the row's threads,
rolled within each thread's chunk), its tile, threads and rows per block sampled. On an
H100 or H200 an ``ops.rmsnorm_gemm`` (RMSNorm + GEMM) is also proposed as the
warp-specialised kernel of :mod:`~tvm_cascade.schedules.warp_specialized_gemm` (its
row-scale deferral traced, its columns, stages and row-tile grouping sampled), and an
``ops.fp8_quant_gemm`` (per-token fp8 quantisation + GEMM) as the kernels of
:mod:`~tvm_cascade.schedules.warp_specialized_fp8_gemm` (128-row tiles, their columns
and row-tile grouping sampled; and, for a static count of up to 64 tokens, the skinny
form, its tokens a block sampled), which the candidate builder
(:func:`candidate_builder`) lowers. Every
step is a traced instruction, so the evolutionary search mutates the sampled tile or
chunk count and the records replay from a JSON database.

:func:`cascade_space` is the space generator to tune with: MetaSchedule's default rules,
postprocessors and mutators for the target, with :class:`CascadeFusion` first::

    ms.tune_tir(func, target, work_dir, max_trials_global=64, space=cascade_space(),
                builder=candidate_builder())

The default rules run as :class:`TargetDefault`: one that fails on a block leaves that
block as it was instead of stopping the whole space, as it does on an unfused attention.

:func:`tune_tir` and :func:`tune_relax` are MetaSchedule's entry points with that space,
a search that measures every design space before evolving
(:class:`~tvm_cascade.spaces_first.SpacesFirst`: a fused space of a few decisions, whose
rule's own choices are the decisions it carries, is otherwise seldom measured) and a
database that reloads the fused records (:class:`tvm_cascade.trace.JSONDatabase`);
with ``rpc_tracker="HOST:PORT"`` and ``rpc_key`` they measure the candidates on the RPC
servers registered under that key with TVM's tracker
(:func:`tvm_cascade.rpc_tuning.rpc_runner`), in parallel, into the one database::

    tune_tir(func, target, work_dir, 64, rpc_tracker="10.0.0.1:9190", rpc_key="h100")

:func:`tuned_schedule` gives a function's best record, from a database of the user's
(``tuned/cascades`` under the kernel cache's directory) or the package's
(:func:`tuned_database`: MetaSchedule's best for the shapes of ``python -m
benchmarks.cascades`` and some GEMM shapes on an H200), and :func:`build` builds it::

    kernel = build(tuned_schedule(ops.cascades.logsumexp(8192, 128256, "bfloat16"), target).mod, target)
"""
from __future__ import annotations

import functools
import importlib
import logging
import os
from typing import Sequence

import tvm
import tvm_ffi
from tvm.ir.utils import derived_object
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.schedule import ScheduleError
from tvm.tirx import PrimFunc

from .analysis.scope import REDUCE, collect_sites
from .errors import FusionError
from .primitives import ir
from .relax.gpu_schedule import UnsupportedOnGpu, drop_layout_hints, schedule_fused_for_gpu
from .rpc_tuning import resolve_runner
from .schedules import warp_specialized_fp8_gemm, warp_specialized_gemm
from .schedules.rows import plan_chain, plan_chunks, row_chains, schedule_rows
from .schedules.warp_specialized import serves_target
from .spaces_first import SpacesFirst
from .trace import JSONDatabase, sample_uniform
from .trace.database import holds_records
from .tvm_intrinsics import imported
from .transform.detect import find_candidates
from .transform.fuse import (
    FusedChain,
    blocks_along_key_axis,
    compute_producers_at,
    fusing_dependents,
    key_loop,
    only_func,
    reason,
)

logger = logging.getLogger("tvm_cascade.meta_schedule")

#: Key tiles the rolling update samples from (those below the key length).
TILES = (16, 32, 64, 128)
#: Chunk counts the split-k update samples from (those that leave no chunk empty).
CHUNKS = (2, 4, 8, 16, 32)
#: Threads a row of a fused nest spreads its spatial loops over on a GPU, sampled from.
GPU_LANES = (32, 64, 128)
#: Positions a thread folds between repairs, threads per row and rows per CUDA block that
#: the one-block-per-row GPU schedule samples from (the plan's own choices, :func:`plan_chain`,
#: and the chunk counts that divide the row into whole tiles are added).
ROW_TILES = (16, 32, 64, 128)
ROW_THREADS = (64, 128, 256)
ROWS_PER_BLOCK = (1, 4, 16)
#: The annotation that makes MetaSchedule's other rules skip a block.
SKIP = ("schedule_rule", "None")


@derived_object
class CascadeFusion(ms.schedule_rule.PyScheduleRule):
    """Propose the rolling and split-k fusions of a cascaded-reduction chain at its root
    (module docstring), and the schedule as it was unless ``unfused`` is False."""

    def __init__(self, tiles: Sequence[int] = TILES, chunks: Sequence[int] = CHUNKS, unfused: bool = True):
        self.tiles, self.chunks, self.unfused = tuple(tiles), tuple(chunks), unfused
        self.on_gpu = self.on_hopper = False

    def _initialize_with_tune_context(self, context) -> None:
        self.on_gpu = context.target is not None and "gpu" in context.target.keys
        self.on_hopper = self.on_gpu and serves_target(context.target)

    def apply(self, sch, block):
        name = sch.get(block).name_hint
        if self.on_hopper and name == "gemm":
            fp8 = warp_specialized_fp8_gemm.fp8_quant_gemm_of(only_func(sch))
            if fp8 is not None:
                return [sch] + self._fp8_gemm(sch, fp8)
        candidate = next((c for c in find_candidates(only_func(sch)) if c.root == name), None)
        if candidate is None:
            return [sch]
        proposals = []
        hows = ("rolling", "split_k") + (("rows",) if self.on_gpu else ()) + (("scaled_gemm",) if self.on_hopper else ())
        special = {"rows": self._fuse_rows, "scaled_gemm": self._scaled_gemm}
        for how in hows:
            fused = sch.copy()
            try:
                if special[how](fused, candidate) if how in special else self._fuse(fused, candidate, how):
                    proposals.append(fused)
            except (ScheduleError, UnsupportedOnGpu):
                continue
        return [sch] + proposals if self.unfused or not proposals else proposals

    def clone(self):
        return CascadeFusion(self.tiles, self.chunks, self.unfused)

    def _fuse(self, sch, candidate, how: str) -> bool:
        """Fuse ``candidate`` by ``how`` on ``sch``; whether any later reduction fused."""
        choices = self._choices(candidate, how)
        if not choices:
            return False
        along_keys = blocks_along_key_axis(sch, candidate.root) if how == "rolling" else None
        root = sch.get_sblock(candidate.root)
        try:
            sch.hoist_independent(root)
        except FusionError as err:
            logger.debug("blocks stay in place around '%s': %s", candidate.root, err)
        key = key_loop(sch, candidate.root)
        sampled = sample_uniform(sch, choices)
        loop = sch.split(key, [None, sampled] if how == "rolling" else [sampled, None], preserve_unit_iters=True)[0]
        primitive = sch.rolling_update if how == "rolling" else sch.split_k_update
        if how == "split_k":
            primitive(root, loop)
        fused = []
        for dependent in candidate.dependents:
            try:
                primitive(sch.get_sblock(dependent), loop)
            except ScheduleError as err:
                logger.debug("'%s' not fused into '%s' (%s): %s", dependent, candidate.root, how, reason(err))
                continue
            fused.append(dependent)
        if not fused:
            return False
        if along_keys is not None:
            compute_producers_at(sch, loop, along_keys)
        # Relax's matmuls (Q·Kᵀ, P·V) mark their second operand layout-free, as a
        # weight's: here they are activations, whose layout transform the builder drops.
        drop_layout_hints(sch)
        if self.on_gpu:
            lanes = sample_uniform(sch, GPU_LANES)
            schedule_fused_for_gpu(sch, [FusedChain(candidate.root, tuple(fused), how, loop)], lanes)
            names = [s.name for s in collect_sites(only_func(sch).body.block)]
        else:
            nest = sch.get(loop)
            names = [s.name for s in collect_sites(only_func(sch).body.block) if s.under(nest)]
            names += [candidate.root] + fused
        for name in dict.fromkeys(names):
            sch.annotate(sch.get_sblock(name), *SKIP)
        return True

    def _fuse_rows(self, sch, candidate) -> bool:
        """On a GPU, a chain that folds each row to values of its own as one CUDA block
        per row (:func:`~tvm_cascade.schedules.rows.schedule_rows`), the tile, the
        threads of a row and the rows of a block sampled."""
        chain = next((c for c in row_chains(only_func(sch)) if c.root == candidate.root), None)
        if candidate.length is None or chain is None:
            return False
        length = candidate.length
        plan = plan_chain(only_func(sch), candidate)
        tiles = sorted({plan["tile"]} | {t for t in ROW_TILES if 32 * t <= length})
        # Chunks of whole tiles, none past the row's end with any of the tiles (the
        # combines would skip it, which leaves TVM unable to stage the loads).
        chunks = sorted(
            c for c in {plan_chunks(length, t) for t in tiles} | set(ROW_THREADS)
            if all((c - 1) * -(-length // (c * t)) * t < length for t in tiles)
        )
        per_block = sorted({plan["rows_per_block"]} | set(ROWS_PER_BLOCK))
        if chain.rows is not None:
            # Whether a block's rows are copied to shared memory follows from the rows
            # per block dividing the rows, decided once for the trace: every sampled
            # value must decide alike.
            per_block = [p for p in per_block if chain.rows % p == 0]
        own = (plan["chunks"], plan["tile"], plan["rows_per_block"])
        sampled = [
            sample_uniform(sch, c, first=o if o in c else None) for c, o in zip((chunks, tiles, per_block), own)
        ]
        schedule_rows(sch, *sampled)
        for site in collect_sites(only_func(sch).body.block):
            sch.annotate(sch.get_sblock(site.name), *SKIP)
        return True

    def _scaled_gemm(self, sch, _candidate) -> bool:
        """On an H100 or H200, an ``ops.rmsnorm_gemm`` as the warp-specialised kernel
        (:func:`~tvm_cascade.schedules.warp_specialized_gemm.apply_schedule`), its
        columns, stages and row-tile grouping sampled."""
        problem = warp_specialized_gemm.rmsnorm_gemm_of(only_func(sch))
        if problem is None:
            return False
        largest = warp_specialized_gemm.WarpSpecializedGemmConfig(
            max(warp_specialized_gemm.COLS_CHOICES), max(warp_specialized_gemm.STAGE_CHOICES)
        )
        if warp_specialized_gemm.unsupported(problem.n, problem.k, problem.layout, problem.dtype, problem.out_dtype, largest):
            return False
        own = warp_specialized_gemm.WarpSpecializedGemmConfig()
        sampled = [
            sample_uniform(sch, choices, first) for choices, first in (
                (warp_specialized_gemm.COLS_CHOICES, own.cols), (warp_specialized_gemm.STAGE_CHOICES, own.stages),
                (warp_specialized_gemm.GROUP_CHOICES, own.group),
            )
        ]
        warp_specialized_gemm.apply_schedule(sch, problem, *sampled)
        for block in ir.blocks_in(only_func(sch).body.block):
            sch.annotate(sch.get_sblock(block.name_hint), *SKIP)
        return True

    def _fp8_gemm(self, sch, problem) -> list:
        """On an H100 or H200, an ``ops.fp8_quant_gemm`` as the kernels of
        :mod:`~tvm_cascade.schedules.warp_specialized_fp8_gemm` that can serve it: 128-row
        tiles (columns and row-tile grouping sampled) and, for up to 64 static tokens,
        the skinny form (tokens and consumer warpgroups a block sampled); for a variable token count, the form
        that picks among the skinny kernels and the 128-row one at run time; for the
        op with one k tile (the two-pass quantisation), the two kernels of
        :mod:`~tvm_cascade.schedules.fp8_two_pass` (columns, stages and grouping
        sampled). Forms that cannot serve the op are left out."""
        fp8 = warp_specialized_fp8_gemm
        forms = [("tiles", (fp8.COLS_CHOICES, (fp8.Fp8GemmConfig.stages,), fp8.GROUP_CHOICES)),
                 ("two_pass", (fp8.COLS_CHOICES, fp8.TWO_PASS_STAGE_CHOICES, fp8.GROUP_CHOICES))]
        if isinstance(problem.m, int) and problem.m <= max(fp8.TOKEN_CHOICES):
            tokens = tuple(t for t in fp8.TOKEN_CHOICES if t < 2 * max(problem.m, 16))
            forms.append(("skinny", (tokens, (4 if max(tokens) < 64 else 3,), fp8.CONSUMER_CHOICES)))
        if not isinstance(problem.m, int):
            forms.append(("by_tokens", tuple((t,) for t in fp8.RUN_TIME_TOKENS)))
        proposals = []
        for form, options in forms:
            if fp8.unsupported_choices(problem, form, [max(o) for o in options]) is not None:
                continue
            proposal = sch.copy()
            firsts = fp8.config_choices(form) if form in ("tiles", "two_pass") else (None,) * len(options)
            fp8.apply_schedule(proposal, form, [
                sample_uniform(proposal, o, f if f in o else None) for o, f in zip(options, firsts)
            ])
            for block in ir.blocks_in(only_func(proposal).body.block):
                proposal.annotate(proposal.get_sblock(block.name_hint), *SKIP)
            proposals.append(proposal)
        return proposals

    def _choices(self, candidate, how: str) -> tuple:
        length = candidate.length
        if how == "rolling":
            return tuple(t for t in self.tiles if length is None or t < length)
        # A chunk past the last key would fold nothing.
        return tuple(c for c in self.chunks if length is not None and (c - 1) * -(-length // c) < length)


@derived_object
class TargetDefault(ms.schedule_rule.PyScheduleRule):
    """The target's ``position``-th default rule (MetaSchedule's, as ``"from-target"``
    gives them once the tuning context names the target; nothing past the last), except
    that a block it fails on (a ScheduleError) is left as it was, and that on a reduction
    no fusion takes (top-k's rounds after a softmax: chained, but with no repair) it
    keeps only its first alternative.

    MetaSchedule's default rules stop the whole design space on some blocks of an
    unfused chain: MultiLevelTiling moves the consumer of P·V, which also reads the
    softmax's sum, under P·V's tiles, which ``reverse_compute_at`` refuses. And each
    reduction's alternatives (with and without a cross-thread reduction, or an rfactor)
    multiply: MoE routing with 8 top-k rounds had 1027 design spaces on CUDA and 72171
    on LLVM (seven minutes to list). The first alternative is the rule's transformed
    form (the cross-thread reduction, the rfactor)."""

    def __init__(self, position: int):
        self.position = position
        self.rule = None
        self.chained = set()

    def _initialize_with_tune_context(self, context) -> None:
        defaults = ms.space_generator.PostOrderApply()
        defaults._initialize_with_tune_context(context)  # resolves the target's rules
        rules = list(defaults.sch_rules)
        self.rule = rules[self.position] if self.position < len(rules) else None
        if self.rule is not None:
            self.rule._initialize_with_tune_context(context)
        self.chained = {
            name for func in context.mod.functions.values() if isinstance(func, PrimFunc) for name in _fused_blocks(func)
        }

    def apply(self, sch, block):
        if self.rule is None:
            return [sch]
        try:
            alternatives = list(self.rule.apply(sch.copy(), block))
        except (ScheduleError, IndexError):
            # (MultiLevelTilingTensorCore indexes past its loops on RMSNorm + GEMM's
            # four-factor GEMM: "Index 6 out of bounds 6", stock TVM's space included)
            return [sch]
        sblock = sch.get(block)
        if sblock.name_hint not in self.chained and any(iv.iter_type == REDUCE for iv in sblock.iter_vars):
            return alternatives[:1]
        return alternatives

    def clone(self):
        twin = TargetDefault(self.position)
        twin.rule, twin.chained = self.rule, set(self.chained)
        return twin


@functools.lru_cache(maxsize=16)
def _fused_blocks(func) -> frozenset:
    """The blocks of ``func``'s chains that a fusion takes: the roots and the dependents
    that rolling or split-k fuses (asked once per function, not once per default rule)."""
    return frozenset(
        name for chain in find_candidates(func)
        for name in (chain.root, *fusing_dependents(func, chain, "rolling"), *fusing_dependents(func, chain, "split_k"))
    )


def _most_default_rules() -> int:
    """The most default rules a target kind has (MetaSchedule's "cuda-tensorcore" list)."""
    imported("tvm.s_tir.tensor_intrin")  # the tensor-core rules name them

    return max(len(ms.ScheduleRule.create(kind)) for kind in ("llvm", "cuda", "cuda-tensorcore", "hexagon"))


def cascade_space(tiles: Sequence[int] = TILES, chunks: Sequence[int] = CHUNKS, unfused: bool = True):
    """The space generator that tunes cascaded reductions (module docstring):
    MetaSchedule's post-order space with :class:`CascadeFusion` before the target's
    default rules (:class:`TargetDefault`), and the target's default postprocessors and
    mutators. ``unfused=False`` drops a chain's unfused schedule where a fusion applies."""
    rules = [CascadeFusion(tiles, chunks, unfused)] + [TargetDefault(k) for k in range(_most_default_rules())]
    return ms.space_generator.PostOrderApply(sch_rules=rules, postprocs="from-target", mutator_probs="from-target")


def candidate_builder(max_workers: int | None = None, timeout_sec: float = 30.0) -> ms.builder.LocalBuilder:
    """MetaSchedule's local builder whose processes load TVM's tensor intrinsics and
    tvm-cascade as they start, and which builds with :data:`BUILD_FUNC`. MetaSchedule's
    default build imports the intrinsics inside each candidate's ``timeout_sec`` (TVM's
    own import: half a minute per fresh builder process, more with many at once, so on
    a many-core machine every candidate of a round ran out of time). Loaded by the
    initializer (:func:`~tvm_cascade.tvm_intrinsics.imported`), they cost no candidate's
    time limit."""
    return ms.builder.LocalBuilder(
        max_workers=max_workers,
        timeout_sec=timeout_sec,
        f_build=BUILD_FUNC,
        initializer=_prepare_builder_process,
    )


def _prepare_builder_process() -> None:
    imported("tvm.s_tir.tensor_intrin")
    importlib.import_module("tvm_cascade.meta_schedule")  # registers BUILD_FUNC


def _build_candidate(mod, target, params):
    if warp_specialized_gemm.lowers(mod):
        return warp_specialized_gemm.build(mod, target).mod
    if warp_specialized_fp8_gemm.lowers(mod):
        return warp_specialized_fp8_gemm.build(mod, target).mod
    return tvm_ffi.get_global_func("s_tir.meta_schedule.builder.default_build")(mod, target, params)


#: The candidate builder's build function, a global function (its worker processes look
#: it up by name): a sample of the warp-specialised scaled GEMM or of the fp8 GEMM is
#: lowered to that kernel (:func:`~tvm_cascade.schedules.warp_specialized_gemm.build`,
#: :func:`~tvm_cascade.schedules.warp_specialized_fp8_gemm.build`), any other module built
#: as MetaSchedule builds it.
BUILD_FUNC = "tvm_cascade.meta_schedule.build"
tvm_ffi.register_global_func(BUILD_FUNC, _build_candidate, override=True)


def tune_tir(
    mod,
    target,
    work_dir: str,
    max_trials_global: int,
    *,
    space=None,
    database=None,
    builder=None,
    runner=None,
    rpc_tracker: str | None = None,
    rpc_key: str | None = None,
    rpc_workers: int | None = None,
    **options,
):
    """``ms.tune_tir`` of ``mod`` (a PrimFunc or an IRModule of them) over ``space``
    (default :func:`cascade_space`) into ``database`` (default the
    :class:`~tvm_cascade.trace.JSONDatabase` in ``work_dir``, which reloads fused
    records where MetaSchedule's own fails); returns the database. The candidates are
    built by ``builder`` (default :func:`candidate_builder`) and measured by ``runner``,
    or with ``rpc_tracker="HOST:PORT"`` and ``rpc_key`` on the RPC servers registered
    under that key (:func:`tvm_cascade.rpc_tuning.rpc_runner`, ``rpc_workers`` at once:
    default one per server), else on this machine
    (:func:`tvm_cascade.candidate_timing.local_runner`: on a GPU the L2 cache flushed
    before each run). ``options`` go to ``ms.tune_tir``
    (``num_trials_per_iter``, ...; ``strategy`` default :class:`SpacesFirst`: every
    design space measured once, then the evolutionary search)."""
    runner = resolve_runner(runner, rpc_tracker, rpc_key, rpc_workers)
    return ms.tune_tir(
        mod, target, work_dir, max_trials_global,
        space=cascade_space() if space is None else space,
        database=_database(work_dir) if database is None else database,
        builder=candidate_builder() if builder is None else builder,
        runner=runner,
        **{"strategy": SpacesFirst(), **options},
    )


def tune_relax(
    mod,
    params,
    target,
    work_dir: str,
    max_trials_global: int,
    *,
    space=None,
    database=None,
    builder=None,
    runner=None,
    rpc_tracker: str | None = None,
    rpc_key: str | None = None,
    rpc_workers: int | None = None,
    **options,
):
    """``ms.relax_integration.tune_relax`` of Relax module ``mod`` (``params``: its bound
    weights) as :func:`tune_tir` tunes a PrimFunc: every task over ``space`` (default
    :func:`cascade_space`), into ``database`` (default the cascade JSON database in
    ``work_dir``), built by ``builder`` (default :func:`candidate_builder`), measured by
    ``runner``, on the RPC servers of ``rpc_tracker`` and ``rpc_key``, or on this
    machine, each task searched by ``strategy`` (default :class:`SpacesFirst`); returns
    the database."""
    runner = resolve_runner(runner, rpc_tracker, rpc_key, rpc_workers)
    return ms.relax_integration.tune_relax(
        mod, params, target, work_dir, max_trials_global,
        space=cascade_space() if space is None else space,
        database=_database(work_dir) if database is None else database,
        builder=candidate_builder() if builder is None else builder,
        runner=runner,
        **{"strategy": SpacesFirst(), **options},
    )


def tuned_database(records=None):
    """The tuning records :func:`tuned_schedule` reads: those in the directory
    ``records`` (MetaSchedule's two JSON files; created where missing), or by default
    the user's own (``tuned/cascades`` under the kernel cache's directory,
    :func:`tvm_cascade.kernels.user_records`: ``tune_tir(..., database=
    tuned_database(user_records("cascades")))`` tunes into it) before those shipped with the package
    (:func:`tvm_cascade.kernels.default_records`: the shapes of ``python -m
    benchmarks.cascades`` and some of ``benchmarks.scaled_gemm`` and ``benchmarks.fp8_gemm``
    tuned on an H200); None where there are none."""
    if records is not None:
        return _database(records)
    from .kernels import default_records, user_records  # (it imports the attention library)

    found = [
        JSONDatabase(work_dir=str(path), allow_missing=False)
        for path in (user_records("cascades"), default_records("cascades"))
        if holds_records(path)
    ]
    if len(found) < 2:
        return found[0] if found else None
    return ms.database.OrderedUnionDatabase(*found)


def tuned_schedule(func, target, database=None):
    """The schedule of ``func`` (an unfused cascade: a PrimFunc, or an IRModule of one)
    its best record in ``database`` (default :func:`tuned_database`) gives on
    ``target``, or None where no record holds its workload. Build it with
    :func:`build`."""
    database = tuned_database() if database is None else database
    if database is None:
        return None
    mod = func if isinstance(func, tvm.IRModule) else tvm.IRModule({"main": func})
    return ms.tir_integration.compile_tir(database, mod, target)


def build(mod, target):
    """``mod`` (a schedule's module, e.g. :func:`tuned_schedule`'s) built for ``target`` as
    the candidate builder builds it: a warp-specialised GEMM or fp8 GEMM lowered to its
    kernel, anything else as MetaSchedule builds it."""
    imported("tvm.s_tir.tensor_intrin")  # (as the candidate builder's processes start: TVM's own import takes half a minute)
    return _build_candidate(mod, tvm.target.Target(target), None)


def _database(work_dir: str) -> JSONDatabase:
    os.makedirs(work_dir, exist_ok=True)
    return JSONDatabase(work_dir=str(work_dir))
