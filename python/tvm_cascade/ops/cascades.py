"""Unfused TE definitions of non-attention cascaded reductions.

Each builder returns a ``tvm.tirx.PrimFunc`` made with ``te.create_prim_func``
whose parameters are only the inputs and outputs; every other stage is an
intermediate buffer allocated inside the function.  Block names (one
``te.compute`` per block) are part of the contract with ``rolling_update``:

=====================  ===============================================================
builder                blocks (program order)
=====================  ===============================================================
``logsumexp``          ``max``, ``exp``, ``sum``, ``out``
``cross_entropy``      ``max``, ``exp``, ``sum``, ``out``
``absmax_quant_gemm``  ``absmax``, ``scale``, ``gemm``, ``out``
``fp8_quant_gemm``     ``peak``, ``scale``, ``quant``, ``gemm``, ``out``
``rmsnorm_gemm``       ``sumsq``, ``rstd``, ``gemm``, ``out``
``moe_routing``        ``max``, ``exp``, ``sum``, ``prob`` [, ``top0`` ..., ``topk_prob``, ``topk_idx``]
=====================  ===============================================================

Reductions use only the standard reducers (``te.sum`` / ``te.max``), so the
TIR update statements are ``X[idx] = X[idx] + expr`` or
``X[idx] = T.max(X[idx], expr)``.
"""

from __future__ import annotations

from typing import Optional

import tvm
from tvm import te, tirx

LOGSUMEXP_BLOCKS = ("max", "exp", "sum", "out")
CROSS_ENTROPY_BLOCKS = ("max", "exp", "sum", "out")
ABSMAX_QUANT_GEMM_BLOCKS = ("absmax", "scale", "gemm", "out")
RMSNORM_GEMM_BLOCKS = ("sumsq", "rstd", "gemm", "out")
MOE_ROUTING_BLOCKS = ("max", "exp", "sum", "prob")
#: The blocks that gather the top-k rounds (``top0`` ... ``top{k-1}``) into the outputs.
MOE_TOPK_BLOCKS = ("topk_prob", "topk_idx")


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


