"""Cases and checks shared by the CPU and GPU tests of tvm_cascade.library's kernels."""
import numpy as np
import tvm

from tvm_cascade.library import MaskTensor
from tvm_cascade.ops import AttentionVariant
from tvm_cascade.ops import testing as tt
from tvm_cascade.ops.reference import sequence_attention_ref

TOL = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 2e-2}

VARIANTS = [
    AttentionVariant("global"),
    AttentionVariant("causal", causal=True),
    AttentionVariant("window", causal=True, window=5),
    AttentionVariant("alibi", causal=True, alibi=True),
    AttentionVariant("softcap", softcap=5.0),
    AttentionVariant("window-alibi-softcap", causal=True, window=7, alibi=True, softcap=8.0),
]


def reference(sequences, variant, scale=None):
    return [sequence_attention_ref(q, k, v, variant, scale) for q, k, v in sequences]


def check(out, expected, dtype):
    """``out`` is finite and within ``dtype``'s tolerance of ``expected`` (relative
    Frobenius error)."""
    out = np.asarray(out, dtype=np.float64)
    assert np.isfinite(out).all()
    err = np.linalg.norm(out - expected) / max(np.linalg.norm(expected), 1e-30)
    assert err < TOL[dtype], err


LAYOUTS = ["bhsd", "bshd", "ragged", "paged"]


def pack(layout, sequences, page_size=None):
    """The arguments of a ``layout`` kernel holding per-sequence ``(q, k, v)`` arrays
    (``[tokens, heads, d]``; as long as each other in the bhsd and bshd layouts)."""
    if layout in ("bhsd", "bshd"):
        order = (0, 2, 1, 3) if layout == "bhsd" else (0, 1, 2, 3)
        return tuple(np.stack([s[n] for s in sequences]).transpose(order).copy() for n in range(3))
    return tt.pack_ragged(sequences) if layout == "ragged" else tt.pack_paged(sequences, page_size)


def run(kernel, sequences):
    """Run ``kernel`` on per-sequence numpy arrays in its layout, as TVM tensors on its
    device (numpy has no DLPack for bfloat16); returns its output per sequence."""
    layout = kernel.spec.layout
    args = pack(layout, sequences, kernel.spec.page_size)
    out = kernel(*(tvm.runtime.tensor(a, kernel.device) for a in args)).numpy()
    if layout == "bhsd":
        return list(out.transpose(0, 2, 1, 3))
    if layout == "bshd":
        return list(out)
    q_indptr = args[3] if layout == "ragged" else args[2]
    return [out[a:b] for a, b in zip(q_indptr[:-1], q_indptr[1:])]


def check_lengths(kernel, lengths, seed=0):
    """Run ``kernel`` on random sequences of each ``(q_lens, kv_lens)`` of ``lengths``
    and check every sequence's output against the float64 reference."""
    spec = kernel.spec
    rng = np.random.default_rng(seed)
    for q_lens, kv_lens in lengths:
        sequences = tt.random_sequences(q_lens, kv_lens, spec.heads_q, spec.heads_kv, spec.head_dim, spec.dtype, rng)
        for out, ref in zip(run(kernel, sequences), reference(sequences, spec.variant, spec.scale)):
            check(out, ref, spec.dtype)


#: Mask tensors of the tests: boolean over every dimension, float16 the same for every
#: query (a padding mask), float32 per head.
MASKS = [
    MaskTensor("bool"),
    MaskTensor("float16", queries=False),
    MaskTensor("float32", batch=False, heads=True),
]


def masked_case(mask, batch, heads_q, heads_kv, seq_q, seq_kv, head_dim, dtype, rng):
    """bhsd ``q, k, v`` and a ``mask`` tensor of its form (numpy; a boolean mask hides
    every key of query row 0 of sequence 0 and some of the others'), and the float64
    reference output (a row that sees no key: zeros)."""
    q = rng.standard_normal((batch, heads_q, seq_q, head_dim)).astype(dtype)
    k, v = (rng.standard_normal((batch, heads_kv, seq_kv, head_dim)).astype(dtype) for _ in range(2))
    shape = (batch if mask.batch else 1, heads_q if mask.heads else 1, seq_q if mask.queries else 1, seq_kv)
    if mask.dtype == "bool":
        m = rng.random(shape) < 0.7
        m[0, :, 0] = False
        term = np.where(m, 0.0, -np.inf)
    else:
        m = np.where(rng.random(shape) < 0.3, -1e4, rng.standard_normal(shape)).astype(mask.dtype)
        term = m.astype(np.float64)
    return (q, k, v, m), masked_reference(q, k, v, term)


def masked_reference(q, k, v, term):
    """float64 attention of bhsd ``q, k, v`` with ``term`` added to the scaled scores
    (broadcast as a mask tensor is; a row that sees no key: zeros)."""
    group = q.shape[1] // k.shape[1]
    k64, v64 = (np.repeat(x.astype(np.float64), group, axis=1) for x in (k, v))
    s = np.einsum("bhid,bhjd->bhij", q.astype(np.float64), k64) / np.sqrt(q.shape[-1]) + term
    top = s.max(-1, keepdims=True)
    p = np.where(np.isfinite(top), np.exp(s - np.where(np.isfinite(top), top, 0)), 0)
    total = p.sum(-1, keepdims=True)
    return np.einsum("bhij,bhjd->bhid", np.divide(p, total, out=np.zeros_like(p), where=total > 0), v64)
