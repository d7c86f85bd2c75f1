"""Arguments of TVM's paged KV cache kernels' calling convention
(:mod:`tvm_cascade.library.kv_cache`) and a numpy reference of what they compute, for
the tests of the kernels on CPU and GPU."""
from __future__ import annotations

import math

import numpy as np
import tvm

PAGE = 16
#: Where ``o`` is among each kind's arguments (``lse`` follows).
OUTPUT_AT = {"ragged": 7, "prefill": 8, "prefill_window": 8, "decode": 7, "decode_window": 7}


def tvm_kernel(kind, heads_q, heads_kv, head_dim, target="llvm", window=0, scaling=None):
    """TVM's own float16 kernel of ``kind`` (``relax.frontend.nn.llm``'s; its CPU kernel
    for an llvm target): the sliding-window prefill's layers' window ``window`` (0: TVM's
    default), its RoPE scaled as ``scaling`` (TVM's ``rope_scaling``) says."""
    from tvm.relax.frontend.nn.llm import kv_cache as tvm_kv  # pylint: disable=import-outside-toplevel

    target = tvm.target.Target(target)
    cpu = target.kind.name == "llvm"
    rope = scaling or {}
    sliding = kind.endswith("window")
    # pylint: disable=protected-access
    if kind == "ragged":
        if cpu:
            return tvm_kv._attention_prefill_ragged_cpu(heads_kv, heads_q, head_dim, head_dim, "float16", rope)
        return tvm_kv._attention_prefill_ragged(heads_kv, heads_q, head_dim, head_dim, "float16", rope, target)
    if kind.startswith("prefill"):
        sized = {"sliding_window_size": window} if window else {}
        if cpu:
            return tvm_kv._attention_prefill_cpu(heads_kv, heads_q, head_dim, "float16", sliding, rope, **sized)
        return tvm_kv._attention_prefill(heads_kv, heads_q, head_dim, "float16", sliding, rope, target, **sized)
    if cpu:
        return tvm_kv._attention_decode_cpu(heads_kv, heads_q, head_dim, "float16", sliding, rope)
    return tvm_kv._attention_decode(heads_kv, heads_q, head_dim, "float16", sliding, rope, target)


