"""hoist_independent: exact IR, trace replay, refusal; the fusion it makes possible."""
import numpy as np
import pytest
import tvm
import tvm_cascade  # noqa: F401
from tvm.script import tirx as T

from tvm_cascade import FusionError
from tvm_cascade.ops import testing

from test_rolling_update import _assert_trace_roundtrip


# fmt: off
@T.prim_func(s_tir=True)
def transposed_late(S: T.Buffer((8, 16), "float32"), V: T.Buffer((16, 8), "float32"), O: T.Buffer((8, 8), "float32")):
    m = T.sblock_alloc_buffer((8,))
    Vt = T.sblock_alloc_buffer((8, 16))
    for i, j in T.grid(8, 16):
        with T.sblock("max"):
            vi, vj = T.axis.remap("SR", [i, j])
            with T.init():
                m[vi] = T.min_value("float32")
            m[vi] = T.max(m[vi], S[vi, vj])
    for d, j in T.grid(8, 16):
        with T.sblock("transpose"):
            vd, vj = T.axis.remap("SS", [d, j])
            Vt[vd, vj] = V[vj, vd]
    for i, d, j in T.grid(8, 8, 16):
        with T.sblock("pv"):
            vi, vd, vj = T.axis.remap("SSR", [i, d, j])
            with T.init():
                O[vi, vd] = T.float32(0)
            O[vi, vd] = O[vi, vd] + T.exp(S[vi, vj] - m[vi]) * Vt[vd, vj]


@T.prim_func(s_tir=True)
def transposed_first(S: T.Buffer((8, 16), "float32"), V: T.Buffer((16, 8), "float32"), O: T.Buffer((8, 8), "float32")):
    m = T.sblock_alloc_buffer((8,))
    Vt = T.sblock_alloc_buffer((8, 16))
    for d, j in T.grid(8, 16):
        with T.sblock("transpose"):
            vd, vj = T.axis.remap("SS", [d, j])
            Vt[vd, vj] = V[vj, vd]
    for i, j in T.grid(8, 16):
        with T.sblock("max"):
            vi, vj = T.axis.remap("SR", [i, j])
            with T.init():
                m[vi] = T.min_value("float32")
            m[vi] = T.max(m[vi], S[vi, vj])
    for i, d, j in T.grid(8, 8, 16):
        with T.sblock("pv"):
            vi, vd, vj = T.axis.remap("SSR", [i, d, j])
            with T.init():
                O[vi, vd] = T.float32(0)
            O[vi, vd] = O[vi, vd] + T.exp(S[vi, vj] - m[vi]) * Vt[vd, vj]
# fmt: on


def test_exact_ir_and_trace():
    sch = tvm.s_tir.Schedule(transposed_late, debug_mask="all")
    sch.hoist_independent(sch.get_sblock("max"))
    tvm.ir.assert_structural_equal(
        sch.mod["main"].without_attr("global_symbol"), transposed_first.without_attr("global_symbol")
    )
    assert "sch.hoist_independent(block=b0)" in str(sch.trace)
    _assert_trace_roundtrip(sch, transposed_late)


def test_makes_the_rolling_update_possible():
    """P·V reads the transpose, which came after the max's loop: refused before the
    hoist, fused after it, and computing what numpy does."""
    sch = tvm.s_tir.Schedule(transposed_late, debug_mask="all")
    j0, _ = sch.split(sch.get_loops(sch.get_sblock("max"))[-1], [None, 4])
    with pytest.raises(FusionError, match="its input block 'transpose' comes after loop 'j_0'"):
        sch.rolling_update(sch.get_sblock("pv"), j0)
    sch.hoist_independent(sch.get_sblock("max"))
    sch.rolling_update(sch.get_sblock("pv"), j0)
    rng = np.random.default_rng(0)
    s, v = rng.standard_normal((8, 16)).astype("float32"), rng.standard_normal((16, 8)).astype("float32")
    (out,) = testing.run_prim_func(sch.mod["main"], [s, v])
    np.testing.assert_allclose(out, np.exp(s - s.max(1, keepdims=True)) @ v, rtol=1e-5, atol=1e-5)


def test_refuses_a_root_statement_that_is_no_single_block_nest():
    sch = tvm.s_tir.Schedule(transposed_late, debug_mask="all")
    sch.compute_at(sch.get_sblock("transpose"), sch.get_loops(sch.get_sblock("pv"))[1])
    before, trace_len = sch.mod, len(sch.trace.insts)
    max_rv = sch.get_sblock("max")
    with pytest.raises(FusionError, match="hoist_independent: block 'max': top-level statement is not a loop nest"):
        sch.hoist_independent(max_rv)
    tvm.ir.assert_structural_equal(sch.mod, before)
    assert len(sch.trace.insts) == trace_len + 1  # the get_sblock
