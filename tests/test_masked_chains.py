"""Both primitives on chains shaped like TOPI's: exponentials masked to 0 (so a tile or
chunk can have a sum of exactly 0), normalisation before P·V, and intermediates several
blocks deep that also feed blocks left outside the loop."""
import numpy as np
import pytest
import tvm
from tvm import te, tirx

import tvm_cascade  # noqa: F401  (adds the primitives)
from tvm_cascade.ops import testing as tt

ROWS, KEYS, DIM = 8, 24, 4


def _softmax_pv(with_pv: bool):
    """Row i sees keys j >= i; masked exponentials are 0. Blocks: max, shifted, exp,
    sum, prob (= exp / sum) and, if ``with_pv``, pv (= sum_j prob * V)."""
    S = te.placeholder((ROWS, KEYS), "float32", name="S")
    V = te.placeholder((KEYS, DIM), "float32", name="V")
    r = [te.reduce_axis((0, KEYS), f"r{k}") for k in range(3)]
    m = te.compute((ROWS,), lambda i: te.max(S[i, r[0]], axis=r[0]), name="max")
    shifted = te.compute((ROWS, KEYS), lambda i, j: S[i, j] - m[i], name="shifted")
    e = te.compute(
        (ROWS, KEYS),
        lambda i, j: tirx.Select(j >= i, te.exp(shifted[i, j]), tirx.const(0.0, "float32")),
        name="exp",
    )
    l = te.compute((ROWS,), lambda i: te.sum(e[i, r[1]], axis=r[1]), name="sum")
    p = te.compute((ROWS, KEYS), lambda i, j: e[i, j] / l[i], name="prob")
    if not with_pv:
        return te.create_prim_func([S, p])
    o = te.compute((ROWS, DIM), lambda i, d: te.sum(p[i, r[2]] * V[r[2], d], axis=r[2]), name="pv")
    return te.create_prim_func([S, V, o])


def _reference(s, v=None):
    s = s.astype(np.float64)
    # Row i's max runs over every key, masked or not, as the TIR's does.
    e = np.where(np.arange(KEYS)[None, :] >= np.arange(ROWS)[:, None], np.exp(s - s.max(1, keepdims=True)), 0)
    p = e / e.sum(1, keepdims=True)
    return p if v is None else p @ v.astype(np.float64)


def _fuse(func, primitive, blocks):
    sch = tvm.s_tir.Schedule(func)
    loop = sch.get_loops(sch.get_sblock("max"))[-1]
    factors = [None, 4] if primitive == "rolling_update" else [6, None]
    key_loop = sch.split(loop, factors)[0]
    if primitive == "split_k_update":
        sch.split_k_update(sch.get_sblock("max"), key_loop)
    for name in blocks:
        getattr(sch, primitive)(sch.get_sblock(name), key_loop)
    return sch.mod["main"]


@pytest.mark.parametrize("primitive", ["rolling_update", "split_k_update"])
def test_deep_intermediates_feed_outside_blocks_complete_values(primitive):
    # Only the sum moves: shifted and exp run under the loop with partial maxima, and
    # prob, left outside, must read complete copies of both.
    func = _fuse(_softmax_pv(with_pv=False), primitive, ["sum"])
    names = tt.block_names(func)
    assert "shifted_complete" in names and "exp_complete" in names
    s = np.random.default_rng(0).standard_normal((ROWS, KEYS)).astype("float32") * 4
    (out,) = tt.run_prim_func(func, [s])
    np.testing.assert_allclose(out, _reference(s), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("primitive", ["rolling_update", "split_k_update"])
def test_fully_masked_tiles_do_not_poison_a_normalised_pv(primitive):
    # Row 7 masks keys 0..6: its first tile (and first chunk) sums to 0, so its
    # normalised P·V there is 0/0; the repair weights it by that 0 sum and drops it.
    func = _fuse(_softmax_pv(with_pv=True), primitive, ["sum", "pv"])
    rng = np.random.default_rng(1)
    s = rng.standard_normal((ROWS, KEYS)).astype("float32") * 4
    v = rng.standard_normal((KEYS, DIM)).astype("float32")
    (out,) = tt.run_prim_func(func, [s, v])
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, _reference(s, v), rtol=1e-5, atol=1e-5)
