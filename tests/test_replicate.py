"""``Schedule.replicate``: a block computed once per replica, its readers picking one."""
import numpy as np
import pytest
import tvm
import tvm_cascade  # noqa: F401
from tvm.script import tirx as T

from tvm_cascade import FusionError, ops
from tvm_cascade import trace as cascade_trace
from tvm_cascade.bench import VARIANTS
from tvm_cascade.ops.reference import attention_ref
from tvm_cascade.ops.testing import run_prim_func
from tvm_cascade.schedules import prefill


@T.prim_func(s_tir=True)
def _softmax(S: T.Buffer((8, 16), "float32"), E: T.Buffer((8, 16), "float32")):
    m = T.sblock_alloc_buffer((8,))
    l = T.sblock_alloc_buffer((8,))
    for i, j in T.grid(8, 16):
        with T.sblock("max"):
            vi, vj = T.axis.remap("SR", [i, j])
            with T.init():
                m[vi] = T.min_value("float32")
            m[vi] = T.max(m[vi], S[vi, vj])
    for i, j in T.grid(8, 16):
        with T.sblock("sum"):
            vi, vj = T.axis.remap("SR", [i, j])
            with T.init():
                l[vi] = T.float32(0)
            l[vi] = l[vi] + T.exp(S[vi, vj] - m[vi])
    for i, j in T.grid(8, 16):
        with T.sblock("norm"):
            vi, vj = T.axis.remap("SS", [i, j])
            E[vi, vj] = T.exp(S[vi, vj] - m[vi]) / l[vi]


