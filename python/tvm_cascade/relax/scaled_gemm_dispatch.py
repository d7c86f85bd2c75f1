"""``DispatchScaledGemm``: an RMSNorm feeding a GEMM, as Relax writes it, on one
tvm-cascade kernel (:mod:`tvm_cascade.schedules.scaled_gemm`) on CUDA.

Matched: ``matmul(rms_norm(x, gamma, axes=[-1]), w)`` with ``w`` as ``[K, N]`` or as
``permute_dims(w)`` of a ``[N, K]`` weight (what ``relax.frontend.nn.Linear`` emits),
float16 throughout, N a multiple of 128 and K of 64, ``x`` of any rank whose rows (all
axes but the last) number 32 or more, or a symbolic number (a prompt's tokens): rows
that do not fill the kernel's tiles are padded inside the kernel (one kernel serves
every length). Fewer than 32 static rows (decode) are left: a GEMV's work, not
a tensor-core tile's. The call becomes ``call_dps_packed`` of the kernel,
built when the pass runs (its warp fragments need tvm-cascade's lowering, not the
default TIR pipeline's) and attached to the module as an external library, as TVM's
BYOC backends attach theirs; the norm itself goes where nothing else reads it. What
does not fit is left to the default lowering and logged.
"""
from __future__ import annotations

import logging

import tvm
from tvm import relax
from tvm.relax.dpl import is_op, rewrite_call, wildcard

from ..cuda import tensor_cores
from ..ops import cascades
from ..schedules.mma_tiles import WARP
from ..schedules.scaled_gemm import ScaledGemmConfig, schedule_scaled_gemm
from .chain_spec import tensor_shape

logger = logging.getLogger("tvm_cascade.relax")

_X, _GAMMA = wildcard(), wildcard()
_NORM = is_op("relax.nn.rms_norm")(_X, _GAMMA)
_PATTERN = is_op("relax.matmul")(_NORM, wildcard())
_EXTERNAL = "external_mods"


@tvm.transform.module_pass(opt_level=0, name="tvm_cascade.DispatchScaledGemm")
class DispatchScaledGemm:
    """The rewrite of the module docstring, on CUDA targets (others: the module as it is)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        target = tvm.target.Target.current(allow_none=True)
        if target is None or target.kind.name != "cuda":
            return mod
        kernels = {}  # (m, n, k, eps, layout) -> (symbol, runtime module)
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


def _rewrite(matched, matches, bound, target, kernels):
    call = bound.get(matched, matched) if isinstance(matched, relax.Var) else matched
    norm = bound.get(call.args[0], call.args[0])
    x, gamma = matches[_X], matches[_GAMMA]
    w, transposed = _weight(call.args[1], bound)
    reason = _refusal(norm, x, gamma, w, transposed)
    if reason is not None:
        logger.info("rms_norm -> matmul left to the default lowering: %s", reason)
        return matched
    shape = tensor_shape(x)
    m, k = _rows(shape), shape[-1]
    n = tensor_shape(w)[0 if transposed else 1]
    eps, layout = float(norm.attrs.epsilon), "nk" if transposed else "kn"
    key = (m if isinstance(m, int) else None, n, k, eps, layout)
    if key not in kernels:
        kernels[key] = _kernel(key, target)
    symbol = kernels[key][0]
    rows = relax.op.reshape(x, [m, k]) if len(shape) != 2 else x
    out = relax.call_dps_packed(relax.ExternFunc(symbol), [rows, gamma, w], relax.TensorType([m, n], "float16"))
    return relax.op.reshape(out, [*shape[:-1], n]) if len(shape) != 2 else out


def _weight(arg, bound):
    """(the weight tensor, whether it is ``[N, K]``): the operand of a 2-d transpose
    ``permute_dims(w)`` (axes reversed), else the matmul's operand itself as ``[K, N]``."""
    value = bound.get(arg, arg) if isinstance(arg, relax.Var) else arg
    if isinstance(value, relax.Call) and getattr(value.op, "name", "") == "relax.permute_dims":
        shape = tensor_shape(value.args[0])
        axes = value.attrs.axes
        if shape is not None and len(shape) == 2 and (axes is None or [int(a) for a in axes] == [1, 0]):
            return value.args[0], True
    return arg, False


def _refusal(norm, x, gamma, w, transposed):
    """Why the kernel does not serve this norm and GEMM, or None."""
    axes = [int(a) for a in norm.attrs.axes]
    shapes = [tensor_shape(t) for t in (x, gamma, w)]
    if any(s is None for s in shapes) or not all(isinstance(d, int) for d in shapes[0][-1:] + shapes[1] + shapes[2]):
        return "K, N and the weights' shapes must be static"
    (xs, gs, ws) = shapes
    if any(str(t.ty.dtype) != "float16" for t in (x, gamma, w)):
        return "float16 only (the kernel's mma.sync operands)"
    if axes not in ([-1], [len(xs) - 1]) or len(gs) != 1 or len(ws) != 2:
        return "the norm must be over the last axis, the weight 2-d"
    m, k = _rows(xs), xs[-1]
    n, wk = (ws[0], ws[1]) if transposed else (ws[1], ws[0])
    if wk != k or gs[0] != k:
        return "the weight's and gamma's K differ from x's"
    if isinstance(m, int) and m < WARP:
        return f"{m} rows: fewer than a warp's tile of {WARP}"
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
    m, n, k, eps, layout = key
    symbol = f"tvm_cascade_rmsnorm_gemm_{'m' if m is None else m}_{n}_{k}_{layout}"
    rows = tvm.tirx.Var("m", "int32") if m is None else m
    tile = ScaledGemmConfig().rows
    pad = None if m is not None and m % WARP == 0 else (tile if m is None or m >= tile else WARP)
    func = cascades.rmsnorm_gemm(rows, n, k, eps, "float16", weight_layout=layout, pad_rows=pad)
    func = schedule_scaled_gemm(func).mod["main"]
    mod = tvm.IRModule({symbol: func.with_attr("global_symbol", symbol)})
    return symbol, tensor_cores.build(mod, target).mod
