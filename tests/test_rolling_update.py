"""rolling_update: exact IR, errors that leave the schedule alone, traces."""
import numpy as np
import pytest
import tvm
import tvm_cascade
from tvm.script import tirx as T

from tvm_cascade import FusionError, ops
from tvm_cascade import trace as cascade_trace
from tvm_cascade.ops import reference, testing

# fmt: off
@T.prim_func(s_tir=True)
def softmax_pv(S: T.Buffer((8, 128), "float32"), V: T.Buffer((128, 64), "float32"), O: T.Buffer((8, 64), "float32")):
    m = T.sblock_alloc_buffer((8,))
    e = T.sblock_alloc_buffer((8, 128))
    l = T.sblock_alloc_buffer((8,))
    for i, j in T.grid(8, 128):
        with T.sblock("max"):
            vi, vj = T.axis.remap("SR", [i, j])
            with T.init():
                m[vi] = T.min_value("float32")
            m[vi] = T.max(m[vi], S[vi, vj])
    for i, j in T.grid(8, 128):
        with T.sblock("exp"):
            vi, vj = T.axis.remap("SS", [i, j])
            e[vi, vj] = T.exp(S[vi, vj] - m[vi])
    for i, j in T.grid(8, 128):
        with T.sblock("sum"):
            vi, vj = T.axis.remap("SR", [i, j])
            with T.init():
                l[vi] = T.float32(0)
            l[vi] = l[vi] + e[vi, vj]
    for i, d, j in T.grid(8, 64, 128):
        with T.sblock("pv"):
            vi, vd, vj = T.axis.remap("SSR", [i, d, j])
            with T.init():
                O[vi, vd] = T.float32(0)
            O[vi, vd] = O[vi, vd] + e[vi, vj] * V[vj, vd]


@T.prim_func(s_tir=True)
def softmax_pv_rolled(S: T.Buffer((8, 128), "float32"), V: T.Buffer((128, 64), "float32"), O: T.Buffer((8, 64), "float32")):
    m = T.sblock_alloc_buffer((8,))
    e = T.sblock_alloc_buffer((8, 128))
    l = T.sblock_alloc_buffer((8,))
    m_prev = T.sblock_alloc_buffer((8,))
    for i, j_0 in T.grid(8, 4):
        for j_1 in range(32):
            with T.sblock("max"):
                vi = T.axis.spatial(8, i)
                vj = T.axis.reduce(128, j_0 * 32 + j_1)
                T.reads(S[vi, vj])
                T.writes(m[vi], m_prev[vi])
                with T.init():
                    m[vi] = T.min_value("float32")
                if vj % 32 == 0:
                    m_prev[vi] = m[vi]
                m[vi] = T.max(m[vi], S[vi, vj])
        for j_1 in range(32):
            with T.sblock("exp"):
                vi = T.axis.spatial(8, i)
                vj = T.axis.spatial(128, j_0 * 32 + j_1)
                T.reads(S[vi, vj], m[vi])
                T.writes(e[vi, vj])
                e[vi, vj] = T.exp(S[vi, vj] - m[vi])
        for j_1 in range(32):
            with T.sblock("sum"):
                vi = T.axis.spatial(8, i)
                vj = T.axis.reduce(128, j_0 * 32 + j_1)
                T.reads(m_prev[vi], m[vi], e[vi, vj])
                T.writes(l[vi])
                with T.init():
                    l[vi] = T.float32(0)
                l[vi] = T.if_then_else(0 < vj and vj % 32 == 0, l[vi] * T.exp(m_prev[vi] - m[vi]), l[vi]) + e[vi, vj]
        for ax0, j_1 in T.grid(64, 32):
            with T.sblock("pv"):
                vi, vd = T.axis.remap("SS", [i, ax0])
                vj = T.axis.reduce(128, j_0 * 32 + j_1)
                T.reads(m_prev[vi], m[vi], e[vi, vj], V[vj, vd])
                T.writes(O[vi, vd])
                with T.init():
                    O[vi, vd] = T.float32(0)
                O[vi, vd] = T.if_then_else(0 < vj and vj % 32 == 0, O[vi, vd] * T.exp(m_prev[vi] - m[vi]), O[vi, vd]) + e[vi, vj] * V[vj, vd]


