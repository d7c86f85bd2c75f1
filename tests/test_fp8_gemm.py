"""The fp8 quantisation + GEMM kernel (``schedules/warp_specialized_fp8_gemm.py``) on the
CPU: the repair it takes from ``rolling_update``'s derivation, its numpy definition, the
CUDA kernel its build makes for sm_90a (through ptxas), and its refusals. The kernel runs
only on an H100 or H200: numerics in test_fp8_gemm_gpu.py."""
import functools
import json
import re

import ml_dtypes
import numpy as np
import pytest
import sympy
import tvm

from tvm_cascade import trace as cascade_trace
from tvm_cascade.errors import FusionError
from tvm_cascade.ops import cascades
from tvm_cascade.ops import reference as R
from tvm_cascade.primitives.ir import annotated_blocks
from tvm_cascade.schedules import warp_specialized_fp8_gemm as fp8
from ptxas import assembled, assembly
from launches import WAITS, grids, kernel_prologues
from ahead import in_a_process_ahead

SM90A = {"kind": "cuda", "arch": "sm_90a"}


def test_the_repair_is_the_derived_ratio_of_the_running_maxima():
    old, new = fp8._OLD, fp8._NEW
    eps = sympy.Float(fp8.EPS)
    expected = sympy.Max(eps, old) / sympy.Max(eps, new)
    assert fp8.derived_repair().free_symbols == {old, new}
    for values in ({old: 3.0, new: 5.0}, {old: 2.0, new: 7.0}, {old: 0.0, new: 1.5}, {old: 0.0, new: 0.0}):
        assert abs(float(fp8.derived_repair().subs(values)) - float(expected.subs(values))) < 1e-12


def _quantised_gemm(x, w, scales_per_tile, tile):
    """Σ_t e4m3(x_t s_t) w_tᵀ / s_t with the given float32 scales of each row and tile."""
    out = np.zeros((x.shape[0], w.shape[0]))
    for t, k0 in enumerate(range(0, x.shape[1], tile)):
        s = scales_per_tile[:, t].astype(np.float32)
        q = (x[:, k0:k0 + tile].astype(np.float32) * s[:, None]).astype(ml_dtypes.float8_e4m3fn)
        out += q.astype(np.float64) @ w[:, k0:k0 + tile].T / s.astype(np.float64)[:, None]
    return out


def test_the_definition_quantises_each_tile_by_the_running_maximum():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 12)).astype(np.float16)
    x[0, 9] = 40  # row 0's max arrives in its last tile
    x[1, 0] = -40  # row 1's in its first
    w = rng.standard_normal((5, 12))
    w_scale = rng.uniform(0.5, 2, 5)
    peaks = np.maximum.accumulate(np.abs(x.astype(np.float32)).reshape(3, 3, 4).max(axis=2), axis=1)
    expected = _quantised_gemm(x, w, np.float32(448) / peaks, 4) * w_scale
    np.testing.assert_allclose(R.fp8_quant_gemm_ref(x, w, w_scale, tile=4), expected, rtol=1e-12)
    two_pass = _quantised_gemm(x, w, np.repeat(np.float32(448) / peaks[:, -1:], 3, axis=1), 4) * w_scale
    np.testing.assert_allclose(R.fp8_quant_gemm_ref(x, w, w_scale), two_pass, rtol=1e-12)
    # a row whose first tile holds its max is quantised alike either way
    np.testing.assert_allclose(R.fp8_quant_gemm_ref(x, w, w_scale, tile=4)[1], two_pass[1], rtol=1e-12)
    assert np.abs(R.fp8_quant_gemm_ref(x, w, w_scale, tile=4)[0] - two_pass[0]).max() > 0


def _source(func):
    return fp8.build(func, SM90A).mod.imports[0].inspect_source()


