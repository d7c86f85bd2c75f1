"""``Schedule.accumulate_in_place``: a tile's reduction started from the running value."""
import numpy as np
import pytest
import tvm
import tvm_cascade  # noqa: F401
import tvm_ffi
from tvm.s_tir.stmt import SBlock
from tvm.script import tirx as T

from tvm_cascade import FusionError
from tvm_cascade import trace as cascade_trace
from tvm_cascade.ops.testing import run_prim_func
from tvm_cascade.primitives.ir import copy_block


@T.prim_func(s_tir=True)
def _folds(E: T.Buffer((4, 32), "float32"), V: T.Buffer((32, 8), "float32"),
           C: T.Buffer((2, 4), "float32"), O: T.Buffer((4, 8), "float32")):
    O_tile = T.sblock_alloc_buffer((2, 4, 8))
    for i, d in T.grid(4, 8):
        with T.sblock("pv_init"):
            vi, vd = T.axis.remap("SS", [i, d])
            O[vi, vd] = T.float32(0)
    for t in range(2):
        for i, d in T.grid(4, 8):
            with T.sblock("pv_tile_init"):
                vi, vd, vt = T.axis.remap("SSS", [i, d, t])
                O_tile[vt, vi, vd] = T.float32(0)
        for i, d, r in T.grid(4, 8, 16):
            with T.sblock("pv_tile_update"):
                vi, vd, vt, vr = T.axis.remap("SSSR", [i, d, t, r])
                O_tile[vt, vi, vd] = O_tile[vt, vi, vd] + E[vi, vt * 16 + vr] * V[vt * 16 + vr, vd]
        for i, d in T.grid(4, 8):
            with T.sblock("pv"):
                vi, vd, vt = T.axis.remap("SSR", [i, d, t])
                O[vi, vd] = O[vi, vd] * C[vt, vi] + O_tile[vt, vi, vd]


@T.prim_func(s_tir=True)
def _in_place(E: T.Buffer((4, 32), "float32"), V: T.Buffer((32, 8), "float32"),
              C: T.Buffer((2, 4), "float32"), O: T.Buffer((4, 8), "float32")):
    O_tile = T.sblock_alloc_buffer((2, 4, 8))
    for i, d in T.grid(4, 8):
        with T.sblock("pv_init"):
            vi, vd = T.axis.remap("SS", [i, d])
            O[vi, vd] = T.float32(0)
    for t in range(2):
        for i, d in T.grid(4, 8):
            with T.sblock("pv_tile_init"):
                vi, vd, vt = T.axis.remap("SSS", [i, d, t])
                O_tile[vt, vi, vd] = O[vi, vd] * C[vt, vi]
        for i, d, r in T.grid(4, 8, 16):
            with T.sblock("pv_tile_update"):
                vi, vd, vt, vr = T.axis.remap("SSSR", [i, d, t, r])
                O_tile[vt, vi, vd] = O_tile[vt, vi, vd] + E[vi, vt * 16 + vr] * V[vt * 16 + vr, vd]
        for i, d in T.grid(4, 8):
            with T.sblock("pv"):
                vi, vd, vt = T.axis.remap("SSR", [i, d, t])
                O[vi, vd] = O_tile[vt, vi, vd]


def test_accumulate_in_place_gives_the_expected_ir_stays_exact_and_replays():
    sch = tvm.s_tir.Schedule(_folds)
    sch.accumulate_in_place(sch.get_sblock("pv"), sch.get_sblock("pv_tile_init"))
    tvm.ir.assert_structural_equal(sch.mod["main"], _in_place.with_attr("global_symbol", "_folds"))
    rng = np.random.default_rng(5)
    e, v = rng.standard_normal((4, 32)).astype("float32"), rng.standard_normal((32, 8)).astype("float32")
    c = rng.uniform(0.1, 1.0, (2, 4)).astype("float32")
    out, = run_prim_func(sch.mod["main"], [e, v, c])
    e64, v64, c64 = e.astype("float64"), v.astype("float64"), c.astype("float64")
    expected = (e64[:, :16] @ v64[:16]) * c64[1][:, None] + e64[:, 16:] @ v64[16:]
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    as_json = cascade_trace.trace_to_json(sch.trace, remove_postproc=True)
    again = tvm.s_tir.Schedule(_folds)
    cascade_trace.apply_json_to_schedule(as_json, again)
    tvm.ir.assert_structural_equal(again.mod, sch.mod)


def _variant(change):
    """``_folds`` with the blocks for which ``change(block)`` returns a block replaced."""
    def visit(block):
        return change(block) or block

    return tvm_ffi.structural_map(_folds, (SBlock, visit))


def test_accumulate_in_place_refuses_what_would_change_the_result():
    def refused(func, steps, block, init, match):
        sch = tvm.s_tir.Schedule(func)
        for step in steps:
            step(sch)
        before = sch.mod
        with pytest.raises(FusionError, match=match):
            sch.accumulate_in_place(sch.get_sblock(block), sch.get_sblock(init))
        tvm.ir.assert_structural_equal(sch.mod, before)

    in_place = lambda sch: sch.accumulate_in_place(sch.get_sblock("pv"), sch.get_sblock("pv_tile_init"))
    refused(_folds, [in_place], "pv", "pv_tile_init", r"block 'pv' does not end in a fold X = f\(a, Y\[...\]\)")
    refused(_folds, [], "pv", "pv_init", r"O_tile, which block 'pv' folds in, is not the result of one reduction")
    # A start other than the reducer's identity is part of the tile's result.
    from_one = _variant(
        lambda b: copy_block(b, body=tvm.tirx.BufferStore(b.body.buffer, T.float32(1), b.body.indices))
        if b.name_hint == "pv_tile_init" else None
    )
    refused(from_one, [], "pv", "pv_tile_init", r"block 'pv_tile_init' does not set O_tile to the identity of its sum")
    # The running value must hold before the first tile, not be set by the fold itself.
    with_init = _variant(
        lambda b: copy_block(b, init=tvm.tirx.BufferStore(b.body.buffer, T.float32(0), b.body.indices))
        if b.name_hint == "pv" else None
    )
    refused(with_init, [], "pv", "pv_tile_init", r"block 'pv' has an initial value; decompose_reduction it first")
