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
      is ``top_k`` max reductions over the experts, ``top0`` ... ``top{k-1}``, of one
      integer key per expert that orders the experts as the probabilities do
      (:class:`_ExpertKey`: the logit's bits made monotone, then the expert's place
      in reverse, so that on equal logits the lower index ranks first). Round ``r``
      takes the largest key below round ``r - 1``'s; round 0 the largest not above
      the row maximum's. The probability ``exp(x - m) /
      l`` is increasing in the logit ``x``, so ranking the logits ranks the
      probabilities, and exactly (no rounding of ``x - m`` merges two logits); a
      round costs an integer comparison per expert, not an exponential and a
      division. Each round reads the one before, but no repair lets a round see a
      partial previous round: they are no chain for the primitives. The blocks
      ``topk_prob`` (``exp(x - m) / l`` of each round's logit, decoded from its key)
      and ``topk_idx`` gather the rounds into the outputs.
      Everything is TIR: the function runs on any target.
    * ``with_topk=False`` gives the pure softmax cascade ``main(logits, prob)``;
      the numpy reference :func:`tvm_cascade.ops.reference.moe_routing_ref`
      always provides the top-k.
    """
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k={top_k} must be in [1, experts={experts}]")
    if with_topk and experts > 1 << 32:
        raise ValueError(f"experts={experts}: the top-k keys hold an expert's place in 32 bits")
    acc = accum_dtype
    logits = te.placeholder((tokens, experts), dtype, name="logits")
    m, e, l = _softmax_stats(logits, tokens, experts, acc)
    prob = te.compute((tokens, experts), lambda t, x: e[t, x] / l[t], name="prob")
    if not with_topk:
        return te.create_prim_func([logits, prob])
    vals, idx = _top_k_rounds(logits, m, l, tokens, experts, top_k, acc, index_dtype)
    return te.create_prim_func([logits, prob, vals, idx] if with_prob else [logits, vals, idx])


def _top_k_rounds(logits, m, l, tokens: int, experts: int, top_k: int, acc: str, index_dtype: str):
    """``topk_prob[tokens, top_k]`` and ``topk_idx`` from ``top_k`` max reductions over
    the experts' keys (:class:`_ExpertKey`; ``m``, ``l``: the softmax's max and sum)."""
    key = _ExpertKey(logits, experts)
    rounds = []
    for r in range(top_k):
        rounds.append(te.compute((tokens,), _round(key, rounds[-1] if rounds else None, m), name=f"top{r}"))

    def gather(decode):
        def rule(t, k):
            picked = rounds[-1][t]
            for r in range(top_k - 2, -1, -1):
                picked = tirx.Select(k == r, rounds[r][t], picked)
            return decode(t, picked)

        return rule

    prob = gather(lambda t, k: te.exp(key.logit(k).astype(acc) - m[t]) / l[t])
    index = gather(lambda t, k: key.expert(k).astype(index_dtype))
    return te.compute((tokens, top_k), prob, name="topk_prob"), te.compute((tokens, top_k), index, name="topk_idx")


def _round(key, prev, m):
    """The compute rule of a round: the largest key below round ``prev``'s, or for the
    first round (``prev`` None) the largest not above the row maximum ``m``'s largest."""
    j = te.reduce_axis((0, key.experts), name="rj")

    def rule(t):
        k = key.encode(t, j)
        below = k < prev[t] if prev is not None else k <= key.ceiling(m[t])
        return te.max(tirx.Select(below, k, tirx.min_value(key.dtype)), axis=j)

    return rule


class _ExpertKey:
    """An integer per (token, expert) whose order is the order of the logits, ties to
    the lower expert index: the logit's bits made monotone (a float's bits order its
    magnitude; a negative float's are negated, and -0 meets +0 at 0) in the high half,
    ``experts - 1 - j`` in the low half. 16-bit logits of at most 2**16 experts fit an
    int32 (one comparison on a GPU); others take an int64 of the float32 logit."""

    def __init__(self, logits, experts: int):
        self.experts = experts
        self.float = str(logits.dtype) if tvm.DataType(logits.dtype).bits == 16 and experts <= 1 << 16 else "float32"
        self.bits = tvm.DataType(self.float).bits
        self.dtype = "int32" if self.bits == 16 else "int64"
        self.logits = logits

    def encode(self, t, j):
        place = tirx.const(self.experts - 1, self.dtype) - j.var.astype(self.dtype)
        return self._ordered(self.logits[t, j]) * tirx.const(1 << self.bits, self.dtype) + place

    def ceiling(self, peak):
        """The largest key a logit of at most ``peak`` (a logit's value, in any float
        type that holds it exactly) has."""
        return self._ordered(peak) * tirx.const(1 << self.bits, self.dtype) + tirx.const((1 << self.bits) - 1, self.dtype)

    def _ordered(self, x):
        if self.float == "bfloat16":  # the high half of its float32 (LLVM bitcasts no bfloat16)
            raw = tirx.shift_right(tirx.reinterpret("int32", x.astype("float32")), tirx.const(16, "int32"))
        else:
            raw = tirx.reinterpret(f"int{self.bits}", x.astype(self.float)).astype(self.dtype)
        magnitude = raw & tirx.const((1 << (self.bits - 1)) - 1, self.dtype)
        return tirx.Select(raw < 0, tirx.const(0, self.dtype) - magnitude, raw)

    def logit(self, key):
        ordered = tirx.floordiv(key, tirx.const(1 << self.bits, self.dtype))
        magnitude = tirx.Select(ordered < 0, tirx.const(0, self.dtype) - ordered, ordered)
        if self.float == "bfloat16":  # the high half of a float32
            x = tirx.reinterpret("float32", magnitude.astype("int32") * tirx.const(1 << 16, "int32"))
        else:
            x = tirx.reinterpret(self.float, magnitude.astype(f"int{self.bits}"))
        return tirx.Select(ordered < 0, -x, x)

    def expert(self, key):
        return tirx.const(self.experts - 1, self.dtype) - tirx.floormod(key, tirx.const(1 << self.bits, self.dtype))
