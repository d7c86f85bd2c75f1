"""``DispatchScaledGemm``: an RMSNorm feeding a GEMM, as Relax writes it, on one
tvm-cascade kernel (:mod:`tvm_cascade.schedules.scaled_gemm`) on CUDA, and on ROCm on
the matrix cores (a wavefront's 64 rows where this says a warp's 32).

Matched: ``matmul(rms_norm(x, gamma, axes=[-1]), w)`` with ``w`` as ``[K, N]`` or as
``permute_dims(w)`` of a ``[N, K]`` weight (what ``relax.frontend.nn.Linear`` emits),
the norm also as the ops TVM's torch frontend gives a hand-written or ``torch.nn``
RMSNorm (float32 square-mean and ``rsqrt``, gamma before or after the cast back) and
the norm's output reshaped to rows, float16 inputs (or bfloat16 on sm_90), an output of
the inputs' dtype or float32 (a ``torch.export``ed linear layer's ``out_dtype``), ``x``
of any rank and any number of rows (all axes but the last), static or symbolic (a
prompt's tokens, a decode batch): one kernel serves every length. On an H100 or H200
(sm_90) the kernel is the warp-specialised one
(:mod:`tvm_cascade.schedules.warp_specialized_gemm`: K and N multiples of 8, its TMA
copies read zeros past the last row), up to 16 rows the kernel for few rows
(:mod:`tvm_cascade.schedules.rmsnorm_gemm_skinny`; a symbolic row count gets both,
picked at run time); elsewhere the mma.sync (or MFMA) one, N a multiple of 128 and K
of 64, rows that do not fill its tiles padded inside the kernel, and fewer than 32
static rows are left (a GEMV's work, not a tensor-core tile's). The call becomes
``call_dps_packed`` of the kernel, built when the pass runs (its warp fragments and
templates need tvm-cascade's lowering, not the default TIR pipeline's) and attached to
the module as an external library, as TVM's BYOC backends attach theirs; the norm
itself goes where nothing else reads it. What does not fit is left to the default
lowering and logged.
"""
from __future__ import annotations

import logging

import tvm
from tvm import relax
from tvm.relax.dpl import is_op, rewrite_call, wildcard

from ..ops import cascades
from ..schedules.mma_tiles import WARP
from ..rocm import mfma as matrix_cores
from ..schedules import warp_specialized_gemm
from ..schedules.scaled_gemm import ScaledGemmConfig, build, schedule_scaled_gemm
from ..schedules.warp_specialized import serves_target
from ..schedules.warp_specialized_gemm import WarpSpecializedGemmConfig
from .chain_spec import tensor_shape

logger = logging.getLogger("tvm_cascade.relax")

_PATTERN = is_op("relax.matmul")(wildcard(), wildcard())
_EXTERNAL = "external_mods"


