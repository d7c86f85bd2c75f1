"""Attention kernels.

:func:`attention_kernel` (from :mod:`tvm_cascade.library`) compiles one kernel for a
model's heads, head dim, variant, dtype and layout whose batch size and lengths are
runtime values, cached on disk. :func:`compile_attention`, below, compiles one static
configuration for CUDA with the best known tuning record, tuned first only when asked:

.. code-block:: python

    from tvm_cascade.kernels import compile_attention
    from tvm_cascade.ops.variants import AttentionVariant

    exe = compile_attention(8, 64, 8, 1, 4096, 128, variant=AttentionVariant("gqa", causal=True))
    exe["main"](q, k, v, out)  # q[b, hq, sq, d], k/v[b, hkv, skv, d], out like q

The schedules are those of the kernel families of
:data:`tvm_cascade.library.families.FAMILIES`, the list the runtime-length kernels are
chosen from, asked once per configuration
(:func:`~tvm_cascade.library.families.schedule_families`): up to
:data:`DECODE_QUERIES` query rows the split-k decode family's
(:mod:`tvm_cascade.schedules.decode`), beyond it, on sm_90 GPUs, the warp-specialised
prefill family's (:mod:`tvm_cascade.schedules.warp_specialized`) where it applies, else
the tensor-core prefill family's (:mod:`tvm_cascade.schedules.prefill`); decode over
:data:`RUNTIME_DECODE_KEYS` keys, untuned, is the runtime-length tensor-core decode
kernel fixed to the configuration (:mod:`tvm_cascade.library.specialise`). Records are
MetaSchedule JSON databases
(:class:`tvm_cascade.trace.JSONDatabase`): the user's own, ``tuned/decode`` and
``tuned/prefill`` under the cache directory (:func:`user_records`), are consulted first,
then those shipped with the package, ``tvm_cascade/tuned/decode`` and
``tvm_cascade/tuned/prefill`` (``TVM_CASCADE_TUNED`` and ``TVM_CASCADE_TUNED_PREFILL``
name others; :func:`default_records`). A configuration without a record gets the
schedule's heuristic choices; ``tune_trials`` runs MetaSchedule's evolutionary search with
the xgboost cost model over the schedule's design space on the GPU first and adds its
records to the user's database.
"""
import functools
import os
from pathlib import Path

import tvm
import tvm_ffi

from . import ops
from .analysis.scope import buffer_params
from .candidate_timing import local_runner
from .library import attention_kernel  # noqa: F401  (the runtime-length entry point)
from .library import cache
from .library.families import FAMILIES, config_family, families_of, schedule_families, scheduled_by
from .library.specialise import compile_specialised
from .library.tensor_core_decode import TensorCoreDecode
from .library.spec import AttentionSpec
from .ops.variants import AttentionVariant
from .schedules import decode, prefill
from .trace import JSONDatabase
from .trace.database import holds_records

