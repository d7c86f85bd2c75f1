"""What attention a hand-written ``matmul -> score ops -> softmax -> matmul`` chain of a
Relax function computes, in the kernel library's terms (:class:`ChainAttention`), or why
the library's kernels cannot compute it.

The chain is read back from its output matmul through the function's bindings (the
forms :mod:`.patterns` matches, after :mod:`.canonicalize`): ``probs @ v`` with
``probs`` a softmax over the last axis (cast, or guarded for fully masked rows) of the
scores ``q @ permute_dims(k)`` taken through

- products with scalar constants, on the scores, on ``q`` or on ``kᵀ`` (the scale);
- ``c * tanh(s / c)`` (a softcap), after the scale;
- the ALiBi bias added (without a softcap), known by value: the library's slopes times
  the key's distance, up to a constant of each row (BLOOM's ``slope * j``);
- a mask after them: an additive constant (0 where a key is seen, ``-inf`` or below
  :data:`MASKED_BELOW` where not) or ``where(constant, s, -inf)`` whose pattern is a
  causal mask aligned to the end of the keys (with a sliding window or not) is that
  variant (whose kernels skip the tiles it hides); any other mask, added to the scores
  or a boolean ``where(mask, s, -inf)``, of constants (a bias, a prefix mask) or
  computed from the function's parameters (a model's attention mask), of shape ``[b|1,
  h|1, sq|1, skv]`` (or its last axes), is a mask tensor the kernel reads
  (:class:`~tvm_cascade.library.spec.MaskTensor`);
- casts (the scores or softmax in float32).

K and V are read before a GQA repeat (``repeat`` over heads, or ``expand_dims ->
broadcast_to -> reshape``) and before casts. Heads and head dims must be static; batch
and lengths may be symbolic (torch.export with dynamic shapes). A mask is known by its
value: a constant, or computed on the CPU from the constants, shapes and ``arange``s it
is built of. Over symbolic lengths it is computed at several lengths
(:func:`sample_lengths`: small ones, and ones past every integer constant of its graph,
where a window's width or an offset would show) and served where each gives the same
variant.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

import numpy as np
import tvm
from tvm import relax

from ..analysis.chain import substitute
from ..library.mask_ranges import MARGIN
from ..library.spec import MaskTensor
from ..ops.variants import AttentionVariant

#: An additive mask's entries at or below this hide a key (``-1e9``, ``finfo.min``, the
#: ``-1e4`` of masks written for float16, which bfloat16 rounds to -9984...): as the mask
#: tensors' scan takes them (:data:`~tvm_cascade.library.mask_ranges.MARGIN`).
MASKED_BELOW = -MARGIN
#: The largest integer constant of a mask over symbolic lengths that :func:`sample_lengths`
#: checks past (at lengths up to twice it).
LONGEST_SAMPLE = 1 << 13
#: :func:`read_chain`'s answer for a matmul that is not a softmax's product with V.
NOT_A_CHAIN = "not a softmax over the keys"


@dataclass
class ChainAttention:
    """``q[b, hq, sq, d]``, ``k/v[b, hkv, skv, d]`` (Relax expressions, in the inputs'
    half type) and what the chain computes of them."""

    q: relax.Expr
    k: relax.Expr
    v: relax.Expr
    variant: AttentionVariant
    scale: float
    mask: Optional[relax.Expr] = None  # the mask tensor the kernel reads, if any
    mask_tensor: Optional[MaskTensor] = None  # its form


def read_chain(root: relax.Call, lookup: Callable, values: Optional[dict] = None) -> "ChainAttention | str":
    """The :class:`ChainAttention` of output matmul ``root`` (``lookup(var)``: the value
    bound to a variable, or None), or the reason it is not one (a str). ``values``
    keeps the masks computed on the CPU by variable, for the other chains of a module
    (a model's layers share one)."""
    values = {} if values is None else values
    probs, v_grouped = root.args
    softmax = _strip(probs, lookup, ("relax.astype",))
    softmax = _unguard(softmax, lookup)
    if not _is(softmax, "relax.nn.softmax") or int(softmax.attrs.axis) not in (-1, 3):
        return NOT_A_CHAIN
    ops = []  # score ops, last first
    scores = _value(softmax.args[0], lookup)
    while not _is(scores, "relax.matmul"):
        if not isinstance(scores, relax.Call) or not isinstance(scores.op, tvm.ir.Op):
            return "the scores are not a matmul's"
        ops.append(scores)
        scores = _value(_operand(scores, lookup), lookup)
    q_side, keys = scores.args
    scale, q = _scaled(q_side, lookup)
    key_scale, kt = _scaled(keys, lookup)
    kt = _value(kt, lookup)
    if not _is(kt, "relax.permute_dims") or [int(a) for a in kt.attrs.axes] != [0, 1, 3, 2]:
        return "the keys are not transposed from [b, h, s, d]"
    k, v = (_ungroup(x, lookup) for x in (kt.args[0], v_grouped))
    q = _strip(q, lookup, ("relax.astype",), value=False)
    shapes = [tensor_shape(x) for x in (q, k, v)]
    if any(s is None or len(s) != 4 for s in shapes):
        return "q, k and v need 4-d shapes [b, h, s, d]"
    (batch, heads_q, seq_q, head_dim), (batch_kv, heads_kv, seq_kv, head_dim_kv) = shapes[:2]
    if not all(isinstance(x, int) for x in (heads_q, heads_kv, head_dim, head_dim_kv, shapes[2][1], shapes[2][3])):
        return "heads and head dims must be static"
    same = all(_same(a, b) for a, b in zip(shapes[1], shapes[2]))
    if heads_q % heads_kv or not same or not _same(batch, batch_kv) or head_dim != head_dim_kv:
        return f"q {shapes[0]}, k {shapes[1]} and v {shapes[2]} are not one batch of heads with K/V groups"
    dtypes = {str(x.ty.dtype) for x in (q, k, v)}
    if len(dtypes) != 1:
        return f"q, k and v differ in type: {sorted(dtypes)}"
    return _score_ops(ops[::-1], scale * key_scale, (batch, heads_q, seq_q, seq_kv), q, k, v, lookup, values)


def _score_ops(ops, scale, scores_shape, q, k, v, lookup, values):
    """The chain's variant and scale from its score ops (first to last)."""
    seq_q, seq_kv = scores_shape[2:]
    softcap, mask = None, None
    i = 0
    while i < len(ops) and (_scalar_factor(ops[i]) is not None or _is(ops[i], "relax.astype")):
        scale *= _scalar_factor(ops[i]) or 1.0
        i += 1
    if i < len(ops) and _is(ops[i], "relax.tanh"):
        after = _scalar_factor(ops[i + 1]) if i + 1 < len(ops) else None
        if after is None:
            return "a tanh not followed by its cap"
        softcap, scale = after, scale * after
        i += 2
    alibi = False
    for op in ops[i:]:
        if _is(op, "relax.astype"):
            continue
        # (the library adds ALiBi before a softcap: one added after it is a mask tensor)
        if not alibi and softcap is None and _adds_alibi(op, scores_shape, lookup, values):
            alibi = True
            continue
        if mask is not None:
            return f"more than one mask ({op.op.name})"
        mask = op
    unmasked = ChainAttention(q, k, v, AttentionVariant("global", softcap=softcap, alibi=alibi), scale)
    if mask is not None and not _closed(_mask_operand(mask, lookup), lookup):
        return _mask_tensor(mask, lookup, scores_shape, unmasked)
    variant = _known_variant(mask, softcap, seq_q, seq_kv, lookup, values)
    if isinstance(variant, str) and mask is not None:
        # A mask of constants and the lengths that is no variant: read as a tensor.
        as_tensor = _mask_tensor(mask, lookup, scores_shape, unmasked)
        return as_tensor if isinstance(as_tensor, ChainAttention) else f"{variant}; as a mask tensor: {as_tensor}"
    if isinstance(variant, str):
        return variant
    return ChainAttention(q, k, v, replace(variant, alibi=True) if alibi else variant, scale)


def _adds_alibi(op, scores_shape, lookup, values) -> bool:
    """Whether score op ``op`` adds the library's ALiBi bias (``slope_h * (j - i)``,
    ``slope_h = 2 ** (-8 (h + 1) / heads)``, up to a constant of each query row, which
    the softmax does not see: BLOOM's ``slope_h * j``), computed in float32 or wider
    from constants and the lengths, at every length it is checked at."""
    if not _is(op, "relax.add"):
        return False
    bias = _mask_operand(op, lookup)
    heads = scores_shape[1]
    if not isinstance(heads, int) or not _closed(bias, lookup) or str(bias.ty.dtype) not in ("float32", "float64"):
        return False
    samples = _samples(scores_shape[2:], op, lookup)
    if isinstance(samples, str):
        return False
    slopes = 2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)
    for sizes in samples:
        value = _closed_value(bias, lookup, values, sizes)
        seq_q, seq_kv = (_size(n, sizes) for n in scores_shape[2:])
        if value is None or value.ndim > 4:
            return False
        try:
            planes = np.broadcast_to(value, value.shape[:-3] + (heads, seq_q, seq_kv)).reshape(-1, heads, seq_q, seq_kv)
        except ValueError:
            return False
        if not np.isfinite(planes).all():  # (a mask)
            return False
        expected = slopes[:, None, None] * np.arange(seq_kv)
        shifted = planes.astype(np.float64) - planes[..., :1]
        # float32 rounding of values up to the largest bias, and of the row's shift
        tolerance = 4 * np.finfo(np.float32).eps * (np.abs(planes).max() + 1)
        if not np.all(np.abs(shifted - expected) <= tolerance):
            return False
    return True


