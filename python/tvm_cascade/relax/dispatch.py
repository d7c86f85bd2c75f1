"""``DispatchAttention``: the attention of a Relax module on a CUDA target runs the
kernel library's kernels (:mod:`tvm_cascade.library`): ``R.nn.attention`` calls (with
a bias, ``R.nn.attention_bias``, read as a float mask tensor), and
hand-written ``matmul -> score ops -> softmax -> matmul`` chains that
:mod:`.chain_spec` reads as one of the library's variants (static shapes, bhsd).

Each call whose configuration a fast family serves (fp16/bf16, head dims the families
take, a mask the library's variants express or a mask tensor the kernel reads)
becomes a ``call_tir`` of that family's
PrimFunc in the ``bshd`` layout (``R.nn.attention``'s own: ``[batch, seq, heads, dim]``),
its lengths the call's shapes, symbolic or not: one PrimFunc per configuration serves
every length. The family is the one of :func:`tvm_cascade.library.choose` whose range of
query rows holds the call's (a static length up to the decode families' rows takes
theirs; any other the any-length family), and its plan (chunk sizes, persistent blocks)
is computed from the shapes in the graph (scalar arguments). Attention that no fast
family serves is left as it is, with the reason logged on ``tvm_cascade.relax``.

Where ``q``, ``k`` and ``v`` of ``R.nn.attention`` are all transposed from ``[batch,
heads, seq, dim]`` (``torch.export``'s SDPA), the kernel reads the tensors before the
transposes (the ``bhsd`` layout), and where those of a chain are all transposed from
``[batch, seq, heads, dim]`` (a model's projections), the ``bshd`` kernel reads those;
its output's transpose back cancels against the graph's own, and so do the casts a
float32 chain's output meets (to float32 and back).

Causal masks: ``"BottomRight"`` aligns queries to the end of the keys as the library
does, where there are no more queries than keys (provably, or a single query);
``"TopLeft"`` agrees with it where queries and keys are as many. ``window_size=W`` (with
``"BottomRight"``, as TVM's CUTLASS lowering takes it: FlashAttention's left window
``W - 1``) is the library's sliding window of ``W`` keys.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import replace
from typing import Optional

import tvm
from tvm import relax, tirx
from tvm.relax.dpl import is_op, rewrite_call, wildcard

from ..library.families import GenericFused, choose
from ..library.spec import AttentionSpec
from ..ops.variants import AttentionVariant
from .canonicalize import flip_masked_row_guards, fold_batched_matmuls
from .chain_spec import NOT_A_CHAIN, mask_form, read_chain, tensor_shape

logger = logging.getLogger("tvm_cascade.relax")

#: The attribute that names the library family of a dispatched kernel's PrimFunc.
LIBRARY_ATTR = "tvm_cascade.library_family"
_ATTENTION = tvm.ir.Op.get("relax.nn.attention")
_ATTENTION_BIAS = tvm.ir.Op.get("relax.nn.attention_bias")
_MATMUL = tvm.ir.Op.get("relax.matmul")
_PERMUTE = tvm.ir.Op.get("relax.permute_dims")
#: bshd <-> bhsd.
_SWAP_SEQ_HEADS = [0, 2, 1, 3]
#: The ``op_pattern`` of a PrimFunc that FuseOps must leave as it is, neither merged
#: with its neighbours nor rebuilt (``relay.OpPatternKind.kOpaque``).
OPAQUE = 8


@tvm.transform.module_pass(opt_level=0, name="DispatchAttention")
class DispatchAttention:
    """Replace the attention (``R.nn.attention``, hand-written chains) a fast kernel family
    serves on the current CUDA target by calls of the library's kernels (a module for any
    other target, or with nothing served, is returned as it is)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        target = tvm.target.Target.current(allow_none=True)
        if target is None or target.kind.name != "cuda":
            return mod
        # Hand-written chains as the chain reader takes them: torch.export's forms rewritten.
        canonical = flip_masked_row_guards(fold_batched_matmuls(mod))
        dispatcher = _Dispatcher(canonical, target)
        out = dispatcher.run()
        return out if dispatcher.kernels else mod


