"""Unfused TE definition of (Flex-style) attention as a cascade of reductions.

The PrimFunc produced by :func:`attention` is deliberately *unfused*: every
stage is its own ``te.compute`` and therefore its own TIR block.  The block
names form a contract with the ``rolling_update`` schedule primitive:

``normalize_before_pv=False`` (default)::

    qk    qk[b,h,i,j]  = sum_d  Q[b,h,i,d] * K[b,h//g,j,d]        (reduction, +)
    score s[b,h,i,j]   = mask ? score_mod(qk*scale, b,h,i,j) : lowest
    max   m[b,h,i]     = max_j  s[b,h,i,j]                         (reduction, max)
    exp   e[b,h,i,j]   = exp(s[b,h,i,j] - m[b,h,i])
    sum   l[b,h,i]     = sum_j  e[b,h,i,j]                         (reduction, +)
    pv    o[b,h,i,d]   = sum_j  e[b,h,i,j] * V[b,h//g,j,d]         (reduction, +)
    out   O[b,h,i,d]   = cast(o[b,h,i,d] / l[b,h,i])

``normalize_before_pv=True``::

    qk, score, max, exp, sum,
    p     p[b,h,i,j]   = e[b,h,i,j] / l[b,h,i]
    pv    o[b,h,i,d]   = sum_j  p[b,h,i,j] * V[b,h//g,j,d]
    out   O[b,h,i,d]   = cast(o[b,h,i,d])

``g = heads_q // heads_kv`` (GQA; MQA when ``heads_kv == 1``).  All
intermediates live in ``accum_dtype`` (float32 by default); Q/K/V are cast to
it when read and the result is cast back to ``dtype`` in ``out``.

Supported ``dtype``: float32, float16 and bfloat16.  With TVM 0.27 on the
``llvm`` (CPU) target bfloat16 inputs/outputs compile and give correct
results (checked in tests/test_ops.py; speed was not measured); numpy test
data for it uses ``ml_dtypes.bfloat16``.

``te.create_prim_func`` itself would emit ``pv`` before ``sum`` (its DFS
follows the read order of ``o / l``); the builder moves the two independent
loop nests into the documented order (checked for dependencies, see
:mod:`tvm_cascade.root_order`).

Masked scores are set to the *lowest finite* value of ``accum_dtype``
(``tvm.tirx.min_value``), never ``-inf``.  This equals the identity of the
``max`` reducer, so a fully masked row has ``m = lowest``, ``exp(s - m) = 1``
for every key and the output is the plain mean of ``V`` over the keys (finite,
no NaN).  Partially masked rows get ``exp(lowest - m) == 0`` for masked keys.

Score / mask modifiers follow FlexAttention:
``score_mod(score, b, h, q_idx, kv_idx) -> PrimExpr`` and
``mask_mod(b, h, q_idx, kv_idx) -> bool PrimExpr``.  Ready-made variants are
described by :class:`AttentionVariant` (see :data:`VARIANTS`, in
:mod:`tvm_cascade.ops.variants`); :func:`variant_te_mods` returns such
callables for a variant, and the numpy reference in
:mod:`tvm_cascade.ops.reference` implements the same descriptions
independently.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import tvm
from tvm import te, tirx

from ..root_order import reorder_root_blocks
from .variants import AttentionVariant, get_variant

ScoreMod = Callable[..., "tvm.tirx.PrimExpr"]
MaskMod = Callable[..., "tvm.tirx.PrimExpr"]

# Block names, in program order, for the two attention layouts.
ATTENTION_BLOCKS = ("qk", "score", "max", "exp", "sum", "pv", "out")
#: The base-2 log-sum-exp of a row that sees no key, where a kernel gives one (TVM's KV
#: cache kernels' value: a merge of attention states gives the row no weight).
NO_KEYS_LSE = -5e4
ATTENTION_BLOCKS_NORMALIZE_FIRST = ("qk", "score", "max", "exp", "sum", "p", "pv", "out")


# ---------------------------------------------------------------------------
# TE callables for the variant descriptions
# ---------------------------------------------------------------------------


def variant_te_mods(
    variant, heads_q: int, seq_q, seq_kv, accum_dtype: str = "float32", query_start=None
) -> Tuple[Optional[ScoreMod], Optional[MaskMod]]:
    """Return FlexAttention-style ``(score_mod, mask_mod)`` TE callables for a
    variant (name or :class:`AttentionVariant`); ``None`` where unused.

    Queries are aligned to the end of the keys: ``seq_q`` and ``seq_kv`` are the lengths
    (ints or expressions), or callables of the batch index ``b`` giving each sequence's
    lengths (batches of sequences of different lengths); ``query_start(b)``, where given,
    places the first query row among the keys' positions instead."""
    variant = get_variant(variant)

    def offset(b):
        if query_start is not None:
            return query_start(b)
        return _length(seq_kv, b) - _length(seq_q, b)

    return (
        _te_score_mod(variant, heads_q, offset, accum_dtype),
        _te_mask_mod(variant, offset),
    )