def test_build_makes_one_tma_and_fp8_wgmma_kernel():
    source = _source(fp8.kernel(tvm.tirx.Var("m", "int64"), 1024, 4096))
    assert source.count("__global__") == 2  # declared and defined
    for mark in (
        "cp.async.bulk.tensor.2d", "setmaxnreg.inc", "setmaxnreg.dec", "max.xorsign.abs.f16x2",
        "cvt.rn.satfinite.e4m3x2.f32", "__fdiv_rn", "wgmma_fp8_rs_mma_async_sync_aligned_m64n128k32_f32_e4m3_e4m3",
    ):
        assert mark in source, mark
    # four output columns a thread at a time (whole 32-byte sectors a warp)
    assert "*(half4*)(out_ptr" in source and "out_ptr[" not in source


def test_a_variable_token_count_chooses_its_kernel_at_run_time():
    """``kernel_for`` of a variable ``m``: one function over one set of parameters whose
    body launches 16-token skinny blocks up to 16 tokens, 32-token ones up to 32, and
    the 128-row kernel past that (three kernels in its source). The skinny kernels count
    the rows of a 64-bit ``m`` in 32 bits, and so index in 32 bits."""
    m = tvm.tirx.Var("m", "int64")
    func = fp8.kernel_for(m, 256, 512)
    assert [p.name for p in func.params] == ["X", "W", "w_scale", "out"]
    bind, first = func.body.seq
    rows = bind.var
    tvm.ir.assert_structural_equal(bind.value, tvm.tirx.Cast("int32", m))
    second = first.else_case
    assert isinstance(first, tvm.tirx.IfThenElse) and isinstance(second, tvm.tirx.IfThenElse)
    tvm.ir.assert_structural_equal([first.condition, second.condition], [m <= 16, m <= 32])
    params = func.params
    skinny = functools.partial(fp8.skinny_kernel, rows, 256, 512, params=params, consumers=fp8.SKINNY_CONSUMERS)
    for branch, kernel in ((first.then_case, skinny(tokens=16)), (second.then_case, skinny(tokens=32)),
                           (second.else_case, fp8.kernel(m, 256, 512, params=params))):
        tvm.ir.assert_structural_equal(func.with_body(branch), kernel, map_free_vars=True)
    source = _source(func)
    assert source.count("__global__") == 6  # three, each declared and defined
    # 64-bit arguments for the 128-row kernel only (the skinny ones: 288 threads)
    signatures = re.findall(r"__global__ void __launch_bounds__\(([\d, ]+)\) \w+\(([^)]*)\)", source)
    assert len(signatures) == 6 and all(("int64_t" in args) == (bounds == "384, 1") for bounds, args in signatures)
    # TVM's CUDA launcher passes no 64-bit unsigned argument: what the kernels share
    # and TIR's CSE computes once on the host for them is no descriptor field.
    assert "uint64_t" not in "".join(re.findall(r"__global__ void[^{;]*\)", source))


def _kernel_source(rows, n, k, dtype, out_dtype):
    return _source(fp8.kernel(tvm.tirx.Var("m", "int64") if rows is None else rows, n, k, dtype, out_dtype))


@pytest.mark.parametrize("rows, n, k, dtype, out_dtype", [
    (2048, 14336, 4096, "float16", "float16"), (None, 328, 528, "bfloat16", "float32"),
])
@assembled(_kernel_source)
def test_ptxas_honours_setmaxnreg_and_keeps_wgmma_asynchronous(rows, n, k, dtype, out_dtype, runs_ahead, request):
    """Through nvcc (no GPU needed): no register spills, setmaxnreg honoured, the wgmma
    instructions asynchronous (not serialised, no warpgroup waits injected)."""
    _, report = assembly(runs_ahead, request)
    assert "0 bytes spill stores, 0 bytes spill loads" in report
    # C7508: setmaxnreg ignored; C7511/C7514/C7519: wgmma serialised, warpgroup arrive/wait injected.
    for remark in ("C7508", "C7511", "C7514", "C7519", "is injected"):
        assert remark not in report, report