@tvm.transform.module_pass(opt_level=0, name="tvm_cascade.DispatchScaledGemm")
class DispatchScaledGemm:
    """The rewrite of the module docstring, on CUDA and ROCm targets (others: the module
    as it is)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        target = tvm.target.Target.current(allow_none=True)
        if target is None or target.kind.name not in ("cuda", "rocm"):
            return mod
        kernels = {}  # (m, n, k, eps, layout, out dtype, dtype) -> (symbol, runtime module)
        updates = {}
        for gvar, func in mod.functions_items():
            if not isinstance(func, relax.Function):
                continue
            bound = relax.analysis.get_var2val(func)

            def rewrite(matched, matches, bound=bound):
                return _rewrite(matched, matches, bound, target, kernels)

            new = rewrite_call(_PATTERN, rewrite, func)
            if not new.same_as(func):
                updates[gvar] = new
        if not kernels:
            return mod
        for gvar, func in updates.items():
            mod[gvar] = func
        external = list(mod.attrs[_EXTERNAL]) if mod.attrs is not None and _EXTERNAL in mod.attrs else []
        mod = mod.with_attr(_EXTERNAL, external + [lib for _, lib in kernels.values()])
        return relax.transform.DeadCodeElimination()(mod)


def _rewrite(matched, _matches, bound, target, kernels):
    call = _value(matched, bound)
    norm = _norm(call.args[0], bound)
    if norm is None:
        return matched
    x, gamma, eps = norm
    w, transposed = _weight(call.args[1], bound)
    out_dtype = str(call.ty.dtype)
    reason = _refusal(x, gamma, w, transposed, out_dtype, target)
    if reason is not None:
        logger.info("rms_norm -> matmul left to the default lowering: %s", reason)
        return matched
    shape = tensor_shape(x)
    m, k = _rows(shape), shape[-1]
    n = tensor_shape(w)[0 if transposed else 1]
    layout = "nk" if transposed else "kn"
    key = (m if isinstance(m, int) else None, n, k, eps, layout, out_dtype, str(x.ty.dtype))
    if key not in kernels:
        kernels[key] = _kernel(key, target)
    symbol = kernels[key][0]
    rows = relax.op.reshape(x, [m, k]) if len(shape) != 2 else x
    out = relax.call_dps_packed(relax.ExternFunc(symbol), [rows, gamma, w], relax.TensorType([m, n], out_dtype))
    wanted = tensor_shape(call)
    return relax.op.reshape(out, wanted) if len(wanted) != 2 else out


def _value(expr, bound):
    return bound.get(expr, expr) if isinstance(expr, relax.Var) else expr


def _call(expr, bound, op):
    """The call of ``op`` bound to ``expr``, or None."""
    value = _value(expr, bound)
    return value if isinstance(value, relax.Call) and getattr(value.op, "name", "") == op else None


def _norm(lhs, bound):
    """``(x, gamma, eps)`` of the RMSNorm over the last axis that ``lhs`` is, possibly
    reshaped to rows: ``R.nn.rms_norm`` (``relax.frontend.nn``), or the ops TVM's torch
    frontend gives a hand-written or ``torch.nn`` RMSNorm (``x`` cast to float32, its
    square's mean over the last axis plus eps, ``rsqrt``, the product cast back, gamma
    multiplied before or after that cast); None otherwise."""
    reshape = _call(lhs, bound, "relax.reshape")
    if reshape is not None:
        lhs = reshape.args[0]
    norm = _call(lhs, bound, "relax.nn.rms_norm")
    if norm is not None:
        x = norm.args[0]
        rank = len(tensor_shape(x) or ())
        if [int(a) % max(rank, 1) for a in norm.attrs.axes] != [rank - 1]:
            return None
        return x, norm.args[1], float(norm.attrs.epsilon)
    return _decomposed_norm(lhs, bound)


def _decomposed_norm(h, bound):
    scaled = _call(h, bound, "relax.multiply")
    cast = _call(h, bound, "relax.astype")
    if scaled is not None:  # gamma * (x * rsqrt(...)).astype(fp16)
        for gamma, normed in (scaled.args, scaled.args[::-1]):
            inner = _call(normed, bound, "relax.astype")
            found = _normalised(inner.args[0], bound) if inner is not None else None
            if found is not None and _is_vector(gamma):
                return found[0], gamma, found[1]
        return None
    if cast is not None:  # ((x * rsqrt(...)) * gamma.astype(fp32)).astype(fp16)
        product = _call(cast.args[0], bound, "relax.multiply")
        for normed, gamma in (product.args, product.args[::-1]) if product is not None else ():
            up = _call(gamma, bound, "relax.astype")
            found = _normalised(normed, bound)
            if found is not None and up is not None and _is_vector(up.args[0]):
                return found[0], up.args[0], found[1]
    return None


def _normalised(expr, bound):
    """``(x, eps)`` where ``expr`` is ``astype(x, f32) * rsqrt(mean(astype(x, f32)^2,
    last axis, keepdims) + eps)``, else None."""
    product = _call(expr, bound, "relax.multiply")
    if product is None:
        return None
    for xf, factor in (product.args, product.args[::-1]):
        rsqrt = _call(factor, bound, "relax.rsqrt")
        plus = _call(rsqrt.args[0], bound, "relax.add") if rsqrt is not None else None
        if plus is None or _call(xf, bound, "relax.astype") is None:
            continue
        for mean, eps in (plus.args, plus.args[::-1]):
            mean = _call(mean, bound, "relax.mean")
            if mean is None or _scalar(eps) is None or not bool(mean.attrs.keepdims):
                continue
            square = _call(mean.args[0], bound, "relax.power")
            rank = len(tensor_shape(xf) or ())
            if square is None or not square.args[0].same_as(xf):
                continue
            if not _scalar(square.args[1], 2.0) or [int(a) % max(rank, 1) for a in mean.attrs.axis] != [rank - 1]:
                continue
            return _call(xf, bound, "relax.astype").args[0], _scalar(eps)
    return None


def _scalar(expr, equal=None):
    """The value of a scalar constant ``expr`` (equal to ``equal`` if given), else None."""
    data = expr.value.numpy() if isinstance(expr, tvm.ir.expr.Constant) and hasattr(expr.value, "numpy") else None
    if data is None or data.size != 1:
        return None
    value = float(data.reshape(()))
    return value if equal is None or value == equal else None


def _is_vector(expr):
    shape = tensor_shape(expr)
    return shape is not None and len(shape) == 1


def _weight(arg, bound):
    """(the weight tensor, whether it is ``[N, K]``): the operand of a 2-d transpose
    ``permute_dims(w)`` (axes reversed), else the matmul's operand itself as ``[K, N]``."""
    value = _call(arg, bound, "relax.permute_dims")
    if value is not None:
        shape = tensor_shape(value.args[0])
        axes = value.attrs.axes
        if shape is not None and len(shape) == 2 and (axes is None or [int(a) for a in axes] == [1, 0]):
            return value.args[0], True
    return arg, False


