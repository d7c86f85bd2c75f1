"""The fp8 quantisation + GEMM kernel (``schedules/warp_specialized_fp8_gemm.py``) on an
H100 or H200 (skipped elsewhere): its output against its float64 numpy definition
(:func:`tvm_cascade.ops.reference.fp8_quant_gemm_ref` with the kernel's k tile) and,
more loosely, against the unquantised product."""
import numpy as np
import pytest
import tvm

from tvm_cascade.ops import reference as R
from tvm_cascade.schedules import warp_specialized
from tvm_cascade.schedules import warp_specialized_fp8_gemm as fp8
from rows_after import check_rows_after, output_with_rows_after

pytestmark = pytest.mark.skipif(not tvm.cuda(0).exist, reason="needs a CUDA GPU")


@pytest.mark.parametrize("m, n, k, dtype, out_dtype, config", [
    (256, 512, 1024, "float16", "float16", fp8.Fp8GemmConfig()),
    (16, 1024, 4096, "float16", "float16", fp8.Fp8GemmConfig()),
    (1, 256, 512, "float16", "float32", fp8.Fp8GemmConfig(cols=64)),
    (200, 328, 528, "float16", "float32", fp8.Fp8GemmConfig(stages=3, group=2)),  # no whole tiles
    (300, 512, 1024, "bfloat16", "bfloat16", fp8.Fp8GemmConfig()),
    (128, 384, 4096, "bfloat16", "float32", fp8.Fp8GemmConfig(cols=64, stages=5)),
])
@pytest.mark.parametrize("symbolic", [False, True])
def test_fp8_gemm_matches_its_definition(m, n, k, dtype, out_dtype, config, symbolic):
    _check(m, n, k, dtype, out_dtype, symbolic, lambda rows: fp8.kernel(rows, n, k, dtype, out_dtype, config))


def _check(m, n, k, dtype, out_dtype, symbolic, kernel_of, tile=fp8.DEPTH):
    target = tvm.target.Target.from_device(tvm.cuda(0))
    if not warp_specialized.serves_target(target):
        pytest.skip("the fp8 kernel needs an H100 or H200 (sm_90)")
    pytest.importorskip("torch")  # float8 and bfloat16 tensors
    rows = tvm.tirx.Var("m", "int64") if symbolic else m
    _compare(fp8.build(kernel_of(rows), target)["main"], m, n, k, dtype, out_dtype, tile)


def test_one_function_serves_every_token_count():
    """``kernel_for`` of a variable token count: one build, run at counts that each of
    its kernels serves (16 tokens a block up to 16, 32 up to 32, 128-row tiles past)."""
    target = tvm.target.Target.from_device(tvm.cuda(0))
    if not warp_specialized.serves_target(target):
        pytest.skip("the fp8 kernel needs an H100 or H200 (sm_90)")
    pytest.importorskip("torch")
    kernel = fp8.build(fp8.kernel_for(tvm.tirx.Var("m", "int64"), 256, 512), target)["main"]
    for m in (1, 16, 17, 32, 33, 300):
        _compare(kernel, m, 256, 512, "float16", "float16")