def _known_variant(mask, softcap, seq_q, seq_kv, lookup, values):
    """The library's variant mask op ``mask`` (or None) computes, known by value, or why
    it is none."""
    # The variant the mask is at the largest lengths sampled; at every other sample it
    # must hide what that variant hides (at small lengths a causal mask may hide none).
    samples = _samples([seq_q, seq_kv], mask, lookup)
    if isinstance(samples, str):
        return samples
    variant = None
    for sizes in samples[::-1]:
        visible = None if mask is None else _mask(mask, lookup, values, sizes)
        if isinstance(visible, str):
            return visible
        lengths = _size(seq_q, sizes), _size(seq_kv, sizes)
        if variant is None:
            variant = _variant(visible, *lengths, softcap)
            if isinstance(variant, str):
                return variant
        elif not np.array_equal(np.broadcast_to(True if visible is None else visible, lengths), _seen(variant, *lengths)):
            return "a mask whose pattern changes with the lengths"
    return variant


def _mask_operand(op, lookup):
    """The operand of mask op ``op`` that is not the scores: an additive mask, or a
    where's condition."""
    if _is(op, "relax.where"):
        return op.args[0]
    scores = _operand(op, lookup)
    return op.args[1] if scores.same_as(op.args[0]) else op.args[0]


def _mask_tensor(op, lookup, scores_shape, chain):
    """``chain`` reading the mask tensor of mask op ``op`` (computed from parameters, or
    constants that are no variant's mask), or why the kernel cannot read it."""
    tensor = _mask_operand(op, lookup)
    if _is(op, "relax.where"):
        fill = _constant(op.args[2])
        if op.args[2].same_as(_operand(op, lookup)) or fill is None or fill.size != 1 or fill.item() > MASKED_BELOW:
            return "a where over a mask tensor that does not hide keys with -inf where the tensor is False"
    elif not _is(op, "relax.add"):
        return f"score op {op.op.name} of a tensor"
    form = mask_form(tensor, scores_shape)
    if isinstance(form, str):
        return form
    chain.mask, chain.mask_tensor = tensor, form
    return chain


