"""``tvm_cascade.schedules.scaled_gemm`` on a CUDA GPU (skipped without one): RMSNorm +
GEMM and abs-max-scaled GEMM as one tensor-core kernel against float64 numpy, at each
block height the default configuration picks; on an H100 or H200 also the
warp-specialised RMSNorm + GEMM (:mod:`tvm_cascade.schedules.warp_specialized_gemm`),
which the cascade pipeline takes there."""
import numpy as np
import pytest
import tvm
import tvm_cascade  # noqa: F401

from tvm_cascade.cuda import tensor_cores
from tvm_cascade.ops import cascades
from tvm_cascade.ops import reference as R
from tvm_cascade.schedules import scaled_gemm, warp_specialized
from tvm_cascade.schedules.scaled_gemm import schedule_scaled_gemm
from tvm_cascade.schedules.warp_specialized_gemm import WarpSpecializedGemmConfig
from rows_after import check_rows_after, output_with_rows_after

pytestmark = pytest.mark.skipif(not tvm.cuda(0).exist, reason="needs a CUDA GPU")


def _run(func, inputs, shape):
    """The kernel's output (no row past M stored: :mod:`rows_after`)."""
    torch = pytest.importorskip("torch")
    sch = schedule_scaled_gemm(func)
    kernel = tensor_cores.build(sch.mod, tvm.target.Target.from_device(tvm.cuda(0)))["main"]
    out, whole = output_with_rows_after(torch, *shape, torch.float16)
    kernel(*[tvm.runtime.tensor(a, tvm.cuda(0)) for a in inputs], tvm.runtime.from_dlpack(out))
    check_rows_after(whole, shape[0])
    return out.double().cpu().numpy()


def _relative_error(got, ref):
    return np.abs(got - ref).max() / np.abs(ref).max()


@pytest.mark.parametrize("m, n, k", [(256, 384, 512), (64, 256, 1024), (32, 128, 4096), (96, 256, 192)])
def test_rmsnorm_gemm(m, n, k):
    rng = np.random.default_rng(m + n + k)
    x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10, (m, 1))).astype("float16")
    gamma = (1 + 0.1 * rng.standard_normal(k)).astype("float16")
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype("float16")
    got = _run(cascades.rmsnorm_gemm(m, n, k, dtype="float16"), [x, gamma, w], (m, n))
    ref = R.rmsnorm_gemm_ref(x.astype("float64"), gamma.astype("float64"), w.astype("float64"))
    assert _relative_error(got, ref) < 5e-3


@pytest.mark.parametrize("m, n, k, layout, out_dtype, config, dtype", [
    (256, 512, 512, "kn", "float16", WarpSpecializedGemmConfig(), "float16"),
    (256, 512, 512, "nk", "float16", WarpSpecializedGemmConfig(cols=128, stages=6), "float16"),
    (200, 328, 520, "kn", "float32", WarpSpecializedGemmConfig(), "float16"),  # no whole tiles along M, N or K
    (77, 200, 1032, "nk", "float16", WarpSpecializedGemmConfig(cols=64, stages=3, group=2), "float16"),
    (16, 1024, 4096, "kn", "float16", WarpSpecializedGemmConfig(cols=128), "float16"),
    (300, 512, 1024, "nk", "bfloat16", WarpSpecializedGemmConfig(), "bfloat16"),
    (128, 384, 4096, "kn", "float32", WarpSpecializedGemmConfig(cols=128), "bfloat16"),
    # persistent blocks taking two tiles or more each
    (2048, 4096, 1024, "kn", "float16", WarpSpecializedGemmConfig(), "float16"),
    (1100, 2048, 512, "nk", "bfloat16", WarpSpecializedGemmConfig(), "bfloat16"),
    # clusters of two blocks sharing W tiles: rounds of pairs of row tiles, an odd number
    # of row tiles (the last pair's second past M), partial tiles, one 64-column panel
    (2048, 4096, 1024, "kn", "float16", WarpSpecializedGemmConfig(cluster=2), "float16"),
    (1100, 2048, 512, "nk", "bfloat16", WarpSpecializedGemmConfig(cluster=2), "bfloat16"),
    (200, 328, 520, "kn", "float32", WarpSpecializedGemmConfig(cluster=2), "float16"),
    (77, 200, 1032, "nk", "float16", WarpSpecializedGemmConfig(cols=64, stages=3, group=2, cluster=2), "float16"),
    (256, 512, 512, "kn", "float16", WarpSpecializedGemmConfig(cols=64, cluster=2), "float16"),
])
@pytest.mark.parametrize("symbolic", [False, True])
def test_warp_specialized_rmsnorm_gemm(m, n, k, layout, out_dtype, config, dtype, symbolic):
    target = tvm.target.Target.from_device(tvm.cuda(0))
    if not warp_specialized.serves_target(target):
        pytest.skip("the warp-specialised kernel needs an H100 or H200 (sm_90)")
    rows = tvm.tirx.Var("m", "int32") if symbolic else m
    func = cascades.rmsnorm_gemm(rows, n, k, dtype=dtype, weight_layout=layout, out_dtype=out_dtype)
    _check_rmsnorm_gemm(scaled_gemm.build(schedule_scaled_gemm(func, config).mod, target)["main"],
                        m, n, k, layout, out_dtype, dtype)