@relax.expr_functor.mutator
class _Dispatcher(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, target):
        super().__init__(mod)
        self.mod_, self.target = mod, target
        self.kernels = {}  # (spec, family name) -> GlobalVar
        self.masks = {}  # mask variable -> its evaluator (read_chain's)

    def run(self) -> tvm.IRModule:
        for gvar, func in self.mod_.functions_items():
            if isinstance(func, relax.Function):
                func = _cancel_round_trips(self.visit_expr(func))
                self.builder_.update_func(gvar, func)
        mod = self.builder_.get()
        # The transposes a kernel no longer reads, and those cancelled, go.
        return relax.transform.DeadCodeElimination()(mod) if self.kernels else mod

    def visit_call_(self, call):
        call = self.visit_expr_post_order(call)
        if call.op.same_as(_MATMUL):
            return self._chain(call)
        if not (call.op.same_as(_ATTENTION) or call.op.same_as(_ATTENTION_BIAS)):
            return call
        served = serving(call, self.target)
        if isinstance(served, str):
            logger.info("R.nn.attention left as it is: %s", served)
            return call
        spec, family = served
        batch, seq_q, _, _ = _shape(call.args[0])
        plan = _plan(family, spec, batch, seq_q, _shape(call.args[1])[1])
        # R.nn.attention_bias's bias is the kernel's mask tensor, [b, h, sq, skv] in
        # either layout.
        q, k, v, bias = call.args[0], call.args[1], call.args[2], list(call.args[3:])
        # Inputs transposed from bhsd (torch.export's SDPA) are read where they are.
        sources = self._untransposed((q, k, v))
        if sources is not None:
            spec = replace(spec, layout="bhsd")
            out = self.builder_.emit(relax.call_tir(self._kernel(spec, family), [*sources, *bias, *plan],
                                                    sources[0].ty))
            return relax.op.permute_dims(out, _SWAP_SEQ_HEADS)
        return relax.call_tir(self._kernel(spec, family), [q, k, v, *bias, *plan], q.ty)

    def _chain(self, root):
        """The library's kernel in place of the attention chain ending in matmul
        ``root``, or ``root`` where none serves it (the reason logged where the matmul is
        a softmax's)."""
        chain = read_chain(root, self.lookup_binding, self.masks)
        if isinstance(chain, str):
            if chain != NOT_A_CHAIN:
                logger.info("attention chain left as it is: %s", chain)
            return root
        (batch, heads_q, seq_q, head_dim), heads_kv = _shape(chain.q)[:4], _shape(chain.k)[1]
        dtype = str(chain.q.ty.dtype)
        # Q, K and V transposed from bshd (a model's projections) are read where they are.
        sources = self._untransposed((chain.q, chain.k, chain.v))
        bshd = sources is not None
        try:
            spec = AttentionSpec.make(heads_q, heads_kv, head_dim, variant=chain.variant, dtype=dtype,
                                      layout="bshd" if bshd else "bhsd", target=self.target, scale=chain.scale,
                                      mask=chain.mask_tensor)
        except ValueError as err:
            logger.info("attention chain left as it is: %s", err)
            return root
        family = _family(spec, seq_q)
        if isinstance(family, GenericFused):
            logger.info("attention chain left as it is: %s: no fast kernel family serves it", spec.describe())
            return root
        plan = _plan(family, spec, batch, seq_q, _shape(chain.k)[2])
        tensors = sources if bshd else [chain.q, chain.k, chain.v]
        if chain.mask is not None:
            tensors.append(self._four_axes(chain.mask))
        out = relax.call_tir(self._kernel(spec, family), [*tensors, *plan], tensors[0].ty)
        if bshd:
            # (back to bhsd for the chain's users; a transpose of theirs to bshd cancels it)
            out = relax.op.permute_dims(self.builder_.emit(out), _SWAP_SEQ_HEADS)
        if str(root.ty.dtype) == dtype:
            return out
        return relax.op.astype(self.builder_.emit(out), str(root.ty.dtype))

    def _four_axes(self, mask):
        """``mask`` as the kernel reads it, ``[b|1, h|1, sq|1, skv]``: a mask of fewer
        axes broadcasts over the leading ones."""
        shape = list(mask.ty.shape.values)
        if len(shape) == 4:
            return mask
        return self.builder_.emit(relax.op.reshape(mask, [1] * (4 - len(shape)) + shape))

    def _untransposed(self, tensors):
        """The tensors ``tensors`` are transposed from (:meth:`_transposed_from`), or None
        where one is not such a transpose."""
        sources = [self._transposed_from(t) for t in tensors]
        return sources if all(x is not None for x in sources) else None

    def _transposed_from(self, expr):
        """``x`` where ``expr`` is bound to ``permute_dims(x, [0, 2, 1, 3])``, else None."""
        bound = self.lookup_binding(expr) if isinstance(expr, relax.Var) else None
        if isinstance(bound, relax.Call) and bound.op.same_as(_PERMUTE) and _axes(bound) == _SWAP_SEQ_HEADS:
            return bound.args[0]
        return None

    def _kernel(self, spec, family):
        key = (spec, family.name)
        if key not in self.kernels:
            name = f"attention_{family.name}_{spec.describe()}".replace("-", "_")
            func = family.build(spec).with_attrs({
                "global_symbol": name, "tirx.is_scheduled": True, "op_pattern": OPAQUE, LIBRARY_ATTR: family.name,
                "target": family.compile_target(self.target),
            })
            self.kernels[key] = self.builder_.add_func(func, name)
        return self.kernels[key]


