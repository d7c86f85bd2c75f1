"""tvm_cascade.library's kernels on a CUDA GPU (skipped without one): every layout,
variant, dtype, GQA group and head dim against float64 numpy, lengths that are no tile
multiples, torch tensors through DLPack."""
import numpy as np
import pytest
import tvm

import tvm_cascade  # noqa: F401
from library_cases import LAYOUTS, MASKS, VARIANTS, check, check_lengths, masked_case, masked_reference, reference
from tvm_cascade.library import KernelArgumentError, attention_kernel
from tvm_cascade.library.spec import UNIFORM_LAYOUTS, MaskTensor
from tvm_cascade.schedules.warp_specialized import key_tile
from tvm_cascade.ops import testing as tt

pytestmark = pytest.mark.skipif(not tvm.cuda(0).exist, reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TVM_CASCADE_CACHE", str(tmp_path / "cache"))


def _kernel(layout, heads_q=8, heads_kv=2, head_dim=64, variant="causal", dtype="float16"):
    return attention_kernel(heads_q, heads_kv, head_dim, variant=variant, dtype=dtype, layout=layout, target="cuda")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_variants_every_layout(layout, variant):
    if layout in UNIFORM_LAYOUTS:
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
    any length, ragged, through the paged layout: the split-k decode families (tensor
    cores at head dims 64 and 128)."""
    kernel = _kernel("paged", *heads, head_dim=head_dim, dtype=dtype)
    assert kernel.family_for(8).name == ("split_k_decode" if head_dim == 256 else "tensor_core_decode")
    check_lengths(kernel, [([1, 4, 8, 1], [1, 700, 3001, 40])], seed=5)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_tensor_core_decode(layout, variant, head_dim):
    """The tensor-core decode family: every layout and variant, a GQA group of 4 with 1-8
    query rows (16-row tiles full and partial), keys of any length (and none)."""
    kernel = _kernel(layout, 16, 4, head_dim=head_dim, variant=variant)
    assert kernel.family_for(8).name == "tensor_core_decode"
    if layout in UNIFORM_LAYOUTS:
        lengths = [([1], [3000]), ([4, 4], [37, 37]), ([8], [8])]
    else:
        lengths = [([1, 4, 8, 1, 2], [1, 700, 3001, 40, 0])]
    check_lengths(kernel, lengths, seed=11)


def _nan_tails(args, page_size):
    """The paged arguments with the unused rows of each sequence's last page NaN (a page
    pool holds whatever was there before)."""
    q, pages, q_indptr, page_indptr, page_ids, last = args
    pages = pages.copy()
    for b, used in enumerate(last):
        if page_indptr[b + 1] > page_indptr[b]:
            pages[page_ids[page_indptr[b + 1] - 1], :, :, used:] = np.nan
    return q, pages, q_indptr, page_indptr, page_ids, last


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_warp_specialized_prefill(layout, variant, dtype):
    """More than 8 query rows at head dim 128 on Hopper: the warp-specialised family,
    lengths that are no tile multiples, fewer keys than queries (rows that see no key
    under a mask give zeros), chunked prefill (512 new tokens on 2500 cached)."""
    kernel = _kernel(layout, 16, 4, head_dim=128, variant=variant, dtype=dtype)
    assert kernel.family_for(9).name == "warp_specialized_prefill"
    if layout in UNIFORM_LAYOUTS:
        lengths = [([300, 300], [300, 300]), ([129], [1000]), ([200], [100]), ([9], [9])]
    else:
        lengths = [([37, 9, 200, 512, 130], [300, 999, 100, 3012, 130]), ([1000, 9], [1000, 4000])]
    check_lengths(kernel, lengths, seed=7)


@pytest.mark.parametrize("head_dim", [64, 256, 80, 96, 200])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("variant", [VARIANTS[1], VARIANTS[-1]], ids=lambda v: v.name)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_warp_specialized_prefill_head_dims(head_dim, layout, variant, dtype):
    """Head dims 64 and 256 (64-key tiles) on the warp-specialised family, and head dims
    between (80, 96: the head dim 128 kernel; 200: 256's) with the tensors' columns
    past them TMA's zeros."""
    kernel = _kernel(layout, 8, 2, head_dim=head_dim, variant=variant, dtype=dtype)
    assert kernel.family_for(9).name == "warp_specialized_prefill"
    lengths = [([300], [300]), ([129], [1000]), ([200], [100])] if layout in UNIFORM_LAYOUTS else \
        [([37, 9, 200, 512, 130], [300, 999, 100, 1012, 130])]
    check_lengths(kernel, lengths, seed=9)


@pytest.mark.parametrize("head_dim", [80, 96])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_padded_head_dim_decode_rows(layout, head_dim):
    """Head dims 80 and 96 run the tensor-core decode's head dim 128 kernel (the columns
    past theirs read as zeros) for decode and speculative rows."""
    kernel = _kernel(layout, 32, 8, head_dim=head_dim, variant=VARIANTS[1], dtype="float16")
    assert [f.name for f in kernel.families] == ["tensor_core_decode", "warp_specialized_prefill"]
    lengths = [([1, 1], [777, 777]), ([4], [3000])] if layout in UNIFORM_LAYOUTS else \
        [([1, 4, 1], [777, 3000, 9])]
    check_lengths(kernel, lengths, seed=11)


@pytest.mark.parametrize("page_size", [8, 16, 64])
def test_warp_specialized_prefill_reads_only_the_sequences_keys(page_size):
    """Unused rows of a last page hold NaN: the kernel masks them and clears their V rows
    before P·V; every page size the family takes."""
    kernel = attention_kernel(8, 2, 128, variant="causal", layout="paged", page_size=page_size, target="cuda")
    assert kernel.family_for(9).name == "warp_specialized_prefill"
    rng = np.random.default_rng(8)
    sequences = tt.random_sequences([100, 33, 300], [133, 70, 301], 8, 2, 128, "float16", rng)
    args = _nan_tails(tt.pack_paged(sequences, page_size), page_size)
    out = kernel(*(tvm.runtime.tensor(a, kernel.device) for a in args)).numpy()
    q_indptr = args[2]
    for b, ref in enumerate(reference(sequences, "causal")):
        check(out[q_indptr[b] : q_indptr[b + 1]], ref, "float16")


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: m.describe())
@pytest.mark.parametrize(
    "head_dim, seq_q, seq_kv, family",
    [(128, 1, 1000, "tensor_core_decode"), (64, 4, 300, "tensor_core_decode"), (256, 1, 513, "split_k_decode"),
     (64, 37, 90, "warp_specialized_prefill"), (128, 300, 700, "warp_specialized_prefill"),
     (256, 129, 129, "warp_specialized_prefill")],
)
def test_mask_tensor(mask, head_dim, seq_q, seq_kv, family):
    """A mask tensor input on the decode families (tensor cores, CUDA cores) and the
    warp-specialised prefill; a row the mask hides entirely gives zeros."""
    kernel = attention_kernel(8, 2, head_dim, variant="global", dtype="float16", layout="bhsd", target="cuda",
                              mask=mask)
    (q, k, v, m), ref = masked_case(mask, 3, 8, 2, seq_q, seq_kv, head_dim, "float16", np.random.default_rng(5))
    dev = tvm.cuda(0)
    args = [tvm.runtime.tensor(x, dev) for x in (q, k, v, m)]
    assert kernel.plan(*args).family.name == family
    check(kernel(*args).numpy(), ref, "float16")