def _check_rmsnorm_gemm(kernel, m, n, k, layout, out_dtype, dtype):
    """``kernel(X, gamma, W, out)`` against float64 numpy, on rows of X of magnitudes 0.1
    to 10 (W as [k, n] for ``layout`` "kn", else [n, k])."""
    torch = pytest.importorskip("torch")  # bfloat16 tensors (numpy has none)
    rng = np.random.default_rng(m + n + k)
    on_gpu = lambda a: torch.from_numpy(a).to(getattr(torch, dtype)).cuda()  # noqa: E731
    x = on_gpu(rng.standard_normal((m, k)) * rng.uniform(0.1, 10, (m, 1)))
    gamma = on_gpu(1 + 0.1 * rng.standard_normal(k))
    w = on_gpu(rng.standard_normal((k, n)) / np.sqrt(k))
    out, whole = output_with_rows_after(torch, m, n, getattr(torch, out_dtype))
    kernel(*(tvm.runtime.from_dlpack(a) for a in (x, gamma, w if layout == "kn" else w.T.contiguous(), out)))
    check_rows_after(whole, m)
    ref = R.rmsnorm_gemm_ref(*(a.double().cpu().numpy() for a in (x, gamma, w)))
    out = out.double().cpu().numpy()
    assert _relative_error(out, ref) < (5e-3 if dtype == "float16" else 2e-2)


@pytest.mark.parametrize("m, n, k, layout, out_dtype, tokens, dtype, stages, splits", [
    (16, 1024, 4096, "kn", "float16", 16, "float16", 4, 1),
    (16, 1024, 4096, "nk", "float16", 16, "float16", 4, 3),
    (16, 1024, 4096, "kn", "float16", 16, "float16", 3, 7),
    (1, 512, 1024, "kn", "float16", 16, "float16", 4, 1),
    (20, 328, 4104, "kn", "float32", 16, "float16", 4, 1),  # no whole tiles along M, N or K
    (20, 328, 4104, "kn", "float32", 16, "float16", 3, 5),  # ... and five splits of 13 k tiles
    (32, 704, 2048, "nk", "bfloat16", 32, "bfloat16", 4, 4),
    (45, 200, 520, "nk", "float16", 32, "float16", 4, 1),
    (45, 200, 520, "nk", "float16", 32, "float16", 3, 3),
])
@pytest.mark.parametrize("symbolic", [False, True])
def test_skinny_rmsnorm_gemm(m, n, k, layout, out_dtype, tokens, dtype, stages, splits, symbolic):
    """The kernel for few rows (:mod:`tvm_cascade.schedules.rmsnorm_gemm_skinny`), its
    k tiles in one block or split among several, in three stages or four."""
    from tvm_cascade.schedules import rmsnorm_gemm_skinny as skinny

    target = tvm.target.Target.from_device(tvm.cuda(0))
    if not warp_specialized.serves_target(target):
        pytest.skip("the kernel needs an H100 or H200 (sm_90)")
    rows = tvm.tirx.Var("m", "int32") if symbolic else m
    func = skinny.skinny_kernel(rows, n, k, layout=layout, out_dtype=out_dtype, tokens=tokens, dtype=dtype,
                                stages=stages, splits=splits)
    _check_rmsnorm_gemm(skinny.build(func, target)["main"], m, n, k, layout, out_dtype, dtype)


@pytest.mark.parametrize("n", [1024, 6144])
def test_a_variable_row_count_launches_the_kernel_its_rows_need(n):
    """One function for any rows (what ``DispatchScaledGemm`` builds for a symbolic
    token count): the kernel for few rows (K split; N = 6144 in three stages) up to 16,
    the 128-row one past."""
    target = tvm.target.Target.from_device(tvm.cuda(0))
    if not warp_specialized.serves_target(target):
        pytest.skip("the warp-specialised kernel needs an H100 or H200 (sm_90)")
    func = cascades.rmsnorm_gemm(tvm.tirx.Var("m", "int32"), n, 4096, dtype="float16", weight_layout="nk")
    kernel = scaled_gemm.build(scaled_gemm.schedule_for_target(func, target).mod, target)["main"]
    for m in (1, 16, 17, 200):
        _check_rmsnorm_gemm(kernel, m, n, 4096, "nk", "float16", "float16")


@pytest.mark.parametrize("m, pad", [(1, 32), (16, 32), (48, 32), (200, 128)])
def test_rmsnorm_gemm_with_padded_rows(m, pad):
    rng = np.random.default_rng(m)
    x = rng.standard_normal((m, 512)).astype("float16")
    gamma = (1 + 0.1 * rng.standard_normal(512)).astype("float16")
    w = (rng.standard_normal((512, 256)) / 16).astype("float16")
    got = _run(cascades.rmsnorm_gemm(m, 256, 512, dtype="float16", pad_rows=pad), [x, gamma, w], (m, 256))
    ref = R.rmsnorm_gemm_ref(x.astype("float64"), gamma.astype("float64"), w.astype("float64"))
    assert _relative_error(got, ref) < 5e-3


