"""Numpy float64 references for the cascades in :mod:`tvm_cascade.ops`.

Nothing here calls TVM.  Inputs of any float dtype (including
``ml_dtypes.bfloat16``) are first converted to float64, so the reference sees
exactly the rounded values that the TVM kernel sees.

Masked attention scores use the lowest finite **float32** value
(``np.finfo(np.float32).min``, i.e. the value the kernel uses with a float32
accumulator), never ``-inf``.  Consequently a fully masked query row attends
uniformly to every key and its output is the mean of ``V`` over the keys.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import numpy as np

from .variants import AttentionVariant, get_variant

MASKED_SCORE = float(np.finfo(np.float32).min)


def _f64(x) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


# ---------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------


def np_mods(variant: AttentionVariant, heads_q: int, seq_q: int, seq_kv: int):
    """Vectorised numpy ``(score_mod, mask_mod)`` for an :class:`AttentionVariant`.

    They take the same arguments as the TE callables, but ``b, h, q_idx,
    kv_idx`` are integer index arrays broadcastable against the score array
    of shape ``[batch, heads_q, seq_q, seq_kv]``.  Written independently of the
    TE versions so the tests compare two implementations of each variant.
    """
    variant = get_variant(variant)
    offset = seq_kv - seq_q
    score_mod = mask_mod = None
    if variant.alibi or variant.softcap is not None:

        def score_mod(score, b, h, q_idx, kv_idx):
            out = score
            if variant.alibi:
                slopes = np.power(2.0, -8.0 * (h + 1) / heads_q)
                out = out + slopes * (kv_idx - (q_idx + offset))
            if variant.softcap is not None:
                out = variant.softcap * np.tanh(out / variant.softcap)
            return out

    if variant.causal or variant.window is not None:

        def mask_mod(b, h, q_idx, kv_idx):
            q_aligned = q_idx + offset
            visible = kv_idx <= q_aligned
            if variant.window is not None:
                visible = visible & (q_aligned - kv_idx < variant.window)
            return visible

    return score_mod, mask_mod


def attention_ref(
    q,
    k,
    v,
    variant=None,
    score_mod: Optional[Callable] = None,
    mask_mod: Optional[Callable] = None,
    scale: Optional[float] = None,
    normalize_before_pv: bool = False,
) -> np.ndarray:
    """Float64 attention ``q[b,hq,sq,d], k/v[b,hkv,skv,d] -> out[b,hq,sq,d]``.

    Either ``variant`` (name or :class:`AttentionVariant`) or numpy
    ``score_mod``/``mask_mod`` callables (see :func:`np_mods` for their
    calling convention) may be given.
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    batch, heads_q, seq_q, head_dim = q.shape
    _, heads_kv, seq_kv, _ = k.shape
    if heads_q % heads_kv:
        raise ValueError("heads_q must be a multiple of heads_kv")
    if variant is not None:
        if score_mod is not None or mask_mod is not None:
            raise ValueError("pass either `variant` or score_mod/mask_mod, not both")
        score_mod, mask_mod = np_mods(get_variant(variant), heads_q, seq_q, seq_kv)
    group = heads_q // heads_kv
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    k_full = np.repeat(k, group, axis=1)  # head h -> kv head h // group
    v_full = np.repeat(v, group, axis=1)

    s = np.einsum("bhid,bhjd->bhij", q, k_full) * scale
    b_idx = np.arange(batch).reshape(-1, 1, 1, 1)
    h_idx = np.arange(heads_q).reshape(1, -1, 1, 1)
    i_idx = np.arange(seq_q).reshape(1, 1, -1, 1)
    j_idx = np.arange(seq_kv).reshape(1, 1, 1, -1)
    if score_mod is not None:
        s = np.broadcast_to(score_mod(s, b_idx, h_idx, i_idx, j_idx), s.shape).astype(np.float64)
    if mask_mod is not None:
        visible = np.broadcast_to(mask_mod(b_idx, h_idx, i_idx, j_idx), s.shape)
        s = np.where(visible, s, MASKED_SCORE)
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - m)
    l = e.sum(axis=-1, keepdims=True)
    if normalize_before_pv:
        return np.einsum("bhij,bhjd->bhid", e / l, v_full)
    return np.einsum("bhij,bhjd->bhid", e, v_full) / l