def _lanes(target):
    """The rows of a warp's (CUDA) or wavefront's (ROCm) tile."""
    return matrix_cores.LANES if target.kind.name == "rocm" else WARP


def _refusal(x, gamma, w, transposed, out_dtype, target):
    """Why the kernel does not serve this norm and GEMM on ``target``, or None."""
    lanes = _lanes(target)
    shapes = [tensor_shape(t) for t in (x, gamma, w)]
    if any(s is None for s in shapes) or not all(isinstance(d, int) for d in shapes[0][-1:] + shapes[1] + shapes[2]):
        return "K, N and the weights' shapes must be static"
    (xs, gs, ws) = shapes
    dtypes = {str(t.ty.dtype) for t in (x, gamma, w)}
    if len(dtypes) != 1:
        return f"x, gamma and the weight in one dtype, not {sorted(dtypes)}"
    (dtype,) = dtypes
    if not serves_target(target) and (dtype != "float16" or out_dtype not in ("float16", "float32")):
        return "float16 inputs only (the kernel's mma.sync operands), a float16 or float32 output"
    if len(gs) != 1 or len(ws) != 2:
        return "gamma must be 1-d, the weight 2-d"
    m, k = _rows(xs), xs[-1]
    n, wk = (ws[0], ws[1]) if transposed else (ws[1], ws[0])
    if wk != k or gs[0] != k:
        return "the weight's and gamma's K differ from x's"
    if serves_target(target):
        return warp_specialized_gemm.unsupported(n, k, "nk" if transposed else "kn", dtype, out_dtype)
    if isinstance(m, int) and m < lanes:
        return f"{m} rows: fewer than a warp's tile of {lanes}"
    config = ScaledGemmConfig()
    for what, extent, tile in (("N", n, config.cols), ("K", k, config.depth)):
        if extent % tile:
            return f"{what} = {extent} is not a multiple of {tile}"
    return None


def _rows(shape):
    """The rows of ``x``: the product of its leading axes (an int, or a PrimExpr where
    one is symbolic)."""
    rows = 1
    for extent in shape[:-1]:
        rows = rows * extent
    return rows


def _kernel(key, target):
    """(symbol, runtime module) of the kernel for ``key`` (rows None: any number)."""
    m, n, k, eps, layout, out_dtype, dtype = key
    symbol = f"tvm_cascade_rmsnorm_gemm_{'m' if m is None else m}_{n}_{k}_{layout}" + ("_f32" if out_dtype == "float32" else "")
    symbol += "_bf16" if dtype == "bfloat16" else ""
    rows = tvm.tirx.Var("m", "int32") if m is None else m
    if serves_target(target):  # the warp-specialised kernel: any rows, no padding
        func = cascades.rmsnorm_gemm(rows, n, k, eps, dtype, weight_layout=layout, out_dtype=out_dtype)
        func = schedule_scaled_gemm(func, WarpSpecializedGemmConfig()).mod["main"]
        mod = tvm.IRModule({symbol: func.with_attr("global_symbol", symbol)})
        return symbol, build(mod, target).mod
    tile, lanes = ScaledGemmConfig().rows, _lanes(target)
    pad = None if m is not None and m % lanes == 0 else (tile if m is None or m >= tile else lanes)
    func = cascades.rmsnorm_gemm(rows, n, k, eps, "float16", weight_layout=layout, pad_rows=pad, out_dtype=out_dtype)
    padded = -(-m // pad) * pad if m is not None and pad is not None else rows
    config = ScaledGemmConfig.for_rows(padded, mfma=target.kind.name == "rocm")
    func = schedule_scaled_gemm(func, config).mod["main"]
    mod = tvm.IRModule({symbol: func.with_attr("global_symbol", symbol)})
    return symbol, build(mod, target).mod
