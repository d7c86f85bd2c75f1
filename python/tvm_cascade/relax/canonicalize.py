"""Rewrites that turn ``torch.export``'s forms of attention into those :mod:`.patterns`
matches.

* :func:`fold_batched_matmuls`: PyTorch decomposes ``matmul`` of ``[B, H, M, K]`` and
  ``[B, H, K, N]`` into ``broadcast_to -> reshape([B*H, M, K])`` on each side, a 3-D
  ``bmm`` and a reshape back to ``[B, H, M, N]``. The reshapes hide the key axis from the
  attention patterns (and from the axis analysis of the fused PrimFunc), so this rewrite
  turns the sequence back into one ``matmul`` of the original operands when the
  broadcasts change no shape. A cast between the bmm and the reshape back (a 16-bit
  model's matmul accumulated in float32 and cast to the model's type, as PyTorch computes
  it) stays after the folded matmul.
* :func:`flip_masked_row_guards`: ``F.scaled_dot_product_attention`` decomposes into a
  safe softmax, ``where(not(row_alive), zeros, softmax(s))`` (a row whose scores are all
  ``-inf`` gives zeros, not NaN). The same value written ``where(row_alive, softmax(s),
  0)`` is a mask the fusion sees through (``algebra/masks.py``): the condition is a
  finished reduction of its own, and the masked value is 0, the identity of P·V's sum.
"""

import numpy as np

import tvm
from tvm import relax
from tvm.relax.dpl import is_const, is_op, rewrite_call, wildcard

from .patterns import is_minus_inf, row_alive


def fold_batched_matmuls(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with every flattened batched matmul of same-batch operands folded back."""
    a, b = wildcard(), wildcard()
    flat_a = is_op("relax.reshape")(is_op("relax.broadcast_to")(a, wildcard()), wildcard())
    flat_b = is_op("relax.reshape")(is_op("relax.broadcast_to")(b, wildcard()), wildcard())
    flat = is_op("relax.matmul")(flat_a, flat_b)
    cast = is_op("relax.astype")(flat)
    pattern = is_op("relax.reshape")(flat | cast, wildcard())

    def rewrite(call, matches):
        lhs, rhs = matches[a], matches[b]
        if not _same_batch(lhs, rhs, call):
            return call
        folded = relax.op.matmul(lhs, rhs, out_dtype=matches[flat].attrs.out_dtype)
        if cast in matches:
            return relax.op.astype(folded, matches[cast].attrs.dtype)
        return folded

    return _rewrite_functions(mod, pattern, rewrite)


def flip_masked_row_guards(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with every ``where(logical_not(row_alive(s)), zeros, softmax(s))`` written
    ``where(row_alive(s), softmax(s), zeros_like(...))`` (zeros of their own: a scalar
    constant would become a parameter of the fused PrimFunc, not a literal 0)."""
    scores = wildcard()
    softmax = is_op("relax.nn.softmax")(scores)
    alive, minus_inf = row_alive(scores)
    fill = is_const()
    zeros = is_op("relax.full_like")(softmax, fill) | fill
    pattern = is_op("relax.where")(is_op("relax.logical_not")(alive), zeros, softmax)

    def rewrite(call, matches):
        if not is_minus_inf(matches[minus_inf]) or np.any(matches[fill].value.numpy() != 0):
            return call
        probs = matches[softmax]
        return relax.op.where(matches[alive], probs, relax.op.zeros_like(probs))

    return _rewrite_functions(mod, pattern, rewrite)


def _rewrite_functions(mod, pattern, rewrite):
    updates = {}
    for gvar, func in mod.functions_items():
        if isinstance(func, relax.Function):
            rewritten = rewrite_call(pattern, rewrite, func)
            if not rewritten.same_as(func):
                updates[gvar] = rewritten
    if not updates:
        return mod
    mod = mod.clone() if hasattr(mod, "clone") else tvm.IRModule(dict(mod.functions_items()))
    for gvar, func in updates.items():
        mod[gvar] = func
    return mod


def _same_batch(lhs, rhs, out) -> bool:
    """Whether ``matmul(lhs, rhs)`` has ``out``'s shape with no broadcast of the batch."""
    shapes = [getattr(x.ty, "shape", None) for x in (lhs, rhs, out)]
    if any(s is None for s in shapes):
        return False
    lhs_shape, rhs_shape, out_shape = (list(s) for s in shapes)
    if not (len(lhs_shape) == len(rhs_shape) == len(out_shape) >= 3):
        return False
    analyzer = tvm.sym.Analyzer()
    expected = lhs_shape[:-1] + [rhs_shape[-1]]
    pairs = list(zip(lhs_shape[:-2], rhs_shape[:-2])) + list(zip(expected, out_shape))
    pairs.append((lhs_shape[-1], rhs_shape[-2]))
    return all(analyzer.can_prove_equal(x, y) for x, y in pairs)
