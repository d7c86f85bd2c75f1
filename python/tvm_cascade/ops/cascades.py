"""Unfused TE definitions of non-attention cascaded reductions.

Each builder returns a ``tvm.tirx.PrimFunc`` made with ``te.create_prim_func``
whose parameters are only the inputs and outputs; every other stage is an
intermediate buffer allocated inside the function.  Block names (one
``te.compute`` per block) are part of the contract with ``rolling_update``:

=====================  =====================================================
builder                blocks (program order)
=====================  =====================================================
``logsumexp``          ``max``, ``exp``, ``sum``, ``out``
``cross_entropy``      ``max``, ``exp``, ``sum``, ``out``
``absmax_quant_gemm``  ``absmax``, ``scale``, ``gemm``, ``out``
``rmsnorm_gemm``       ``sumsq``, ``rstd``, ``gemm``, ``out``
``moe_routing``        ``max``, ``exp``, ``sum``, ``prob`` [, ``topk_cpu``]
=====================  =====================================================

Reductions use only the standard reducers (``te.sum`` / ``te.max``), so the
TIR update statements are ``X[idx] = X[idx] + expr`` or
``X[idx] = T.max(X[idx], expr)``.
"""

from __future__ import annotations

import tvm
from tvm import te, tirx, topi

LOGSUMEXP_BLOCKS = ("max", "exp", "sum", "out")
CROSS_ENTROPY_BLOCKS = ("max", "exp", "sum", "out")
ABSMAX_QUANT_GEMM_BLOCKS = ("absmax", "scale", "gemm", "out")
RMSNORM_GEMM_BLOCKS = ("sumsq", "rstd", "gemm", "out")
MOE_ROUTING_BLOCKS = ("max", "exp", "sum", "prob")
#: Name of the block created by ``tvm.topi.topk`` (an extern call, not a reduction).
MOE_TOPK_BLOCK = "topk_cpu"


def _softmax_stats(X, rows: int, n: int, acc: str):
    """``max``, ``exp``, ``sum`` blocks over the last axis of ``X[rows, n]``."""
    rmax = te.reduce_axis((0, n), name="rj")
    m = te.compute((rows,), lambda i: te.max(X[i, rmax].astype(acc), axis=rmax), name="max")
    e = te.compute((rows, n), lambda i, j: te.exp(X[i, j].astype(acc) - m[i]), name="exp")
    rsum = te.reduce_axis((0, n), name="rj")
    l = te.compute((rows,), lambda i: te.sum(e[i, rsum], axis=rsum), name="sum")
    return m, e, l


def logsumexp(rows: int, n: int, dtype: str = "float32", accum_dtype: str = "float32") -> tvm.tirx.PrimFunc:
    """``main(X[rows, n]: dtype, out[rows]: accum_dtype)`` with
    ``out_i = log(sum_j exp(X[i, j]))`` computed as ``m_i + log(sum_j exp(X[i,j] - m_i))``.

    Blocks: ``max`` (reduction), ``exp``, ``sum`` (reduction), ``out``.
    """
    X = te.placeholder((rows, n), dtype, name="X")
    m, _, l = _softmax_stats(X, rows, n, accum_dtype)
    out = te.compute((rows,), lambda i: m[i] + te.log(l[i]), name="out")
    return te.create_prim_func([X, out])


def cross_entropy(
    rows: int,
    n: int,
    dtype: str = "float32",
    label_dtype: str = "int32",
    accum_dtype: str = "float32",
) -> tvm.tirx.PrimFunc:
    """``main(X[rows, n]: dtype, labels[rows]: label_dtype, out[rows]: accum_dtype)``
    with ``out_i = logsumexp_j(X[i, j]) - X[i, labels_i]``.

    Labels must lie in ``[0, n)`` (not checked at run time).
    Blocks: ``max``, ``exp``, ``sum``, ``out``.
    """
    X = te.placeholder((rows, n), dtype, name="X")
    labels = te.placeholder((rows,), label_dtype, name="labels")
    m, _, l = _softmax_stats(X, rows, n, accum_dtype)
    out = te.compute(
        (rows,),
        lambda i: m[i] + te.log(l[i]) - X[i, labels[i]].astype(accum_dtype),
        name="out",
    )
    return te.create_prim_func([X, labels, out])