@pytest.mark.parametrize("mask", [MaskTensor("bool", heads=False), MaskTensor("float16", queries=False),
                                  MaskTensor("bfloat16", queries=False)], ids=lambda m: m.describe())
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_warp_specialized_prefill_reads_only_the_key_tiles_a_mask_shows(mask, head_dim):
    """Key tiles a mask tensor hides from every row hold NaN in K and V: the prefill does
    not read them (the ranges its first kernels find). The masks: a causal mask and
    right padding as a boolean tensor; right padding as an additive float16 one (-65504
    on hidden keys); left and right padding as a bfloat16 one written for float16
    (-1e4, which bfloat16 rounds to -9984), on bfloat16 tensors. A row tile whose rows
    all see no key reads one tile and gives zeros."""
    batch, seq, valid = 2, 700, (300, 650)
    dtype = "bfloat16" if mask.dtype == "bfloat16" else "float16"
    kernel = attention_kernel(8, 2, head_dim, variant="global", dtype=dtype, layout="bhsd", target="cuda",
                              mask=mask)
    rng = np.random.default_rng(9)
    q = rng.standard_normal((batch, 8, seq, head_dim)).astype(tt.np_dtype(dtype))
    k, v = (rng.standard_normal((batch, 2, seq, head_dim)).astype(tt.np_dtype(dtype)) for _ in range(2))
    keys = np.arange(seq)
    first = (0, 200) if mask.dtype == "bfloat16" else (0, 0)
    shown = (keys[None, :] < np.array(valid)[:, None]) & (keys[None, :] >= np.array(first)[:, None])  # [b, key]
    if mask.dtype == "bool":
        m = (keys[None, None, :, None] >= keys[None, None, None, :]) & shown[:, None, None, :]
        m[1, :, :128] = False
        term = np.where(m, 0.0, -np.inf)
    else:
        m = np.where(shown, 0, -1e4 if mask.dtype == "bfloat16" else -65504).astype(tt.np_dtype(mask.dtype))
        m = m[:, None, None, :]
        term = m.astype(np.float64)
    ref = masked_reference(q, k, v, term)
    tile = key_tile(head_dim)
    for b, n in enumerate(valid):
        for part in (slice(-(-n // tile) * tile, None), slice(0, first[b] // tile * tile)):
            k[b, :, part] = np.nan
            v[b, :, part] = np.nan
    dev = tvm.cuda(0)
    args = [tvm.runtime.tensor(x, dev) for x in (q, k, v, m)]
    assert kernel.plan(*args).family.name == "warp_specialized_prefill"
    check(kernel(*args).numpy(), ref, dtype)
