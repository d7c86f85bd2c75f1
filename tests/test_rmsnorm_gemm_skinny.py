"""The RMSNorm + GEMM kernel for few rows (``schedules/rmsnorm_gemm_skinny.py``) on the
CPU: the CUDA kernel it makes for sm_90a, what ptxas makes of it, and its refusals. It
runs only on an H100 or H200: numerics in test_scaled_gemm_gpu.py."""
import pytest
import tvm

from tvm_cascade.schedules import rmsnorm_gemm_skinny as skinny
from launches import grid as launched
from launches import WAITS, grids, kernel_prologues
from ptxas import assembled, assembly

SM90A = {"kind": "cuda", "arch": "sm_90a"}


def _source(func):
    return skinny.build(func, SM90A).mod.imports[0].inspect_source()


@pytest.mark.parametrize("layout, transposed", [("kn", 1), ("nk", 0)])
@pytest.mark.parametrize("tokens", [16, 32])
def test_build_makes_one_tma_and_wgmma_kernel_of_w_by_the_scaled_rows(layout, transposed, tokens):
    """One kernel, ``outᵀ = Wᵀ·X̃ᵀ``: TMA copies of X and W, X̃ = X·γ by 16-bit pair
    products stored to shared memory, and wgmma m64n{tokens}k16 with both operands in
    shared memory, W as A (MN-major as [K, N]: transpose flag 1; K-major as [N, K]: 0);
    a block for each 64 columns of W and ``tokens`` rows of X."""
    m = tvm.tirx.Var("m", "int64")
    func = skinny.skinny_kernel(m, 1000, 4096, layout=layout, tokens=tokens)
    source = _source(func)
    assert source.count("__global__") == 2  # declared and defined
    assert "griddepcontrol" not in source
    for mark in ("cp.async.bulk.tensor.2d", "mul.rn.f16x2", "st.shared.v4.b32",
                 f"wgmma.mma_async.sync.aligned.m64n{tokens}k16.f32.f16.f16", f"ps0, 1, 1, {transposed}, 0;"):
        assert mark in source, mark
    tvm.ir.assert_structural_equal(launched(func), (m + tokens - 1) // tokens * 16)


def test_splits_of_k_run_a_block_a_split_then_a_kernel_that_adds_them_up():
    """With ``splits``, each output tile's k tiles are shared among that many blocks,
    which store unscaled float32 products and partial sums of squares; a second kernel,
    a block per row and 256 columns, adds them up, scales and stores, launched as a
    programmatic dependent of the first (it launches as the splits end, then waits)."""
    m = tvm.tirx.Var("m", "int64")
    func = skinny.skinny_kernel(m, 1000, 4096, tokens=16, splits=3)
    source = _source(func)
    assert source.count("__global__") == 4  # two kernels, each declared and defined
    assert kernel_prologues(source) == [WAITS, WAITS]
    assert "float* __restrict__ parts" in source and "float* __restrict__ squares" in source
    tile_blocks, combine_blocks = grids(func)
    tvm.ir.assert_structural_equal(tile_blocks, (m + 16 - 1) // 16 * 16 * 3)
    tvm.ir.assert_structural_equal(combine_blocks, m * 4)


def _kernel_source(layout, m, n, k, tokens, dtype, out_dtype, stages, splits):
    return _source(skinny.skinny_kernel(m, n, k, layout=layout, tokens=tokens, dtype=dtype, out_dtype=out_dtype,
                                        stages=stages, splits=splits))


@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("m, n, k, tokens, dtype, out_dtype, stages, splits", [
    (tvm.tirx.Var("m", "int64"), 14336, 4096, 16, "float16", "float16", 4, 1),
    (20, 328, 4104, 32, "bfloat16", "float32", 4, 1),  # no whole tiles along M, N or K
    (16, 4096, 14336, 16, "float16", "float16", 3, 9),  # default_config's
])
@assembled(_kernel_source)
def test_ptxas_finds_no_spills_and_keeps_wgmma_asynchronous(layout, m, n, k, tokens, dtype, out_dtype, stages, splits,
                                                           runs_ahead, request):
    _, report = assembly(runs_ahead, request)
    assert report.count("0 bytes spill stores, 0 bytes spill loads") == (1 if splits == 1 else 2)
    # C7511/C7514/C7519: wgmma serialised, warpgroup arrive/wait injected.
    for remark in ("C7511", "C7514", "C7519", "is injected"):
        assert remark not in report, report


def test_default_config_fits_its_blocks_in_the_sms_at_once():
    """Splits for about 4.5 blocks an SM, in four stages where all the blocks fit in the
    SMs' shared memory at once (four blocks an SM), else three (six an SM)."""
    assert (skinny.blocks_an_sm(4), skinny.blocks_an_sm(3)) == (4, 6)
    for (n, k), config in {(14336, 4096): (3, 3), (6144, 4096): (3, 6), (4096, 14336): (3, 9),
                           (4096, 4096): (4, 8), (28672, 4096): (4, 1)}.items():
        stages, splits = skinny.default_config(n, k, sms=132)
        assert (stages, splits) == config, (n, k)
        assert n // skinny.W_COLS * splits <= skinny.blocks_an_sm(stages) * 132
        skinny.skinny_kernel(16, n, k, stages=stages, splits=splits)  # not refused


@pytest.mark.parametrize("args, message", [
    (dict(dtype="float32"), "computes in float16 or bfloat16, not float32"),
    (dict(out_dtype="bfloat16"), "stores float16 or float32, not bfloat16"),
    (dict(layout="kk"), "W's layout must be one of"),
    (dict(k=4100), "TMA needs rows of a multiple of 16 bytes: K = 4100"),
    (dict(tokens=64), "64 rows of X a block: one of"),
    (dict(stages=12), "12 stages of 16 rows: 2 or more, in a third of the shared memory"),
    (dict(k=320, splits=4), "4 splits of K = 320's 5 tiles of 64: each split needs a tile"),
    (dict(splits=0), "0 splits of K = 4096's 64 tiles"),
])
def test_refusals(args, message):
    shape = dict(m=16, n=1024, k=4096)
    shape.update(args)
    with pytest.raises(ValueError, match=message):
        skinny.skinny_kernel(**shape)
    with pytest.raises(ValueError, match="needs sm_90a"):
        skinny.build(skinny.skinny_kernel(16, 1024, 4096), {"kind": "cuda", "arch": "sm_80"})