def absmax_quant_gemm(
    M: int,
    N: int,
    K: int,
    fp8_max: float = 448.0,
    dtype: str = "float32",
    accum_dtype: str = "float32",
    eps: float = 1e-12,
) -> tvm.tirx.PrimFunc:
    """Per-row absmax-scaled GEMM ``main(X[M, K], W[K, N], out[M, N])``.

    ``absmax``: ``a_i = max_k |X[i,k]|`` (reduction);
    ``scale``:  ``s_i = fp8_max / max(a_i, eps)`` (spatial, per row);
    ``gemm``:   ``y[i,n] = sum_k (X[i,k] * s_i) * W[k,n]`` (reduction);
    ``out``:    ``out[i,n] = y[i,n] / s_i``.

    This is the GEMM in the *quantised domain* but without rounding
    ``X * s`` to fp8: rounding is not a linear map, so a rolling (online)
    rescaling of partial sums could not repair it exactly.  Mathematically
    ``out == X @ W`` (up to float rounding).
    """
    acc = accum_dtype
    X = te.placeholder((M, K), dtype, name="X")
    W = te.placeholder((K, N), dtype, name="W")
    rk = te.reduce_axis((0, K), name="rk")
    a = te.compute((M,), lambda i: te.max(te.abs(X[i, rk].astype(acc)), axis=rk), name="absmax")
    s = te.compute(
        (M,),
        lambda i: tirx.const(fp8_max, acc) / te.max(a[i], tirx.const(eps, acc)),
        name="scale",
    )
    rk2 = te.reduce_axis((0, K), name="rk")
    y = te.compute(
        (M, N),
        lambda i, j: te.sum((X[i, rk2].astype(acc) * s[i]) * W[rk2, j].astype(acc), axis=rk2),
        name="gemm",
    )
    out = te.compute((M, N), lambda i, j: (y[i, j] / s[i]).astype(dtype), name="out")
    return te.create_prim_func([X, W, out])


def rmsnorm_gemm(
    M: int,
    N: int,
    K: int,
    eps: float = 1e-6,
    dtype: str = "float32",
    accum_dtype: str = "float32",
) -> tvm.tirx.PrimFunc:
    """RMSNorm followed by a GEMM: ``main(X[M, K], gamma[K], W[K, N], out[M, N])``.

    ``sumsq``: ``ss_i = sum_k X[i,k]^2`` (reduction);
    ``rstd``:  ``r_i = 1 / sqrt(ss_i / K + eps)`` (spatial, per row);
    ``gemm``:  ``y[i,n] = sum_k X[i,k] * r_i * gamma[k] * W[k,n]`` (reduction);
    ``out``:   ``out[i,n] = cast(y[i,n])`` (so ``y`` is an intermediate).
    """
    acc = accum_dtype
    X = te.placeholder((M, K), dtype, name="X")
    gamma = te.placeholder((K,), dtype, name="gamma")
    W = te.placeholder((K, N), dtype, name="W")
    rk = te.reduce_axis((0, K), name="rk")
    ss = te.compute(
        (M,),
        lambda i: te.sum(X[i, rk].astype(acc) * X[i, rk].astype(acc), axis=rk),
        name="sumsq",
    )
    r = te.compute(
        (M,),
        lambda i: tirx.const(1.0, acc)
        / te.sqrt(ss[i] / tirx.const(float(K), acc) + tirx.const(eps, acc)),
        name="rstd",
    )
    rk2 = te.reduce_axis((0, K), name="rk")
    y = te.compute(
        (M, N),
        lambda i, j: te.sum(
            X[i, rk2].astype(acc) * r[i] * gamma[rk2].astype(acc) * W[rk2, j].astype(acc),
            axis=rk2,
        ),
        name="gemm",
    )
    out = te.compute((M, N), lambda i, j: y[i, j].astype(dtype), name="out")
    return te.create_prim_func([X, gamma, W, out])


def moe_routing(
    tokens: int,
    experts: int,
    top_k: int,
    dtype: str = "float32",
    accum_dtype: str = "float32",
    with_topk: bool = True,
    index_dtype: str = "int32",
) -> tvm.tirx.PrimFunc:
    """Mixture-of-experts router: softmax over experts, then top-k.

    ``main(logits[tokens, experts], prob[tokens, experts],
    topk_prob[tokens, top_k], topk_idx[tokens, top_k])``
    (the last two only with ``with_topk=True``).

    What is a reduction and what is not:

    * ``max`` (reduction, max), ``exp`` (spatial), ``sum`` (reduction, +) and
      ``prob`` (spatial, ``e / l``) form the softmax cascade -- the part that
      ``rolling_update`` can fuse.
    * top-k is **not** a commutative/associative scalar reduction for
      ``k > 1`` (its state is a sorted list of k pairs), so it is not written as
      a TE reduction.  With ``with_topk=True`` it is ``tvm.topi.topk``, i.e. one
      opaque ``te.extern`` block named ``topk_cpu`` that calls the packed
      function ``tvm.contrib.sort.topk`` (CPU runtime only) and declares no
      reads/writes.  It reads the *output* ``prob`` so the softmax result stays
      materialised whatever a schedule does to the cascade.  Order: descending
      probability; ties are resolved by that runtime sort.  Because softmax is
      monotone the selected experts equal ``topk(logits)``.
    * ``with_topk=False`` gives the pure softmax cascade ``main(logits, prob)``;
      the numpy reference :func:`tvm_cascade.ops.reference.moe_routing_ref`
      always provides the top-k.
    """
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k={top_k} must be in [1, experts={experts}]")
    acc = accum_dtype
    logits = te.placeholder((tokens, experts), dtype, name="logits")
    _, e, l = _softmax_stats(logits, tokens, experts, acc)
    prob = te.compute((tokens, experts), lambda t, x: e[t, x] / l[t], name="prob")
    if not with_topk:
        return te.create_prim_func([logits, prob])
    vals, idx = topi.topk(prob, k=top_k, axis=-1, ret_type="both", is_ascend=False, dtype=index_dtype)
    return te.create_prim_func([logits, prob, vals, idx])
