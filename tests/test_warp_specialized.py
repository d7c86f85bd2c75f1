"""The warp-specialised Hopper prefill kernel (``schedules/warp_specialized.py``): which
key tiles a block visits and masks (against a numpy mask), what it refuses, that
``compile_attention`` takes it on sm_90 for whole tiles, and that ptxas assembles it
without spills, ignored ``setmaxnreg`` or serialised wgmma. Its numerics are checked on
the GPU (``tests/test_kernels.py``)."""
import functools
import shutil

import numpy as np
import pytest
import tvm
import tvm_ffi
import tvm_cascade  # noqa: F401

from tvm_cascade import kernels
from tvm_cascade.analysis.chain import substitute
from tvm_cascade.bench import VARIANTS
from tvm_cascade.cuda import sm_count
from tvm_cascade.ops.variants import AttentionVariant
from tvm_cascade.schedules import warp_specialized as ws
from tvm_cascade.schedules.prefill import PrefillConfig

from launches import grid as launched
from ptxas import assembled, assembly
from ahead import in_a_process_ahead

HOPPER = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})


def _value(expr):
    return int(tvm.sym.Analyzer().simplify(expr)) if isinstance(expr, tvm.ir.expr.Expr) else int(expr)


@pytest.mark.parametrize(
    "variant, seq_q, seq_kv",
    [
        (VARIANTS["global"], 384, 512),
        (VARIANTS["causal"], 512, 512),
        (VARIANTS["causal"], 256, 640),  # the mask's diagonal offset by 384 keys
        (AttentionVariant("w", causal=True, window=256), 768, 768),
        (AttentionVariant("w", causal=True, window=100), 640, 896),  # window within one tile, offset
        (AttentionVariant("w", causal=True, window=300), 512, 512),
        (AttentionVariant("w", causal=True, window=129), 512, 512),  # a window ending on a tile's edge
        # Part tiles: rows past seq_q see nothing, keys past seq_kv are not seen.
        (VARIANTS["global"], 200, 200),
        (VARIANTS["causal"], 300, 456),
        (VARIANTS["global"], 72, 8),
        (AttentionVariant("w", causal=True, window=100), 520, 520),
        (AttentionVariant("w", causal=True, window=256), 130, 1000),
    ],
)
def test_blocks_visit_the_tiles_they_see_and_mask_only_the_edges(variant, seq_q, seq_kv):
    _check_tiles(variant, seq_q, seq_kv)


@pytest.mark.parametrize(
    "window, seq_q, seq_kv",
    [
        (300, 200, 299),  # a sliding layer's keys short of its window
        (300, 400, 300),  # rows from 299 on see none of them
        (4096, 511, 4104),  # a window of whole tiles over keys from inside a page
        (129, 128, 1000),
    ],
)
def test_queries_after_the_keys_visit_the_tiles_they_see(window, seq_q, seq_kv):
    """``offset``: the rows placed after the keys (a sliding layer's new tokens over its
    cached keys), under a window: row ``i`` sees the last ``window - 1 - i`` keys."""
    _check_tiles(AttentionVariant("w", causal=True, window=window), seq_q, seq_kv, offset=seq_kv)