def test_absmax_scaled_gemm():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((128, 256)) * 3).astype("float16")
    w = (rng.standard_normal((256, 256)) / 16).astype("float16")
    got = _run(cascades.absmax_quant_gemm(128, 256, 256, dtype="float16"), [x, w], (128, 256))
    ref = R.absmax_quant_gemm_ref(x.astype("float64"), w.astype("float64"))
    assert _relative_error(got, ref) < 5e-3


@pytest.mark.parametrize("transposed", [False, True])
def test_relax_norm_and_linear_through_the_cascade_pipeline(transposed):
    """``relax_pipeline="cascade"`` runs ``matmul(rms_norm(x), w)`` on the kernel
    (``DispatchScaledGemm``) and matches numpy."""
    from test_relax_scaled_gemm import norm_then_linear
    from tvm import relax

    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 64, 512)).astype("float16")
    gamma = (1 + 0.1 * rng.standard_normal(512)).astype("float16")
    w = (rng.standard_normal((512, 256)) / 16).astype("float16")
    target = tvm.target.Target.from_device(tvm.cuda(0))
    executable = tvm.compile(norm_then_linear((2, 64), 512, 256, transposed), target=target, relax_pipeline="cascade")
    dev = tvm.cuda(0)
    vm = relax.VirtualMachine(executable, dev)
    got = vm["main"](*(tvm.runtime.tensor(a, dev) for a in (x, gamma, w.T.copy() if transposed else w))).numpy()
    ref = R.rmsnorm_gemm_ref(x.reshape(128, 512).astype("float64"), gamma.astype("float64"), w.astype("float64"), eps=1e-5)
    assert _relative_error(got.reshape(128, 256).astype("float64"), ref) < 5e-3


def test_relax_prompt_of_any_length_on_one_kernel():
    """A symbolic token count: one executable, run at lengths that are and are not whole
    128-row tiles, matches numpy."""
    from test_relax_scaled_gemm import norm_then_linear
    from tvm import relax

    tokens = tvm.tirx.Var("tokens", "int64")
    target = tvm.target.Target.from_device(tvm.cuda(0))
    executable = tvm.compile(norm_then_linear((1, tokens), 512, 256, True), target=target, relax_pipeline="cascade")
    dev = tvm.cuda(0)
    vm = relax.VirtualMachine(executable, dev)
    rng = np.random.default_rng(5)
    gamma = (1 + 0.1 * rng.standard_normal(512)).astype("float16")
    w = (rng.standard_normal((512, 256)) / 16).astype("float16")
    for length in (77, 256, 300):
        x = rng.standard_normal((1, length, 512)).astype("float16")
        got = vm["main"](*(tvm.runtime.tensor(a, dev) for a in (x, gamma, w.T.copy()))).numpy()
        ref = R.rmsnorm_gemm_ref(x[0].astype("float64"), gamma.astype("float64"), w.astype("float64"), eps=1e-5)
        assert _relative_error(got[0].astype("float64"), ref) < 5e-3


def test_torch_exported_norm_and_linear_through_the_cascade_pipeline():
    """``torch.export`` of a hand-written RMSNorm and a linear layer (a float32 output,
    as TVM's torch frontend gives it) on the kernel matches numpy."""
    torch = pytest.importorskip("torch")
    from torch.export import export
    from tvm import relax
    from tvm.relax.frontend.torch import from_exported_program

    class NormLinear(torch.nn.Module):
        def __init__(self, gamma, weight):
            super().__init__()
            self.gamma = torch.nn.Parameter(torch.from_numpy(gamma))
            self.proj = torch.nn.Linear(512, 256, bias=False, dtype=torch.float16)
            self.proj.weight.data = torch.from_numpy(weight)

        def forward(self, x):
            h = x.to(torch.float32)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
            return self.proj(self.gamma * h.to(torch.float16))

    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 64, 512)).astype("float16")
    gamma = (1 + 0.1 * rng.standard_normal(512)).astype("float16")
    w = (rng.standard_normal((512, 256)) / 16).astype("float16")
    model = from_exported_program(export(NormLinear(gamma, w.T.copy()), (torch.from_numpy(x),)))
    target = tvm.target.Target.from_device(tvm.cuda(0))
    dev = tvm.cuda(0)
    vm = relax.VirtualMachine(tvm.compile(model, target=target, relax_pipeline="cascade"), dev)
    got = vm["main"](tvm.runtime.tensor(x, dev))[0].numpy()
    ref = R.rmsnorm_gemm_ref(x.reshape(128, 512).astype("float64"), gamma.astype("float64"), w.astype("float64"), eps=1e-5)
    assert got.dtype == np.float32 and _relative_error(got.reshape(128, 256).astype("float64"), ref) < 5e-3
