"""Helpers shared by the numerics tests of the fusion primitives: tolerances, cached
unfused kernels, closeness checks against the float64 reference and the unfused kernel."""

from __future__ import annotations

import functools

import numpy as np
import tvm
from hypothesis import HealthCheck

from tvm_cascade import ops
from tvm_cascade.ops import testing as tt

DTYPES = ["float32", "float16"]

EPS32 = float(np.finfo(np.float32).eps)

PROPERTY_SETTINGS = dict(
    deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)

TOL = {
    "float32": dict(rtol=1e-4, atol=1e-4),
    "float16": dict(rtol=1e-2, atol=1e-2),
}

TOL_VS_UNFUSED = {
    "float32": dict(rtol=1e-5, atol=1e-5),
    "float16": dict(rtol=1e-2, atol=1e-2),
}

VARIANT_NAMES = sorted(ops.VARIANTS)

WIN0 = ops.AttentionVariant("win0", causal=True, window=0)  # every key masked


def assert_well_formed(mod):
    assert tvm.s_tir.analysis.verify_well_formed(mod["main"], False)


def attention_unfused(shape, variant, dtype, nb):
    return unfused("attention", tuple(shape), (("variant", variant), ("dtype", dtype), ("normalize_before_pv", nb)))


def large_logit_tol(max_abs_score, v):
    # fp32 scores of magnitude |s| carry an absolute rounding error ~ eps*|s|, which
    # moves the softmax weights by that relative amount.
    scale = 4 * EPS32 * max(max_abs_score, 1.0) * float(np.abs(v.astype(np.float64)).max())
    return dict(rtol=1e-3, atol=max(scale, 1e-4))


def loop_names(sch, block):
    return [sch.get(l).loop_var.name for l in sch.get_loops(sch.get_sblock(block))]


def mean_v(v, shape):
    group = shape[1] // shape[2]
    mean = np.repeat(v.astype(np.float64).mean(axis=2, keepdims=True), group, axis=1)
    return np.broadcast_to(mean, (shape[0], shape[1], shape[3], shape[5]))


@functools.lru_cache(maxsize=None)

def unfused(builder: str, args: tuple, kwargs: tuple):
    """(unfused PrimFunc, compiled executable) of ``ops.<builder>(*args, **kwargs)``,
    compiled once per configuration."""
    func = getattr(ops, builder)(*args, **dict(kwargs))
    return func, tt.compile_prim_func(func)


def check_close(out, expected, unfused_out, dtype, tol=None, tol_unfused=None, what="fused"):
    out64 = np.asarray(out).astype(np.float64)
    assert np.all(np.isfinite(out64)), f"{what} output has NaN/inf"
    np.testing.assert_allclose(out64, expected, err_msg=f"{what} vs reference", **(tol or TOL[dtype]))
    np.testing.assert_allclose(
        out64, np.asarray(unfused_out).astype(np.float64), err_msg=f"{what} vs unfused",
        **(tol_unfused or TOL_VS_UNFUSED[dtype]),
    )