def _check_tiles(variant, seq_q, seq_kv, offset=None):
    """A block's key tiles (:func:`~ws.key_tiles`) are those its rows see, and only the
    tiles on the mask's edge (:func:`~ws.straddles`) mask their keys, each as
    :func:`~ws.visible` says, as numpy's mask of ``variant`` (rows from ``offset`` among
    the keys' positions; None: ending where the keys do)."""
    start = seq_kv - seq_q if offset is None else offset
    rows = np.arange(seq_q)[:, None] + start
    keys = np.arange(seq_kv)[None, :]
    seen = np.ones((seq_q, seq_kv), bool)
    if variant.is_causal:
        seen &= keys <= rows
    if variant.window is not None:
        seen &= rows - keys < variant.window
    whole = (-(-seq_q // ws.ROWS) * ws.ROWS, -(-seq_kv // ws.KEYS) * ws.KEYS)
    seen = np.pad(seen, [(0, whole[0] - seq_q), (0, whole[1] - seq_kv)])
    real = np.arange(whole[0]) < seq_q
    for r0 in range(0, seq_q, ws.ROWS):
        block = seen[r0 : r0 + ws.ROWS][real[r0 : r0 + ws.ROWS]].reshape(-1, whole[1] // ws.KEYS, ws.KEYS)  # [row, tile, key]
        tiles = np.flatnonzero(block.any(axis=(0, 2)))
        lo, hi = (_value(x) for x in ws.key_tiles(r0, seq_q, seq_kv, variant, offset=offset))
        if not tiles.size:
            assert hi <= lo, r0
            continue
        assert (lo, hi) == (tiles[0], tiles[-1] + 1), r0
        assert np.array_equal(tiles, np.arange(lo, hi)), "the visited tiles are contiguous"
        for t in range(lo, hi):
            edge = bool(_value(ws.straddles(r0, t, seq_q, seq_kv, variant, offset=offset)))
            assert edge == (not block[:, t].all()), (r0, t)
            for row in (r0, min(r0 + ws.ROWS, seq_q) - 1):
                for key in range(t * ws.KEYS, (t + 1) * ws.KEYS):
                    assert bool(_value(ws.visible(row, key, seq_q, seq_kv, variant, offset=offset))) == seen[row, key], \
                        (row, key)


@pytest.mark.parametrize(
    "args, message",
    [
        ((32, 32, 256, 256, 128, VARIANTS["global"], "float16", {"kind": "cuda", "arch": "sm_80"}), "needs sm_90a"),
        ((32, 32, 256, 256, 128, VARIANTS["global"], "float32", HOPPER), "computes in float16 or bfloat16, not float32"),
        ((32, 32, 256, 256, 64, VARIANTS["global"], "float16", HOPPER), "head dim 128, not 64"),
        ((32, 32, 512, 256, 128, VARIANTS["causal"], "float16", HOPPER), "more queries \\(512\\) than keys \\(256\\)"),
    ],
)
def test_unsupported_configurations_are_named(args, message):
    assert ws.unsupported(*args) is not None
    assert __import__("re").search(message, ws.unsupported(*args))


@pytest.mark.parametrize("stages", [0, 4])
def test_stages_must_fit_in_shared_memory(stages):
    with pytest.raises(ValueError, match=f"{stages} K/V stages need .* bytes of shared memory; an sm_90 block has 232448"):
        ws.attention(1, 4, 4, 256, 256, 128, VARIANTS["global"], ws.WarpSpecializedConfig(stages=stages))


def test_supported_configurations_are_not_refused():
    assert ws.unsupported(32, 8, 1024, 2048, 128, VARIANTS["causal"], "float16", HOPPER) is None
    assert ws.unsupported(32, 8, 1000, 1000, 128, VARIANTS["causal"], "float16", HOPPER) is None
    assert ws.unsupported(32, 8, 300, 250, 128, VARIANTS["global"], "bfloat16", HOPPER) is None
    assert ws.sm90a(HOPPER).attrs["arch"] == "sm_90a"


@in_a_process_ahead
def test_compile_attention_takes_the_kernel_on_hopper_for_whole_tiles(tmp_path):
    source = kernels.compile_attention(
        1, 4, 2, 256, 384, 128, variant=VARIANTS["causal"], target=HOPPER, records=tmp_path
    ).mod.imports[0].inspect_source()
    for instruction in (
        "cp.async.bulk.tensor.3d",
        "setmaxnreg.dec.sync.aligned.u32 40",
        "setmaxnreg.inc.sync.aligned.u32 232",
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16",
        "mbarrier.arrive.expect_tx",
    ):
        assert instruction in source, instruction
    part = kernels.compile_attention(
        1, 4, 2, 200, 200, 128, variant=VARIANTS["causal"], target=HOPPER, records=tmp_path
    ).mod.imports[0].inspect_source()
    assert "setmaxnreg" in part
    # Keys not in groups of 8, in bfloat16: the kernel too.
    odd = kernels.compile_attention(
        1, 4, 2, 200, 203, 128, variant=VARIANTS["causal"], dtype="bfloat16", target=HOPPER, records=tmp_path
    ).mod.imports[0].inspect_source()
    assert "setmaxnreg" in odd and "m64n128k16.f32.bf16.bf16" in odd
    # A PrefillConfig, a sliding window (not preferred): the mma.sync prefill schedule.
    assert not ws.preferred(VARIANTS["window"]) and ws.preferred(VARIANTS["alibi"])
    for variant, seq, config in (("causal", 256, PrefillConfig()), ("window", 256, None)):
        other = kernels.compile_attention(
            1, 4, 2, seq, seq, 128, variant=VARIANTS[variant], target=HOPPER, records=tmp_path, config=config
        ).mod.imports[0].inspect_source()
        assert "setmaxnreg" not in other and "mma.sync" in other
    with pytest.raises(ValueError, match="more queries \\(256\\) than keys \\(128\\)"):
        kernels.compile_attention(
            1, 4, 2, 256, 128, 128, variant=VARIANTS["causal"], target=HOPPER, config=ws.WarpSpecializedConfig()
        )
    with pytest.raises(ValueError, match="config must be a WarpSpecializedConfig or PrefillConfig for the prefill schedules, not a object"):
        kernels.compile_attention(1, 4, 2, 256, 256, 128, target=HOPPER, config=object())


def _attention_source(variant, heads_kv, config, seq_q, seq_kv):
    return kernels.compile_attention(
        1, 4, heads_kv, seq_q, seq_kv, 128, variant=VARIANTS[variant], target=HOPPER, config=config
    ).mod.imports[0].inspect_source()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to assemble the kernel")
@pytest.mark.parametrize(
    "variant, heads_kv, config, seq_q, seq_kv",
    [
        ("global", 4, ws.WarpSpecializedConfig(), 512, 512),
        ("alibi", 4, ws.WarpSpecializedConfig(), 512, 512),
        ("softcap", 2, ws.WarpSpecializedConfig(), 512, 512),
        ("window", 4, ws.WarpSpecializedConfig(), 512, 512),
        ("gqa", 1, ws.WarpSpecializedConfig(pingpong=False), 512, 512),
        ("causal", 4, ws.WarpSpecializedConfig(overlap=False, pingpong=False, stages=2), 512, 512),
        ("global", 4, ws.WarpSpecializedConfig(), 200, 200),  # part tiles
        ("causal", 4, ws.WarpSpecializedConfig(), 300, 456),
        ("causal", 4, ws.WarpSpecializedConfig(), 65536, 65536),  # folds: a span of one head
        ("gqa", 2, ws.WarpSpecializedConfig(cluster=2), 384, 640),  # clusters: two heads of a group
        ("global", 4, ws.WarpSpecializedConfig(cluster=2), 512, 512),  # two row tiles of a head
    ],
)
@assembled(_attention_source)
def test_ptxas_honours_setmaxnreg_and_keeps_wgmma_asynchronous(variant, heads_kv, config, seq_q, seq_kv, runs_ahead,
                                                              request):
    _, report = assembly(runs_ahead, request)
    assert "0 bytes spill stores, 0 bytes spill loads" in report
    # C7508: setmaxnreg ignored; C7511/C7514/C7519: wgmma serialised, warpgroup arrive/wait injected.
    for remark in ("C7508", "C7511", "C7514", "C7519", "is injected"):
        assert remark not in report, report


@pytest.mark.parametrize("variant", ["global", "causal", "alibi", "softcap", "window"])
def test_the_kernels_repair_is_the_one_rolling_update_proves(variant):
    """The kernel emits the repair the algebra derives and proves for ``ops.attention``'s
    sum and P·V under a partial max, t·exp(m_old - m_new) for every variant: with maxima
    in log2 units, exp2(m_old - m_new)."""
    import sympy

    from tvm_cascade.algebra.repair import RUNNING

    for fusion in ws.derived_repairs(VARIANTS[variant]):
        (old,), (new,) = fusion.repair.old, fusion.repair.new
        assert sympy.simplify(fusion.repair.h - RUNNING * sympy.exp(old - new)) == 0, fusion.describe()
    m_old, m_new = tvm.tirx.Var("m_old", "float32"), tvm.tirx.Var("m_new", "float32")
    assert tvm_ffi.structural_equal(ws.repair_factor(VARIANTS[variant], m_old, m_new), tvm.tirx.exp2(m_old - m_new))


@pytest.mark.parametrize("variant, seq", [("causal", 512), ("alibi", 512), ("window", 512), ("global", 200)])
@in_a_process_ahead
def test_only_tiles_on_the_masks_edge_compute_it(variant, seq):
    """Every masked score is stored in the then-branch of a per-tile branch whose else
    computes the tile's scores without the mask: one for the overlapped loop's peeled
    first tile, one for the loop (without a mask: for the part tile's padded keys)."""
    from tvm_cascade.primitives import ir

    func = ws.attention(1, 4, 4, seq, seq, 128, VARIANTS[variant])

    def masked_stores(node):
        return [
            s for s in ir.nodes(node, tvm.tirx.BufferStore)
            if isinstance(s.value, tvm.tirx.FloatImm) and s.value.value == ws.MASKED_SCORE
        ]

    edges = [
        branch for branch in ir.nodes(func.body, tvm.tirx.IfThenElse)
        if branch.else_case is not None and masked_stores(branch.then_case) and not masked_stores(branch.else_case)
        and len(ir.nodes(branch.else_case, tvm.tirx.BufferStore)) > 0
    ]
    assert len(edges) == 2
    assert len(masked_stores(func.body)) == sum(len(masked_stores(b.then_case)) for b in edges) > 0


def _source(lib):
    return lib.mod.imports[0].inspect_source()


def _kernel_source(func, variant, config):
    """The CUDA source of the kernel template for ``ops.attention`` function ``func``."""
    kernel = ws.attention(*ws.shapes(func)[:6], variant, config)
    return _source(tvm.compile(tvm.IRModule({"main": kernel}), target=ws.sm90a(HOPPER)))


def _samples(trace):
    return [i for i in trace.insts if i.kind.name == "SampleCategorical"]


def _config(stages, form, cluster=0):
    """The kernel's choices of the design space's decisions (indices of its options)."""
    overlap, pingpong = ws.FORMS[form]
    return ws.WarpSpecializedConfig(
        stages=ws.STAGE_CHOICES[stages], overlap=overlap, pingpong=pingpong, cluster=ws.CLUSTER_CHOICES[cluster]
    )


def test_design_space_samples_clusters_only_where_the_kernel_takes_them():
    """Clusters pair two heads of a group, or two row tiles of an unmasked head: without
    either (causal MHA, an odd row-tile count) the space samples no cluster size."""
    from tvm_cascade import ops

    for variant, heads_kv, seq_q, samples in (
        ("causal", 4, 256, 2), ("global", 4, 384, 2), ("global", 4, 256, 3), ("causal", 2, 384, 3),
    ):
        func = ops.attention(1, 4, heads_kv, seq_q, 384, 128, dtype="float16", variant=VARIANTS[variant])
        sch = tvm.s_tir.Schedule(func, seed=1)
        ws.design_space(VARIANTS[variant])(sch)
        assert len(_samples(sch.trace)) == samples, (variant, heads_kv, seq_q)


@in_a_process_ahead
def test_design_space_replays_every_decision_into_the_kernel_of_its_choices():
    """A sample of the design space is ``rolling_update``'s fusion of the chain over
    128-key tiles with the sampled choices annotated on the key-tile loop; every decision
    replays (also through JSON) into :func:`ws.schedule` of those choices, which
    ``prefill.build`` compiles to exactly the template's kernel of those choices."""
    import itertools
    import json

    from tvm_cascade import ops
    from tvm_cascade import trace as cascade_trace
    from tvm_cascade.schedules import prefill

    variant = VARIANTS["alibi"]
    func = ops.attention(1, 4, 2, 256, 384, 128, dtype="float16", variant=variant)
    sch = tvm.s_tir.Schedule(func, seed=1)
    ws.design_space(variant)(sch)
    samples = _samples(sch.trace)
    choices = [ws.STAGE_CHOICES, range(len(ws.FORMS)), ws.CLUSTER_CHOICES]  # (groups of 2 heads: clusters)
    assert [[int(c) for c in i.attrs[0]] for i in samples] == [list(c) for c in choices]
    assert [i.kind.name for i in sch.trace.insts].count("RollingUpdate") == 2
    compiled = {(0, 0, 0), (1, 1, 0), (1, 2, 1)}  # (each stage count, form and cluster: compiling takes seconds)
    for decisions in itertools.product(*(range(len(c)) for c in choices)):
        trace = sch.trace
        for inst, decision in zip(samples, decisions):
            trace = trace.with_decision(inst, decision, remove_postproc=True)
        replayed = tvm.s_tir.Schedule(func)
        trace.apply_to_schedule(replayed, remove_postproc=True)
        config = _config(*decisions)
        assert tvm_ffi.structural_equal(replayed.mod, ws.schedule(func, variant, config).mod), decisions
        if decisions in compiled:
            assert _source(prefill.build(replayed.mod, HOPPER)) == _kernel_source(func, variant, config), decisions
    as_json = json.loads(json.dumps(cascade_trace.trace_to_json(trace, remove_postproc=True)))
    reloaded = tvm.s_tir.Schedule(func)
    cascade_trace.apply_json_to_schedule(as_json, reloaded)
    assert tvm_ffi.structural_equal(reloaded.mod, replayed.mod)


def test_build_lowers_only_the_fused_key_tile_loop_of_a_supported_function():
    from tvm_cascade import ops

    variant = VARIANTS["causal"]
    func = ops.attention(1, 4, 4, 256, 256, 128, dtype="float16", variant=variant)
    # The key loop annotated without rolling_update's fusion, or split into other tiles.
    for tile, fuse in ((ws.KEYS, False), (64, True)):
        sch = tvm.s_tir.Schedule(func)
        loop, _ = sch.split(sch.get_loops(sch.get_sblock("max"))[-1], [None, tile])
        if fuse:
            for name in ("sum", "pv"):
                sch.rolling_update(sch.get_sblock(name), loop)
        ws._annotate(sch, loop, variant, 3, 2)
        with pytest.raises(ValueError, match="must be max's loop over 128-key tiles with sum and pv fused into it"):
            ws.build(sch.mod, HOPPER)
    with pytest.raises(ValueError, match="needs sm_90a"):
        ws.build(ws.schedule(func, variant).mod, {"kind": "cuda", "arch": "sm_80"})
    fp32 = ops.attention(1, 4, 4, 256, 256, 128, dtype="float32", variant=variant)
    with pytest.raises(ValueError, match="computes in float16 or bfloat16, not float32"):
        ws.build(ws.schedule(fp32, variant).mod, HOPPER)


@pytest.mark.parametrize("variant", list(VARIANTS.values()) + [AttentionVariant("x", window=7, alibi=True, softcap=2.5)])
def test_variants_round_trip_through_their_annotation(variant):
    assert ws.variant_of(ws.variant_text(variant)) == variant
    assert '"' not in ws.variant_text(variant)


@in_a_process_ahead
def test_compile_attention_takes_the_best_record_that_serves_the_target(tmp_path):
    """A database holding a warp-specialised record (faster) and a tensor-core one: on
    sm_90 the first compiles to the template's kernel of its choices; on sm_80 the other."""
    from tvm_cascade import ops
    from tvm_cascade.schedules import prefill

    from tuning_records import write_records

    variant = VARIANTS["causal"]
    func = ops.attention(1, 4, 2, 256, 256, 128, dtype="float16", variant=variant)
    mma, = write_records(tmp_path, func, prefill.prefill_design_space(), HOPPER, [(1, 2e-5)])
    warp, = write_records(tmp_path, func, ws.design_space(variant), HOPPER, [(2, 1e-5)])
    config = _config(*(int(warp.decisions[i]) for i in _samples(warp)))
    compiled = kernels.compile_attention(1, 4, 2, 256, 256, 128, variant=variant, target=HOPPER, records=tmp_path)
    assert _source(compiled) == _kernel_source(func, variant, config)
    ampere = tvm.target.Target({"kind": "cuda", "arch": "sm_80"})
    expected = tvm.s_tir.Schedule(func)
    mma.apply_to_schedule(expected, remove_postproc=True)
    assert tvm_ffi.structural_equal(kernels.tuned_schedule(func, ampere, tmp_path).mod, expected.mod)


def test_tuning_builder_processes_build_warp_specialised_samples(monkeypatch):
    """MetaSchedule's builder processes, as ``kernels.tune`` starts them for the
    warp-specialised space alone (no tensor intrinsics), build its samples."""
    from pathlib import Path

    from tvm.s_tir import meta_schedule as ms

    from tvm_cascade import ops
    from tvm_cascade.schedules import prefill

    # LocalBuilder's constructor starts a process of its own only to look up the build
    # function, which the build's process looks up again (an error there is the
    # result's error_msg).
    monkeypatch.setattr(ms.builder.LocalBuilder._cls, "_sanity_check", lambda self: None)
    func = ops.attention(1, 2, 2, 128, 128, 128, dtype="float16", variant=VARIANTS["global"])
    sch = tvm.s_tir.Schedule(func, seed=1)
    ws.design_space(VARIANTS["global"])(sch)
    builder = ms.builder.LocalBuilder(
        f_build=prefill.BUILD_FUNC, initializer=functools.partial(kernels.builder_init, ("warp_specialized_prefill",)),
        timeout_sec=120, max_workers=1,
    )
    result, = builder.build([ms.builder.BuilderInput(sch.mod, HOPPER)])
    assert result.error_msg is None, result.error_msg
    assert Path(result.artifact_path).stat().st_size > 0


def test_tuning_searches_the_kernels_space_beside_the_tensor_cores_on_hopper():
    """``kernels.design_space``: on sm_90 the union of the mma.sync schedule's space and
    the warp-specialised kernel's (``spaces`` picks), elsewhere the first alone."""
    from tvm_cascade import ops

    variant = VARIANTS["causal"]
    func = ops.attention(1, 4, 2, 256, 256, 128, dtype="float16", variant=variant)
    ampere = tvm.target.Target({"kind": "cuda", "arch": "sm_80"})

    def kernels_of(target, **spaces):
        designs = kernels.design_space(func, target, variant, **spaces).generate_design_space(tvm.IRModule({"main": func}))
        return [ws.lowers(design.mod) for design in designs]

    assert kernels_of(HOPPER) == [False, True]
    assert kernels_of(ampere) == [False]
    assert kernels_of(HOPPER, spaces=("warp-specialized",)) == [True]
    with pytest.raises(ValueError, match="no design space of \\['warp-specialized'\\] serves this function"):
        kernels.design_space(func, ampere, variant, spaces=("warp-specialized",))


@pytest.mark.parametrize("batch, seq, cluster, grid", [(8, 1024, 1, 132), (1, 256, 1, 16), (1, 256, 2, 16)])
@in_a_process_ahead
def test_blocks_are_persistent_without_a_cluster(batch, seq, cluster, grid):
    """Without a cluster the kernel of static lengths launches a block per SM (132
    without a GPU to ask), or per row tile where there are fewer, each taking row tiles
    in turn, as the runtime-length kernel does; a cluster launches a block per row tile."""
    func = ws.attention(batch, 8, 2, seq, seq, 128, VARIANTS["causal"], ws.WarpSpecializedConfig(cluster=cluster))
    assert launched(func) == (min(grid, sm_count(tvm.cuda(0))) if cluster == 1 else grid)


def test_clusters_share_each_tile_by_multicast_where_their_blocks_see_the_same_tiles():
    """``cluster=2`` (through ``compile_attention``'s schedule path, whose annotation
    carries it): the cluster launch, K and V multicast, stages released in both blocks;
    refused where the two blocks of a pair would see different tiles."""
    source = kernels.compile_attention(
        1, 8, 2, 256, 384, 128, variant=VARIANTS["causal"], target=HOPPER, config=ws.WarpSpecializedConfig(cluster=2)
    ).mod.imports[0].inspect_source()
    for instruction in (
        "%cluster_ctarank",
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster",
        "mapa.shared::cluster.u32",
        "mbarrier.arrive.shared::cluster.b64",
        "barrier.cluster.wait",
    ):
        assert instruction in source, instruction
    with pytest.raises(ValueError, match="groups of 1 heads and 2 row tiles"):
        ws.attention(1, 4, 4, 256, 256, 128, VARIANTS["causal"], ws.WarpSpecializedConfig(cluster=2))
    with pytest.raises(ValueError, match="groups of 1 heads and 3 row tiles"):
        ws.attention(1, 4, 4, 384, 384, 128, VARIANTS["global"], ws.WarpSpecializedConfig(cluster=2))
    with pytest.raises(ValueError, match="clusters of 1 or 2 blocks, not 4"):
        ws.attention(1, 8, 2, 256, 256, 128, VARIANTS["global"], ws.WarpSpecializedConfig(cluster=4))


@pytest.mark.parametrize("heads, q_tiles, span", [(6, 4, 2), (7, 3, 3), (5, 4, 8), (4, 2, None), (1, 5, 1)])
def test_causal_order_takes_a_span_of_heads_longest_row_tiles_first(heads, q_tiles, span):
    """Each row tile comes once; the heads go ``span`` at a time (the last span may hold
    fewer), within a span the row tiles from the longest (unit 0) down, each unit's heads
    together; as PrimExprs the same order as ints."""
    order = [ws.causal_order(n, heads, q_tiles, span) for n in range(heads * q_tiles)]
    assert sorted(order) == [(h, u) for h in range(heads) for u in range(q_tiles)]
    width = heads if span is None else span
    for first in range(0, heads, width):
        taken = order[first * q_tiles: min(first + width, heads) * q_tiles]
        assert {h for h, _ in taken} == set(range(first, min(first + width, heads)))
        assert [u for _, u in taken] == sorted(u for _, u in taken)
    n = tvm.tirx.Var("n", "int32")
    head, unit = ws.causal_order(n, tvm.tirx.IntImm("int32", heads), q_tiles, None if span is None else tvm.tirx.IntImm("int32", span))
    at = [{n: tvm.tirx.IntImm("int32", i)} for i in range(heads * q_tiles)]
    assert [(_value(substitute(head, v)), _value(substitute(unit, v))) for v in at] == order


@pytest.mark.parametrize("heads, q_tiles, blocks, span", [(8, 16, 14, 2), (6, 7, 5, 4), (3, 9, 4, 1), (2, 1, 3, 1)])
def test_causal_folds_take_each_row_tile_once_and_even_out_the_blocks(heads, q_tiles, blocks, span):
    """Blocks taking fold ``n // 2 * blocks + block`` in round ``n`` (as the persistent
    kernel does) take each row tile once, and their shares of keys (a row tile's count
    from the first) differ by at most one fold's (``q_tiles + 1``) in a span's order
    (two where the count is odd: a middle row tile is a fold alone);
    row tiles one a round longest first (rounds of alternate direction) leave a span of
    two heads' 16 row tiles on 14 blocks more than twice as far apart."""
    unit, n = tvm.tirx.Var("unit", "int32"), tvm.tirx.Var("n", "int32")
    real, head, tile = ws.causal_fold(unit, n, tvm.tirx.IntImm("int32", heads), q_tiles, tvm.tirx.IntImm("int32", span))
    folds = heads * ((q_tiles + 1) // 2)
    taken, shares = [], []
    for block in range(blocks):
        share = 0
        for r in range(-(-folds // blocks) * 2):
            at = {unit: tvm.tirx.IntImm("int32", r // 2 * blocks + block), n: tvm.tirx.IntImm("int32", r)}
            if r // 2 * blocks + block < folds and _value(substitute(real, at)):
                taken.append((_value(substitute(head, at)), _value(substitute(tile, at))))
                share += q_tiles - taken[-1][1]
        shares.append(share)
    assert sorted(taken) == [(h, t) for h in range(heads) for t in range(q_tiles)]
    assert max(shares) - min(shares) <= (q_tiles + 1) * (1 + q_tiles % 2)
    if (heads, q_tiles, blocks, span) == (8, 16, 14, 2):
        order = [ws.causal_order(i, heads, q_tiles, span) for i in range(heads * q_tiles)]
        longest_first = [0] * blocks
        for i, (_, t) in enumerate(order):
            r, at = divmod(i, blocks)
            longest_first[at if r % 2 == 0 else blocks - 1 - at] += q_tiles - t
        assert max(longest_first) - min(longest_first) > 2 * (max(shares) - min(shares))


@pytest.mark.parametrize("heads_q, heads_kv, keys, span", [(32, 32, 1024, 32), (32, 32, 4096, 8), (32, 8, 4096, 32),
                                                           (32, 32, 16384, 2), (32, 8, 1 << 20, 4), (8, 8, 0, 32768)])
def test_a_causal_span_holds_the_heads_whose_keys_fit_a_share_of_l2(heads_q, heads_kv, keys, span):
    """At head dim 128 a K/V head's keys take 512 bytes each: :data:`L2_SHARE` (16 MB)
    holds 32768 keys of K/V heads, at least one, and a span is whole groups."""
    assert ws.causal_span(heads_q, heads_kv, 128, keys) == span


def test_only_the_static_kernel_takes_a_causal_span():
    """The runtime-length family's kernel, causal or not, takes its blocks alone as
    scalars (no causal span: every head's longest row tiles first), and its plan gives
    only them; the span is the static kernel's (tested above)."""
    from tvm_cascade.library.spec import AttentionSpec
    from tvm_cascade.library.warp_specialized_prefill import WarpSpecializedPrefill

    family = WarpSpecializedPrefill()
    for variant in ("causal", None):
        spec = AttentionSpec.make(32, 8, 128, variant=variant, layout="ragged", target=HOPPER)
        func = family.build(spec)
        names = [p.name for p in func.params]
        assert names[names.index("blocks"): names.index("out")] == ["blocks"]
        assert len(family.plan(spec, 4, 1000, 4096, tvm.cuda(0))) == 1
