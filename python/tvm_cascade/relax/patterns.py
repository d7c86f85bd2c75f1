"""Relax dataflow patterns of attention, for ``FuseOpsByPattern``.

Two forms are matched:

* ``R.nn.attention`` (also with a bias), which ``nn.op.scaled_dot_product_attention``
  of ``tvm.relax.frontend.nn`` emits;
* the hand-written chain ``matmul(q, permute_dims(k)) -> score ops -> softmax -> matmul(p, v)``,
  where the score ops are up to :data:`MAX_SCORE_OPS` elementwise operations (scale,
  bias or additive mask, ``where`` mask, softcap ``tanh``, casts) and K and V may be
  repeated or broadcast over the query heads of a GQA group; ``torch.export`` gives this
  form once :mod:`.canonicalize` has folded its flattened batched matmuls.

Each pattern is named ``cascade.attention`` or ``cascade.attention_chain_<n>`` (``n`` score
ops); longer chains come first so that a chain is grouped whole.
"""

import numpy as np
from tvm import relax
from tvm.relax.dpl import is_const, is_op, wildcard
from tvm.relax.transform import FusionPattern

PREFIX = "cascade.attention"
MAX_SCORE_OPS = 6

# Elementwise operations between the scores and the softmax, by how they take the scores:
# (op, number of operands, positions the scores may take).
_SCORE_OPS = (
    ("relax.multiply", 2, (0, 1)),
    ("relax.divide", 2, (0,)),
    ("relax.add", 2, (0, 1)),
    ("relax.subtract", 2, (0,)),
    ("relax.maximum", 2, (0, 1)),
    ("relax.minimum", 2, (0, 1)),
    ("relax.where", 3, (1, 2)),
    ("relax.tanh", 1, (0,)),
    ("relax.astype", 1, (0,)),
)


def attention_patterns():
    """The :class:`FusionPattern` list of every attention form, highest priority first."""
    patterns = [_chain_pattern(n) for n in range(MAX_SCORE_OPS, -1, -1)]
    patterns.append(_attention_op_pattern())
    return patterns


def _attention_op_pattern():
    q, k, v, bias = wildcard(), wildcard(), wildcard(), wildcard()
    root = is_op("relax.nn.attention")(q, k, v) | is_op("relax.nn.attention_bias")(q, k, v, bias)
    return FusionPattern(PREFIX, root, {"root": root}, _check_outputs_only)


def _chain_pattern(score_ops: int):
    keys = is_op("relax.permute_dims")(_grouped(wildcard()))
    scaled_keys = keys | is_op("relax.multiply")(keys, is_const())
    scores = qk = is_op("relax.matmul")(wildcard(), scaled_keys)
    for _ in range(score_ops):
        scores = _score_op(scores)
    softmax = is_op("relax.nn.softmax")(scores)
    guard, minus_inf = _masked_row_guard(scores, softmax)
    guarded = softmax | guard
    probs = guarded | is_op("relax.astype")(guarded)
    root = is_op("relax.matmul")(probs, _grouped(wildcard()))
    annotations = {"root": root, "qk": qk, "keys": keys, "softmax": softmax, "minus_inf": minus_inf}
    return FusionPattern(f"{PREFIX}_chain_{score_ops}", root, annotations, _check_chain)


def _grouped(tensor):
    """K or V as the matmuls read it: as is, or repeated over a GQA group (``repeat``, or
    the ``expand_dims -> broadcast_to -> reshape`` that PyTorch's ``repeat_interleave``
    and ``expand`` import to)."""
    broadcast = is_op("relax.broadcast_to")(is_op("relax.expand_dims")(tensor) | tensor, wildcard())
    return is_op("relax.repeat")(tensor) | is_op("relax.reshape")(broadcast, wildcard()) | tensor


def _masked_row_guard(scores, softmax):
    """``where(row_alive, softmax, 0)``, with ``row_alive`` whether any score of the row is
    not ``-inf``: PyTorch's safe softmax after :func:`.canonicalize.flip_masked_row_guards`."""
    alive, minus_inf = row_alive(scores)
    guard = is_op("relax.where")(alive, softmax, is_op("relax.zeros_like")(softmax))
    return guard, minus_inf


def row_alive(scores):
    """The pattern of ``astype(max(astype(scores != -inf, int8), axis=-1, keepdims=True),
    bool)`` as ``torch.export`` writes it (the comparison as ``logical_not(equal(...))``),
    and the pattern of the constant compared with (to check that it is ``-inf``)."""
    minus_inf = is_const()
    alive = is_op("relax.logical_not")(is_op("relax.equal")(scores, minus_inf))
    reduced = is_op("relax.max")(is_op("relax.astype")(alive)).has_attr(
        {"axis": [-1], "keepdims": True}
    )
    return is_op("relax.astype")(reduced), minus_inf


def _score_op(scores):
    alternatives = None
    for op, arity, positions in _SCORE_OPS:
        for position in positions:
            args = [wildcard() for _ in range(arity)]
            args[position] = scores
            call = is_op(op)(*args)
            alternatives = call if alternatives is None else alternatives | call
    return alternatives


def _check_chain(context) -> bool:
    """Accept a chain whose softmax and matmuls run over the key axis (the last axis of
    the scores) and whose intermediates are used inside the group only."""
    ann = context.annotated_expr
    softmax, keys, qk = ann["softmax"], ann["keys"], ann["qk"]
    rank = len(qk.ty.shape)
    if rank < 3 or len(ann["root"].ty.shape) != rank:
        return False
    axis = int(softmax.attrs.axis)
    if axis not in (-1, rank - 1):
        return False
    axes = keys.attrs.axes
    expected = list(range(rank - 2)) + [rank - 1, rank - 2]
    if axes is None or [int(a) for a in axes] != expected:
        return False
    minus_inf = ann.get("minus_inf")
    if minus_inf is not None and not is_minus_inf(minus_inf):
        return False
    return _check_outputs_only(context)


def _check_outputs_only(context) -> bool:
    """Reject a match whose intermediate values are also used outside it (the attention
    weights of a model that returns them): they would not exist after fusion."""
    matched = set(context.matched_bindings.keys())
    root_var = context.value_to_bound_var.get(context.annotated_expr["root"])
    for var in matched:
        if var.same_as(root_var):
            continue
        for user in context.var_usages.get(var, []):
            if user not in matched:
                return False
    return True


def is_minus_inf(const) -> bool:
    """Whether a Relax constant is the scalar ``-inf``."""
    data = const.value.numpy()
    return data.size == 1 and bool(np.isneginf(data).all())


def is_attention_group(func) -> bool:
    """Whether a Relax function is a group made from one of these patterns."""
    if not isinstance(func, relax.Function) or func.attrs is None:
        return False
    composite = func.attrs.get("Composite")
    return composite is not None and str(composite).startswith(PREFIX)


__all__ = ["MAX_SCORE_OPS", "PREFIX", "attention_patterns", "is_attention_group"]
