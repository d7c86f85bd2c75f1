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


@T.prim_func(s_tir=True)
def two_maxima(S: T.Buffer((4, 32), "float32"), U: T.Buffer((4, 32), "float32"), out: T.Buffer((4,), "float32")):
    m = T.sblock_alloc_buffer((4,))
    n = T.sblock_alloc_buffer((4,))
    for i, j in T.grid(4, 32):
        with T.sblock("max_s"):
            vi, vj = T.axis.remap("SR", [i, j])
            with T.init():
                m[vi] = T.min_value("float32")
            m[vi] = T.max(m[vi], S[vi, vj])
    for i, j in T.grid(4, 32):
        with T.sblock("max_u"):
            vi, vj = T.axis.remap("SR", [i, j])
            with T.init():
                n[vi] = T.min_value("float32")
            n[vi] = T.max(n[vi], U[vi, vj])
    for i, j in T.grid(4, 32):
        with T.sblock("sum"):
            vi, vj = T.axis.remap("SR", [i, j])
            with T.init():
                out[vi] = T.float32(0)
            out[vi] = out[vi] + T.exp(S[vi, vj] - m[vi]) * T.exp(U[vi, vj] - n[vi])
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


def test_one_argument_form_infers_the_key_loop():
    """``rolling_update(block)`` fuses across the outermost split of the chain's first
    reduction's key loop: the same IR as with the loop given; the trace records the
    lookups of that loop and replays."""
    sch = tvm.s_tir.Schedule(softmax_pv, debug_mask="all")
    sch.split(sch.get_loops(sch.get_sblock("max"))[-1], [None, 4, 8])
    sch.rolling_update(sch.get_sblock("sum"))
    sch.rolling_update(sch.get_sblock("pv"))
    explicit = tvm.s_tir.Schedule(softmax_pv, debug_mask="all")
    j0, _, _ = explicit.split(explicit.get_loops(explicit.get_sblock("max"))[-1], [None, 4, 8])
    explicit.rolling_update(explicit.get_sblock("sum"), j0)
    explicit.rolling_update(explicit.get_sblock("pv"), j0)
    tvm.ir.assert_structural_equal(sch.mod, explicit.mod)
    assert 'sch.get_sblock(name="max"' in str(sch.trace)
    _assert_trace_roundtrip(sch, softmax_pv)


def _assert_one_argument_refused(sch, block, match):
    before, trace_len = sch.mod, len(sch.trace.insts)
    block_rv = sch.get_sblock(block)
    with pytest.raises(FusionError, match=match) as info:
        sch.rolling_update(block_rv)
    tvm.ir.assert_structural_equal(sch.mod, before)
    assert len(sch.trace.insts) == trace_len + 1  # the get_sblock above, nothing more
    assert f"block '{block}'" in str(info.value)
    return str(info.value)


def test_one_argument_form_refusals():
    """An unsplit key loop, and a block the primitive then refuses (the loop found, its
    lookups taken off the trace again)."""
    sch = tvm.s_tir.Schedule(softmax_pv, debug_mask="all")
    _assert_one_argument_refused(sch, "sum", "the key loop 'j' around 'max' is not split")
    sch, _ = _split_max(variance, 8)
    _assert_one_argument_refused(sch, "spread", "has no repair")


def test_one_argument_form_takes_the_loop_of_the_reduction_before_the_others():
    """Of two split reductions the block reads, only the later one's key loop can be fused
    across (the earlier must be complete before it): the one-argument form takes it; two
    loops of different nests are not ordered, the ambiguity it would refuse."""
    from tvm_cascade.analysis.scope import collect_sites
    from tvm_cascade.primitives.loop_inference import _outermost

    sch = tvm.s_tir.Schedule(two_maxima, debug_mask="all")
    outer = {}
    for name in ("max_s", "max_u"):
        outer[name], _ = sch.split(sch.get_loops(sch.get_sblock(name))[-1], [None, 8])
    one_argument = sch.copy()
    sch.rolling_update(sch.get_sblock("sum"), outer["max_u"])
    one_argument.rolling_update(one_argument.get_sblock("sum"))
    tvm.ir.assert_structural_equal(one_argument.mod, sch.mod)
    sites = collect_sites(one_argument.mod["main"].body.block)
    first = next(s for s in sites if s.name == "max_s")
    sum_site = next(s for s in sites if s.name == "sum")
    assert len(first.loops) == 3 and sum_site.loops[1].loop_var.name == "j_0"  # under max_u's outer loop
    assert _outermost([first.loops[1], sum_site.loops[1]], sites) is None
    assert _outermost([first.loops[1], first.loops[2]], sites).same_as(first.loops[1])


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
