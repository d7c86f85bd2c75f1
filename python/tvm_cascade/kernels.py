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

Up to :data:`DECODE_QUERIES` query rows the split-k decode schedule
(:mod:`tvm_cascade.schedules.decode`) is used, beyond it the tensor-core prefill schedule
(:mod:`tvm_cascade.schedules.prefill`) or, on sm_90 GPUs, the warp-specialised prefill
kernel (:mod:`tvm_cascade.schedules.warp_specialized`) where it applies. Records are
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
import math
import os
from pathlib import Path

import tvm
import tvm_ffi

from . import ops
from .analysis.scope import buffer_params
from .cuda import mma16x8, tensor_cores
from .library import attention_kernel  # noqa: F401  (the runtime-length entry point)
from .library import cache
from .ops.variants import AttentionVariant
from .schedules import decode, prefill, warp_specialized
from .schedules.decode import DecodeConfig, decode_design_space, schedule_decode
from .schedules.warp_specialized import WarpSpecializedConfig
from .trace import JSONDatabase

#: Query rows up to which a configuration is decode (split-k), beyond which prefill.
DECODE_QUERIES = 8
_SHIPPED_RECORDS = Path(__file__).resolve().parent / "tuned"
_RECORDS_ENV = {"decode": "TVM_CASCADE_TUNED", "prefill": "TVM_CASCADE_TUNED_PREFILL"}
#: Lengths are padded to multiples of these (query rows, keys), the whole tiles of the
#: schedules and of every choice of their design spaces; padded keys are masked. Decode
#: may pad its query rows further (:func:`padding`).
PAD_TO = {
    "decode": (1, decode.PAD_KEYS),
    "prefill": (prefill.PrefillConfig().rows, max(prefill.KEY_TILES)),
}
#: Prefill design spaces :func:`tune` searches: the tensor-core schedule's
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
    """``"decode"`` or ``"prefill"``: which schedule serves ``seq_q`` query rows."""
    return "decode" if seq_q <= DECODE_QUERIES else "prefill"