def serving(call, target):
    """``(spec, family)``: the library's kernel for ``R.nn.attention`` (or
    ``R.nn.attention_bias``: its bias a float mask tensor) call ``call`` on ``target``,
    or the reason none serves it (a str)."""
    shapes = [_shape(a) for a in call.args[:3]]
    if any(s is None for s in shapes):
        return "q, k and v need 4-d shapes"
    (batch, seq_q, heads_q, head_dim), (_, seq_kv, heads_kv, head_dim_k), (_, _, _, head_dim_v) = shapes
    if not all(isinstance(x, int) for x in (heads_q, heads_kv, head_dim, head_dim_k, head_dim_v)):
        return "heads and head dims must be static"
    if not head_dim == head_dim_k == head_dim_v:
        return f"head dims q {head_dim}, k {head_dim_k}, v {head_dim_v} differ"
    attrs = call.attrs
    causal = _causal(attrs.causal_mask, seq_q, seq_kv)
    if isinstance(causal, str):
        return causal
    window = None if attrs.window_size is None else int(attrs.window_size)
    if window is not None and attrs.causal_mask != "BottomRight":
        # TVM's own lowering of a window (FlashAttention's through CUTLASS) takes it with this mask only
        return f"a sliding window with causal mask {attrs.causal_mask!r}: served with 'BottomRight'"
    variant = AttentionVariant("window" if window else "causal" if causal else "global", causal=causal, window=window)
    dtype = str(call.args[0].ty.dtype)
    scale = float(attrs.scale.value) if attrs.scale is not None else None
    mask = mask_form(call.args[3], (batch, heads_q, seq_q, seq_kv)) if len(call.args) > 3 else None
    if isinstance(mask, str):
        return f"its bias: {mask}"
    try:
        spec = AttentionSpec.make(heads_q, heads_kv, head_dim, variant=variant, dtype=dtype, layout="bshd",
                                  target=target, scale=scale, mask=mask)
    except ValueError as err:
        return str(err)
    family = _family(spec, seq_q)
    if isinstance(family, GenericFused):
        return f"{spec.describe()}: no fast kernel family serves it (see the tvm_cascade.library log)"
    return spec, family