def mask_form(tensor, scores_shape) -> "MaskTensor | str":
    """The :class:`~tvm_cascade.library.spec.MaskTensor` of mask tensor ``tensor`` (a
    Relax expression) over scores of ``scores_shape`` ``[b, h, sq, skv]``: of shape
    ``[b|1, h|1, sq|1, skv]``, or its last 2 or 3 axes; or why it is none."""
    shape, dtype = tensor_shape(tensor), str(tensor.ty.dtype)
    if shape is None or not 2 <= len(shape) <= 4:
        return "a mask tensor that is not [b, h, sq, skv] (or its last 2 or 3 axes)"
    shape = [1] * (4 - len(shape)) + shape
    broadcast = [_same(n, 1) for n in shape[:3]]
    if not all(kept or _same(n, full) for n, full, kept in zip(shape[:3], scores_shape[:3], broadcast)) or not _same(
            shape[3], scores_shape[3]):
        return f"a mask tensor of shape {shape}: [b or 1, h or 1, sq or 1, skv] of the scores' {list(scores_shape)}"
    return MaskTensor(dtype, *(not kept for kept in broadcast))


def _samples(lengths, mask, lookup):
    """The bindings (shape variable -> int) of the lengths' variables to check a mask at
    (one empty binding where the lengths are static), or why there are none."""
    names = _sorted_vars(v for x in lengths if not isinstance(x, int) for v in tvm.tirx.analysis.undefined_vars(x))
    if not names:
        return [{}]
    constants = _integer_constants(mask, lookup) if mask is not None else []
    if constants and max(abs(c) for c in constants) > LONGEST_SAMPLE:
        return f"a mask over symbolic lengths with a constant past {LONGEST_SAMPLE}, too long to check it at"
    return [{var: n + 2 * k for k, var in enumerate(names)} for n in sample_lengths(constants)]