@T.prim_func(s_tir=True)
def variance(X: T.Buffer((4, 32), "float32"), out: T.Buffer((4,), "float32")):
    m = T.sblock_alloc_buffer((4,))
    for i, j in T.grid(4, 32):
        with T.sblock("max"):
            vi, vj = T.axis.remap("SR", [i, j])
            with T.init():
                m[vi] = T.min_value("float32")
            m[vi] = T.max(m[vi], X[vi, vj])
    for i, j in T.grid(4, 32):
        with T.sblock("spread"):
            vi, vj = T.axis.remap("SR", [i, j])
            with T.init():
                out[vi] = T.float32(0)
            out[vi] = out[vi] + (X[vi, vj] - m[vi]) * (X[vi, vj] - m[vi])


@T.prim_func(s_tir=True)
def two_sums(X: T.Buffer((4, 32), "float32"), out: T.Buffer((4,), "float32")):
    m = T.sblock_alloc_buffer((4,))
    s = T.sblock_alloc_buffer((4,))
    for i, j in T.grid(4, 32):
        with T.sblock("max"):
            vi, vj = T.axis.remap("SR", [i, j])
            with T.init():
                m[vi] = T.min_value("float32")
            m[vi] = T.max(m[vi], X[vi, vj])
    for i, j in T.grid(4, 32):
        with T.sblock("plain_sum"):
            vi, vj = T.axis.remap("SR", [i, j])
            with T.init():
                s[vi] = T.float32(0)
            s[vi] = s[vi] + X[vi, vj]
    for i in range(4):
        with T.sblock("out"):
            vi = T.axis.spatial(4, i)
            out[vi] = m[vi] + s[vi]
# fmt: on


def _assert_trace_roundtrip(sch, func):
    """Replaying the trace, directly and through JSON, rebuilds the same module (TVM's own
    verify_trace_roundtrip cannot: its JSON loader knows only TVM's instruction kinds)."""
    replayed = tvm.s_tir.Schedule(func, debug_mask="all")
    sch.trace.apply_to_schedule(replayed, remove_postproc=False)
    tvm.ir.assert_structural_equal(replayed.mod, sch.mod)
    from_json = tvm.s_tir.Schedule(func, debug_mask="all")
    cascade_trace.apply_json_to_schedule(sch.trace.as_json(), from_json)
    tvm.ir.assert_structural_equal(from_json.mod, sch.mod)
    assert str(from_json.trace) == str(sch.trace)


def _split_max(func, tile):
    sch = tvm.s_tir.Schedule(func, debug_mask="all")
    j = sch.get_loops(sch.get_sblock("max"))[-1]
    j0, _ = sch.split(j, [None, tile])
    return sch, j0


def test_exact_ir_softmax_sum_pv():
    sch, j0 = _split_max(softmax_pv, 32)
    sch.rolling_update(sch.get_sblock("sum"), j0)
    sch.rolling_update(sch.get_sblock("pv"), j0)
    tvm.ir.assert_structural_equal(
        sch.mod["main"].without_attr("global_symbol"),
        softmax_pv_rolled.without_attr("global_symbol"),
    )
    _assert_trace_roundtrip(sch, softmax_pv)


def test_exact_ir_numerics():
    rng = np.random.default_rng(0)
    s = (rng.standard_normal((8, 128)) * 8).astype("float32")
    v = rng.standard_normal((128, 64)).astype("float32")
    (out,) = testing.run_prim_func(softmax_pv_rolled, [s, v])
    s64 = s.astype("float64")
    p = np.exp(s64 - s64.max(axis=1, keepdims=True))
    np.testing.assert_allclose(out, p @ v, rtol=1e-5, atol=1e-4)