def _plan(family, spec, batch, seq_q, seq_kv) -> list:
    """``family``'s plan for these (static or symbolic) lengths, as the int32 arguments
    that follow the tensors of its PrimFunc."""
    scalars = family.plan(spec, batch, seq_q, seq_kv, tvm.cuda(0))
    return [tirx.IntImm("int32", s) if isinstance(s, int) else tirx.Cast("int32", s) for s in scalars]


def _family(spec, seq_q):
    """The family of :func:`~tvm_cascade.library.choose` whose range holds ``seq_q``
    query rows: a range's family only where the rows are a static count within it."""
    families = choose(spec)
    for family in families:
        if family.queries is None or (isinstance(seq_q, int) and seq_q <= family.queries):
            return family
    return families[-1]


def _causal(mask: Optional[str], seq_q, seq_kv):
    """Whether the call is causal in the library's sense (queries aligned to the end of
    the keys), or why its mask is not that."""
    if mask is None:
        return False
    if mask == "BottomRight":
        if (isinstance(seq_q, int) and seq_q == 1) or _proves(seq_q <= seq_kv):
            return True
        return f"a BottomRight mask over {seq_q} queries and {seq_kv} keys: more queries than keys is not served"
    if mask == "TopLeft":
        static = isinstance(seq_q, int) and isinstance(seq_kv, int)
        if _proves(seq_q == seq_kv if static else tirx.EQ(seq_q, seq_kv)):
            return True
        return f"a TopLeft mask over {seq_q} queries and {seq_kv} keys: served where they are as many"
    return f"causal mask {mask!r}"


def _proves(claim) -> bool:
    """Whether ``claim`` (over shape variables, which are sizes: never negative) holds."""
    if isinstance(claim, bool):
        return claim
    analyzer = tvm.sym.Analyzer()
    sizes = tirx.analysis.undefined_vars(claim)
    if not sizes:
        return analyzer.can_prove(claim)
    with analyzer.constraint_scope(functools.reduce(tirx.And, [v >= 0 for v in sizes])):
        return analyzer.can_prove(claim)


def _shape(expr):
    """``expr``'s 4-d shape (ints where static, PrimExprs where symbolic), or None."""
    shape = tensor_shape(expr)
    return shape if shape is not None and len(shape) == 4 else None


def _axes(call):
    axes = call.attrs.axes
    return None if axes is None else [int(a) for a in axes]


def _cancel_round_trips(func: relax.Function) -> relax.Function:
    """``func`` with the round trips a dispatched kernel leaves read as their start:
    ``astype(x, x's type)``, ``astype(astype(x, wider), x's type)`` (a half output cast
    for a float32 chain, then back), and ``permute_dims(permute_dims(x, a), b)`` that
    compose to the identity (a kernel's output transposed for the call it replaced, then
    back by the graph)."""
    inner = is_op("relax.permute_dims")(wildcard())
    outer = is_op("relax.permute_dims")(inner)

    def transposes(expr, matched):
        first, second = _axes(matched[inner]), _axes(expr)
        if first is not None and second is not None and [first[a] for a in second] == list(range(len(first))):
            return matched[inner].args[0]
        return expr

    up = is_op("relax.astype")(wildcard())
    down = is_op("relax.astype")(up)

    def casts(expr, matched):
        start = matched[up].args[0]
        wider = str(matched[up].ty.dtype) == "float32"
        return start if wider and str(start.ty.dtype) == str(expr.ty.dtype) else expr

    # A cast to the type a value has (a float32 chain's output cast to float32 by the
    # graph) is no cast; round trips of casts may stand between those of transposes.
    def no_cast(expr, matched):
        return expr.args[0] if str(expr.args[0].ty.dtype) == str(expr.ty.dtype) else expr

    func = rewrite_call(down, casts, rewrite_call(up, no_cast, func))
    return rewrite_call(outer, transposes, func)