def _sorted_vars(found) -> list:
    """Shape variables, each once, by name."""
    unique = {}
    for var in found:
        unique.setdefault(var.name, var)
    return [unique[name] for name in sorted(unique)]


def sample_lengths(constants) -> list:
    """Lengths a mask over symbolic lengths is computed at: a few small ones, and ones
    past the largest integer constant of its graph (a window's width, an offset), where
    a pattern that turns at such a constant has turned."""
    past = max((abs(c) for c in constants), default=0)
    small = [1, 2, 3, 5, 8]
    return small + [past + 1, past + 2, 2 * past + 3] if past else small


def _size(length, sizes) -> int:
    if isinstance(length, int):
        return length
    return int(tvm.sym.Analyzer().simplify(substitute(length, sizes)))


def _same(a, b) -> bool:
    if isinstance(a, int) or isinstance(b, int):
        return a == b
    return tvm.sym.Analyzer().can_prove_equal(a, b)


def _integer_constants(op, lookup) -> list:
    """The integer scalars the closed operands of mask op ``op`` are computed with (a
    window's width, an offset; not a fill value such as -1e9)."""
    found = []
    for arg in op.args:
        for _, value in _closed_bindings(arg, lookup) or []:
            for operand in value.args if isinstance(value, relax.Call) else []:
                found += _integer_scalar(operand)
        found += _integer_scalar(arg)
    return found


def _integer_scalar(expr) -> list:
    """``[n]`` where ``expr`` is an integer scalar constant or immediate of the value n."""
    if isinstance(expr, tvm.tirx.IntImm):
        return [int(expr.value)]
    c = _constant(expr)
    return [int(c.item())] if c is not None and c.size == 1 and np.issubdtype(c.dtype, np.integer) else []


def _variant(visible: Optional[np.ndarray], seq_q, seq_kv, softcap):
    """The library's variant whose keys seen are ``visible`` ([sq, skv] bools, or None
    for all), or why none is."""
    if visible is None or visible.all():
        return AttentionVariant("global", softcap=softcap)
    # (the mask broadcasts to the scores: one row for every query, say)
    visible = np.broadcast_to(visible, (seq_q, seq_kv))
    causal = AttentionVariant("causal", causal=True, softcap=softcap)
    if np.array_equal(visible, _seen(causal, seq_q, seq_kv)):
        return causal
    window = AttentionVariant("window", causal=True, window=int(visible[-1].sum()), softcap=softcap)
    if window.window and np.array_equal(visible, _seen(window, seq_q, seq_kv)):
        return window
    return "a mask that is no causal or sliding-window mask aligned to the end of the keys"