def _assert_refused(func, tile, block, loop_of=None, match=""):
    sch, j0 = _split_max(func, tile)
    loop = j0 if loop_of is None else loop_of(sch)
    block_rv = sch.get_sblock(block)
    before = sch.mod
    trace_len = len(sch.trace.insts)
    with pytest.raises(FusionError, match=match) as info:
        sch.rolling_update(block_rv, loop)
    tvm.ir.assert_structural_equal(sch.mod, before)
    assert len(sch.trace.insts) == trace_len
    assert f"'{block}'" in str(info.value)
    return str(info.value)


def test_refuses_non_reduction_block():
    _assert_refused(softmax_pv, 32, "exp", match="not a reduction block")


def test_refuses_loop_that_is_not_a_producer_reduction_loop():
    msg = _assert_refused(
        softmax_pv,
        32,
        "sum",
        loop_of=lambda sch: sch.get_loops(sch.get_sblock("max"))[0],
        match="does not drive the reduction iterator",
    )
    assert "'i'" in msg


def test_refuses_block_reading_no_earlier_reduction():
    _assert_refused(two_sums, 8, "plain_sum", match="reads no result of a reduction")


def test_refuses_combiner_without_repair():
    msg = _assert_refused(variance, 8, "spread", match="has no repair")
    assert "reducer 'sum'" in msg
    assert "The sub-expression ([X[vi, vj]] - m)**2 blocks it" in msg


def test_refuses_reduction_that_must_be_rolled_first():
    func = ops.attention(1, 2, 2, 4, 24, 8, normalize_before_pv=True)
    _assert_refused(func, 8, "pv", match="apply rolling_update to 'sum' first")


def test_error_is_a_schedule_error():
    assert issubclass(FusionError, tvm.s_tir.schedule.ScheduleError)
    assert issubclass(FusionError, ValueError)


def test_trace_print_replay_and_json():
    func = ops.attention(1, 2, 1, 3, 20, 8, variant="causal")
    sch = tvm.s_tir.Schedule(func, debug_mask="all")
    j0, _ = sch.split(sch.get_loops(sch.get_sblock("max"))[-1], [None, 8])
    sch.rolling_update(sch.get_sblock("sum"), j0)
    sch.rolling_update(sch.get_sblock("pv"), j0)
    sch.compute_at(sch.get_sblock("score"), j0)
    sch.compute_at(sch.get_sblock("qk"), j0)
    text = str(sch.trace)
    assert "sch.rolling_update(block=b7, loop=l5)" in text
    assert "sch.rolling_update(block=b8, loop=l5)" in text
    _assert_trace_roundtrip(sch, func)
    from_json = tvm.s_tir.Schedule(func)
    cascade_trace.apply_json_to_schedule(sch.trace.as_json(), from_json)
    q, k, v = testing.random_attention_inputs(1, 2, 1, 3, 20, 8, magnitude=2)
    (out,) = testing.run_prim_func(from_json.mod["main"], [q, k, v])
    np.testing.assert_allclose(out, reference.attention_ref(q, k, v, variant="causal"), atol=1e-5)


def test_block_and_loop_rvs_stay_valid():
    sch, j0 = _split_max(softmax_pv, 32)
    max_rv = sch.get_sblock("max")
    i, _, j1 = sch.get_loops(max_rv)
    sch.rolling_update(sch.get_sblock("sum"), j0)
    assert sch.get(max_rv).name_hint == "max"
    assert sch.get(j1).extent.value == 32
    sch.rolling_update(sch.get_sblock("pv"), j0)
    sch.parallel(i)
    rng = np.random.default_rng(1)
    s = rng.standard_normal((8, 128)).astype("float32")
    v = rng.standard_normal((128, 64)).astype("float32")
    (out,) = testing.run_prim_func(sch.mod["main"], [s, v])
    p = np.exp(s - s.max(axis=1, keepdims=True))
    np.testing.assert_allclose(out, p @ v, rtol=1e-5, atol=1e-4)
