"""A Relax model's loss, log-sum-exp and router as one fused kernel each.

:class:`DispatchRowChains` rewrites, before legalisation, these cascades in the forms
``torch.export`` gives ``F.cross_entropy(x.float(), labels, reduction="none")`` and
``torch.topk(torch.softmax(x.float(), -1), k)``, and a log-sum-exp written by hand:

* cross-entropy, ``negative(squeeze(gather_elements(log_softmax(x), expand_dims(labels,
  1), axis=1), 1))``, becomes one call of :func:`~tvm_cascade.ops.cascades.cross_entropy`
  (what follows it, as the frontend's ``where`` for an ignored index, stays); so does
  ``nll_loss(log_softmax(x), labels)`` (no class weights; any reduction), the ignored
  index read as class 0 and its loss zeroed around the call, as ``nll_loss`` does;
* MoE routing's top-k, ``topk(softmax(x), k)`` over the last axis with the largest
  first, becomes one call of :func:`~tvm_cascade.ops.cascades.moe_routing`'s top-k
  outputs (the softmax stays where something else reads it);
* log-sum-exp as it is written by hand, ``log(sum(exp(x - m))) + squeeze(m)`` with
  ``m = max(x, keepdims=True)`` (either order of the sum), becomes one call of
  :func:`~tvm_cascade.ops.cascades.logsumexp` (TVM's default lowering of it fails on
  CUDA: dlight's GEMV rule asserts).

``x`` is a 2-d float32 tensor, or the float32 cast of a half one, which the kernel then
reads as it is; the number of rows may be symbolic, the row length must be static. On
CUDA and ROCm the kernel is :func:`~tvm_cascade.schedules.rows.schedule_rows`' one block
per row. On CPUs nothing is rewritten unless asked (``cpu=True``: the chain fused by the
rolling update, the rows a parallel loop): there the fused cross-entropy and log-sum-exp
measured about twice as slow as TVM's default lowering (256 x 32000 fp16 logits on two
cores: 105 ms against 56). On other GPUs nothing is rewritten. Anything else is left as
it is.
"""
from __future__ import annotations

import logging

import tvm
from tvm import relax
from tvm.relax.dpl import is_op, rewrite_call, wildcard

from ..ops import cascades
from ..schedules.rows import plan_chain, row_chains, schedule_rows
from ..transform import fuse_cascaded_reductions
from .chain_spec import tensor_shape
from .dispatch import OPAQUE

logger = logging.getLogger("tvm_cascade.relax")

_HALF = ("float16", "bfloat16")
#: The GPU target kinds whose kernels :func:`~tvm_cascade.schedules.rows.schedule_rows` binds.
_ROW_GPUS = ("cuda", "rocm")


@tvm.transform.module_pass(opt_level=0, name="tvm_cascade.DispatchRowChains")
class DispatchRowChains:
    """Replace a Relax module's cross-entropy, MoE top-k and log-sum-exp (module
    docstring) by calls of fused kernels for the current target: CUDA or ROCm, or a CPU
    with ``cpu=True``."""

    def __init__(self, cpu: bool = False):
        self.cpu = cpu

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        target = tvm.target.Target.current(allow_none=True)
        if target is None or target.kind.name not in _ROW_GPUS + (("llvm",) if self.cpu else ()):
            return mod
        rewriter = _Rewriter(relax.BlockBuilder(mod), target)
        for gvar, func in list(mod.functions_items()):
            if isinstance(func, relax.Function):
                for pattern, rewrite in ((_CROSS_ENTROPY, rewriter.cross_entropy), (_NLL_LOSS, rewriter.nll_loss),
                                         (_TOP_K, rewriter.top_k), (_LOG_SUM_EXP, rewriter.log_sum_exp)):
                    rewriter.bound = relax.analysis.get_var2val(func)
                    func = rewrite_call(pattern, rewrite, func)
                rewriter.builder.update_func(gvar, func)
        if not rewriter.kernels:
            return mod
        return relax.transform.DeadCodeElimination()(rewriter.builder.get())


_X = wildcard()
_LABELS = wildcard()
_LOG_SOFTMAX = is_op("relax.nn.log_softmax")(_X)
_PICKED = is_op("relax.gather_elements")(_LOG_SOFTMAX, is_op("relax.expand_dims")(_LABELS))
_CROSS_ENTROPY = is_op("relax.negative")(is_op("relax.squeeze")(_PICKED))
_NLL_LOSS = is_op("relax.nn.nll_loss")(_LOG_SOFTMAX, _LABELS)
_TOP_K = is_op("relax.topk")(is_op("relax.nn.softmax")(_X))
_MAX = is_op("relax.max")(_X)
_SUM = is_op("relax.sum")(is_op("relax.exp")(is_op("relax.subtract")(_X, _MAX)))
_LOG = is_op("relax.log")(_SUM)
_SQUEEZED = is_op("relax.squeeze")(_MAX)
_LOG_SUM_EXP = is_op("relax.add")(_LOG, _SQUEEZED) | is_op("relax.add")(_SQUEEZED, _LOG)