#: Query rows up to which a configuration is decode (split-k), beyond which prefill.
DECODE_QUERIES = 8
#: Keys from which :func:`compile_attention` gives decode the runtime-length family's
#: tensor-core kernel fixed to the configuration
#: (:func:`~tvm_cascade.library.specialise.specialised`) rather than the static
#: schedule: side by side on an H200 (``python -m benchmarks.decode_crossover``; batch 8,
#: head dim 128, MHA, GQA and softcap) it takes 0.84-0.95x the static kernel's time from
#: 8192 keys and 0.98-1.01x at 4096.
RUNTIME_DECODE_KEYS = 8192
_SHIPPED_RECORDS = Path(__file__).resolve().parent / "tuned"
_RECORDS_ENV = {"decode": "TVM_CASCADE_TUNED", "prefill": "TVM_CASCADE_TUNED_PREFILL", "cascades": "TVM_CASCADE_TUNED_CASCADES"}
#: Lengths are padded to multiples of these (query rows, keys), the whole tiles of the
#: schedules and of every choice of their design spaces; padded keys are masked. Decode
#: may pad its query rows further (:func:`padding`).
PAD_TO = {"decode": (1, decode.PAD_KEYS), "prefill": prefill.PADDING}
#: Prefill design spaces :func:`tune` searches (the ``space`` of the prefill families):
#: the tensor-core schedule's
#: (:func:`~tvm_cascade.schedules.prefill.prefill_design_space`) and the warp-specialised
#: kernel's (:func:`~tvm_cascade.schedules.warp_specialized.design_space`).
PREFILL_SPACES = ("mma", "warp-specialized")
#: Records of a workload :func:`tuned_schedule` considers, best first.
_RECORDS_READ = 64
#: Candidates MetaSchedule measures per search round.
_TRIALS_PER_ROUND = {"decode": 16, "prefill": 8}
#: MetaSchedule's evolutionary search, per kind (decode: its defaults). Prefill's design
#: space has a dozen points and a schedule of it takes most of a second to replay, so the
#: default population of 512 would spend minutes sampling the same few points over.
_SEARCH = {"decode": {}, "prefill": {"population_size": 32, "init_min_unmeasured": 16}}


def kind_of(seq_q):
    """``"decode"`` or ``"prefill"``: which schedules serve ``seq_q`` query rows."""
    return "decode" if seq_q <= DECODE_QUERIES else "prefill"