def _length(length, b):
    return length(b) if callable(length) else length


def _te_mask_mod(var: AttentionVariant, offset) -> Optional[MaskMod]:
    if not var.is_causal:
        return None
    window = var.window

    def mask_mod(b, h, q_idx, kv_idx):
        q_aligned = q_idx + offset(b)
        visible = kv_idx <= q_aligned
        if window is not None:
            visible = te.all(visible, q_aligned - kv_idx < window)
        return visible

    return mask_mod


def _te_score_mod(var: AttentionVariant, heads_q: int, offset, accum_dtype: str) -> Optional[ScoreMod]:
    if not var.has_score_mod:
        return None
    alibi = var.alibi
    cap = var.softcap

    def score_mod(score, b, h, q_idx, kv_idx):
        if alibi:
            exponent = tirx.const(-8.0 / heads_q, accum_dtype) * (h + 1).astype(accum_dtype)
            slope = te.power(tirx.const(2.0, accum_dtype), exponent)
            score = score + slope * (kv_idx - (q_idx + offset(b))).astype(accum_dtype)
        if cap is not None:
            c = tirx.const(cap, accum_dtype)
            score = c * te.tanh(score / c)
        return score

    return score_mod


# ---------------------------------------------------------------------------
# Builder
# ---------------------------------------------------------------------------


def _as_bool_expr(value):
    if isinstance(value, bool):
        return tirx.const(value, "bool")
    return value