@T.prim_func(s_tir=True)
def _softmax_replicated(S: T.Buffer((8, 16), "float32"), E: T.Buffer((8, 16), "float32")):
    m = T.sblock_alloc_buffer((8, 4))
    l = T.sblock_alloc_buffer((8, 4))
    for i, j, replica in T.grid(8, 16, 4):
        with T.sblock("max"):
            vi, vj, v_replica = T.axis.remap("SRS", [i, j, replica])
            T.sblock_attr({"tvm_cascade.replicas": 4})
            with T.init():
                m[vi, v_replica] = T.min_value("float32")
            m[vi, v_replica] = T.max(m[vi, v_replica], S[vi, vj])
    for i, j, replica in T.grid(8, 16, 4):
        with T.sblock("sum"):
            vi, vj, v_replica = T.axis.remap("SRS", [i, j, replica])
            T.sblock_attr({"tvm_cascade.replicas": 4})
            with T.init():
                l[vi, v_replica] = T.float32(0)
            l[vi, v_replica] = l[vi, v_replica] + T.exp(S[vi, vj] - m[vi, v_replica])
    for i, j in T.grid(8, 16):
        with T.sblock("norm"):
            vi, vj = T.axis.remap("SS", [i, j])
            E[vi, vj] = T.exp(S[vi, vj] - m[vi, vj // 2 % 4]) / l[vi, vj // 2 % 4]


def _replicated(order):
    sch = tvm.s_tir.Schedule(_softmax)
    for name in order:
        sch.replicate(sch.get_sblock(name), 4, 2)
    return sch


@pytest.mark.parametrize("order", [("max", "sum"), ("sum", "max")])
def test_replicate_gives_the_expected_ir_in_any_order_and_stays_exact(order):
    sch = _replicated(order)
    tvm.ir.assert_structural_equal(sch.mod["main"], _softmax_replicated.with_attr("global_symbol", "_softmax"))
    s = np.random.default_rng(1).standard_normal((8, 16)).astype("float32") * 4
    out, = run_prim_func(sch.mod["main"], [s])
    p = np.exp(s.astype("float64") - s.max(axis=1, keepdims=True))
    np.testing.assert_allclose(out, p / p.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-6)


def test_replicate_replays_from_its_trace_and_json():
    sch = _replicated(("max", "sum"))
    assert "sch.replicate(block=b0, factor=4, stride=2)" in str(sch.trace)
    as_json = cascade_trace.trace_to_json(sch.trace, remove_postproc=True)
    again = tvm.s_tir.Schedule(_softmax)
    cascade_trace.apply_json_to_schedule(as_json, again)
    tvm.ir.assert_structural_equal(again.mod, sch.mod)


@T.prim_func(s_tir=True)
def _two_writers(S: T.Buffer((8, 16), "float32"), E: T.Buffer((8, 16), "float32")):
    m = T.sblock_alloc_buffer((8,))
    for i in range(8):
        with T.sblock("start"):
            vi = T.axis.remap("S", [i])
            m[vi] = S[vi, 0]
    for i, j in T.grid(8, 16):
        with T.sblock("norm"):
            vi, vj = T.axis.remap("SS", [i, j])
            E[vi, vj] = S[vi, vj] - m[vi]
    for i in range(8):
        with T.sblock("again"):
            vi = T.axis.remap("S", [i])
            m[vi] = S[vi, 1]


def _refused(func, steps, match):
    sch = tvm.s_tir.Schedule(func)
    for step in steps[:-1]:
        step(sch)
    before = sch.mod
    with pytest.raises(FusionError, match=match):
        steps[-1](sch)
    tvm.ir.assert_structural_equal(sch.mod, before)


def _replicate(name, factor=4, stride=2):
    return lambda sch: sch.replicate(sch.get_sblock(name), factor, stride)


def test_replicate_refuses_what_would_change_the_result():
    _refused(_softmax, [_replicate("max", 1)], r"block 'max' needs at least 2 replicas")
    _refused(_softmax, [_replicate("max"), _replicate("max")], r"block 'max' is replicated already")
    _refused(_softmax, [_replicate("norm")], r"block 'norm' writes E, which the root block does not allocate")
    _refused(_two_writers, [_replicate("start")], r"block 'again' also writes a buffer of block 'start'")
    _refused(_softmax, [_replicate("max"), _replicate("sum", 2)], r"block 'sum' reads m, which has 4 replicas, not 2")
    relaid = lambda sch: sch.transform_layout(sch.get_sblock("max"), ("write", 0), lambda i, c: (c, i))
    _refused(
        _softmax, [_replicate("max"), relaid, _replicate("sum")],
        r"block 'sum' reads m at .*, whose last index no longer picks a replica",
    )


@pytest.mark.parametrize("variant", ["global", "causal", "softcap", "window"])
def test_prefill_row_statistics_replicated_in_a_quad_stay_exact(variant):
    """The prefill schedule's IR steps before its GPU mapping: per-tile max and sum split
    by fragment lane, the row statistics replicated four times."""
    seq, dim = 96, 16
    var = VARIANTS[variant]
    if var.window is not None:
        var = type(var)("window", causal=True, window=40)
    func = ops.attention(1, 2, 2, seq, seq, dim, dtype="float32", variant=var)
    sch = tvm.s_tir.Schedule(func)
    *_, i1 = prefill.row_tiles(sch, 48, 32, per_tile=("pv", "max", "sum"))
    sch.distribute(i1)
    for name in ("max_tile", "sum_tile"):
        block = sch.get_sblock(name)
        rows, keys = sch.get_loops(block)[-2:]
        _, lane, _ = sch.split(keys, [None, 4, 2])
        sch.reorder(lane, sch.get_loops(block)[-3])
        sch.split_tile_accumulation(block, lane)
        sch.distribute(lane)
        sch.distribute(rows)
    for name in ("max_tile", "max", "sum_scale", "sum_tile", "sum", "pv_scale"):
        sch.replicate(sch.get_sblock(name), 4, 2)
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 2, seq, dim)).astype("float32") for _ in range(3))
    out, = run_prim_func(sch.mod["main"], [q, k, v])
    np.testing.assert_allclose(out, attention_ref(q, k, v, variant=var), rtol=1e-5, atol=1e-5)
