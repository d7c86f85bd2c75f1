"""Float32 reference attention for a :class:`~benchmarks.configs.Config`.

Written against operations that numpy and torch share (``einsum``, ``exp``,
``tanh``, ``where``, ``amax``/``sum`` with ``axis=``/``keepdims=``), so the same
code runs on numpy arrays (the CPU tests) and on CUDA torch tensors (the
harness, chunked over batch and query rows to bound memory).  Masked scores
use the lowest finite float32 value, like ``tvm_cascade.ops.reference``.
"""

from __future__ import annotations

import numpy as np

from .configs import Config

MASKED_SCORE = float(np.finfo(np.float32).min)
#: Upper bound on the elements of one chunk's score matrix (1 GiB of fp32).
CHUNK_ELEMENTS = 1 << 28


def _xp(x):
    if isinstance(x, np.ndarray):
        return np
    import torch

    return torch


def _f32(x):
    return x.astype(np.float32) if isinstance(x, np.ndarray) else x.float()


def _arange(n: int, like):
    return np.arange(n) if isinstance(like, np.ndarray) else _xp(like).arange(n, device=like.device)


def score_chunk(cfg: Config, qk, q_start: int):
    """Scaled, modified and masked scores for query rows ``q_start...``.

    ``qk`` holds the raw products ``q . k`` of one batch element, shaped
    ``[heads_kv, group, rows, seq_kv]``.
    """
    xp = _xp(qk)
    op = cfg.op
    group = op.heads_q // op.heads_kv
    s = qk * cfg.scale
    rows = s.shape[-2]
    q_pos = (_arange(rows, s) + q_start + cfg.offset).reshape(rows, 1)
    kv_pos = _arange(cfg.seq_kv, s).reshape(1, cfg.seq_kv)
    if op.alibi:
        heads = (_arange(op.heads_q, s) + 1).reshape(op.heads_kv, group, 1, 1)
        slopes = _f32(2.0 ** (-8.0 * heads / op.heads_q))
        s = s + slopes * _f32(kv_pos - q_pos)
    if op.softcap is not None:
        s = op.softcap * xp.tanh(s / op.softcap)
    if op.causal:
        visible = kv_pos <= q_pos
        if op.window is not None:
            visible = visible & (q_pos - kv_pos < op.window)
        s = xp.where(visible, s, MASKED_SCORE)
    return s


def attention_reference(cfg: Config, q, k, v):
    """``out[b, hq, sq, d]`` in float32 for numpy or torch ``q[b,hq,sq,d]``, ``k/v[b,hkv,skv,d]``."""
    xp = _xp(q)
    op = cfg.op
    group = op.heads_q // op.heads_kv
    rows = max(1, min(cfg.seq_q, CHUNK_ELEMENTS // (op.heads_q * cfg.seq_kv)))
    out = []
    for b in range(cfg.batch):
        kb, vb = _f32(k[b]), _f32(v[b])
        qb = q[b].reshape(op.heads_kv, group, cfg.seq_q, cfg.head_dim)
        parts = []
        for start in range(0, cfg.seq_q, rows):
            qc = _f32(qb[:, :, start : start + rows])
            s = score_chunk(cfg, xp.einsum("hgid,hjd->hgij", qc, kb), start)
            e = xp.exp(s - xp.amax(s, axis=-1, keepdims=True))
            o = xp.einsum("hgij,hjd->hgid", e, vb) / xp.sum(e, axis=-1, keepdims=True)
            parts.append(o)
        out.append(xp.concatenate(parts, axis=2).reshape(op.heads_q, cfg.seq_q, cfg.head_dim))
    return xp.stack(out)