def attention(
    batch: int,
    heads_q: int,
    heads_kv: int,
    seq_q: int,
    seq_kv: int,
    head_dim: int,
    dtype: str = "float32",
    score_mod: Optional[ScoreMod] = None,
    mask_mod: Optional[MaskMod] = None,
    scale: Optional[float] = None,
    normalize_before_pv: bool = False,
    accum_dtype: str = "float32",
    variant=None,
    pad_to: Optional[Tuple[int, int]] = None,
) -> tvm.tirx.PrimFunc:
    """Build the unfused attention PrimFunc ``main(Q, K, V, out)``.

    Shapes: ``Q[batch, heads_q, seq_q, head_dim]``,
    ``K, V[batch, heads_kv, seq_kv, head_dim]``,
    ``out[batch, heads_q, seq_q, head_dim]``; Q/K/V/out have ``dtype``.

    ``variant`` (a name from :data:`VARIANTS` or an :class:`AttentionVariant`)
    supplies ``score_mod`` / ``mask_mod``; it cannot be combined with explicit
    ``score_mod`` / ``mask_mod`` arguments.

    ``pad_to=(rows, keys)`` computes over query and key lengths rounded up to multiples
    of ``rows`` and ``keys`` (for schedules with whole tiles only): blocks ``Q_pad``,
    ``K_pad`` and ``V_pad`` read the inputs with zeros past their ends, keys past
    ``seq_kv`` are masked, and ``out`` keeps the unpadded rows. Lengths that are
    multiples already give the function without padding. The result equals the unpadded
    one except for a row that sees no key at all: it averages ``V`` over the padded keys
    (zeros included), not over ``seq_kv`` keys.
    """
    if heads_kv <= 0 or heads_q % heads_kv != 0:
        raise ValueError(f"heads_q={heads_q} must be a positive multiple of heads_kv={heads_kv}")
    if variant is not None:
        if score_mod is not None or mask_mod is not None:
            raise ValueError("pass either `variant` or explicit score_mod/mask_mod, not both")
        score_mod, mask_mod = variant_te_mods(variant, heads_q, seq_q, seq_kv, accum_dtype)
    group = heads_q // heads_kv
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    acc = accum_dtype
    scale_c = tirx.const(scale, acc)
    lowest = tirx.min_value(acc)

    Q_in = te.placeholder((batch, heads_q, seq_q, head_dim), dtype, name="Q")
    K_in = te.placeholder((batch, heads_kv, seq_kv, head_dim), dtype, name="K")
    V_in = te.placeholder((batch, heads_kv, seq_kv, head_dim), dtype, name="V")
    rows, keys = pad_to or (1, 1)
    rows_p, keys_p = -(-seq_q // rows) * rows, -(-seq_kv // keys) * keys
    Q = _padded(Q_in, 2, rows_p)
    K, V = (_padded(x, 2, keys_p) for x in (K_in, V_in))
    if keys_p != seq_kv:
        inner_mask = mask_mod

        def mask_mod(b, h, i, j):
            valid = j < seq_kv
            return valid if inner_mask is None else te.all(_as_bool_expr(inner_mask(b, h, i, j)), valid)

    rd = te.reduce_axis((0, head_dim), name="rd")
    qk = te.compute(
        (batch, heads_q, rows_p, keys_p),
        lambda b, h, i, j: te.sum(
            Q[b, h, i, rd].astype(acc) * K[b, h // group, j, rd].astype(acc), axis=rd
        ),
        name="qk",
    )

    def _score(b, h, i, j):
        s = qk[b, h, i, j] * scale_c
        if score_mod is not None:
            s = score_mod(s, b, h, i, j)
            # astype is the identity when the dtype already matches.
            s = tirx.const(s, acc) if isinstance(s, (int, float)) else s.astype(acc)
        if mask_mod is not None:
            s = tirx.Select(_as_bool_expr(mask_mod(b, h, i, j)), s, lowest)
        return s

    score = te.compute((batch, heads_q, rows_p, keys_p), _score, name="score")

    rj_max = te.reduce_axis((0, keys_p), name="rj")
    m = te.compute(
        (batch, heads_q, rows_p),
        lambda b, h, i: te.max(score[b, h, i, rj_max], axis=rj_max),
        name="max",
    )
    e = te.compute(
        (batch, heads_q, rows_p, keys_p),
        lambda b, h, i, j: te.exp(score[b, h, i, j] - m[b, h, i]),
        name="exp",
    )
    rj_sum = te.reduce_axis((0, keys_p), name="rj")
    l = te.compute(
        (batch, heads_q, rows_p),
        lambda b, h, i: te.sum(e[b, h, i, rj_sum], axis=rj_sum),
        name="sum",
    )
    rj_pv = te.reduce_axis((0, keys_p), name="rj")
    if normalize_before_pv:
        p = te.compute(
            (batch, heads_q, rows_p, keys_p),
            lambda b, h, i, j: e[b, h, i, j] / l[b, h, i],
            name="p",
        )
        o = te.compute(
            (batch, heads_q, rows_p, head_dim),
            lambda b, h, i, d: te.sum(
                p[b, h, i, rj_pv] * V[b, h // group, rj_pv, d].astype(acc), axis=rj_pv
            ),
            name="pv",
        )
        out = te.compute(
            (batch, heads_q, seq_q, head_dim),
            lambda b, h, i, d: o[b, h, i, d].astype(dtype),
            name="out",
        )
    else:
        o = te.compute(
            (batch, heads_q, rows_p, head_dim),
            lambda b, h, i, d: te.sum(
                e[b, h, i, rj_pv] * V[b, h // group, rj_pv, d].astype(acc), axis=rj_pv
            ),
            name="pv",
        )
        out = te.compute(
            (batch, heads_q, seq_q, head_dim),
            lambda b, h, i, d: (o[b, h, i, d] / l[b, h, i]).astype(dtype),
            name="out",
        )
    func = te.create_prim_func([Q_in, K_in, V_in, out])
    # create_prim_func emits `pv` before `sum` (DFS order of `out`'s reads);
    # put the blocks in the documented order (they are independent).
    order = ATTENTION_BLOCKS_NORMALIZE_FIRST if normalize_before_pv else ATTENTION_BLOCKS
    pads = tuple(x.op.name for x in (Q, K, V) if x.op.name.endswith("_pad"))
    return reorder_root_blocks(func, pads + order)


def _padded(tensor, axis, length):
    """``tensor`` extended along ``axis`` to ``length`` with zeros (``tensor`` itself if it
    is that long)."""
    if int(tensor.shape[axis]) == length:
        return tensor
    end = tensor.shape[axis]

    def read(*index):
        inside = index[axis] < end
        clamped = list(index)
        clamped[axis] = tirx.min(index[axis], end - 1)
        return tirx.if_then_else(inside, tensor[tuple(clamped)], tirx.const(0, tensor.dtype))

    shape = list(tensor.shape)
    shape[axis] = length
    return te.compute(shape, read, name=f"{tensor.op.name}_pad")