def test_the_skinny_kernel_splits_k_each_split_from_its_tokens_abs_max_before_it():
    """With ``splits``, blocks share an output tile's k tiles: each first reads its
    tokens' abs-max over the tiles before its own from X (16-byte loads), quantises as
    the whole loop would from there, and stores float32 parts that a second kernel adds
    (a block per token and 256 columns, launched as a programmatic dependent of the
    first). By default the splits are ``skinny_splits``'s."""
    m = tvm.tirx.Var("m", "int64")
    func = fp8.skinny_kernel(m, 1024, 4096, splits=4)
    source = _source(func)
    assert source.count("__global__") == 4  # two kernels, each declared and defined
    assert kernel_prologues(source) == [WAITS, WAITS]
    assert "griddepcontrol" not in _source(fp8.skinny_kernel(m, 1024, 4096, splits=1))
    assert "*(uint4*)(X_ptr" in source and "float* __restrict__ parts" in source
    tile_blocks, sum_blocks = grids(func)
    tvm.ir.assert_structural_equal(tile_blocks, (m + 16 - 1) // 16 * 16 * 4)
    tvm.ir.assert_structural_equal(sum_blocks, m * 4)
    tvm.ir.assert_structural_equal(fp8.skinny_kernel(m, 1024, 4096), fp8.skinny_kernel(m, 1024, 4096, splits=8))
    assert fp8.split_count(1024 // fp8.W_ROWS, 4096 // fp8.DEPTH, sms=132) == 8
    assert fp8.skinny_splits(14336 // fp8.W_ROWS, 4096 // fp8.DEPTH, sms=132) == 1  # no SM idle
    with pytest.raises(ValueError, match="4 splits of K = 640's 5 tiles of 128: each split needs a tile"):
        fp8.skinny_kernel(16, 256, 640, splits=4)


def _split_skinny_source(tokens, consumers):
    return _source(fp8.skinny_kernel(tvm.tirx.Var("m", "int64"), 14336, 4096, tokens=tokens, splits=2,
                                     consumers=consumers))


@pytest.mark.parametrize("tokens, consumers", [(16, 1), (32, 1), (16, 2), (32, 2)])
@assembled(_split_skinny_source)
def test_ptxas_keeps_the_split_skinny_kernel_asynchronous(tokens, consumers, runs_ahead, request):
    _, report = assembly(runs_ahead, request)
    assert report.count("0 bytes spill stores, 0 bytes spill loads") == 2
    for remark in ("C7511", "C7514", "C7519", "is injected"):
        assert remark not in report, report


@pytest.mark.parametrize("args, config, reason", [
    ((64, 64, "float32", "float16"), fp8.Fp8GemmConfig(), "quantises float16 or bfloat16"),
    ((64, 64, "float16", "int8"), fp8.Fp8GemmConfig(), "stores float16, bfloat16 or float32"),
    ((64, 72, "float16", "float16"), fp8.Fp8GemmConfig(), "multiple of 16 bytes"),
    ((64, 64, "float16", "float16"), fp8.Fp8GemmConfig(cols=256), "64 or 128"),
    ((64, 64, "float16", "float16"), fp8.Fp8GemmConfig(stages=5), "bytes of shared memory"),
])
def test_refusals_say_why(args, config, reason):
    assert reason in fp8.unsupported(*args, config)
    with pytest.raises(ValueError, match=reason):
        fp8.kernel(16, *args, config=config)


def test_two_consumer_warpgroups_share_a_block_s_quantised_tokens():
    """``consumers=2``: blocks of 128 W rows, two consumer warpgroups of 64 and a producer
    warp, the second warpgroup's wgmma reading W's rows 64 on (8 KiB on in each stage) and
    storing rows 64 on; a thread quantises 8 elements of a token's tile at 16 tokens (an
    8-byte store of them), 16 at 32; two such blocks an SM bound the stages."""
    m = tvm.tirx.Var("m", "int64")
    func = fp8.skinny_kernel(m, 14336, 4096, tokens=32, splits=1, consumers=2)
    (blocks,) = grids(func)
    tvm.ir.assert_structural_equal(blocks, (m + 32 - 1) // 32 * (14336 // 128))
    source = _source(func)
    assert "__launch_bounds__(288)" in source
    assert "(((int)threadIdx.x) >> 7) * 4096)" in source  # the warpgroup's W rows in shared memory
    # splits where a token tile's rows, in tiles of 64, leave SMs idle
    assert fp8.skinny_splits(14336 // 128, 4096 // fp8.DEPTH, sms=132, consumers=2) == 1
    assert fp8.skinny_splits(4096 // 128, 4096 // fp8.DEPTH, sms=132, consumers=2) == fp8.split_count(
        4096 // 128, 4096 // fp8.DEPTH, sms=132, per_sm=fp8.BLOCKS_PER_SM / 2) > 1
    assert "st.shared.v2.b32" in _source(fp8.skinny_kernel(m, 14336, 4096, tokens=16, splits=1, consumers=2))
    assert "st.shared.v2.b32" not in source
    for kwargs, reason in (
        (dict(tokens=32, consumers=3), "3 consumer warpgroups a block: one of (1, 2)"),
        (dict(tokens=64, stages=4, consumers=2), "4 stages of 64 tokens and 128 W rows"),
    ):
        assert reason in fp8.skinny_unsupported(14336, 4096, "float16", "float16", kwargs.get("tokens"),
                                                kwargs.get("stages", 4), 1, kwargs["consumers"])
        with pytest.raises(ValueError, match=re.escape(reason)):
            fp8.skinny_kernel(16, 14336, 4096, **kwargs)


@pytest.mark.parametrize("choices, reason", [
    ([32, 16], "ascending order"), ([], "ascending order"), ([16, 48], "one of (16, 32, 64)"),
])
def test_a_run_time_choice_refuses_what_it_cannot_launch(choices, reason):
    problem = fp8.Fp8QuantGemm(tvm.tirx.Var("m", "int64"), 512, 1024, "float16", "float16")
    assert reason in fp8.unsupported_choices(problem, "by_tokens", choices)
    with pytest.raises(ValueError, match=re.escape(reason)):
        fp8.schedule(problem.function(), "by_tokens", choices)


def test_build_refuses_a_gpu_without_wgmma():
    with pytest.raises(ValueError, match="needs sm_90a"):
        fp8.build(fp8.kernel(16, 64, 64), {"kind": "cuda", "arch": "sm_80"})


def test_the_benchmark_checks_against_the_same_definition():
    """benchmarks.fp8_gemm's PyTorch form of the definition (what the GPU run checks
    against) equals the numpy one."""
    torch = pytest.importorskip("torch")
    from benchmarks import fp8_gemm as bench

    rng = np.random.default_rng(1)
    x = torch.from_numpy(rng.standard_normal((5, 300)) * rng.uniform(0.01, 10, (5, 1))).half()
    w = torch.from_numpy(np.clip(rng.standard_normal((7, 300)) * 100, -448, 448)).float().to(torch.float8_e4m3fn)
    w_scale = torch.from_numpy(rng.uniform(1e-3, 1e-2, 7)).float()
    got = bench.rolling_reference(x, w, w_scale, fp8.DEPTH).numpy()
    ref = R.fp8_quant_gemm_ref(x.double().numpy(), w.double().numpy(), w_scale.double().numpy(), tile=fp8.DEPTH)
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12 * np.abs(ref).max())


def test_the_benchmark_table_gives_speed_ups_over_the_faster_compiled_path():
    from benchmarks import fp8_gemm as bench

    rows = bench.against_compiled([
        {"shape": "s", "peer": "tvm-cascade", "ms": 0.02, "TFLOP/s": 5.0, "relative error": 0.03},
        {"shape": "s", "peer": bench.TWO_KERNELS, "ms": 0.03, "relative error": 0.025},
        {"shape": "s", "peer": "torch.compile", "error": "fails"},
        {"shape": "s", "peer": "tvm-cascade, two passes", "ms": 0.025},
    ])
    assert ("| s | 0.0200 | -- | 0.0250 | -- | 0.0300 | fails | -- | 5 | 1.50x / 1.20x | 3.00e-02 / 2.50e-02 |"
            in bench.markdown(rows))
    # against the faster compiled path: here torch.compile's
    rows[2] = {"shape": "s", "peer": "torch.compile", "ms": 0.024}
    assert "| 5 | 1.20x / 0.96x |" in bench.markdown(bench.against_compiled(rows))


def _exact_inputs(rng, m, k, n, tile):
    """X whose every tile's e4m3 scale is a power of two that keeps X·s on e4m3's grid (so
    that a cast which does not round, as TVM's LLVM one, still gives the e4m3 values), and
    no zeros (TVM's LLVM code reads an e4m3 zero as 2⁻⁷)."""
    grid = np.array([0.5, 1, 1.5, 2, 3, 4, 6, 8, -1, -2, -3, -0.75, 12, 16])
    x = rng.choice(grid, (m, k))
    for t in range(k // tile):
        x[:, t * tile] = 448 / 2 ** rng.integers(0, 3, m)  # the tile's max: 448, 224 or 112
    x[:, 0] = 112  # the row's first tile
    w = rng.choice(grid, (n, k)).astype(ml_dtypes.float8_e4m3fn)
    return x.astype(np.float16), w, rng.uniform(0.5, 2, n).astype(np.float32)


def test_the_op_computes_its_definition_on_the_cpu():
    """``ops.fp8_quant_gemm`` through TVM's LLVM code against numpy, on inputs whose
    quantisation is exact (see :func:`_exact_inputs`): its tiles, scales and sums; the
    rounding of the running-max form is checked on the GPU (test_fp8_gemm_gpu.py)."""
    rng = np.random.default_rng(3)
    m, k, n, tile = 6, 32, 5, 8
    x, w, w_scale = _exact_inputs(rng, m, k, n, tile)
    func = cascades.fp8_quant_gemm(m, n, k, tile=tile, out_dtype="float32")
    lib = tvm.compile(tvm.IRModule({"main": func}), target="llvm")
    dev = tvm.cpu()
    args = [tvm.runtime.tensor(a, dev) for a in (x, w, w_scale)] + [tvm.runtime.tensor(np.zeros((m, n), np.float32), dev)]
    lib["main"](*args)
    ref = R.fp8_quant_gemm_ref(x, w.astype(np.float64), w_scale, tile=tile)
    np.testing.assert_allclose(args[-1].numpy(), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@in_a_process_ahead
def test_schedule_annotates_the_form_and_replays_from_json():
    rows = tvm.tirx.Var("m", "int64")
    func = cascades.fp8_quant_gemm(rows, 512, 1024, out_dtype="float32")
    assert fp8.fp8_quant_gemm_of(func) == fp8.Fp8QuantGemm(rows, 512, 1024, "float16", "float32")
    sch = fp8.schedule(func)
    expected = tvm.s_tir.Schedule(func)
    expected.annotate(expected.get_sblock("gemm"), fp8.FORM, "by_tokens")
    expected.annotate(expected.get_sblock("gemm"), f"{fp8.CHOICES}.0", 16)
    expected.annotate(expected.get_sblock("gemm"), f"{fp8.CHOICES}.1", 32)
    tvm.ir.assert_structural_equal(sch.mod, expected.mod)
    replayed = tvm.s_tir.Schedule(func)
    cascade_trace.apply_json_to_schedule(json.loads(json.dumps(cascade_trace.to_plain_json(sch.trace.as_json()))), replayed)
    tvm.ir.assert_structural_equal(replayed.mod, sch.mod)
    assert _source(sch.mod) == _source(fp8.kernel_for(rows, 512, 1024, "float16", "float32"))
    few = cascades.fp8_quant_gemm(20, 512, 1024)
    assert _source(fp8.schedule(few).mod) == _source(fp8.skinny_kernel(20, 512, 1024, tokens=32, consumers=2))
    assert _source(fp8.schedule(few, "skinny", [32, 3, 2]).mod) == _source(
        fp8.skinny_kernel(20, 512, 1024, tokens=32, stages=3, consumers=2))
    # a record of the skinny form's first two choices: one consumer warpgroup
    assert _source(fp8.schedule(few, "skinny", [32, 3]).mod) == _source(
        fp8.skinny_kernel(20, 512, 1024, tokens=32, stages=3, consumers=1))
    with pytest.raises(ValueError, match=re.escape("choices are [tokens, stages, consumers], not [32]")):
        fp8.schedule(few, "skinny", [32])


def test_only_the_op_with_the_kernels_tile_is_recognised():
    assert fp8.fp8_quant_gemm_of(cascades.fp8_quant_gemm(16, 64, 512, tile=64)) is None
    assert fp8.fp8_quant_gemm_of(cascades.absmax_quant_gemm(16, 64, 512)) is None
    with pytest.raises(FusionError, match="serve ops.fp8_quant_gemm"):
        fp8.schedule(cascades.rmsnorm_gemm(16, 64, 512))
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        fp8.schedule(cascades.fp8_quant_gemm(16, 64, 520))
    sch = tvm.s_tir.Schedule(cascades.fp8_quant_gemm(16, 64, 512))
    fp8.apply_schedule(sch, "skinny", [48, 4])
    with pytest.raises(ValueError, match="48 tokens a block"):
        fp8.build(sch.mod, SM90A)
    with pytest.raises(ValueError, match="48 tokens a block"):
        fp8.schedule(cascades.fp8_quant_gemm(16, 64, 512), "skinny", [48, 4])


def test_the_op_with_one_k_tile_runs_as_two_kernels():
    """``ops.fp8_quant_gemm`` with one k tile (each row quantised by its abs-max over all
    of k: the two-pass form) is recognised as such and scheduled to the two kernels of
    ``fp8_two_pass`` (its default form for any token count): a quantisation kernel
    writing e4m3 rows and their scales into a workspace, then TMA copies of both e4m3
    operands into ``wgmma`` from shared memory (launched as a programmatic dependent of
    the first: it launches as the quantisation ends, asks for its first stages of W in
    L2, then waits, before it touches global memory). The one-kernel forms refuse it,
    and it refuses the op with 128-wide k tiles."""
    from tvm_cascade.schedules import fp8_two_pass

    rows = tvm.tirx.Var("m", "int64")
    problem = fp8.fp8_quant_gemm_of(cascades.fp8_quant_gemm(rows, 512, 1024, tile=1024))
    assert problem is not None and problem.tile == 1024 and problem.one_tile()
    sch = fp8.schedule(problem.function())
    source = _source(sch.mod)
    assert source == _source(fp8.kernel_for(rows, 512, 1024, tile=1024))
    assert source == _source(fp8_two_pass.two_pass_kernel(rows, 512, 1024))
    assert source.count("__global__") == 4  # two, each declared and defined
    assert kernel_prologues(source) == [WAITS, WAITS[1:] + [kernel_prologues(source)[1][1]]]
    gemm = source[source.rindex('extern "C" __global__'):]
    gemm = gemm[gemm.index("{"):]  # its body
    before_wait = gemm[:gemm.index(WAITS[0])]
    # the 6 stages' W boxes (k 0, 128, ..., 640) asked for in L2, by one thread, before the wait
    assert fp8.TWO_PASS_CONFIG.stages == 6
    assert re.findall(r"tvm_cascade_prefetch_box_2d\(\(\(unsigned long long\)\(&\(w_map\)\)\), (\d+),", before_wait) == [
        "0", "128", "256", "384", "512", "640"]
    assert not any(f"{name}_ptr" in before_wait for name in ("q_scale", "w_scale", "out", "X", "q"))
    assert gemm.count(WAITS[0]) == 1
    for mark in ("cvt.rn.satfinite.e4m3x2.f32", "__fdiv_rn", "cp.async.bulk.tensor.2d",
                 "wgmma_fp8_ss_mma_async_sync_aligned_m64n128k32_f32_e4m3_e4m3"):
        assert mark in source, mark
    with pytest.raises(ValueError, match="one-kernel forms quantise k tiles of 128"):
        fp8.schedule(problem.function(), "tiles", [128, 4, 16])
    with pytest.raises(ValueError, match="one k tile, not 128 of 1024"):
        fp8.schedule(cascades.fp8_quant_gemm(rows, 512, 1024), "two_pass", [128, 4, 16])
    with pytest.raises(ValueError, match="bytes of shared memory"):
        fp8.schedule(problem.function(), "two_pass", [128, 8, 16])
    with pytest.raises(ValueError, match="16-byte pieces"):
        fp8_two_pass.two_pass_kernel(16, 64, 1028)
    with pytest.raises(ValueError, match="k tiles of 128 or one of K"):
        fp8.kernel_for(16, 64, 1024, tile=256)


def _two_pass_source(k, cluster):
    from tvm_cascade.schedules import fp8_two_pass

    config = fp8._two_pass_config([128, 6, 16, cluster])
    return _source(fp8_two_pass.two_pass_kernel(tvm.tirx.Var("m", "int64"), 328, k, "bfloat16", "float32", config))


# k tiles in runs of 8, 2, 1; clusters of two blocks sharing W tiles
@pytest.mark.parametrize("k, cluster", [(4096, 1), (4352, 1), (4224, 1), (4096, 2)])
@assembled(_two_pass_source)
def test_ptxas_keeps_the_two_pass_gemm_asynchronous(k, cluster, runs_ahead, request):
    """As :func:`test_ptxas_honours_setmaxnreg_and_keeps_wgmma_asynchronous`, for the
    two kernels of the op with one k tile (six stages, partial tiles of M and N): the
    GEMM's runs of k tiles overlap a tile's wgmmas with the tile before's additions;
    no kernel spills (in a cluster, with the producer's 32 registers)."""
    source, report = assembly(runs_ahead, request)
    assert ("wgmma.wait_group.sync.aligned 1;" in source) == (k != 4224)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert len(spills) == 2 and all(count == "0" for pair in spills for count in pair), report
    for remark in ("C7508", "C7511", "C7514", "C7519", "is injected"):
        assert remark not in report, report


def test_metaschedule_proposes_the_kernels_and_its_builder_lowers_them():
    """On an H100 target ``cascade_space`` proposes both forms for 32 tokens (the tile
    form's columns and grouping, the skinny form's tokens sampled); after the target's
    postprocessors the candidate builder's build function makes the sampled kernel."""
    from tvm.s_tir import meta_schedule as ms

    from tvm_cascade.meta_schedule import BUILD_FUNC, cascade_space

    target = tvm.target.Target("nvidia/nvidia-h100")
    func = cascades.fp8_quant_gemm(32, 512, 1024)
    context = ms.TuneContext(mod=tvm.IRModule({"main": func}), target=target, space_generator=cascade_space(), task_name="t")
    samples = [s for s in context.generate_design_space() if fp8.lowers(s.mod)]
    forms = []
    for sample in samples:
        for postproc in context.space_generator.postprocs:
            assert postproc.apply(sample), type(postproc).__name__
        (block,) = {str(b.annotations[fp8.FORM]): b for _, _, b in annotated_blocks(sample.mod, fp8.FORM)}.values()
        form, choices = fp8.chosen(block.annotations)
        forms.append(form)
        source = tvm.get_global_func(BUILD_FUNC)(sample.mod, target, None).imports[0].inspect_source()
        columns = choices[0] if form == "tiles" else choices[0]
        assert f"m64n{columns}k32_f32_e4m3_e4m3" in source
    assert sorted(forms) == ["skinny", "tiles"]
    assert sum(inst.kind.name == "SampleCategorical" for inst in samples[0].trace.insts) >= 2  # columns, grouping


def test_metaschedule_proposes_the_two_kernels_for_the_op_with_one_k_tile():
    """For the op with one k tile ``CascadeFusion`` proposes the two-pass form alone
    (columns, stages and grouping sampled), which the candidate builder lowers."""
    from tvm.s_tir import meta_schedule as ms

    from tvm_cascade.meta_schedule import BUILD_FUNC, CascadeFusion

    target = tvm.target.Target("nvidia/nvidia-h100")
    func = cascades.fp8_quant_gemm(2048, 512, 1024, tile=1024)
    space = ms.space_generator.PostOrderApply(sch_rules=[CascadeFusion(unfused=False)], postprocs=[], mutator_probs={})
    context = ms.TuneContext(mod=tvm.IRModule({"main": func}), target=target, space_generator=space, task_name="t")
    samples = {str(b.annotations[fp8.FORM]): s for s in context.generate_design_space()
               for _, _, b in annotated_blocks(s.mod, fp8.FORM)}
    assert sorted(samples) == ["two_pass"]
    assert sum(inst.kind.name == "SampleCategorical" for inst in samples["two_pass"].trace.insts) == 3
    source = tvm.get_global_func(BUILD_FUNC)(samples["two_pass"].mod, target, None).imports[0].inspect_source()
    assert "wgmma_fp8_ss_mma_async" in source


def test_metaschedule_proposes_the_run_time_choice_for_a_variable_token_count():
    """For a variable token count ``CascadeFusion`` proposes the 128-row kernel and the
    function that picks its kernel at run time, which the candidate builder lowers to
    five kernels (the 16- and 32-token ones, each with its splits' sum, and the
    128-row one)."""
    from tvm.s_tir import meta_schedule as ms

    from tvm_cascade.meta_schedule import BUILD_FUNC, CascadeFusion

    target = tvm.target.Target("nvidia/nvidia-h100")
    func = cascades.fp8_quant_gemm(tvm.tirx.Var("m", "int64"), 512, 1024)
    space = ms.space_generator.PostOrderApply(sch_rules=[CascadeFusion(unfused=False)], postprocs=[], mutator_probs={})
    context = ms.TuneContext(mod=tvm.IRModule({"main": func}), target=target, space_generator=space, task_name="t")
    samples = {str(b.annotations[fp8.FORM]): s for s in context.generate_design_space()
               for _, _, b in annotated_blocks(s.mod, fp8.FORM)}
    assert sorted(samples) == ["by_tokens", "tiles"]
    source = tvm.get_global_func(BUILD_FUNC)(samples["by_tokens"].mod, target, None).imports[0].inspect_source()
    assert source.count("__global__") == 10


def test_a_two_pass_gemm_in_clusters_of_two_shares_each_w_tile():
    """The two-pass form's fourth choice, 2: the GEMM's blocks go in clusters of two over
    two row tiles of one column tile (a grid of whole pairs), each copying its own
    quantised rows and half the W tile's rows into both blocks (TMA multicast, its map's
    box half the tile), each stage's ``empty`` awaiting both blocks' consumer threads
    (remote arrivals), cluster barriers after initialisation and before leaving, the
    producer with 32 registers. Three choices (or a fourth of 1) build the kernel
    without clusters."""
    from tvm_cascade.schedules import fp8_two_pass

    problem = fp8.fp8_quant_gemm_of(cascades.fp8_quant_gemm(300, 1024, 1024, tile=1024))
    sch = fp8.schedule(problem.function(), "two_pass", [128, 6, 16, 2])
    source = _source(sch.mod)
    assert _source(fp8.schedule(problem.function(), "two_pass", [128, 6, 16, 1]).mod) == _source(
        fp8.schedule(problem.function()).mod)
    gemm = source[source.rindex('extern "C" __global__'):]
    copies = re.findall(r"complete_tx__bytes(_multicast__cluster)?\((.*?)\);\n", gemm)
    assert [bool(multicast) for multicast, _ in copies] == [False, True]
    # the W half: 64 rows (4096 16-bit elements) on from the block's rank, mask 0b11
    assert "cluster_ctaid_x()) * 4096)" in copies[1][1] and "cluster_ctaid_x()) * 64)" in copies[1][1]
    assert copies[1][1].endswith("(ushort)3")
    assert "arrive_shared__cluster_b64(" in gemm and "mapa_u32_shared__cluster_u32(" in gemm
    assert gemm.count("barrier_cluster_arrive_cluster_arrive();") == 2
    assert "setmaxnreg_dec_sync_aligned_u32_32();" in gemm
    assert re.search(r"init_shared_b64\(.*empty_ptr\[0\].*\(condval(_\d+)? \* 128\) \+ \(condval(_\d+)? \* 128\)", gemm)
    func = fp8_two_pass.two_pass_kernel(300, 1024, 1024, config=fp8._two_pass_config([128, 6, 16, 2]))
    assert grids(func)[-1] == 2 * 2 * 8  # 3 row tiles in 2 pairs, 8 column tiles
    encodes = [c for c in func.script().splitlines() if "tensormap_encode_tiled(w_map" in c]
    assert len(encodes) == 1 and "1024, 1024, 1024, 128, 64, 1, 1" in encodes[0]
    with pytest.raises(ValueError, match="clusters of 1 or 2 blocks, not 3"):
        fp8.schedule(problem.function(), "two_pass", [128, 6, 16, 3])