def _indptr(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype("int32")


def _viewed(array, dev, rng):
    """``array`` (int32) as a view at a random element offset into a larger tensor, as
    the cache's index arrays are views into its workspace."""
    offset = int(rng.integers(1, 9))
    backing = tvm.runtime.tensor(np.concatenate([np.full(offset, -7, "int32"), array, [-7]]).astype("int32"), dev)
    return backing._create_view(array.shape, "int32", relative_byte_offset=4 * offset)  # pylint: disable=protected-access


def arguments(kind, q_lens, kv_lens, heads_q, heads_kv, head_dim, dev, seed=0, dtype="float16", sinks=True):
    """``(args, (q, ks, vs), causal)``: the call's arguments (TVM tensors on ``dev`` and
    scalars) and, for the reference, the queries (tokens × heads × dim, float32) and
    each sequence's keys and values; a sliding-window cache's sequences keep sinks
    where ``sinks`` (a cache of sliding layers keeps none)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((sum(q_lens), heads_q, head_dim)).astype(dtype)
    ks = [rng.standard_normal((n, heads_kv, head_dim)).astype(dtype) for n in kv_lens]
    vs = [rng.standard_normal((n, heads_kv, head_dim)).astype(dtype) for n in kv_lens]
    t = lambda a: tvm.runtime.tensor(a, dev)  # noqa: E731
    o = t(np.zeros_like(q))
    lse = t(np.zeros(q.shape[:2], "float32"))
    sm_scale = 1.0 / math.sqrt(head_dim)
    q_rope = _viewed(np.zeros(q.shape[0], "int32"), dev, rng)
    k_rope = _viewed(np.zeros(len(kv_lens), "int32"), dev, rng)
    reference = (q.astype("float32"), [k.astype("float32") for k in ks], [v.astype("float32") for v in vs])
    if kind == "ragged":
        args = [t(q), _viewed(_indptr(q_lens), dev, rng), t(np.concatenate(ks)), t(np.concatenate(vs)),
                _viewed(_indptr(kv_lens), dev, rng), q_rope, k_rope, o, lse, 1, 0, 1.0, 1e4, sm_scale]
        return args, reference, True
    # A sliding-window cache keeps a sequence's sink (its first keys) and its window,
    # stored from `start` on: the positions between hold evicted keys.
    window = kind in ("prefill_window", "decode_window")
    sinks = [int(rng.integers(0, min(n, 20) + 1)) if window and sinks else 0 for n in kv_lens]
    starts = [sink + int(rng.integers(0, 40)) if window else 0 for sink in sinks]
    stored = [n - sink + start for n, sink, start in zip(kv_lens, sinks, starts)]
    pages_of = [-(-n // PAGE) for n in stored]
    total = sum(pages_of)
    # Pages in a random order, one spare page never listed.
    pages = rng.standard_normal((total + 1, 2, heads_kv, PAGE, head_dim)).astype(dtype)
    order = rng.permutation(total + 1)[:total].astype("int32")
    for s, first in enumerate(_indptr(pages_of)[:-1]):
        for j in range(kv_lens[s]):
            at = j if j < sinks[s] else j - sinks[s] + starts[s]
            page = order[first + at // PAGE]
            pages[page, 0, :, at % PAGE] = ks[s][j]
            pages[page, 1, :, at % PAGE] = vs[s][j]
    last = np.array([n - (p - 1) * PAGE if p else 0 for n, p in zip(stored, pages_of)], "int32")
    if window:
        last = np.stack([last, np.array(starts, "int32"), np.array(sinks, "int32")])
    paged = [t(pages), _viewed(_indptr(pages_of), dev, rng), _viewed(order, dev, rng),
             _viewed(last.reshape(-1), dev, rng)._create_view(last.shape, "int32")]
    if kind in ("prefill", "prefill_window"):
        args = [t(q), _viewed(_indptr(q_lens), dev, rng), *paged, k_rope, q_rope, o, lse, 0, 0, 1.0, 1e4, sm_scale]
    else:
        args = [t(q), *paged, k_rope, q_rope, o, lse, 0, 1.0, 1e4, sm_scale]
    return args, reference, False


def expected(q_lens, reference, causal, sm_scale, window=0):
    """float64 outputs and base-2 log-sum-exps of every query token: each sequence's
    queries over its keys, aligned to their end under ``causal``; with ``window``, the
    queries follow the keys and query ``i`` sees the last ``window - 1 - i`` of them (a
    sliding layer's new tokens over its cached keys); a row that sees no key gives
    zeros and lse -5e4."""
    q, ks, vs = reference
    outs, lses = [], []
    for s, first in enumerate(_indptr(q_lens)[:-1]):
        rows = q[first: first + q_lens[s]].astype("float64")
        k, v = ks[s].astype("float64"), vs[s].astype("float64")
        group = rows.shape[1] // k.shape[1]
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("ihd,jhd->hij", rows, k) * sm_scale
        n_q, n_k = scores.shape[1:]
        if causal:
            visible = np.arange(n_k)[None] <= np.arange(n_q)[:, None] + n_k - n_q
            scores = np.where(visible[None], scores, -np.inf)
        if window:
            visible = np.arange(n_k)[None] >= n_k - np.maximum(window - 1 - np.arange(n_q)[:, None], 0)
            scores = np.where(visible[None], scores, -np.inf)
        top = np.max(scores, axis=-1, keepdims=True, initial=-np.inf)
        seen = np.isfinite(top)
        weights = np.where(seen, np.exp(scores - np.where(seen, top, 0)), 0)
        total = weights.sum(-1, keepdims=True)
        out = np.einsum("hij,jhd->ihd", weights / np.where(total > 0, total, 1), v)
        lse = np.where(seen[..., 0], (top[..., 0] + np.log(np.where(total[..., 0] > 0, total[..., 0], 1))) / math.log(2),
                       -5e4)
        outs.append(out)
        lses.append(lse.T)
    return np.concatenate(outs), np.concatenate(lses)


def rotated(x, positions, theta=1e4, scale=1.0, scaling=None):
    """RoPE of ``x`` (tokens × heads × dim) at ``positions`` (one a token), the halves of
    the head dim rotated together, in float64 and rounded to float16 as the kernels'
    rotated inputs are; ``scaling``: Llama-3's frequency scaling (``rope_type`` "llama3"
    and its factors, as TVM's ``rope_scaling``), else none."""
    half = x.shape[-1] // 2
    frequency = 1.0 / theta ** (np.arange(half) * 2 / x.shape[-1])
    if scaling is not None:
        # Wavelengths past the original context's are slowed by ``factor``; between the
        # two bands the frequency is interpolated.
        spread = scaling["high_freq_factor"] - scaling["low_freq_factor"]
        smooth = np.clip(scaling["original_max_position_embeddings"] / (2 * math.pi) / spread * frequency
                         - scaling["low_freq_factor"] / spread, 0.0, 1.0)
        frequency = (1 - smooth) * frequency / scaling["factor"] + smooth * frequency
    angle = np.asarray(positions, "float64")[:, None] * scale * frequency
    cos, sin = np.cos(angle)[:, None], np.sin(angle)[:, None]
    first, second = x[..., :half].astype("float64"), x[..., half:].astype("float64")
    out = np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return out.astype("float16").astype("float32")


#: RoPE's base and scale in the tests' calls with RoPE inside attention.
ROPE_THETA, ROPE_SCALE = 5e5, 2.0


def rope_inside_runs(kind, funcs, q_lens, kv_lens, heads_q, heads_kv, head_dim, dev, seed=0, scaling=None):
    """Each of ``funcs`` (compiled kernels of ``kind``'s convention) called with RoPE
    inside attention (``rotary_mode`` 1) at random positions, on the same inputs:
    ``([(out, lse) of each], (out, lse) of numpy's attention over numpy-rotated Q and K)``
    (query ``t`` at ``q_rope_position[t]``, key ``j`` of sequence ``b`` at
    ``k_rope_pos_offset[b] + j``; ``scaling`` as :func:`rotated`'s)."""
    at = OUTPUT_AT[kind]
    # (q_rope_position, k_rope_pos_offset) among the arguments, and rotary_mode
    positions, offsets = (5, 6) if kind == "ragged" else (at - 1, at - 2)
    rotary = at + 2 if kind.startswith("decode") else at + 3
    rng = np.random.default_rng(seed + 1)
    q_positions = rng.integers(0, 5000, sum(q_lens)).astype("int32")
    k_offsets = rng.integers(0, 3000, len(kv_lens)).astype("int32")
    runs = []
    for func in funcs:
        args, _, _ = arguments(kind, q_lens, kv_lens, heads_q, heads_kv, head_dim, dev, seed=seed)
        args[positions].copyfrom(q_positions)
        args[offsets].copyfrom(k_offsets)
        args[rotary], args[rotary + 1], args[rotary + 2] = 1, ROPE_SCALE, ROPE_THETA
        func(*args)
        runs.append((args[at].numpy().astype("float64"), args[at + 1].numpy()))
    args, (q, ks, vs), causal = arguments(kind, q_lens, kv_lens, heads_q, heads_kv, head_dim, dev, seed=seed)
    reference = (rotated(q, q_positions, ROPE_THETA, ROPE_SCALE, scaling),
                 [rotated(k, k_offsets[s] + np.arange(len(k)), ROPE_THETA, ROPE_SCALE, scaling)
                  for s, k in enumerate(ks)], vs)
    return runs, expected(q_lens, reference, causal, args[-1])


def both_modes_runs(kind, func, q_lens, kv_lens, heads_q, heads_kv, head_dim, dev, seed=0):
    """``func`` (a compiled kernel of ``kind``'s convention) called with RoPE inside
    attention (``rotary_mode`` 1, as :func:`rope_inside_runs`) and without (0) on the
    same inputs: ``[((out, lse), (out, lse) of numpy's)]`` for each call."""
    runs, reference = rope_inside_runs(kind, [func], q_lens, kv_lens, heads_q, heads_kv, head_dim, dev, seed=seed)
    args, unrotated, causal = arguments(kind, q_lens, kv_lens, heads_q, heads_kv, head_dim, dev, seed=seed)
    func(*args)  # (rotary_mode 0)
    at = OUTPUT_AT[kind]
    plain = (args[at].numpy().astype("float64"), args[at + 1].numpy())
    return [(runs[0], reference), (plain, expected(q_lens, unrotated, causal, args[-1]))]