def _seen(variant: AttentionVariant, seq_q: int, seq_kv: int) -> np.ndarray:
    """The [sq, skv] keys each query sees under ``variant`` (queries aligned to the end
    of the keys)."""
    rows = np.arange(seq_q)[:, None] + (seq_kv - seq_q)
    keys = np.arange(seq_kv)[None, :]
    seen = keys <= rows if variant.is_causal else np.ones((seq_q, seq_kv), bool)
    return seen & (keys > rows - variant.window) if variant.window is not None else seen


def _mask(op, lookup, values, sizes):
    """The keys seen by the mask op ``op`` ([sq, skv] bools) at the lengths ``sizes``
    (shape variable -> int), or why it is not one."""
    if _is(op, "relax.add"):
        mask = _closed_value(op.args[1], lookup, values, sizes)
        if mask is None:
            mask = _closed_value(op.args[0], lookup, values, sizes)
        if mask is None:
            return "an additive mask not computed from constants and the lengths (a mask tensor input)"
        visible, hidden = mask == 0, mask <= MASKED_BELOW
        if not (visible | hidden).all():
            return "an additive mask with values other than 0 and -inf (a bias)"
        return _plane(visible)
    if _is(op, "relax.where"):
        cond, lhs, rhs = (_closed_value(a, lookup, values, sizes) for a in op.args)
        if cond is None:
            return "a where-mask whose condition is not a constant"
        for fill, keep in ((rhs, True), (lhs, False)):
            if fill is not None and fill.size == 1 and fill.item() <= MASKED_BELOW:
                return _plane(cond.astype(bool) if keep else ~cond.astype(bool))
        return "a where that does not hide keys with -inf"
    return f"score op {op.op.name}"


def _plane(visible: np.ndarray):
    """``visible`` as one [sq, skv] plane (the same for every sequence and head)."""
    planes = visible.reshape(-1, *visible.shape[-2:])
    if not (planes == planes[:1]).all():
        return "a mask that differs between sequences or heads"
    return planes[0]


def _scaled(expr, lookup):
    """(the product of scalar constants ``expr`` is multiplied or divided by, what they
    multiply)."""
    scale = 1.0
    value = _value(expr, lookup)
    while _scalar_factor(value) is not None:
        scale *= _scalar_factor(value)
        expr = _operand(value, lookup)
        value = _value(expr, lookup)
    return scale, expr


def _scalar_factor(call) -> Optional[float]:
    """The factor a ``multiply``/``divide`` by a scalar constant applies, or None."""
    if not (_is(call, "relax.multiply") or _is(call, "relax.divide")):
        return None
    constant = _constant(call.args[1])
    if constant is None and _is(call, "relax.multiply"):
        constant = _constant(call.args[0])
    if constant is None or constant.size != 1:
        return None
    c = float(constant.item())
    return c if _is(call, "relax.multiply") else 1.0 / c


def _operand(call, lookup):
    """The operand of score op ``call`` that carries the scores (not a value of
    constants alone)."""
    if _is(call, "relax.where"):
        return call.args[1] if not _closed(call.args[1], lookup) else call.args[2]
    if len(call.args) == 2 and (_closed(call.args[0], lookup) or _parameter(call.args[0], lookup)):
        return call.args[1]
    return call.args[0]


def _parameter(expr, lookup) -> bool:
    """Whether ``expr`` is a parameter of the function (a variable bound to nothing)."""
    return isinstance(expr, relax.Var) and lookup(expr) is None


def _ungroup(expr, lookup):
    """K or V before a GQA repeat over heads and before casts."""
    expr = _strip(expr, lookup, ("relax.astype",), value=False)
    value = _value(expr, lookup)
    if _is(value, "relax.repeat") and int(value.attrs.axis) == 1:
        expr = value.args[0]
    elif _is(value, "relax.reshape"):
        broadcast = _value(value.args[0], lookup)
        if _is(broadcast, "relax.broadcast_to"):
            expanded = _value(broadcast.args[0], lookup)
            if _is(expanded, "relax.expand_dims") and [int(a) for a in expanded.attrs.axis] == [2]:
                expr = expanded.args[0]
    return _strip(expr, lookup, ("relax.astype",), value=False)