def sequence_attention_ref(q, k, v, variant=None, scale: Optional[float] = None) -> np.ndarray:
    """Float64 attention of one sequence, ``q[sq, hq, d], k/v[skv, hkv, d] -> [sq, hq,
    d]``, queries aligned to the end of the keys, as the library's kernels compute it:
    masked scores are ``-inf`` and a row that sees no key gives zeros."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    seq_q, heads_q, head_dim = q.shape
    seq_kv, heads_kv, _ = k.shape
    score_mod, mask_mod = np_mods(get_variant(variant), heads_q, seq_q, seq_kv)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    group = heads_q // heads_kv
    k_full, v_full = (np.repeat(x, group, axis=1) for x in (k, v))
    s = np.einsum("ihd,jhd->hij", q, k_full) * scale
    h_idx = np.arange(heads_q).reshape(-1, 1, 1)
    i_idx = np.arange(seq_q).reshape(1, -1, 1)
    j_idx = np.arange(seq_kv).reshape(1, 1, -1)
    if score_mod is not None:
        s = np.broadcast_to(score_mod(s, 0, h_idx, i_idx, j_idx), s.shape).astype(np.float64)
    if mask_mod is not None:
        s = np.where(np.broadcast_to(mask_mod(0, h_idx, i_idx, j_idx), s.shape), s, -np.inf)
    seen = np.isfinite(s).any(axis=-1, keepdims=True)
    m = np.where(seen, s.max(axis=-1, keepdims=True, initial=-np.inf), 0.0)
    e = np.exp(s - m)
    l = np.where(seen, e.sum(axis=-1, keepdims=True), 1.0)
    return np.einsum("hij,jhd->ihd", e / l, v_full)


# ---------------------------------------------------------------------------
# Other cascades
# ---------------------------------------------------------------------------


def logsumexp_ref(x) -> np.ndarray:
    x = _f64(x)
    m = x.max(axis=-1)
    return m + np.log(np.exp(x - m[:, None]).sum(axis=-1))


def cross_entropy_ref(x, labels) -> np.ndarray:
    x = _f64(x)
    labels = np.asarray(labels).astype(np.int64)
    return logsumexp_ref(x) - x[np.arange(x.shape[0]), labels]


def absmax_quant_gemm_ref(x, w, fp8_max: float = 448.0, eps: float = 1e-12) -> np.ndarray:
    x, w = _f64(x), _f64(w)
    s = fp8_max / np.maximum(np.abs(x).max(axis=1), eps)
    y = (x * s[:, None]) @ w
    return y / s[:, None]


def fp8_quant_gemm_ref(x, w, w_scale, tile: Optional[int] = None, fp8_max: float = 448.0, eps: float = 1e-12) -> np.ndarray:
    """``out[i, n] = w_scale[n] · Σ_k e4m3(X[i, k]·s_i)·W[n, k] / s_i``, X's rows quantised
    to e4m3 with ``s_i = fp8_max / max(eps, max_k |X[i, k]|)`` (the scale and the product
    rounded to float32, as a GPU computes them; W ``[n, k]`` given as its e4m3 values).
    With ``tile``, the k axis is taken in tiles of ``tile`` and each tile is quantised with
    the scale of the row's running abs-max over the tiles up to it (the rolling form of
    :mod:`tvm_cascade.schedules.warp_specialized_fp8_gemm`); without, the whole row's."""
    import ml_dtypes

    x32 = np.asarray(x).astype(np.float32)
    w, w_scale = _f64(w), _f64(w_scale)
    k = x32.shape[1]
    tile = tile or k
    out = np.zeros((x32.shape[0], w.shape[0]))
    peak = np.zeros(x32.shape[0], np.float32)
    for k0 in range(0, k, tile):
        part = x32[:, k0:k0 + tile]
        peak = np.maximum(peak, np.abs(part).max(axis=1))
        scale = np.float32(fp8_max) / np.maximum(peak, np.float32(eps))
        q = (part * scale[:, None]).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
        out += (q @ w[:, k0:k0 + tile].T) / scale.astype(np.float64)[:, None]
    return out * w_scale[None, :]


def rmsnorm_gemm_ref(x, gamma, w, eps: float = 1e-6) -> np.ndarray:
    x, gamma, w = _f64(x), _f64(gamma), _f64(w)
    r = 1.0 / np.sqrt((x * x).mean(axis=1) + eps)
    return ((x * r[:, None]) * gamma[None, :]) @ w


def softmax_ref(x) -> np.ndarray:
    x = _f64(x)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def moe_routing_ref(logits, top_k: int):
    """Return ``(prob, topk_prob, topk_idx)``; top-k in descending probability,
    ties broken towards the lower expert index."""
    prob = softmax_ref(logits)
    idx = np.argsort(-prob, axis=-1, kind="stable")[:, :top_k]
    return prob, np.take_along_axis(prob, idx, axis=-1), idx
