"""Relax models' row chains through the ``"cascade"`` pipeline on a CUDA GPU (skipped
without one): softmax, log-softmax and cross-entropy (row kernels after legalisation),
torch.export's cross-entropy, an MoE router and a log-sum-exp (``DispatchRowChains``'
fused kernels)
against float64 numpy, rows the chunks divide and rows they do not, a static and a
runtime number of rows."""
import numpy as np
import pytest
import tvm
from relax_row_cases import row_model, row_reference
from tvm import relax

import tvm_cascade  # noqa: F401  (registers the "cascade" pipeline)

pytestmark = pytest.mark.skipif(not tvm.cuda(0).exist, reason="needs a CUDA GPU")


def _logits(rows, n, dtype, rng):
    x = rng.standard_normal((rows, n)) * 4
    if dtype == "bfloat16":
        import ml_dtypes

        return x.astype(ml_dtypes.bfloat16)
    return x.astype(dtype)


@pytest.mark.parametrize("symbolic", [False, True], ids=["static", "symbolic"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("n", [4096, 1001])
@pytest.mark.parametrize("kind", ["softmax", "log_softmax", "cross_entropy", "exported_cross_entropy", "router",
                                  "log_sum_exp"])
def test_matches_float64(kind, n, dtype, symbolic):
    rows = 37
    dev = tvm.cuda(0)
    target = tvm.target.Target.from_device(dev)
    extent = tvm.tirx.Var("tokens", "int64") if symbolic else rows
    executable = tvm.compile(row_model(kind, extent, n, dtype), target=target, relax_pipeline="cascade")
    rng = np.random.default_rng(n)
    x = _logits(rows, n, dtype, rng)
    args = [x] + ([rng.integers(0, n, rows).astype("int64")] if "cross_entropy" in kind else [])
    got = relax.VirtualMachine(executable, dev)["main"](*(tvm.runtime.tensor(a, dev) for a in args))
    expected = row_reference(kind, x, *args[1:])
    for out, ref in zip(got if kind == "router" else [got], expected if kind == "router" else [expected]):
        np.testing.assert_allclose(out.numpy(), ref, rtol=1e-4, atol=1e-5)