def _unguard(expr, lookup):
    """``softmax`` of ``where(row_alive, softmax, zeros)`` (a guard for fully masked rows,
    which give zeros in the library's kernels too)."""
    if _is(expr, "relax.where"):
        return _value(expr.args[1], lookup)
    return expr


def _strip(expr, lookup, ops, value=True):
    """``expr`` through the calls of ``ops`` (their first operand), as the value bound
    (``value``) or as the expression."""
    current = _value(expr, lookup)
    while isinstance(current, relax.Call) and isinstance(current.op, tvm.ir.Op) and current.op.name in ops:
        expr = current.args[0]
        current = _value(expr, lookup)
    return current if value else expr


def _value(expr, lookup):
    if isinstance(expr, relax.Var):
        bound = lookup(expr)
        return bound if bound is not None else expr
    return expr


def _is(expr, op_name) -> bool:
    return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.name == op_name


def _closed_bindings(expr, lookup):
    """The bindings ``expr``'s value is computed by, in order, where it depends on no
    parameter of the function (constants, ``arange`` and the like); else None."""
    order, seen = [], set()

    def visit(e):
        if isinstance(e, relax.Var) and isinstance(e.ty, tvm.ir.PrimType):
            return True  # a shape variable: the lengths, not a parameter
        if isinstance(e, relax.Var):
            if e in seen:
                return True
            value = lookup(e)
            if value is None or not visit(value):
                return False  # a parameter, or computed from one
            seen.add(e)
            order.append((e, value))
            return True
        if isinstance(e, relax.Call):
            return all(visit(a) for a in e.args)
        if isinstance(e, relax.Tuple):
            return all(visit(f) for f in e.fields)
        return True

    return order if visit(expr) else None


def _closed(expr, lookup) -> bool:
    return _closed_bindings(expr, lookup) is not None


def _closed_value(expr, lookup, values: dict, sizes: dict) -> Optional[np.ndarray]:
    """The value of ``expr`` at the lengths ``sizes`` where it depends on no parameter (a
    mask built of ``arange``, comparisons and constants), computed on the CPU (its
    function compiled once: ``values``); else None."""
    constant = _constant(expr)
    if constant is not None or not isinstance(expr, relax.Var):
        return constant
    if expr not in values:
        values[expr] = _evaluator(expr, lookup)
    evaluate = values[expr]
    return None if evaluate is None else evaluate(sizes)


def _evaluator(target, lookup) -> Optional[Callable]:
    """A function of the lengths (shape variable -> int) computing variable ``target``
    on the CPU, where no parameter feeds it; None where one does or where it uses sizes
    other than the lengths."""
    order = _closed_bindings(target, lookup)
    if order is None:
        return None
    bb = relax.BlockBuilder()
    free = _sorted_vars(v for _, value in order for v in relax.analysis.free_symbolic_vars(value))
    params = [relax.Var("sizes", relax.ShapeType(free))] if free else []
    with bb.function("main", params):
        mapping = {}
        for var, value in order:
            if isinstance(value, relax.Call):
                value = relax.Call(value.op, [mapping.get(a, a) for a in value.args], value.attrs, value.ty_args)
            mapping[var] = bb.emit(value)
        bb.emit_func_output(mapping[target])
    vm = relax.VirtualMachine(tvm.compile(bb.get(), target="llvm"), tvm.cpu())

    def evaluate(lengths: dict) -> Optional[np.ndarray]:
        if any(v not in lengths for v in free):
            return None
        args = [tvm.runtime.ShapeTuple([lengths[v] for v in free])] if free else []
        return vm["main"](*args).numpy()

    return evaluate


def _constant(expr) -> Optional[np.ndarray]:
    return expr.value.numpy() if isinstance(expr, tvm.ir.expr.Constant) and hasattr(expr.value, "numpy") else None


def tensor_shape(expr):
    """``expr``'s shape: ints where static, PrimExprs where symbolic; None where unknown."""
    ty = expr.ty
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    return [int(v) if isinstance(v, tvm.tirx.IntImm) else v for v in ty.shape.values]