def _compare(kernel, m, n, k, dtype, out_dtype, tile=fp8.DEPTH):
    """``kernel`` on random inputs of ``m`` tokens against the definition (k tile ``tile``)."""
    import torch

    rng = np.random.default_rng(m + n + k)
    # rows of different magnitudes, a few large values late in the row (the running max moves)
    x = rng.standard_normal((m, k)) * rng.uniform(0.01, 10, (m, 1))
    x[:, -k // 3:] *= rng.choice([1, 4], (m, 1))
    x = torch.from_numpy(x).to(getattr(torch, dtype)).cuda()
    w = torch.from_numpy(np.clip(rng.standard_normal((n, k)) * 100, -448, 448)).float().cuda().to(torch.float8_e4m3fn)
    w_scale = torch.from_numpy(rng.uniform(1e-4, 1e-2, n)).float().cuda()
    out, whole = output_with_rows_after(torch, m, n, getattr(torch, out_dtype))
    kernel(*(tvm.runtime.from_dlpack(a) for a in (x, w, w_scale, out)))
    check_rows_after(whole, m)
    x64, w64, s64 = (a.double().cpu().numpy() for a in (x, w, w_scale))
    got = out.double().cpu().numpy()
    ref = R.fp8_quant_gemm_ref(x64, w64, s64, tile=tile)
    error = lambda r: np.abs(got - r).max() / np.abs(r).max()  # noqa: E731
    assert error(ref) < (1e-3 if out_dtype == "float32" else 4e-3), (m, error(ref))
    assert error(x64 @ (w64 * s64[:, None]).T) < 5e-2


@pytest.mark.parametrize("m, n, k, dtype, out_dtype, tokens, stages, splits, consumers", [
    (16, 1024, 4096, "float16", "float16", 16, 4, None, 1),  # split_count's: 8 splits
    (16, 1024, 4096, "float16", "float16", 16, 4, 1, 1),
    (1, 256, 512, "float16", "float32", 16, 2, 2, 1),
    (45, 328, 528, "float16", "float32", 32, 4, 1, 1),  # no whole tiles
    (45, 328, 528, "float16", "float32", 32, 4, 3, 1),  # ... in splits of 2, 2 and 1 k tiles
    (100, 512, 1024, "bfloat16", "bfloat16", 64, 3, None, 1),
    # two consumer warpgroups a block, sharing the quantised tokens
    (32, 1024, 4096, "float16", "float16", 32, 4, None, 2),
    (16, 1024, 4096, "float16", "float16", 16, 4, None, 2),  # 8 elements a thread of a token's tile
    (1, 256, 512, "float16", "float32", 16, 2, 2, 2),
    (45, 328, 528, "float16", "float32", 32, 3, 2, 2),  # W's last tile past N in one warpgroup's rows
    (100, 512, 1024, "bfloat16", "bfloat16", 64, 3, 1, 2),
])
@pytest.mark.parametrize("symbolic", [False, True])
def test_skinny_fp8_gemm_matches_its_definition(m, n, k, dtype, out_dtype, tokens, stages, splits, consumers,
                                                 symbolic):
    """The kernel for few tokens, whole or with K split (the inputs' large values late
    in each row: the splits after the first start from the abs-max before them), of
    one or two consumer warpgroups a block."""
    _check(m, n, k, dtype, out_dtype, symbolic,
           lambda rows: fp8.skinny_kernel(rows, n, k, dtype, out_dtype, tokens, stages, splits=splits,
                                          consumers=consumers))


@pytest.mark.parametrize("m, n, k, dtype, out_dtype, config", [
    (256, 512, 1024, "float16", "float16", fp8.Fp8GemmConfig()),
    (1, 256, 512, "float16", "float32", fp8.Fp8GemmConfig(cols=64)),
    (200, 328, 528, "float16", "float32", fp8.Fp8GemmConfig(stages=3, group=2)),  # no whole tiles
    (300, 512, 1024, "bfloat16", "bfloat16", fp8.Fp8GemmConfig(stages=6)),
    (128, 384, 4096, "bfloat16", "float32", fp8.Fp8GemmConfig(cols=64, stages=7)),
    # clusters of two blocks sharing W tiles: one pair of row tiles, an odd number (the
    # last pair's second past M), partial tiles, many pairs, 64 columns (32-row halves)
    (256, 512, 1024, "float16", "float16", fp8._two_pass_config([128, 6, 16, 2])),
    (300, 512, 1024, "bfloat16", "bfloat16", fp8._two_pass_config([128, 6, 16, 2])),
    (200, 328, 528, "float16", "float32", fp8._two_pass_config([128, 3, 2, 2])),
    (2048, 1024, 2048, "float16", "float16", fp8._two_pass_config([128, 6, 16, 2])),
    (256, 384, 1024, "float16", "float16", fp8._two_pass_config([64, 6, 16, 2])),
])
@pytest.mark.parametrize("symbolic", [False, True])
def test_two_pass_fp8_gemm_matches_its_definition(m, n, k, dtype, out_dtype, config, symbolic):
    """The op with one k tile (each row quantised by its abs-max over all of k) as two
    kernels (``fp8_two_pass``): quantisation, then the GEMM of e4m3 operands."""
    from tvm_cascade.schedules import fp8_two_pass

    _check(m, n, k, dtype, out_dtype, symbolic,
           lambda rows: fp8_two_pass.two_pass_kernel(rows, n, k, dtype, out_dtype, config), tile=k)


@pytest.mark.parametrize("m, form, choices", [(24, None, None), (300, None, None), (40, "skinny", [64, 3]), (40, "skinny", [64, 3, 2])])
def test_a_schedule_of_the_op_builds_the_kernel(m, form, choices):
    """``ops.fp8_quant_gemm`` scheduled (:func:`fp8.schedule`: the default form or a given
    one) and built by :func:`fp8.build`, as MetaSchedule's candidates are."""
    from tvm_cascade.ops import cascades

    n, k = 384, 1024
    _check(m, n, k, "float16", "float16", False, lambda rows: fp8.schedule(cascades.fp8_quant_gemm(rows, n, k), form, choices).mod)