def fp8_quant_gemm(
    M,
    N: int,
    K: int,
    tile: int = 128,
    dtype: str = "float16",
    out_dtype: Optional[str] = None,
    fp8_max: float = 448.0,
    eps: float = 1e-12,
) -> tvm.tirx.PrimFunc:
    """Per-token fp8 quantisation + GEMM: ``main(X[M, K], W[N, K], w_scale[N], out[M, N])``,
    W in float8_e4m3fn with a float32 scale per output channel (row of W), X's rows
    quantised to e4m3 in tiles of ``tile`` along k, each tile by the row's running
    abs-max up to it. ``M`` may be a variable.

    ``peak``:  ``p[i, t] = max_{k < (t+1)·tile} |X[i, k]|`` (reduction);
    ``scale``: ``s[i, t] = fp8_max / max(p[i, t], eps)`` (float32);
    ``quant``: ``q[i, k] = e4m3(X[i, k] · s[i, k // tile])``;
    ``gemm``:  ``y[i, n] = Σ_k q[i, k] · W[n, k] / s[i, k // tile]`` (float32);
    ``out``:   ``out[i, n] = y[i, n] · w_scale[n]`` (``out_dtype``, default ``dtype``).

    With ``tile >= K`` every tile takes the row's abs-max: the usual two-pass
    quantisation. (TVM's LLVM code generator does not round casts to e4m3 to e4m3
    values: on a CPU this function computes something else; numpy's
    ``ops.reference.fp8_quant_gemm_ref`` is its reference.)
    """
    f32 = "float32"
    X = te.placeholder((M, K), dtype, name="X")
    W = te.placeholder((N, K), "float8_e4m3fn", name="W")
    w_scale = te.placeholder((N,), f32, name="w_scale")
    tiles = -(-K // tile)
    rk = te.reduce_axis((0, K), name="rk")
    peak = te.compute(
        (M, tiles),
        # (zero past the tile: no smaller than a magnitude)
        lambda i, t: te.max(tirx.if_then_else(rk < (t + 1) * tile, te.abs(X[i, rk].astype(f32)), tirx.const(0, f32)), axis=rk),
        name="peak",
    )
    scale = te.compute(
        (M, tiles), lambda i, t: tirx.const(fp8_max, f32) / te.max(peak[i, t], tirx.const(eps, f32)), name="scale"
    )
    quant = te.compute(
        (M, K), lambda i, k: (X[i, k].astype(f32) * scale[i, k // tile]).astype("float8_e4m3fn"), name="quant"
    )
    rk2 = te.reduce_axis((0, K), name="rk")
    gemm = te.compute(
        (M, N),
        lambda i, j: te.sum(quant[i, rk2].astype(f32) * W[j, rk2].astype(f32) / scale[i, rk2 // tile], axis=rk2),
        name="gemm",
    )
    out = te.compute((M, N), lambda i, j: (gemm[i, j] * w_scale[j]).astype(out_dtype or dtype), name="out")
    return te.create_prim_func([X, W, w_scale, out])


def rmsnorm_gemm(
    M,
    N: int,
    K: int,
    eps: float = 1e-6,
    dtype: str = "float32",
    accum_dtype: str = "float32",
    weight_layout: str = "kn",
    pad_rows: Optional[int] = None,
    out_dtype: Optional[str] = None,
) -> tvm.tirx.PrimFunc:
    """RMSNorm followed by a GEMM: ``main(X[M, K], gamma[K], W[K, N], out[M, N])``, or
    with ``weight_layout="nk"`` ``W[N, K]`` (as ``torch.nn.Linear`` and a Relax
    ``matmul(x, permute_dims(w))`` hold it). ``M`` may be a variable.

    ``sumsq``: ``ss_i = sum_k X[i,k]^2`` (reduction);
    ``rstd``:  ``r_i = 1 / sqrt(ss_i / K + eps)`` (spatial, per row);
    ``gemm``:  ``y[i,n] = sum_k X[i,k] * r_i * gamma[k] * W[k,n]`` (reduction);
    ``out``:   ``out[i,n] = cast(y[i,n])`` (so ``y`` is an intermediate).

    ``pad_rows`` computes over ``M`` rounded up to a multiple of it (for schedules with
    whole tiles only): block ``X_pad`` reads ``X``'s last row again past its end (a
    plain copy, which a GPU schedule issues asynchronously; those rows' results are
    never stored), and ``out`` keeps the first ``M`` rows. ``out_dtype`` (default
    ``dtype``) is ``out``'s.
    """
    acc = accum_dtype
    X = te.placeholder((M, K), dtype, name="X")
    gamma = te.placeholder((K,), dtype, name="gamma")
    if weight_layout not in ("kn", "nk"):
        raise ValueError(f"weight_layout must be 'kn' or 'nk', not {weight_layout!r}")
    W = te.placeholder((K, N) if weight_layout == "kn" else (N, K), dtype, name="W")
    weight = (lambda k, j: W[k, j]) if weight_layout == "kn" else (lambda k, j: W[j, k])
    rows = M
    if pad_rows is not None:
        rows = tvm.sym.Analyzer().simplify(tirx.floordiv(M + pad_rows - 1, pad_rows) * pad_rows)
        if not (isinstance(rows, tirx.IntImm) and isinstance(M, int) and rows.value == M):
            X = te.compute(
                (rows, K),
                lambda i, k: X[tirx.min(i, M - 1), k],
                name="X_pad",
            )
    rk = te.reduce_axis((0, K), name="rk")
    ss = te.compute(
        (rows,),
        lambda i: te.sum(X[i, rk].astype(acc) * X[i, rk].astype(acc), axis=rk),
        name="sumsq",
    )
    r = te.compute(
        (rows,),
        lambda i: tirx.const(1.0, acc)
        / te.sqrt(ss[i] / tirx.const(float(K), acc) + tirx.const(eps, acc)),
        name="rstd",
    )
    rk2 = te.reduce_axis((0, K), name="rk")
    y = te.compute(
        (rows, N),
        lambda i, j: te.sum(
            X[i, rk2].astype(acc) * r[i] * gamma[rk2].astype(acc) * weight(rk2, j).astype(acc),
            axis=rk2,
        ),
        name="gemm",
    )
    out = te.compute((M, N), lambda i, j: y[i, j].astype(out_dtype or dtype), name="out")
    inputs = [X.op.input_tensors[0] if X.op.name == "X_pad" else X, gamma, W]
    return te.create_prim_func(inputs + [out])


def moe_routing(
    tokens: int,
    experts: int,
    top_k: int,
    dtype: str = "float32",
    accum_dtype: str = "float32",
    with_topk: bool = True,
    index_dtype: str = "int32",
    with_prob: bool = True,
) -> tvm.tirx.PrimFunc:
    """Mixture-of-experts router: softmax over experts, then top-k.

    ``main(logits[tokens, experts], prob[tokens, experts],
    topk_prob[tokens, top_k], topk_idx[tokens, top_k])``
    (the last two only with ``with_topk=True``; ``prob`` only with ``with_prob=True``).

    What is a reduction and what is not:

    * ``max`` (reduction, max), ``exp`` (spatial), ``sum`` (reduction, +) and
      ``prob`` (spatial, ``e / l``) form the softmax cascade -- the part that
      ``rolling_update`` can fuse.
    * top-k is **not** a commutative/associative scalar reduction for
      ``k > 1`` (its state is a sorted list of k pairs). With ``with_topk=True`` it
      is ``top_k`` arg-max reductions over the experts, ``top0`` ... ``top{k-1}``:
      round ``r`` takes the largest ``x - m`` (logit less the row's maximum) among the
      experts that come after round ``r - 1``'s in the order (descending, index
      ascending), so ties go to the lower expert index. The probability
      ``exp(x - m) / l`` is increasing in ``x - m``, so that is the order of the
      probabilities, and a round costs a subtraction and comparisons per expert, not
      an exponential and a division. Each round reads the one before, but no repair
      lets a round see a partial previous round: they are no chain for the
      primitives. The blocks ``topk_prob`` (``exp(x - m) / l`` of each round's
      ``x - m``) and ``topk_idx`` gather the rounds into the outputs.
      Everything is TIR: the function runs on any target.
    * ``with_topk=False`` gives the pure softmax cascade ``main(logits, prob)``;
      the numpy reference :func:`tvm_cascade.ops.reference.moe_routing_ref`
      always provides the top-k.
    """
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k={top_k} must be in [1, experts={experts}]")
    if with_topk and experts >= 1 << 24:
        raise ValueError(f"experts={experts}: the top-k rounds count experts in float32, exact below 2**24")
    acc = accum_dtype
    logits = te.placeholder((tokens, experts), dtype, name="logits")
    m, e, l = _softmax_stats(logits, tokens, experts, acc)
    prob = te.compute((tokens, experts), lambda t, x: e[t, x] / l[t], name="prob")
    if not with_topk:
        return te.create_prim_func([logits, prob])
    vals, idx = _top_k_rounds(logits, m, l, tokens, experts, top_k, acc, index_dtype)
    return te.create_prim_func([logits, prob, vals, idx] if with_prob else [logits, vals, idx])


#: The type of the arg-max rounds' expert index (see :func:`_top_k_rounds`).
_ROUND_INDEX = "float32"


def _top_k_rounds(logits, m, l, tokens: int, experts: int, top_k: int, acc: str, index_dtype: str):
    """``topk_prob[tokens, top_k]`` and ``topk_idx`` from ``top_k`` arg-max rounds over
    the logits less their row's maximum ``m`` (``l``: the softmax's sum)."""

    def combine(x, y):  # (index, value): the larger value, on a tie the lower index
        # TVM's arg-max form, so that its cross-thread reduction recognises it. The index
        # is carried as a float (exact below 2**24 experts): an integer one is bound, with
        # the selects that compute it, into the analyzer of TVM's CompactBufferAllocation,
        # which then took seconds per compile (8.6 s for 8 rounds, 0.2 s as a float).
        keep_x = tirx.Or(x[1] > y[1], tirx.And(x[1] == y[1], x[0] < y[0]))
        return tirx.Select(keep_x, x[0], y[0]), tirx.Select(x[1] > y[1], x[1], y[1])

    def identity(index_t, value_t):
        return tirx.const(-1, index_t), tirx.min_value(value_t)

    argmax = te.comm_reducer(combine, identity, name="argmax")
    rounds = []
    for r in range(top_k):
        rule = _round(logits, m, experts, rounds[-1] if rounds else None, argmax, acc)
        rounds.append(te.compute((tokens,), rule, name=f"top{r}"))

    def gather(part):
        def rule(t, k):
            picked = rounds[-1][part][t]
            for r in range(top_k - 2, -1, -1):
                picked = tirx.Select(k == r, rounds[r][part][t], picked)
            return te.exp(picked) / l[t] if part == 1 else picked.astype(index_dtype)

        return rule

    parts = ((1, "topk_prob"), (0, "topk_idx"))
    return tuple(te.compute((tokens, top_k), gather(part), name=name) for part, name in parts)


def _round(logits, m, experts: int, prev, argmax, acc: str):
    """The compute rule of one arg-max round, after round ``prev`` (None for the first);
    its index is a float32."""
    j = te.reduce_axis((0, experts), name="rj")

    def pair(t):
        index, value = j.var.astype(_ROUND_INDEX), logits[t, j].astype(acc) - m[t]
        if prev is not None:
            after = tirx.Or(value < prev[1][t], tirx.And(value == prev[1][t], index > prev[0][t]))
            value = tirx.Select(after, value, tirx.min_value(acc))
        return argmax((index, value), axis=j)

    return pair