def padding(kind, heads_q, heads_kv, seq_q, head_dim, config=None):
    """``ops.attention``'s ``pad_to`` for this configuration: :data:`PAD_TO`, with
    decode's query rows padded to fill tensor-core tiles where that serves them better
    (:func:`~tvm_cascade.schedules.decode.query_rows`), and to whole tiles of
    ``config``'s as well (the padding of the family whose schedule takes ``config``)."""
    family = families_of(kind)[0] if config is None else config_family(kind, config)
    return family.padding(heads_q // heads_kv, seq_q, head_dim, config)


def default_records(kind):
    """The tuning database of ``kind`` kernels (``"decode"``, ``"prefill"``, or
    ``"cascades"``: the cascades beyond attention,
    :func:`tvm_cascade.meta_schedule.tuned_database`) shipped with the package (package
    data), or the one the environment names."""
    return Path(os.environ.get(_RECORDS_ENV[kind], _SHIPPED_RECORDS / kind))


def user_records(kind):
    """The user's tuning database of ``kind`` kernels, under the kernel cache's directory
    (:func:`tvm_cascade.library.cache.directory`): where :func:`compile_attention`'s
    tuning writes, consulted before :func:`default_records`."""
    return cache.directory() / "tuned" / kind


def compile_attention(
    batch,
    heads_q,
    heads_kv,
    seq_q,
    seq_kv,
    head_dim,
    variant=AttentionVariant("global"),
    dtype="float16",
    target=None,
    records=None,
    tune_trials=0,
    config=None,
):
    """Compile ``ops.attention`` of this configuration for a CUDA ``target`` (default: the
    GPU of this machine) with the best record of the database at ``records`` (default:
    the user's, :func:`user_records`, then the shipped one, :func:`default_records`),
    else the heuristic schedule: that of the first family of
    :data:`~tvm_cascade.library.families.FAMILIES` whose schedule serves the
    configuration (:func:`~tvm_cascade.library.families.schedule_families`; those passed
    over are logged on ``tvm_cascade.library``). Lengths need not be multiples of the schedules' tiles:
    the function computes over lengths padded to :data:`PAD_TO`. With ``tune_trials`` >
    0 the configuration is tuned first (on this machine's GPU), its records written to
    ``records`` (default: the user's database). ``config`` (a
    :class:`~tvm_cascade.schedules.decode.DecodeConfig` for :data:`DECODE_QUERIES` query
    rows or fewer, else a :class:`~tvm_cascade.schedules.prefill.PrefillConfig`) asks
    for the schedule of the family that takes it with those choices and skips the
    records. A target other than CUDA raises
    ``ValueError``.

    On an sm_90 GPU (H100, H200) prefill may take the warp-specialised kernel
    (:mod:`~tvm_cascade.schedules.warp_specialized`: TMA, wgmma, FlashAttention-3's
    structure) where it supports the configuration (fp16, head dim 128, keys in groups
    of 8): its design space joins the tensor-core schedule's in tuning
    (``variant`` names its variant), its records serve like any other, and without a
    record it is the heuristic choice where it is preferred (no sliding window:
    :func:`~tvm_cascade.schedules.warp_specialized.preferred`). A
    :class:`~tvm_cascade.schedules.warp_specialized.WarpSpecializedConfig` asks for it
    with those choices (a configuration it does not support is then refused).

    Decode over :data:`RUNTIME_DECODE_KEYS` keys or more, where the runtime-length
    kernels' tensor-core decode family serves it, is that family's kernel fixed to the
    configuration (:func:`~tvm_cascade.library.specialise.specialised`), unless
    ``records``, ``tune_trials`` or ``config`` is given or the user's database holds a
    record of it. Returns the compiled module; its ``"main"`` takes ``q, k, v, out``."""
    kind = kind_of(seq_q)
    family = None if config is None else config_family(kind, config)
    if target is None:
        target = tvm.target.Target.from_device(tvm.cuda(0))
    target = tvm.target.Target(target)
    if target.kind.name != "cuda":
        raise ValueError(
            f"compile_attention builds CUDA kernels (mma.sync, ldmatrix, cp.async, wgmma), not {target.kind.name} "
            "ones: on other targets fuse with tvm_cascade.transform.FuseCascadedReductions or the Relax "
            "FuseAttention pass"
        )
    spec = AttentionSpec.make(heads_q, heads_kv, head_dim, variant=variant, dtype=dtype, layout="bhsd", target=target)
    if family is not None:
        reason = family.schedule_supports(spec, seq_q, seq_kv)
        if reason is not None:
            raise ValueError(reason)
    func = ops.attention(
        batch, heads_q, heads_kv, seq_q, seq_kv, head_dim, dtype=dtype, variant=variant,
        pad_to=padding(kind, heads_q, heads_kv, seq_q, head_dim, config),
    )
    read = [Path(records)] if records is not None else [user_records(kind), default_records(kind)]
    if tune_trials:
        tune(func, target, read[0], tune_trials, variant)
    elif family is None and records is None and _runtime_decode(spec, kind, seq_kv) \
            and tuned_schedule(func, target, read[0]) is None:
        return compile_specialised(spec, batch, seq_q, seq_kv, target)
    sch = schedule(func, target, read, variant) if family is None else family.schedule(func, spec, config)
    return build(sch.mod, target)


def _runtime_decode(spec, kind, seq_kv) -> bool:
    """Whether :func:`compile_attention` compiles the runtime-length decode kernel for
    ``spec`` at ``seq_kv`` keys (:data:`RUNTIME_DECODE_KEYS`)."""
    if kind != "decode" or seq_kv < RUNTIME_DECODE_KEYS:
        return False
    # The first family choose() asks, asked alone: compile_specialised's choose() logs
    # the families passed over, once.
    return TensorCoreDecode().supports(spec) is None


def build(mod, target):
    """Compile ``mod``, a schedule of an ``ops.attention`` function (of
    :func:`schedule`, a record, a family's), for ``target`` with the build of the family
    whose schedule it is."""
    func = next(f for f in mod.functions.values() if isinstance(f, tvm.tirx.PrimFunc))
    kind = kind_of(_dims(func)[2])
    family = scheduled_by(mod, kind)
    if family is None:
        raise ValueError(f"the module is not a schedule of any {kind} family's")
    return family.compile(mod, target)


def schedule(func, target, records, variant=None):
    """The schedule of ``ops.attention`` function ``func``: the best record that serves
    ``target`` of the first database at ``records`` (a path, or several) that has one,
    else the heuristic one: the schedule of the first family whose schedule serves the
    function on ``target`` and is preferred for ``variant``
    (:func:`~tvm_cascade.library.families.schedule_families`; without ``variant``, of
    the families whose schedules are made from the function alone): for prefill on an
    sm_90 ``target`` the warp-specialised kernel's where it supports the function and
    is preferred for the variant
    (:func:`~tvm_cascade.schedules.warp_specialized.preferred`), else the tensor-core
    schedule's."""
    for path in [records] if isinstance(records, (str, Path)) else records:
        tuned = tuned_schedule(func, target, path)
        if tuned is not None:
            return tuned
    spec, seq_q, seq_kv = _spec(func, target, variant)
    families = schedule_families(spec, kind_of(seq_q), seq_q, seq_kv, with_variant=variant is not None)
    preferred = [family for family in families if family.prefers(spec)]
    if not preferred:
        raise ValueError(f"no schedule serves {spec.describe()} at {seq_q} queries and {seq_kv} keys on {target}")
    return preferred[0].schedule(func, spec)


def tuned_schedule(func, target, records):
    """The best tuned schedule of ``func`` for ``target`` in the database at ``records``,
    or None (no database, or no valid record of this workload): a record serves where
    the schedule of the family it comes from serves the function on ``target`` (records
    of the warp-specialised kernel an sm_90 ``target`` only)."""
    records = Path(records)
    if not holds_records(records):
        return None
    spec, seq_q, seq_kv = _spec(func, target)
    kind = kind_of(seq_q)
    database = _database(records, kind, allow_missing=False)
    mod = tvm.IRModule({"main": func})
    if not database.has_workload(mod):
        return None
    for record in database.get_top_k(database.commit_workload(mod), _RECORDS_READ):
        sch = tvm.s_tir.Schedule(func)
        record.trace.apply_to_schedule(sch, remove_postproc=False)
        family = scheduled_by(sch.mod, kind)
        if family is not None and family.schedule_supports(spec, seq_q, seq_kv) is None:
            return sch
    return None


def _database(records, kind, allow_missing=True):
    """The JSON database at ``records`` of ``kind`` kernels, read once the tensor
    intrinsics its records' tensorize instructions name are registered."""
    for family in families_of(kind):
        family.register_intrinsics()
    return JSONDatabase(work_dir=str(records), allow_missing=allow_missing)


def tune(func, target, records, trials, variant=None, spaces=PREFILL_SPACES, runner=None):
    """MetaSchedule's evolutionary search with the xgboost cost model over
    :func:`design_space` of ``func`` (of ``variant``; ``spaces``: prefill's design spaces
    searched), ``trials`` candidates measured by ``runner`` (default: on this machine's
    GPU, the L2 cache flushed before each run: :func:`tvm_cascade.candidate_timing.local_runner`;
    :func:`tvm_cascade.rpc_tuning.rpc_runner`: on RPC servers); the records go to the
    JSON database at ``records``, MetaSchedule's logs below its ``logs`` folder. Returns
    the best valid run time in seconds, or None."""
    from tvm.s_tir import meta_schedule as ms

    if runner is None and not tvm.cuda(0).exist:
        raise RuntimeError("tuning measures candidates on a CUDA GPU; this machine has none")
    spec, families = _space_families(func, target, variant, spaces)
    kind = families[0].kind
    (build_func,) = {family.build_func for family in families}
    builder = ms.builder.LocalBuilder(
        f_build=build_func,
        initializer=functools.partial(builder_init, tuple(family.name for family in families)),
        timeout_sec=120,
    )
    records = Path(records)
    records.mkdir(parents=True, exist_ok=True)
    database = _database(records, kind)
    ms.tune_tir(
        func,
        target=target,
        work_dir=str(records / "logs" / _workload_name(func)),
        max_trials_global=trials,
        num_trials_per_iter=min(_TRIALS_PER_ROUND[kind], trials),
        space=_space_generator(families, spec),
        builder=builder,
        runner=local_runner() if runner is None else runner,
        strategy=ms.search_strategy.EvolutionarySearch(**_SEARCH[kind]),
        cost_model="xgb",
        database=database,
    )
    best = database.query_tuning_record(tvm.IRModule({"main": func}), target, "main")
    secs = [float(s) for s in best.run_secs] if best is not None else []
    return min(secs) if secs and min(secs) < 1e9 else None


def design_space(func, target, variant=None, spaces=PREFILL_SPACES):
    """The MetaSchedule space generator :func:`tune` searches for ``ops.attention``
    function ``func`` (of ``variant``) on ``target``: the design space of each family
    whose schedule serves the function there (for prefill, those of ``spaces``, in that
    order), their union where there are several."""
    spec, families = _space_families(func, target, variant, spaces)
    return _space_generator(families, spec)


def _space_families(func, target, variant, spaces):
    """``(spec, families)``: the function's spec and the families whose design spaces
    :func:`design_space` joins."""
    spec, seq_q, seq_kv = _spec(func, target, variant)
    kind = kind_of(seq_q)
    families = schedule_families(spec, kind, seq_q, seq_kv, with_variant=variant is not None)
    if kind == "prefill":
        families = sorted((family for family in families if family.space in spaces),
                          key=lambda family: spaces.index(family.space))
    if not families:
        raise ValueError(f"no design space of {list(spaces) if kind == 'prefill' else kind} serves this "
                         f"function on {target}")
    return spec, families


def _space_generator(families, spec):
    from tvm.s_tir import meta_schedule as ms

    def postprocs(verify):
        # VerifyGPUCode holds shared memory to the static 48 KB: not for the families
        # whose dynamic shared memory is larger by design.
        return [ms.postproc.VerifyGPUCode()] if verify else []

    fns = [ms.space_generator.ScheduleFn(family.design_space(spec), sch_rules=[],
                                         postprocs=postprocs(family.verifies_gpu_code), mutator_probs={})
           for family in families]
    if len(fns) == 1:
        return fns[0]
    return ms.space_generator.SpaceGeneratorUnion(
        fns, sch_rules=[], postprocs=postprocs(all(f.verifies_gpu_code for f in families)), mutator_probs={})


def builder_init(families):
    """MetaSchedule builder-process initializer for candidates of the named ``families``:
    importing this module registers the build functions; the tensor intrinsics of the
    families' schedules (the CUDA ones of the tensor-core prefill, once per process
    rather than per build) are registered, whose index maps the CUDA codegen reads."""
    for family in FAMILIES:
        if family.name in families:
            family.register_intrinsics()


def _spec(func, target, variant=None):
    """``(spec, seq_q, seq_kv)``: the ``bhsd`` spec of ``ops.attention`` function
    ``func`` on ``target`` (of ``variant``, default global: the function does not record
    it) and its query and key lengths."""
    q, k = buffer_params(func)[:2]
    (_, heads_q, seq_q, head_dim), (_, heads_kv, seq_kv, _) = (_shape(p) for p in (q, k))
    spec = AttentionSpec.make(heads_q, heads_kv, head_dim, variant=variant, dtype=str(q.dtype), layout="bhsd",
                              target=tvm.target.Target(target))
    return spec, seq_q, seq_kv


def _dims(func):
    """(query heads, kv heads, query rows, head dim) of an ``ops.attention`` function."""
    q, k = (_shape(p) for p in buffer_params(func)[:2])
    return q[1], k[1], q[2], q[3]


def _workload_name(func):
    q, k = (_shape(p) for p in buffer_params(func)[:2])
    shape = f"b{q[0]}-h{q[1]}x{k[1]}-q{q[2]}-kv{k[2]}-d{q[3]}"
    return f"{shape}-{tvm_ffi.structural_hash(func) & 0xFFFFFFFF:08x}"  # variants differ here


def _shape(buffer):
    return [int(x) for x in buffer.shape]
