"""Warpgroup MMA (wgmma, sm_90a) in the prefill schedule: the layouts against the PTX
ISA's, the batch synchronisation pass as exact IR, and the scheduled kernel compiled for
sm_90a and checked by ptxas. No GPU here: the kernels' numerics are checked on a GPU by
``tests/test_kernels.py`` and ``python -m benchmarks.wgmma_check``."""
import re

import pytest
import tvm
import tvm_ffi
import tvm_cascade  # noqa: F401
from tvm.script import tirx as T

from tvm_cascade import kernels, ops
from tvm_cascade.bench import VARIANTS
from tvm_cascade.schedules import prefill
from tvm_cascade.cuda import software_pipeline, wgmma, wgmma_batches

from ptxas import ptxas_report

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})


def _mapped(layout, *index):
    return [int(v) for v in tvm.tirx.IndexMap.from_func(layout, ndim=len(index)).map_indices(list(index))]


def test_accumulator_layout_is_the_instruction_register_layout():
    """``accumulator`` puts C[r, c] of a warp's 16 rows where m64nNk16 leaves it: register
    ``4 * (c // 8) + 2 * (r // 8) + c % 2`` of lane ``4 * (r % 8) + (c % 8) // 2`` (PTX ISA,
    wgmma register fragment D), one such tile per 16 rows."""
    for r in range(32):
        for c in range(64):
            lane = 4 * (r % 8) + (c % 8) // 2
            register = 4 * (c // 8) + 2 * ((r % 16) // 8) + c % 2
            assert _mapped(wgmma.accumulator, r, c) == [r // 16, lane, register]


def test_row_slices_give_each_warp_its_rows_in_both_halves():
    """Row ``32 w + 16 h + i`` of a 128-row tile (warp ``w``'s slice) sits at row ``64 h
    + 16 w + i`` of the core-matrix layout, where half ``h``'s m64 instruction hands it
    to warp ``w``; the map is a bijection per tile."""
    seen = set()
    for r in range(256):
        for k in (0, 13, 127):
            tile, group, depth_group, row, depth = _mapped(wgmma.row_slices(32), r, k)
            w, h, i = (r % 128) // 32, (r % 32) // 16, r % 16
            assert (tile, group * 8 + row) == (r // 128, 64 * h + 16 * w + i)
            assert (depth_group, depth) == (k // 8, k % 8)
            seen.add((tile, group, row, k))
    assert len(seen) == 256 * 3
    # Warps of 16 rows: a warpgroup's 64 rows are one instruction's, in order.
    for r in range(256):
        tile, group, _, row, _ = _mapped(wgmma.row_slices(16), r, 5)
        assert (tile, group * 8 + row) == (r // 128, r % 128)
    with pytest.raises(ValueError, match="16 or 32, not 64"):
        wgmma.row_slices(64)
    assert _mapped(wgmma.core_matrices, 2, 19, 13) == [2, 19 // 8, 13 // 8, 19 % 8, 13 % 8]


def test_a_descriptors_constant_fields_are_one_constant():
    """A descriptor of static offsets is the start address's field OR one 64-bit constant
    (the PTX ISA's matrix descriptor: leading and stride byte offsets >> 4 at bits 16 and
    32, 128-byte swizzle at bit 62), so common subexpression elimination finds nothing in
    it to hoist out of a kernel; offsets of variables keep their fields as expressions."""
    smem = tvm.tirx.decl_buffer((4096,), "float16", "smem", scope="shared.dyn")
    for leading, stride, swizzle in ((16, 1024, True), (256, 512, False)):
        fields = wgmma.descriptor(smem.access_ptr("r"), leading, stride, swizzle=swizzle).b
        assert isinstance(fields, tvm.tirx.IntImm) and str(fields.ty) == "uint64"
        expected = (leading >> 4) << 16 | (stride >> 4) << 32 | (1 << 62 if swizzle else 0)
        assert fields.value == expected
    stride = tvm.tirx.Var("stride", "int32")
    assert not isinstance(wgmma.descriptor(smem.access_ptr("r"), 16, stride).b, tvm.tirx.IntImm)


def test_intrinsics_exist_for_the_tiles_the_schedule_uses():
    assert wgmma.scores_intrin(64) == "tvm_cascade.wgmma_scores_m64n64k16_f16_f32"
    assert wgmma.output_intrin(32) == "tvm_cascade.wgmma_output_m64n32k16_f16_f32"
    with pytest.raises(ValueError, match=r"\(32, 64, 128\) columns, not 48"):
        wgmma.scores_intrin(48)


def _fence(load):
    return T.cuda.func_call(wgmma_batches.FENCE_OPERAND, load, source_code=wgmma_batches.FENCE_OPERAND_SOURCE)


_MMA = T.ptx.wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16


@T.macro
def _issued(acc, desc, steps):
    """What sync_batches makes of a batch of ``steps`` m64n8k16 (accumulators ``acc``)
    up to its commit."""
    T.ptx.fence.proxy.async_.shared__cta()
    T.evaluate(_fence(acc[0]))
    T.evaluate(_fence(acc[1]))
    T.evaluate(_fence(acc[2]))
    T.evaluate(_fence(acc[3]))
    T.ptx.wgmma.fence.sync.aligned()
    for ks in range(steps):
        _MMA(acc[0], acc[1], acc[2], acc[3], desc[0] + T.Cast("uint64", ks), desc[0], T.bool(True), 1, 1, 0, 0)
    T.ptx.wgmma.commit_group.sync.aligned()


@T.macro
def _waited(depth, acc):
    """The wait for a batch with ``depth`` later ones left in flight, and the fences of its
    accumulators ``acc``."""
    T.ptx.wgmma.wait_group.sync.aligned(depth)
    T.evaluate(_fence(acc[0]))
    T.evaluate(_fence(acc[1]))
    T.evaluate(_fence(acc[2]))
    T.evaluate(_fence(acc[3]))


@T.macro
def _synced_batch(acc, desc, steps):
    _issued(acc, desc, steps)
    _waited(0, acc)


def test_sync_batches_fences_commits_and_waits_for_a_batch():
    """A loop annotated ``BATCH`` is preceded by the async-proxy fence, operand fences on
    the registers its instructions read (each once: the depth loop goes) and the wgmma
    fence, and followed by commit, wait and operand fences on the accumulators."""

    @T.prim_func
    def before(A: T.Buffer((1,), "uint64")):
        acc = T.alloc_buffer((4,), "float32", scope="local")
        for ks in T.serial(2, annotations={wgmma.BATCH: 1}):
            _MMA(acc[0], acc[1], acc[2], acc[3], A[0] + T.Cast("uint64", ks), A[0], T.bool(True), 1, 1, 0, 0)

    @T.prim_func
    def after(A: T.Buffer((1,), "uint64")):
        acc = T.alloc_buffer((4,), "float32", scope="local")
        _synced_batch(acc, A, 2)

    lowered = wgmma_batches.sync_batches(tvm.IRModule({"main": before}))["main"]
    assert tvm_ffi.structural_equal(lowered.body, after.body, map_free_vars=True)


def test_sync_batches_fences_shared_memory_before_the_block_barriers():
    """In a function with batches, each thread's shared-memory stores are fenced for the
    async proxy before a thread-block barrier (the batch after it reads what other
    threads stored); warp barriers are not; a function without batches is unchanged."""

    @T.prim_func
    def before(A: T.Buffer((64,), "float16"), D: T.Buffer((1,), "uint64")):
        S = T.alloc_buffer((64,), "float16", scope="shared.dyn")
        acc = T.alloc_buffer((4,), "float32", scope="local")
        S[0] = A[0]
        T.tvm_storage_sync("shared.dyn")
        T.tvm_storage_sync("warp")
        for ks in T.serial(1, annotations={wgmma.BATCH: 1}):
            _MMA(acc[0], acc[1], acc[2], acc[3], D[0] + T.Cast("uint64", ks), D[0], T.bool(True), 1, 1, 0, 0)

    @T.prim_func
    def after(A: T.Buffer((64,), "float16"), D: T.Buffer((1,), "uint64")):
        S = T.alloc_buffer((64,), "float16", scope="shared.dyn")
        acc = T.alloc_buffer((4,), "float32", scope="local")
        S[0] = A[0]
        T.ptx.fence.proxy.async_.shared__cta()
        T.tvm_storage_sync("shared.dyn")
        T.tvm_storage_sync("warp")
        _synced_batch(acc, D, 1)

    lowered = wgmma_batches.sync_batches(tvm.IRModule({"main": before}))["main"]
    assert tvm_ffi.structural_equal(lowered.body, after.body, map_free_vars=True)

    @T.prim_func
    def plain(A: T.Buffer((64,), "float16")):
        S = T.alloc_buffer((64,), "float16", scope="shared.dyn")
        S[0] = A[0]
        T.tvm_storage_sync("shared.dyn")

    assert tvm_ffi.structural_equal(wgmma_batches.sync_batches(tvm.IRModule({"main": plain}))["main"].body, plain.body)


def test_sync_batches_waits_for_a_batch_where_its_registers_are_next_touched():
    """Two batches issued back to back: the scores' batch is waited for with
    ``wait_group 1`` (the second stays in flight) where they are read, the second where
    its accumulators are; a batch whose registers nothing touches before a block barrier
    or the end of a loop body is waited for there."""

    @T.prim_func
    def before(D: T.Buffer((1,), "uint64"), out: T.Buffer((2,), "float32")):
        s = T.alloc_buffer((4,), "float32", scope="local")
        o = T.alloc_buffer((4,), "float32", scope="local")
        for ks in T.serial(1, annotations={wgmma.BATCH: 1}):
            _MMA(s[0], s[1], s[2], s[3], D[0] + T.Cast("uint64", ks), D[0], T.bool(True), 1, 1, 0, 0)
        for ks in T.serial(1, annotations={wgmma.BATCH: 1}):
            _MMA(o[0], o[1], o[2], o[3], D[0] + T.Cast("uint64", ks), D[0], T.bool(True), 1, 1, 0, 0)
        out[0] = s[0]
        out[1] = o[0]
        for j in range(2):
            for ks in T.serial(1, annotations={wgmma.BATCH: 1}):
                _MMA(s[0], s[1], s[2], s[3], D[0] + T.Cast("uint64", ks), D[0], T.bool(True), 1, 1, 0, 0)
        for ks in T.serial(1, annotations={wgmma.BATCH: 1}):
            _MMA(o[0], o[1], o[2], o[3], D[0] + T.Cast("uint64", ks), D[0], T.bool(True), 1, 1, 0, 0)
        T.tvm_storage_sync("shared")

    @T.prim_func
    def after(D: T.Buffer((1,), "uint64"), out: T.Buffer((2,), "float32")):
        s = T.alloc_buffer((4,), "float32", scope="local")
        o = T.alloc_buffer((4,), "float32", scope="local")
        _issued(s, D, 1)
        _issued(o, D, 1)
        _waited(1, s)
        out[0] = s[0]
        _waited(0, o)
        out[1] = o[0]
        for j in range(2):
            _synced_batch(s, D, 1)
        _synced_batch(o, D, 1)
        T.ptx.fence.proxy.async_.shared__cta()
        T.tvm_storage_sync("shared")

    lowered = wgmma_batches.sync_batches(tvm.IRModule({"main": before}))["main"]
    assert tvm_ffi.structural_equal(lowered.body, after.body, map_free_vars=True)


@pytest.fixture(scope="module")
def wgmma_source():
    func = ops.attention(1, 2, 2, 256, 256, 128, dtype="float16")
    sch = prefill.schedule_prefill(func, prefill.PrefillConfig(wgmma=True, pv_split=2))
    return prefill.build(sch.mod, CUDA).mod.imports[0].inspect_source()


def test_wgmma_prefill_kernel_issues_both_gemms_as_warpgroup_instructions(wgmma_source):
    """Q·Kᵀ from shared memory (ss, K-major) and P·V with the exps from registers (rs, V
    MN-major), each 64-row half of the block one instruction per k16 step, no mma.sync or
    ldmatrix left."""
    body = wgmma_source.split("__global__")[-1]
    scores = re.findall(r"wgmma_f16_ss_mma_async_sync_aligned_m64n64k16_f32_f16_f16_1_1_0_0\(", body)
    output = re.findall(r"wgmma_f16_rs_mma_async_sync_aligned_m64n64k16_f32_f16_f16_1_1_1\(", body)
    # The key loop's body twice (the software pipeline's loop and its last tile), each
    # 2 halves x 8 depth steps, and 2 halves x 4 key steps x 2 passes over the head
    # dimension; a wait after Q·Kᵀ and after each pass.
    assert (len(scores), len(output)) == (2 * 16, 2 * 16)
    assert "mma.sync" not in wgmma_source and "ldmatrix" not in wgmma_source
    assert body.count("wait_group_sync_aligned_0();") == 2 * 3


@pytest.fixture(scope="module")
def overlapped_schedule():
    func = ops.attention(1, 1, 1, 512, 512, 128, dtype="float16")
    return prefill.schedule_prefill(func, prefill.PrefillConfig(wgmma=True, warp_rows=16, pv_split=1, overlap=True))


@pytest.fixture(scope="module")
def overlapped_source(overlapped_schedule):
    return prefill.build(overlapped_schedule.mod, CUDA).mod.imports[0].inspect_source()


def test_overlapped_key_loop_issues_the_next_scores_with_the_output(overlapped_source):
    """FlashAttention-3's order in the key loop: tile j+1's Q·Kᵀ and tile j's P·V are
    committed back to back, the softmax waits for Q·Kᵀ only (``wait_group 1``), the exps
    and the fold for P·V; the K/V copies stay asynchronous (two tiles ahead)."""
    loop = overlapped_source.split("for (int rj_0 = 0; rj_0 < 6; ++rj_0) {")[1]
    steps = re.findall(r"(commit_group_sync_aligned|wait_group_sync_aligned_\d|exp_warp_ptr\[0\] =|pv_warp_ptr\[0\] =)", loop)
    assert steps[:6] == [
        "commit_group_sync_aligned", "commit_group_sync_aligned", "wait_group_sync_aligned_1",
        "wait_group_sync_aligned_0", "exp_warp_ptr[0] =", "pv_warp_ptr[0] =",
    ]
    assert "cp_async" in loop.split("commit_group_sync_aligned")[0]


def test_overlap_annotations_order_the_statements_in_three_stages(overlapped_schedule):
    """Copies in stage 0; Q·Kᵀ, the softmax and the exps in stage 1; P·V and its fold in
    stage 2, P·V ordered right after Q·Kᵀ and the fold last."""
    loops = []
    tvm_ffi.structural_walk(
        overlapped_schedule.mod["main"].body,
        lambda node: loops.append(node)
        if isinstance(node, tvm.tirx.For) and software_pipeline.CHOSEN in node.annotations
        else None,
    )
    assert [int(loop.annotations[software_pipeline.CHOSEN]) for loop in loops] == [software_pipeline.OVERLAPPED]
    annotations = software_pipeline.overlap_annotations(loops[0])
    # V, K, qk_init, qk, 8 softmax statements, the exps, pv_tile_init, pv_tile, the fold.
    assert list(annotations[software_pipeline.STAGES]) == [0, 0] + [1] * 11 + [2, 2, 2]
    assert list(annotations[software_pipeline.ORDER]) == [0, 1, 2, 3] + list(range(6, 15)) + [4, 5, 15]


def test_ptxas_keeps_the_wgmma_kernel_asynchronous(wgmma_source, overlapped_source, tmp_path):
    """With every register the instructions read fenced, ptxas neither injects warpgroup
    waits nor arrives (it does, serialising the instructions, when a register write or
    read moves across the fences), also with waits deferred past the next batch."""
    for name, source in (("prefill", wgmma_source), ("overlapped", overlapped_source)):
        _check_ptxas(source, tmp_path / f"{name}.cu")


def _check_ptxas(source, path):
    report = ptxas_report(source, path)
    assert "Compiling entry function 'main_kernel' for 'sm_90a'" in report
    assert "is injected" not in report


@pytest.mark.parametrize(
    "variant, config, message",
    [
        ("gqa", prefill.PrefillConfig(wgmma=True, heads=4), "one query head and a multiple of 128 rows"),
        ("causal", prefill.PrefillConfig(wgmma=True, rows=64), "a multiple of 128 rows"),
        ("window", prefill.PrefillConfig(wgmma=True, keys=32), "64-key tiles under a sliding window; got 32"),
        ("global", prefill.PrefillConfig(warp_rows=16), "16 rows per warp; the schedule takes 32, or 16 with wgmma"),
        ("global", prefill.PrefillConfig(wgmma=True, warp_rows=64), "64 rows per warp"),
        ("global", prefill.PrefillConfig(overlap=True), "takes wgmma and P·V in one pass; got wgmma=False"),
        ("global", prefill.PrefillConfig(wgmma=True, overlap=True), "P·V in one pass; got wgmma=True, pv_split=4"),
        ("causal", prefill.PrefillConfig(wgmma=True, pv_split=1, overlap=True), "a constant number of tiles"),
    ],
)
def test_wgmma_prefill_schedule_refuses_what_it_cannot_build(variant, config, message):
    func = ops.attention(1, 8, 2, 256, 256, 128, dtype="float16", variant=VARIANTS[variant])
    with pytest.raises(ValueError, match=message):
        prefill.schedule_prefill(func, config)


def test_wgmma_config_reaches_the_compiled_kernel():
    """``kernels.compile_attention(config=PrefillConfig(wgmma=True))`` builds the wgmma
    schedule (GQA: one query head per block)."""
    compiled = kernels.compile_attention(
        1, 8, 2, 200, 300, 128, variant=VARIANTS["gqa"], target=CUDA, records="/none",
        config=prefill.PrefillConfig(wgmma=True),
    )
    assert "wgmma.mma_async" in compiled.mod.imports[0].inspect_source()


def test_wgmma_causal_tiles_build_in_one_double_buffered_loop():
    """A causal mask's merged tile loop (a run-time trip count) under wgmma: double
    buffered, its epilogue's waits written by TVM as ``if_then_else(True & True, 1, 0)``,
    which must reach PTX as the constant 1 (before, codegen refused the expression)."""
    func = ops.attention(1, 2, 2, 512, 512, 128, dtype="float16", variant=VARIANTS["causal"])
    sch = prefill.schedule_prefill(func, prefill.PrefillConfig(wgmma=True))
    source = prefill.build(sch.mod, CUDA).mod.imports[0].inspect_source()
    assert "wgmma.mma_async" in source
    assert re.findall(r"cp\.async\.wait_group (\d+);", source) and "wait_group 1;" in source