def padding(kind, heads_q, heads_kv, seq_q, head_dim, config=None):
    """``ops.attention``'s ``pad_to`` for this configuration: :data:`PAD_TO`, with
    decode's query rows padded to fill tensor-core tiles where that serves them better
    (:func:`~tvm_cascade.schedules.decode.query_rows`), and prefill's lengths to whole
    tiles of ``config``'s as well."""
    rows, keys = PAD_TO[kind]
    if kind == "decode":
        rows = decode.query_rows(heads_q // heads_kv, seq_q, head_dim, config or DecodeConfig())
    elif config is not None:
        rows, keys = math.lcm(rows, config.rows), math.lcm(keys, config.keys)
    return rows, keys


def default_records(kind):
    """The tuning database of ``kind`` kernels shipped with the package (package data),
    or the one the environment names."""
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
    else the heuristic schedule. Lengths need not be multiples of the schedules' tiles:
    the function computes over lengths padded to :data:`PAD_TO`. With ``tune_trials`` >
    0 the configuration is tuned first (on this machine's GPU), its records written to
    ``records`` (default: the user's database). ``config`` (a
    :class:`~tvm_cascade.schedules.decode.DecodeConfig` for :data:`DECODE_QUERIES` query
    rows or fewer, else a :class:`~tvm_cascade.schedules.prefill.PrefillConfig`) sets the
    heuristic schedule's choices and skips the records. A target other than CUDA raises
    ``ValueError``.

    On an sm_90 GPU (H100, H200) prefill may take the warp-specialised kernel
    (:mod:`~tvm_cascade.schedules.warp_specialized`: TMA, wgmma, FlashAttention-3's
    structure) where it supports the configuration (fp16, head dim 128, keys in groups
    of 8): its design space joins the tensor-core schedule's in tuning
    (``variant`` names its variant), its records serve like any other, and without a
    record it is the heuristic choice where it is preferred (no sliding window:
    :func:`~tvm_cascade.schedules.warp_specialized.preferred`). A
    :class:`~tvm_cascade.schedules.warp_specialized.WarpSpecializedConfig` asks for it
    with those choices (a configuration it does not support is then refused). Returns
    the compiled module; its ``"main"`` takes ``q, k, v, out``."""
    kind = kind_of(seq_q)
    expected = (DecodeConfig,) if kind == "decode" else (prefill.PrefillConfig, WarpSpecializedConfig)
    if config is not None and not isinstance(config, expected):
        names = " or ".join(c.__name__ for c in expected)
        raise ValueError(f"{seq_q} query rows take the {kind} schedule: config must be a {names}")
    if target is None:
        target = tvm.target.Target.from_device(tvm.cuda(0))
    target = tvm.target.Target(target)
    if target.kind.name != "cuda":
        raise ValueError(
            f"compile_attention builds CUDA kernels (mma.sync, ldmatrix, cp.async, wgmma), not {target.kind.name} "
            "ones: on other targets fuse with tvm_cascade.transform.FuseCascadedReductions or the Relax "
            "FuseAttention pass"
        )
    warp_specialize = isinstance(config, WarpSpecializedConfig)
    if warp_specialize:
        reason = warp_specialized.unsupported(heads_q, heads_kv, seq_q, seq_kv, head_dim, variant, dtype, target)
        if reason is not None:
            raise ValueError(reason)
    func = ops.attention(
        batch, heads_q, heads_kv, seq_q, seq_kv, head_dim, dtype=dtype, variant=variant,
        pad_to=padding(kind, heads_q, heads_kv, seq_q, head_dim, None if warp_specialize else config),
    )
    read = [Path(records)] if records is not None else [user_records(kind), default_records(kind)]
    if tune_trials:
        tune(func, target, read[0], tune_trials, variant)
    if warp_specialize:
        sch = warp_specialized.schedule(func, variant, config)
    elif config is None:
        sch = schedule(func, target, read, variant)
    else:
        sch = heuristic_schedule(func, config)
    return prefill.build(sch.mod, target) if kind == "prefill" else tensor_cores.build(sch.mod, target)


def schedule(func, target, records, variant=None):
    """The schedule of ``ops.attention`` function ``func``: the best record that serves
    ``target`` of the first database at ``records`` (a path, or several) that has one,
    else the heuristic one: for prefill
    of ``variant`` on an sm_90 ``target`` the warp-specialised kernel's
    (:func:`~tvm_cascade.schedules.warp_specialized.schedule`) where it supports the
    function and is preferred for the variant, else the tensor-core schedule's."""
    for path in [records] if isinstance(records, (str, Path)) else records:
        tuned = tuned_schedule(func, target, path)
        if tuned is not None:
            return tuned
    if variant is not None and _warp_specialized(func, variant, target) and warp_specialized.preferred(variant):
        return warp_specialized.schedule(func, variant)
    return heuristic_schedule(func)


def _warp_specialized(func, variant, target):
    """Whether the warp-specialised kernel serves ``ops.attention`` function ``func``."""
    return kind_of(_dims(func)[2]) == "prefill" and warp_specialized.function_unsupported(func, variant, target) is None


def heuristic_schedule(func, config=None):
    """The heuristic schedule of ``ops.attention`` function ``func`` with the choices of
    ``config`` (default: the schedule's defaults)."""
    heads_q, heads_kv, seq_q, head_dim = _dims(func)
    if kind_of(seq_q) == "prefill":
        return prefill.schedule_prefill(func, config or prefill.PrefillConfig())
    return schedule_decode(func, heads_q, heads_kv, head_dim, _multiprocessors(), config or DecodeConfig())


def tuned_schedule(func, target, records):
    """The best tuned schedule of ``func`` for ``target`` in the database at ``records``,
    or None (no database, or no valid record of this workload): records of the
    warp-specialised kernel (:func:`~tvm_cascade.schedules.warp_specialized.lowers`)
    serve only an sm_90 ``target``."""
    records = Path(records)
    if not (records / "database_tuning_record.json").exists():
        return None
    database = _database(records, kind_of(_dims(func)[2]), allow_missing=False)
    mod = tvm.IRModule({"main": func})
    if not database.has_workload(mod):
        return None
    for record in database.get_top_k(database.commit_workload(mod), _RECORDS_READ):
        sch = tvm.s_tir.Schedule(func)
        record.trace.apply_to_schedule(sch, remove_postproc=False)
        if warp_specialized.serves_target(target) or not warp_specialized.lowers(sch.mod):
            return sch
    return None


def _database(records, kind, allow_missing=True):
    """The JSON database at ``records`` of ``kind`` kernels, read once the tensor
    intrinsics its records' tensorize instructions name are registered."""
    _register_intrinsics(kind)
    return JSONDatabase(work_dir=str(records), allow_missing=allow_missing)


def tune(func, target, records, trials, variant=None, spaces=PREFILL_SPACES, runner=None):
    """MetaSchedule's evolutionary search with the xgboost cost model over
    :func:`design_space` of ``func`` (of ``variant``; ``spaces``: prefill's design spaces
    searched), ``trials`` candidates measured by ``runner`` (default: on this machine's
    GPU; :func:`tvm_cascade.rpc_tuning.rpc_runner`: on RPC servers); the records go to the
    JSON database at ``records``, MetaSchedule's logs below its ``logs`` folder. Returns
    the best valid run time in seconds, or None."""
    from tvm.s_tir import meta_schedule as ms

    if runner is None and not tvm.cuda(0).exist:
        raise RuntimeError("tuning measures candidates on a CUDA GPU; this machine has none")
    kind = kind_of(_dims(func)[2])
    space = design_space(func, target, variant, spaces)
    builder = ms.builder.LocalBuilder(
        f_build=prefill.BUILD_FUNC if kind == "prefill" else tensor_cores.BUILD_FUNC,
        initializer=functools.partial(builder_init, kind, "mma" in spaces),
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
        space=space,
        builder=builder,
        runner="local" if runner is None else runner,
        strategy=ms.search_strategy.EvolutionarySearch(**_SEARCH[kind]),
        cost_model="xgb",
        database=database,
    )
    best = database.query_tuning_record(tvm.IRModule({"main": func}), target, "main")
    secs = [float(s) for s in best.run_secs] if best is not None else []
    return min(secs) if secs and min(secs) < 1e9 else None


def design_space(func, target, variant=None, spaces=PREFILL_SPACES):
    """The MetaSchedule space generator :func:`tune` searches for ``ops.attention``
    function ``func`` (of ``variant``) on ``target``: decode's design space, or the union
    of the prefill ``spaces`` that serve the function there."""
    from tvm.s_tir import meta_schedule as ms

    heads_q, heads_kv, seq_q, head_dim = _dims(func)
    if kind_of(seq_q) == "decode":
        return ms.space_generator.ScheduleFn(
            decode_design_space(heads_q, heads_kv, head_dim),
            sch_rules=[], postprocs=[ms.postproc.VerifyGPUCode()], mutator_probs={},
        )
    fns = [prefill.prefill_design_space()] if "mma" in spaces else []
    if "warp-specialized" in spaces and variant is not None and _warp_specialized(func, variant, target):
        fns.append(warp_specialized.design_space(variant))
    if not fns:
        raise ValueError(f"no design space of {list(spaces)} serves this function on {target}")
    # No VerifyGPUCode: it holds shared memory to the static 48 KB, and the kernels'
    # dynamic shared memory is larger by design.
    return ms.space_generator.SpaceGeneratorUnion(
        [ms.space_generator.ScheduleFn(fn, sch_rules=[], postprocs=[], mutator_probs={}) for fn in fns],
        sch_rules=[], postprocs=[], mutator_probs={},
    )


def builder_init(kind, tensor_intrinsics=True):
    """MetaSchedule builder-process initializer for ``kind`` candidates: importing this
    module registers the build function; prefill's tensor-core schedules also need TVM's
    CUDA tensor intrinsics (half a minute, once per process rather than per build), whose
    index maps the CUDA codegen reads (``tensor_intrinsics``: whether the candidates
    include them)."""
    if kind == "prefill" and tensor_intrinsics:
        tensor_cores.cuda_intrinsics()


def _register_intrinsics(kind):
    if kind == "prefill":
        tensor_cores.cuda_intrinsics()
    else:
        mma16x8.register()


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


def _multiprocessors():
    """SMs of this machine's GPU, for the decode schedule's chunk count; H100/H200's 132
    when compiling without one."""
    dev = tvm.cuda(0)
    return dev.multi_processor_count if dev.exist else 132
