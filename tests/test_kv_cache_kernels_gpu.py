"""The kernels with TVM's paged KV cache's calling convention
(:mod:`tvm_cascade.library.kv_cache`) on a CUDA GPU (skipped without one): the fast
families' outputs and log-sum-exps against numpy's, over ragged batches longer than a
tile, pages in any order and index arrays at element offsets."""
import numpy as np
import pytest
import tvm

from kv_cache_cases import OUTPUT_AT, arguments, expected
from tvm_cascade.library.kv_cache import cache_kernel

pytestmark = pytest.mark.skipif(not tvm.cuda(0).exist, reason="needs a CUDA GPU")

#: (kind, query lengths, key lengths).
CASES = [
    ("ragged", [300, 1, 77, 129], [300, 1, 77, 129]),
    ("ragged", [1000], [1000]),
    ("prefill", [200, 3, 64], [500, 17, 0]),
    ("prefill", [130], [1030]),
    ("decode", [1] * 5, [1, 300, 1000, 4097, 77]),
    ("decode", [1] * 40, list(range(10, 4010, 100))),
]
#: The family each kind runs on an sm_90 GPU.
FAMILIES = {"ragged": "warp_specialized_prefill", "prefill": "warp_specialized_prefill"}


@pytest.mark.parametrize("kind, q_lens, kv_lens", CASES)
@pytest.mark.parametrize("heads", [(32, 8), (16, 16), (12, 4)], ids=["gqa4", "mha", "gqa3"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fast_families_match_numpy(kind, q_lens, kv_lens, heads, head_dim):
    target = tvm.target.Target.from_device(tvm.cuda(0))
    kernel, why = cache_kernel(kind, *heads, head_dim, "float16", target)
    assert kernel is not None, why
    if kind in FAMILIES and int(str(target.arch)[3:5]) == 90:
        assert kernel.family.name == FAMILIES[kind]
    if kind == "decode":
        assert kernel.family.name in ("tensor_core_decode", "split_k_decode")
    func = tvm.compile(tvm.IRModule({"main": kernel.func}), target=kernel.func.attrs["target"])["main"]
    args, reference, causal = arguments(kind, q_lens, kv_lens, *heads, head_dim, tvm.cuda(0), seed=3)
    func(*args)
    out, lse = expected(q_lens, reference, causal, args[-1])
    at = OUTPUT_AT[kind]
    np.testing.assert_allclose(args[at].numpy().astype("float64"), out, atol=5e-3, rtol=5e-3)
    np.testing.assert_allclose(args[at + 1].numpy(), lse, atol=2e-3, rtol=1e-3)