class _Rewriter:
    def __init__(self, builder, target):
        self.builder, self.target = builder, target
        self.kernels = {}  # (workload, ...) -> the kernel's GlobalVar
        self.bound = {}  # variable -> its value, in the function rewritten

    def cross_entropy(self, matched, matches):
        call = self._value(matched)
        log_softmax, picked, squeeze = (self._value(e) for e in (matches[_LOG_SOFTMAX], matches[_PICKED], call.args[0]))
        labels = matches[_LABELS]
        x, rows, n = self._rows(matches[_X], log_softmax.attrs.axis)
        if x is None or int(picked.attrs.axis) not in (1, -1) or list(squeeze.attrs.axis or [1]) not in ([1], [-1]):
            return matched
        if not _labels_of_rows(labels):
            return matched
        return self._cross_entropy_call(x, labels, str(labels.ty.dtype), rows, n)

    def nll_loss(self, matched, matches):
        call = self._value(matched)
        labels = matches[_LABELS]
        x, rows, n = self._rows(matches[_X], self._value(matches[_LOG_SOFTMAX]).attrs.axis)
        reduction = str(call.attrs.reduction)
        if x is None or not _labels_of_rows(labels) or reduction not in ("none", "mean", "sum"):
            return matched
        kept = relax.op.not_equal(labels, relax.const(int(call.attrs.ignore_index), str(labels.ty.dtype)))
        safe = relax.op.where(kept, labels, relax.const(0, str(labels.ty.dtype)))
        picked = self._cross_entropy_call(x, safe, str(labels.ty.dtype), rows, n)
        loss = relax.op.where(kept, picked, relax.const(0.0, "float32"))
        if reduction == "none":
            return loss
        if reduction == "sum":
            return relax.op.sum(loss)
        return relax.op.divide(relax.op.sum(loss), relax.op.sum(relax.op.astype(kept, "float32")))

    def _cross_entropy_call(self, x, labels, index, rows, n):
        dtype = str(x.ty.dtype)
        gvar = self._kernel(("cross_entropy", n, dtype, index), lambda r: cascades.cross_entropy(r, n, dtype, index))
        return relax.call_tir(gvar, [x, labels], relax.TensorType([rows], "float32"))

    def top_k(self, matched, matches):
        call = self._value(matched)
        attrs = call.attrs
        softmax = self._value(call.args[0])
        x, rows, n = self._rows(matches[_X], softmax.attrs.axis)
        if x is None or int(attrs.axis) not in (1, -1) or not bool(attrs.largest) or attrs.ret_type != "both":
            return matched
        k, index = int(attrs.k), str(attrs.dtype)
        gvar = self._kernel(
            ("moe_routing", n, k, str(x.ty.dtype), index),
            lambda r: cascades.moe_routing(r, n, k, str(x.ty.dtype), index_dtype=index, with_prob=False),
        )
        out = [relax.TensorType([rows, k], "float32"), relax.TensorType([rows, k], index)]
        return relax.call_tir(gvar, [x], out)

    def log_sum_exp(self, matched, matches):
        maximum, total = self._value(matches[_MAX]), self._value(matches[_SUM])
        squeeze = self._value(matches[_SQUEEZED])
        x, rows, n = self._rows(matches[_X], _one_axis(maximum.attrs.axis))
        if x is None or _one_axis(total.attrs.axis) not in (1, -1) or not bool(maximum.attrs.keepdims):
            return matched
        if bool(total.attrs.keepdims) or list(squeeze.attrs.axis or [1]) not in ([1], [-1]):
            return matched
        gvar = self._kernel(("logsumexp", n, str(x.ty.dtype)), lambda r: cascades.logsumexp(r, n, str(x.ty.dtype)))
        return relax.call_tir(gvar, [x], relax.TensorType([rows], "float32"))

    def _rows(self, x, axis):
        """(the tensor the kernel reads, its rows, its row length) of the chain's float32
        input ``x`` reduced over ``axis``, or (None, None, None) where no kernel serves it."""
        source = x
        value = self._value(x)
        if isinstance(value, relax.Call) and value.op.name == "relax.astype" and str(value.args[0].ty.dtype) in _HALF:
            source = value.args[0]
        shape = tensor_shape(x)
        if str(x.ty.dtype) != "float32" or shape is None or len(shape) != 2 or int(axis) not in (1, -1):
            return None, None, None
        if not isinstance(shape[1], int):
            logger.info("a row chain over rows of a symbolic length left as it is")
            return None, None, None
        return source, shape[0], shape[1]

    def _value(self, expr):
        """The value bound to ``expr`` where it is a variable, else ``expr``."""
        return self.bound.get(expr, expr) if isinstance(expr, relax.Var) else expr

    def _kernel(self, key, build):
        """The GlobalVar of the kernel of ``key`` (one per workload, its rows symbolic)."""
        if key not in self.kernels:
            name = "_".join(str(part) for part in key)
            func = _schedule(build(tvm.tirx.Var("rows", "int64")), self.target)
            func = func.without_attr("global_symbol").with_attrs({"tirx.is_scheduled": True, "op_pattern": OPAQUE})
            self.kernels[key] = self.builder.add_func(func, name)
        return self.kernels[key]


def _labels_of_rows(labels) -> bool:
    """Whether ``labels`` is a 1-d integer tensor (one class per row)."""
    shape = tensor_shape(labels)
    return shape is not None and len(shape) == 1 and "int" in str(labels.ty.dtype)


def _one_axis(axes) -> int:
    """The one axis of a reduction's ``axis`` attribute, or 0 (not the rows' axis)."""
    return int(axes[0]) if axes is not None and len(axes) == 1 else 0


def _schedule(func, target):
    sch = tvm.s_tir.Schedule(func)
    if target.kind.name in _ROW_GPUS:
        (chain,) = row_chains(func)
        schedule_rows(sch, **plan_chain(func, chain))
    else:
        fuse_cascaded_reductions(sch, method="rolling")
        rows = sch.get_loops(sch.get_sblock("max"))[0]
        sch.parallel(rows)
    return sch.mod["main"]
