"""tvm_cascade.library's kernels on a CUDA GPU (skipped without one): every layout,
variant, dtype, GQA group and head dim against float64 numpy, lengths that are no tile
multiples, torch tensors through DLPack."""
import numpy as np
import pytest
import tvm

import tvm_cascade  # noqa: F401
from library_cases import VARIANTS, check, check_lengths, reference
from tvm_cascade.library import KernelArgumentError, attention_kernel
from tvm_cascade.ops import testing as tt

pytestmark = pytest.mark.skipif(not tvm.cuda(0).exist, reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TVM_CASCADE_CACHE", str(tmp_path / "cache"))


def _kernel(layout, heads_q=8, heads_kv=2, head_dim=64, variant="causal", dtype="float16"):
    return attention_kernel(heads_q, heads_kv, head_dim, variant=variant, dtype=dtype, layout=layout, target="cuda")


@pytest.mark.parametrize("layout", ["bhsd", "ragged", "paged"])
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_variants_every_layout(layout, variant):
    if layout == "bhsd":
        lengths = [([37, 37], [300, 300]), ([1, 1, 1], [1000, 1000, 1000]), ([129], [129])]
    else:
        lengths = [([37, 1, 200, 5], [300, 999, 200, 70]), ([8, 4], [4000, 17])]
    check_lengths(_kernel(layout, variant=variant), lengths, seed=1)


@pytest.mark.parametrize("heads", [(8, 8), (8, 4), (16, 4), (32, 4), (16, 1)], ids=["mha", "gqa2", "gqa4", "gqa8", "mqa"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_groups_dtypes_head_dims(heads, dtype, head_dim):
    check_lengths(_kernel("paged", *heads, head_dim=head_dim, dtype=dtype), [([5, 1, 64], [77, 513, 64])], seed=2)


def test_torch_tensors():
    torch = pytest.importorskip("torch")
    kernel = _kernel("ragged")
    sequences = tt.random_sequences([3, 40], [50, 41], 8, 2, 64, dtype="float16", rng=np.random.default_rng(3))
    args = [torch.from_numpy(a).cuda() for a in tt.pack_ragged(sequences)]
    out = kernel(*args)
    assert isinstance(out, torch.Tensor) and out.is_cuda
    ref = np.concatenate(reference(sequences, "causal"))
    check(out.cpu().numpy(), ref, "float16")
    # A slice of a larger tensor (not 64-byte aligned) is read through a copy.
    wide = torch.empty(args[0].numel() + 8, dtype=torch.float16, device="cuda")
    q = wide[3 : 3 + args[0].numel()].view(args[0].shape)
    q.copy_(args[0])
    check(kernel(q, *args[1:]).cpu().numpy(), ref, "float16")
    with pytest.raises(KernelArgumentError, match="strided"):
        kernel(args[0].transpose(0, 1), *args[1:])
    with pytest.raises(KernelArgumentError, match="on cpu:0, but the kernel runs on cuda:0"):
        kernel(args[0].cpu(), *args[1:])


@pytest.mark.parametrize("heads", [(8, 8), (8, 4), (16, 4), (32, 4), (28, 4), (32, 2), (16, 1)],
                         ids=["mha", "gqa2", "gqa4", "gqa8", "gqa7", "gqa16", "mqa"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_split_k_decode(heads, head_dim, dtype):
    """1-8 query rows per sequence (speculative decode beside plain decode) over keys of
    any length, ragged, through the paged layout: the split-k decode family."""
    kernel = _kernel("paged", *heads, head_dim=head_dim, dtype=dtype)
    assert kernel.family_for(8).name == "split_k_decode"
    check_lengths(kernel, [([1, 4, 8, 1], [1, 700, 3001, 40])], seed=5)
