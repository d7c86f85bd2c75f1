"""Warpgroup MMA (wgmma, sm_90a) in the prefill schedule: the layouts against the PTX
ISA's, the batch synchronisation pass as exact IR, and the scheduled kernel compiled for
sm_90a and checked by ptxas. No GPU here: the kernels' numerics are checked on a GPU by
``tests/test_kernels.py`` and ``python -m benchmarks.wgmma_check``."""
import re
import subprocess

import pytest
import tvm
import tvm_ffi
import tvm_cascade  # noqa: F401
from tvm.script import tirx as T

from tvm_cascade import kernels, ops
from tvm_cascade.bench import VARIANTS
from tvm_cascade.schedules import prefill, wgmma

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


def test_intrinsics_exist_for_the_tiles_the_schedule_uses():
    assert wgmma.scores_intrin(64) == "tvm_cascade.wgmma_scores_m64n64k16_f16_f32"
    assert wgmma.output_intrin(32) == "tvm_cascade.wgmma_output_m64n32k16_f16_f32"
    with pytest.raises(ValueError, match=r"\(32, 64, 128\) columns, not 48"):
        wgmma.scores_intrin(48)


def _fence(load):
    return T.cuda.func_call(wgmma.FENCE_OPERAND, load, source_code=wgmma.FENCE_OPERAND_SOURCE)


_MMA = T.ptx.wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16


@T.macro
def _synced_batch(acc, desc, steps):
    """What sync_batches makes of a batch of ``steps`` m64n8k16 (accumulators ``acc``)."""
    T.ptx.fence.proxy.async_.shared__cta()
    T.evaluate(_fence(acc[0]))
    T.evaluate(_fence(acc[1]))
    T.evaluate(_fence(acc[2]))
    T.evaluate(_fence(acc[3]))
    T.ptx.wgmma.fence.sync.aligned()
    for ks in range(steps):
        _MMA(acc[0], acc[1], acc[2], acc[3], desc[0] + T.Cast("uint64", ks), desc[0], T.bool(True), 1, 1, 0, 0)
    T.ptx.wgmma.commit_group.sync.aligned()
    T.ptx.wgmma.wait_group.sync.aligned(0)
    T.evaluate(_fence(acc[0]))
    T.evaluate(_fence(acc[1]))
    T.evaluate(_fence(acc[2]))
    T.evaluate(_fence(acc[3]))


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

    lowered = wgmma.sync_batches(tvm.IRModule({"main": before}))["main"]
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

    lowered = wgmma.sync_batches(tvm.IRModule({"main": before}))["main"]
    assert tvm_ffi.structural_equal(lowered.body, after.body, map_free_vars=True)

    @T.prim_func
    def plain(A: T.Buffer((64,), "float16")):
        S = T.alloc_buffer((64,), "float16", scope="shared.dyn")
        S[0] = A[0]
        T.tvm_storage_sync("shared.dyn")

    assert tvm_ffi.structural_equal(wgmma.sync_batches(tvm.IRModule({"main": plain}))["main"].body, plain.body)


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


def test_ptxas_keeps_the_wgmma_kernel_asynchronous(wgmma_source, tmp_path):
    """With every register the instructions read fenced, ptxas neither injects warpgroup
    waits nor arrives (it does, serialising the instructions, when a register write or
    read moves across the fences)."""
    path = tmp_path / "prefill.cu"
    path.write_text(wgmma_source)
    command = ["nvcc", "-cubin", "-arch=sm_90a", "-Xptxas", "-v", "-o", str(tmp_path / "prefill.cubin"), str(path)]
    report = subprocess.run(command, capture_output=True, text=True, check=True).stderr
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
