"""The tensor-core prefill schedule, its design space and the tile rewrites it is built on.

No GPU here: the rewrites are checked on the CPU against numpy, the schedule compiled with
TVM's CUDA codegen and its source checked for what it must hold; the GPU numbers are in
benchmarks/RESULTS.md."""
import functools
import itertools
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import tvm
import tvm_ffi
import tvm_cascade  # noqa: F401
from tvm.s_tir.stmt import SBlockRealize
from tvm.script import tirx as T

from tvm_cascade import FusionError, kernels, ops
from tvm_cascade import trace as cascade_trace
from tvm_cascade.bench import VARIANTS
from tvm_cascade.ops.reference import attention_ref
from tvm_cascade.ops.testing import run_prim_func
from tvm_cascade.analysis.chain import substitute
from tvm_cascade.analysis.scope import vars_in
from tvm_cascade.primitives import ir
from tvm_cascade.primitives.tiles import _is_masked_read
from tvm_cascade.schedules import prefill, warp_specialized
from tvm_cascade.cuda import software_pipeline, tensor_cores
from tvm_cascade.cuda.padding import padded_inputs

from tuning_records import write_records
from ahead import in_a_process_ahead

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})


def _row_tiles(func, keys, rows):
    """The prefill schedule's IR steps up to its ``distribute``; returns the schedule and
    the row loop below the key-tile loop."""
    sch = tvm.s_tir.Schedule(func, seed=1)
    return sch, prefill.row_tiles(sch, rows, keys)[-1]


def _fused_row_tiles(func, keys, rows, sizes=None):
    """The prefill schedule's IR steps before any GPU mapping (``sizes``: how
    ``distribute`` groups the stages)."""
    sch, i1 = _row_tiles(func, keys, rows)
    if sizes is None:
        sch.distribute(i1)
    else:
        sch.distribute(i1, sizes)
    return sch


@pytest.mark.parametrize(
    "variant, heads_q, heads_kv",
    [("global", 2, 2), ("causal", 4, 2), ("alibi", 2, 2), ("softcap", 2, 1), ("window", 2, 2)],
)
def test_tile_rewrites_keep_attention_exact(variant, heads_q, heads_kv):
    seq, dim = 96, 16
    var = VARIANTS[variant]
    if var.window is not None:
        var = type(var)("window", causal=True, window=40)  # a few tiles inside the window
    func = ops.attention(1, heads_q, heads_kv, seq, seq, dim, dtype="float32", variant=var)
    sch = _fused_row_tiles(func, keys=32, rows=48)
    names = [b.name_hint for b in ir.blocks_in(sch.mod["main"].body.block)]
    assert names.count("pv_tile") == 1 and names.index("pv_tile") < names.index("pv")
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, heads_q, seq, dim)).astype("float32")
    k, v = (rng.standard_normal((1, heads_kv, seq, dim)).astype("float32") for _ in range(2))
    out, = run_prim_func(sch.mod["main"], [q, k, v])
    np.testing.assert_allclose(out, attention_ref(q, k, v, variant=var), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", ["causal", "global"])
def test_row_tiles_of_several_query_heads_keep_attention_exact(variant):
    """``row_tiles(heads=2)``: a tile of 16 rows of each of 2 query heads of a GQA group,
    one slice per head."""
    seq, dim = 96, 16
    func = ops.attention(1, 4, 2, seq, seq, dim, dtype="float32", variant=VARIANTS[variant])
    sch = tvm.s_tir.Schedule(func, seed=1)
    _, groups, tiles, slices, _, i1 = prefill.row_tiles(sch, 32, 32, warps=2, heads=2)
    assert [int(sch.get(l).extent) for l in (groups, tiles, slices, i1)] == [2, seq // 16, 2, 16]
    sch.distribute(i1)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 4, seq, dim)).astype("float32")
    k, v = (rng.standard_normal((1, 2, seq, dim)).astype("float32") for _ in range(2))
    out, = run_prim_func(sch.mod["main"], [q, k, v])
    np.testing.assert_allclose(out, attention_ref(q, k, v, variant=VARIANTS[variant]), rtol=1e-5, atol=1e-5)


def test_distribute_gives_each_stage_its_row_loop():
    func = ops.attention(1, 1, 1, 64, 64, 16, dtype="float32", variant=VARIANTS["causal"])
    sch = _fused_row_tiles(func, keys=16, rows=32)
    for name in ("qk", "score", "max", "exp", "sum", "pv_scale", "pv_tile", "pv"):
        loops = sch.get_loops(sch.get_sblock(name))
        assert int(sch.get(loops[5]).extent) == 32, name  # b, h, i0, warp slice, key tile, row
    assert str(sch.trace).count("sch.distribute(") == 1


@T.prim_func(s_tir=True)
def _shared_accumulator(x: T.Buffer((8,), "float32"), y: T.Buffer((8,), "float32")):
    acc = T.sblock_alloc_buffer((1,))
    for i in range(8):
        with T.sblock("fold"):
            vi = T.axis.spatial(8, i)
            acc[0] = acc[0] + x[vi]
        with T.sblock("use"):
            vi = T.axis.spatial(8, i)
            y[vi] = acc[0]


def test_distribute_refuses_state_shared_between_iterations():
    sch = tvm.s_tir.Schedule(_shared_accumulator)
    before = sch.mod
    with pytest.raises(FusionError, match="'acc' is not indexed by the row"):
        sch.distribute(sch.get_loops(sch.get_sblock("fold"))[0])
    assert tvm_ffi.structural_equal(sch.mod, before)


@T.prim_func(s_tir=True)
def _softmax_pv(S: T.Buffer((4, 32), "float32"), V: T.Buffer((32, 8), "float32"), O: T.Buffer((4, 8), "float32")):
    m = T.sblock_alloc_buffer((4,))
    e = T.sblock_alloc_buffer((4, 32))
    for i, j in T.grid(4, 32):
        with T.sblock("max"):
            vi, vj = T.axis.remap("SR", [i, j])
            with T.init():
                m[vi] = T.min_value("float32")
            m[vi] = T.max(m[vi], S[vi, vj])
    for i, j in T.grid(4, 32):
        with T.sblock("exp"):
            vi, vj = T.axis.remap("SS", [i, j])
            e[vi, vj] = T.exp(S[vi, vj] - m[vi])
    for i, d, j in T.grid(4, 8, 32):
        with T.sblock("pv"):
            vi, vd, vj = T.axis.remap("SSR", [i, d, j])
            with T.init():
                O[vi, vd] = T.float32(0)
            O[vi, vd] = O[vi, vd] + e[vi, vj] * V[vj, vd]


@T.prim_func(s_tir=True)
def _softmax_pv_tiles(S: T.Buffer((4, 32), "float32"), V: T.Buffer((32, 8), "float32"), O: T.Buffer((4, 8), "float32")):
    m = T.sblock_alloc_buffer((4,))
    e = T.sblock_alloc_buffer((4, 32))
    m_prev = T.sblock_alloc_buffer((4,))
    O_tile = T.sblock_alloc_buffer((2, 4, 8))
    O_scale = T.sblock_alloc_buffer((2, 4))
    for i, j_0 in T.grid(4, 2):
        for j_1 in range(16):
            with T.sblock("max"):
                vi = T.axis.spatial(4, i)
                vj = T.axis.reduce(32, j_0 * 16 + j_1)
                T.reads(S[vi, vj])
                T.writes(m[vi], m_prev[vi])
                with T.init():
                    m[vi] = T.min_value("float32")
                if vj % 16 == 0:
                    m_prev[vi] = m[vi]
                m[vi] = T.max(m[vi], S[vi, vj])
        for j_1 in range(16):
            with T.sblock("exp"):
                vi = T.axis.spatial(4, i)
                vj = T.axis.spatial(32, j_0 * 16 + j_1)
                e[vi, vj] = T.exp(S[vi, vj] - m[vi])
        with T.sblock("pv_scale"):
            v_t, vi = T.axis.remap("SS", [j_0, i])
            O_scale[v_t, vi] = T.if_then_else(0 < v_t, T.exp(m_prev[vi] - m[vi]), T.float32(1))
        for ax0, j_1 in T.grid(8, 16):
            with T.sblock("pv_tile"):
                vi, vd, v_t, v_r = T.axis.remap("SSSR", [i, ax0, j_0, j_1])
                T.sblock_attr({"tvm_cascade.tile_iterators": [2]})
                with T.init():
                    O_tile[v_t, vi, vd] = T.float32(0)
                O_tile[v_t, vi, vd] = O_tile[v_t, vi, vd] + e[vi, v_t * 16 + v_r] * V[v_t * 16 + v_r, vd]
        for ax0 in range(8):
            with T.sblock("pv"):
                vi, vd, v_t = T.axis.remap("SSR", [i, ax0, j_0])
                T.reads(O_scale[v_t, vi], O_tile[v_t, vi, vd])
                T.writes(O[vi, vd])
                with T.init():
                    O[vi, vd] = T.float32(0)
                O[vi, vd] = O[vi, vd] * O_scale[v_t, vi] + O_tile[v_t, vi, vd]


def test_split_tile_accumulation_exact_ir_and_numerics():
    """A scaling repair (``O * exp(m_prev - m)``) gets its factor as a stage per row and tile."""
    sch = tvm.s_tir.Schedule(_softmax_pv)
    j0, _ = sch.split(sch.get_loops(sch.get_sblock("max"))[1], [None, 16])
    sch.rolling_update(sch.get_sblock("pv"), j0)
    sch.split_tile_accumulation(sch.get_sblock("pv"), j0)
    tvm.ir.assert_structural_equal(
        sch.mod["main"].without_attr("global_symbol"), _softmax_pv_tiles.without_attr("global_symbol")
    )
    _check_softmax_pv(_softmax_pv_tiles, seed=3)


def _check_softmax_pv(func, seed):
    """``func`` (``_softmax_pv`` rewritten) on random scores against numpy in float64."""
    rng = np.random.default_rng(seed)
    s = (rng.standard_normal((4, 32)) * 6).astype("float32")
    v = rng.standard_normal((32, 8)).astype("float32")
    out, = run_prim_func(func, [s, v])
    p = np.exp(s.astype("float64") - s.max(axis=1, keepdims=True))
    np.testing.assert_allclose(out, p @ v, rtol=1e-5, atol=1e-5)


@T.prim_func(s_tir=True)
def _softmax_pv_max_tiles(S: T.Buffer((4, 32), "float32"), V: T.Buffer((32, 8), "float32"), O: T.Buffer((4, 8), "float32")):
    m = T.sblock_alloc_buffer((4,))
    e = T.sblock_alloc_buffer((4, 32))
    m_prev = T.sblock_alloc_buffer((4,))
    m_tile = T.sblock_alloc_buffer((2, 4))
    for i, j_0 in T.grid(4, 2):
        for j_1 in range(16):
            with T.sblock("max_tile"):
                vi, v_t, v_r = T.axis.remap("SSR", [i, j_0, j_1])
                T.sblock_attr({"tvm_cascade.tile_iterators": [1]})
                T.reads(S[vi, v_t * 16 + v_r])
                T.writes(m_tile[v_t, vi])
                with T.init():
                    m_tile[v_t, vi] = T.min_value("float32")
                m_tile[v_t, vi] = T.max(m_tile[v_t, vi], S[vi, v_t * 16 + v_r])
        with T.sblock("max"):
            vi, v_t = T.axis.remap("SR", [i, j_0])
            T.reads(m_tile[v_t, vi])
            T.writes(m[vi], m_prev[vi])
            with T.init():
                m[vi] = T.min_value("float32")
            m_prev[vi] = m[vi]
            m[vi] = T.max(m[vi], m_tile[v_t, vi])
        for j_1 in range(16):
            with T.sblock("exp"):
                vi = T.axis.spatial(4, i)
                vj = T.axis.spatial(32, j_0 * 16 + j_1)
                e[vi, vj] = T.exp(S[vi, vj] - m[vi])
        for ax0, j_1 in T.grid(8, 16):
            with T.sblock("pv"):
                vi, vd = T.axis.remap("SS", [i, ax0])
                vj = T.axis.reduce(32, j_0 * 16 + j_1)
                T.reads(m_prev[vi], m[vi], e[vi, vj], V[vj, vd])
                T.writes(O[vi, vd])
                with T.init():
                    O[vi, vd] = T.float32(0)
                O[vi, vd] = T.if_then_else(
                    0 < vj and vj % 16 == 0, O[vi, vd] * T.exp(m_prev[vi] - m[vi]), O[vi, vd]
                ) + e[vi, vj] * V[vj, vd]


def test_split_tile_accumulation_of_a_max_keeps_the_saved_value():
    """A max needs no repair; the value ``rolling_update`` saves at a tile's first key is
    saved once per tile, before the tile's max folds in."""
    sch = tvm.s_tir.Schedule(_softmax_pv)
    j0, _ = sch.split(sch.get_loops(sch.get_sblock("max"))[1], [None, 16])
    sch.rolling_update(sch.get_sblock("pv"), j0)
    sch.split_tile_accumulation(sch.get_sblock("max"), j0)
    tvm.ir.assert_structural_equal(
        sch.mod["main"].without_attr("global_symbol"), _softmax_pv_max_tiles.without_attr("global_symbol")
    )
    _check_softmax_pv(_softmax_pv_max_tiles, seed=4)


def test_split_tile_accumulation_groups_by_a_strided_loop():
    """Without a repair the groups need not be contiguous: the keys of each lane of an mma
    fragment (``(key % 8) // 2``) reduce apart, the four partials after them (with the
    reduction's loop distributed, each group its own copy)."""
    sch = tvm.s_tir.Schedule(_softmax_pv)
    i, j = sch.get_loops(sch.get_sblock("max"))
    column, lane, pair = sch.split(j, [None, 4, 2])
    sch.reorder(lane, column)
    sch.split_tile_accumulation(sch.get_sblock("max"), lane)
    sch.distribute(lane)
    partial = sch.get(sch.get_sblock("max_tile"))
    assert [int(iv.dom.extent) for iv in partial.iter_vars] == [4, 4, 4, 2]
    lanes = [sch.get(l) for l in (sch.get_loops(sch.get_sblock("max_tile"))[1], sch.get_loops(sch.get_sblock("max"))[1])]
    assert not lanes[0].same_as(lanes[1])
    _check_softmax_pv(sch.mod["main"], seed=5)


def test_split_tile_accumulation_refuses_what_it_cannot_split():
    func = ops.attention(1, 1, 1, 32, 32, 16, dtype="float32", variant=VARIANTS["causal"])
    sch = tvm.s_tir.Schedule(func)
    j0, _ = sch.split(sch.get_loops(sch.get_sblock("max"))[-1], [None, 16])
    sch.rolling_update(sch.get_sblock("sum"), j0)
    before = sch.mod
    with pytest.raises(FusionError, match="'exp' is not a sum, max or min"):
        sch.split_tile_accumulation(sch.get_sblock("exp"), j0)
    assert tvm_ffi.structural_equal(sch.mod, before)
    # The groups must be the loop's iterations over all the loops above it.
    _, inner = sch.split(sch.get_loops(sch.get_sblock("sum"))[-1], [2, None])
    before = sch.mod
    with pytest.raises(FusionError, match="'rj_0' above 'rj_1_1' iterates the reduced axis of 'sum' too"):
        sch.split_tile_accumulation(sch.get_sblock("sum"), inner)
    assert tvm_ffi.structural_equal(sch.mod, before)


def test_distribute_groups_consecutive_statements():
    func = ops.attention(1, 1, 1, 64, 64, 16, dtype="float32", variant=VARIANTS["causal"])
    sch = _fused_row_tiles(func, keys=16, rows=32, sizes=[1, 1, 3, 1, 1, 1])
    rows = {name: sch.get(sch.get_loops(sch.get_sblock(name))[5]) for name in ("max", "exp", "sum", "pv")}
    assert rows["max"].same_as(rows["exp"]) and rows["exp"].same_as(rows["sum"])
    assert not rows["sum"].same_as(rows["pv"])
    assert "sizes=[1, 1, 3, 1, 1, 1]" in str(sch.trace)
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 1, 64, 16)).astype("float32") for _ in range(3))
    out, = run_prim_func(sch.mod["main"], [q, k, v])
    np.testing.assert_allclose(out, attention_ref(q, k, v, variant=VARIANTS["causal"]), rtol=1e-5, atol=1e-5)


def test_distribute_refuses_sizes_that_do_not_cover_the_body():
    func = ops.attention(1, 1, 1, 64, 64, 16, dtype="float32", variant=VARIANTS["causal"])
    sch, i1 = _row_tiles(func, keys=16, rows=32)
    before = sch.mod
    with pytest.raises(FusionError, match="do not split"):
        sch.distribute(i1, [2, 2])
    assert tvm_ffi.structural_equal(sch.mod, before)


def _decomposed_row_tiles(func, keys, rows, scores_kept=False):
    """:func:`_fused_row_tiles` with the scores inlined (or, ``scores_kept``, a block of
    their own in each key tile) and the rolled reductions' initial values before the key
    loop; returns (schedule, the block computing or reading the masked scores, key-tile
    loop)."""
    sch = _fused_row_tiles(func, keys, rows)
    if not scores_kept:
        sch.compute_inline(sch.get_sblock("score"))
    masked = sch.get_sblock("score" if scores_kept else "max")
    j0 = sch.get_loops(sch.get_sblock("max"))[4]
    for name in ("max", "sum", "pv"):
        sch.decompose_reduction(sch.get_sblock(name), j0)
    return sch, masked, j0


def _assert_matches_reference(sch, variant, seq_q, seq_kv):
    """The scheduled float32 ``ops.attention(1, 2, 1, seq_q, seq_kv, 16)`` on the CPU
    against the numpy reference."""
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 2, seq_q, 16)).astype("float32")
    k, v = (rng.standard_normal((1, 1, seq_kv, 16)).astype("float32") for _ in range(2))
    out, = run_prim_func(sch.mod["main"], [q, k, v])
    np.testing.assert_allclose(out, attention_ref(q, k, v, variant=variant), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "variant, seq_q, seq_kv, tiles, scores_kept",
    [
        # (first, last + 1) key tile of each 32-row block; keys in tiles of 16
        ("causal", 96, 96, [(0, 2), (0, 4), (0, 6)], False),
        ("window", 96, 96, [(0, 2), (0, 4), (1, 6)], False),  # window of 40 keys
        ("alibi", 64, 128, [(0, 6), (0, 8)], False),  # causal, bottom-right aligned
        ("window", 64, 160, [(3, 8), (5, 10)], False),
        # The mask's block computes the scores (its key a spatial iterator of the tile).
        ("alibi", 64, 128, [(0, 6), (0, 8)], True),
        ("window", 96, 96, [(0, 2), (0, 4), (1, 6)], True),
    ],
)
def test_skip_masked_tiles_visits_the_visible_tiles_and_stays_exact(variant, seq_q, seq_kv, tiles, scores_kept):
    var = VARIANTS[variant]
    if var.window is not None:
        var = type(var)("window", causal=True, window=40)
    func = ops.attention(1, 2, 1, seq_q, seq_kv, 16, dtype="float32", variant=var)
    sch, masked, j0 = _decomposed_row_tiles(func, keys=16, rows=32, scores_kept=scores_kept)
    tile = sch.get(j0).loop_var
    i0 = sch.get(sch.get_loops(masked)[2]).loop_var
    sch.skip_masked_tiles(masked, j0)
    # The tile loop, and the variable holding its first tile if that one moves.
    found = {}
    tvm_ffi.structural_walk(
        sch.mod["main"].body,
        lambda n: found.update(
            {"loop": n} if isinstance(n, tvm.tirx.For) and n.loop_var.same_as(tile) else
            {"first": n} if isinstance(n, tvm.tirx.Bind) else {}
        ),
    )
    loop, bind = found["loop"], found.get("first")
    analyzer = tvm.sym.Analyzer()
    for block_row, (first, end) in enumerate(tiles):
        at = {i0: tvm.tirx.const(block_row, "int32")}
        start = analyzer.simplify(substitute(bind.value if bind else loop.min, at)).value
        if bind:
            at[bind.var] = tvm.tirx.const(start, "int32")
        assert start == first
        assert start + analyzer.simplify(substitute(loop.extent, at)).value == end
    _assert_matches_reference(sch, var, seq_q, seq_kv)


def test_skip_masked_tiles_walks_the_same_tiles_in_every_thread():
    """Rows split between threads above the key-tile loop (each warp a slice of the
    block's rows, as the prefill schedule does): the loop visits the tiles any row of the
    block sees, in every thread, since a tile's body synchronises them; its bounds do
    not read the thread index."""
    func = ops.attention(1, 2, 1, 96, 96, 16, dtype="float32", variant=VARIANTS["causal"])
    sch = tvm.s_tir.Schedule(func, seed=1)
    _, _, i0, slices, j0, i1 = prefill.row_tiles(sch, 32, 16, warps=2)
    sch.distribute(i1)
    sch.compute_inline(sch.get_sblock("score"))
    sch.bind(slices, "threadIdx.y")
    max_block = sch.get_sblock("max")
    for name in ("max", "sum", "pv"):
        sch.decompose_reduction(sch.get_sblock(name), j0)
    tile, thread, row_tile = (sch.get(loop).loop_var for loop in (j0, slices, i0))
    sch.skip_masked_tiles(max_block, j0)
    loops = []
    tvm_ffi.structural_walk(
        sch.mod["main"].body,
        lambda n: loops.append(n) if isinstance(n, tvm.tirx.For) and n.loop_var.same_as(tile) else None,
    )
    (loop,) = loops
    read = []
    tvm_ffi.structural_walk(loop.extent, lambda n: read.append(n) if isinstance(n, tvm.tirx.Var) else None)
    assert loop.min.value == 0 and any(v.same_as(row_tile) for v in read)
    assert not any(v.same_as(thread) for v in read)
    # Causal, 32 rows per block in two slices of 16: the block's last row bounds the tiles.
    analyzer = tvm.sym.Analyzer()
    for block_row, end in enumerate([2, 4, 6]):
        assert analyzer.simplify(substitute(loop.extent, {row_tile: tvm.tirx.const(block_row, "int32")})).value == end


def test_skip_masked_tiles_refuses_what_would_change_the_result():
    causal = VARIANTS["causal"]
    # The first tile still initialises the running max: skipping it would lose that.
    func = ops.attention(1, 1, 1, 64, 64, 16, dtype="float32", variant=causal)
    sch = _fused_row_tiles(func, keys=16, rows=32)
    sch.compute_inline(sch.get_sblock("score"))
    before = sch.mod
    with pytest.raises(FusionError, match="decompose the reduction"):
        sch.skip_masked_tiles(sch.get_sblock("max"), sch.get_loops(sch.get_sblock("max"))[4])
    assert tvm_ffi.structural_equal(sch.mod, before)
    # More queries than keys: the first rows see no key (mean of V over all keys).
    func = ops.attention(1, 1, 1, 96, 64, 16, dtype="float32", variant=causal)
    sch, max_block, j0 = _decomposed_row_tiles(func, keys=16, rows=32)
    with pytest.raises(FusionError, match="sees no key"):
        sch.skip_masked_tiles(max_block, j0)
    # No mask, nothing to skip.
    func = ops.attention(1, 1, 1, 64, 64, 16, dtype="float32", variant=VARIANTS["global"])
    sch, max_block, j0 = _decomposed_row_tiles(func, keys=16, rows=32)
    with pytest.raises(FusionError, match="reads no masked scores"):
        sch.skip_masked_tiles(max_block, j0)


@T.prim_func(s_tir=True)
def _masked_max_and_unmasked_sum(
    x: T.Buffer((8, 8), "float32"), y: T.Buffer((8,), "float32"),
    m: T.Buffer((8,), "float32"), c: T.Buffer((8,), "float32"),
):
    for i, t in T.grid(8, 2):
        for r in range(4):
            with T.sblock("masked_max"):
                vi = T.axis.spatial(8, i)
                vj = T.axis.reduce(8, t * 4 + r)
                with T.init():
                    m[vi] = T.min_value("float32")
                m[vi] = T.max(m[vi], T.Select(vj <= vi, x[vi, vj], T.min_value("float32")))
        for r in range(4):
            with T.sblock("total"):
                vi = T.axis.spatial(8, i)
                vj = T.axis.reduce(8, t * 4 + r)
                with T.init():
                    c[vi] = T.float32(0)
                c[vi] = c[vi] + y[vj]


def test_skip_masked_tiles_refuses_a_reduction_outside_the_masked_chain():
    sch = tvm.s_tir.Schedule(_masked_max_and_unmasked_sum)
    masked_max = sch.get_sblock("masked_max")
    tiles = sch.get_loops(masked_max)[1]
    for name in ("masked_max", "total"):
        sch.decompose_reduction(sch.get_sblock(name), tiles)
    before = sch.mod
    with pytest.raises(FusionError, match="'total_update' reduces over loop 't' without reading"):
        sch.skip_masked_tiles(masked_max, tiles)
    assert tvm_ffi.structural_equal(sch.mod, before)


@T.prim_func(s_tir=True)
def _causal_max(x: T.Buffer((8, 8), "float32"), m: T.Buffer((8,), "float32")):
    for i in range(8):
        with T.sblock("init"):
            vi = T.axis.spatial(8, i)
            m[vi] = T.min_value("float32")
        for t, r in T.grid(2, 4):
            with T.sblock("masked_max"):
                vi = T.axis.spatial(8, i)
                vj = T.axis.reduce(8, t * 4 + r)
                m[vi] = T.max(m[vi], T.Select(vj <= vi, x[vi, vj], T.min_value("float32")))


@T.prim_func(s_tir=True)
def _causal_max_unmasked(x: T.Buffer((8, 8), "float32"), m: T.Buffer((8,), "float32")):
    for i in range(8):
        with T.sblock("init"):
            vi = T.axis.spatial(8, i)
            m[vi] = T.min_value("float32")
        t_outer: T.let[T.int32] = T.max(T.min(2, (i - 3) // 4 + 1), 0)
        for t, r in T.grid(T.max(T.min(2, (i - 3) // 4 + 1), 0), 4):
            with T.sblock("masked_max_inner"):
                vi = T.axis.spatial(8, i)
                vj = T.axis.reduce(8, t * 4 + r)
                m[vi] = T.max(m[vi], x[vi, vj])
        for t, r in T.grid(2 - t_outer, 4):
            with T.sblock("masked_max"):
                vi = T.axis.spatial(8, i)
                vj = T.axis.reduce(8, (t + t_outer) * 4 + r)
                m[vi] = T.max(m[vi], T.Select(vj <= vi, x[vi, vj], T.min_value("float32")))


def test_unmask_inner_tiles_gives_the_expected_ir_and_replays():
    sch = tvm.s_tir.Schedule(_causal_max)
    sch.unmask_inner_tiles(sch.get_loops(sch.get_sblock("masked_max"))[1])
    tvm.ir.assert_structural_equal(
        sch.mod["main"].without_attr("global_symbol"), _causal_max_unmasked.without_attr("global_symbol")
    )
    replayed = tvm.s_tir.Schedule(_causal_max)
    sch.trace.apply_to_schedule(replayed, remove_postproc=True)
    assert tvm_ffi.structural_equal(replayed.mod, sch.mod)
    x = np.random.default_rng(0).standard_normal((8, 8)).astype("float32")
    (m,) = run_prim_func(sch.mod["main"], [x])
    np.testing.assert_array_equal(m, np.where(np.tril(np.ones((8, 8), bool)), x, -np.inf).max(axis=1))


def _tile_pieces(func, block_row, i0):
    """Per piece of the key-tile loop after ``unmask_inner_tiles``, in order: whether its
    blocks read masked scores, and its tile count for thread block row ``block_row``."""
    values = {i0: tvm.tirx.const(block_row, "int32")}
    analyzer = tvm.sym.Analyzer()
    pieces = []

    def visit(node):
        if isinstance(node, tvm.tirx.Bind):
            values[node.var] = analyzer.simplify(substitute(node.value, values))
        elif isinstance(node, tvm.tirx.For) and node.loop_var.name == "rj_0":
            masked = []
            tvm_ffi.structural_walk(node, lambda n: masked.append(1) if _is_masked_read(n) else None)
            pieces.append((bool(masked), analyzer.simplify(substitute(node.extent, values)).value))
            return
        for child in (node if isinstance(node, tvm.tirx.SeqStmt) else [getattr(node, "body", None)]):
            if child is not None:
                visit(child)

    root = func.body.block
    for node in root.body:
        visit(node)
    return pieces


@pytest.mark.parametrize(
    "variant, window, seq_q, seq_kv, pad",
    [("causal", None, 96, 96, False), ("window", 80, 96, 96, False), ("alibi", None, 64, 128, False),
     ("global", None, 64, 100, True), ("window", 40, 64, 160, False)],
)
def test_unmask_inner_tiles_computes_whole_tiles_without_the_mask(variant, window, seq_q, seq_kv, pad):
    """Tiles every row of a 32-row block sees in full run without the mask; the boundary
    tiles before and after keep it (numpy decides which tile is which); the result is
    unchanged."""
    var = VARIANTS[variant]
    if window is not None:
        var = type(var)("window", causal=True, window=window)
    func = ops.attention(1, 2, 1, seq_q, seq_kv, 16, dtype="float32", variant=var, pad_to=(32, 16) if pad else None)
    sch, max_block, j0 = _decomposed_row_tiles(func, keys=16, rows=32)
    i0 = sch.get(sch.get_loops(max_block)[2]).loop_var
    sch.skip_masked_tiles(max_block, j0)
    sch.unmask_inner_tiles(sch.get_loops(sch.get_sblock("max_update"))[4])
    keys = -(-seq_kv // 16) * 16
    rows, cols = np.arange(seq_q)[:, None] + (seq_kv - seq_q), np.arange(keys)[None, :]
    visible = (cols <= rows if var.causal else rows >= 0) & (cols < seq_kv)
    if var.window is not None:
        visible &= rows - cols < var.window
    for r in range(seq_q // 32):
        tiles = visible[r * 32:(r + 1) * 32].reshape(32, -1, 16)
        seen, full = tiles.any(axis=(0, 2)), tiles.all(axis=(0, 2))
        kinds = [not f for s, f in zip(seen, full) if s]  # masked?, over the visited tiles
        expected = [(k, len(list(g))) for k, g in itertools.groupby(kinds)]
        # Consecutive pieces of one kind (a head and a tail around an empty inner piece)
        # are one run of masked tiles.
        pieces = [(k, n) for k, n in _tile_pieces(sch.mod["main"], r, i0) if n]
        runs = [(k, sum(n for _, n in g)) for k, g in itertools.groupby(pieces, key=lambda p: p[0])]
        assert runs == expected, (r, pieces, expected)
    _assert_matches_reference(sch, var, seq_q, seq_kv)


def test_unmask_inner_tiles_refuses_a_loop_without_masked_scores():
    func = ops.attention(1, 1, 1, 64, 64, 16, dtype="float32", variant=VARIANTS["global"])
    sch, _, j0 = _decomposed_row_tiles(func, keys=16, rows=32)
    before = sch.mod
    with pytest.raises(FusionError, match="no block below loop 'rj_0' reads masked scores"):
        sch.unmask_inner_tiles(j0)
    assert tvm_ffi.structural_equal(sch.mod, before)


def _source(mod):
    return prefill.build(mod, CUDA).mod.imports[0].inspect_source()


def test_schedule_runs_both_gemms_on_tensor_cores_in_one_kernel():
    func = ops.attention(1, 2, 1, 256, 256, 128, dtype="float16", variant=VARIANTS["causal"])
    sch = prefill.schedule_prefill(func, prefill.PrefillConfig(keys=32))
    trace = str(sch.trace)
    assert trace.count("sch.rolling_update(") == 2 and "sch.split_tile_accumulation(" in trace
    assert _key_tile(sch) == 32
    source = _source(sch.mod)
    assert len(re.findall(r'extern "C" __global__ void __launch_bounds__\(128\) \w+\(.*\{', source)) == 1
    # Q·Kᵀ (K read as the transposed operand) and P·V on m16n8k16 mma.sync; Q, K and P
    # loaded by plain ldmatrix, V transposed.
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in source
    assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in source
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in source
    # Every fragment is lowered to per-lane registers (a whole-warp array has 512+
    # elements); the running output is a warp's 32 rows x 128 dims, 128 floats a lane,
    # never in shared memory until the epilogue, which normalises it a column pair at a
    # time into shared memory, from where each warp stores its rows in 128-bit words.
    fragments = dict(re.findall(r"alignas\(64\) \w+ (\w+_warp_ptr)\[(\d+)\]", source))
    assert fragments.pop("pv_warp_ptr") == "128"
    assert all(int(size) <= 32 for size in fragments.values()), fragments
    assert "pv_shared" not in source and "pv_tile_shared" not in source
    pair = re.search(r"float2 (\w+) = \*\(float2\*\)\(pv_warp_ptr \+ 0\);", source)
    assert pair and f"{pair[1]}.x/" in source
    assert re.search(r"\*\(half2\*\)\(\(\(half\*\)buf_dyn_shmem_ptr\) \+ .*\) = __\w+;", source)
    stores = re.findall(r"\*\(uint4\*\)\(out_ptr \+ .*\) = \*\(uint4\*\)\(\(\(half\*\)buf_dyn_shmem_ptr\)", source)
    assert len(stores) == 16 and "out_ptr[" not in source  # 32 x 128 halves, 8 a lane a store
    # Every K and V copy is asynchronous (cp.async: the pipelined key loop, its prologue).
    assert "*(uint4*)(K_ptr" not in source and "*(uint4*)(V_ptr" not in source
    # A tile is 32 x 128 halves, 8 a lane a copy: 4 copies, in the prologue and the loop.
    copies = [re.findall(rf"ptx_cp_async\w*\(buf_dyn_shmem_ptr, .*, {name}_ptr, ", source) for name in "KV"]
    assert [len(c) for c in copies] == [8, 8]
    # The row statistics are registers, replicated in the four lanes of a row: only the
    # lanes' partial max and sum cross lanes, by shuffles within the quad; nothing lives
    # in static shared memory.
    shuffled = re.findall(r"__shfl_sync\(__activemask\(\), (\w+)\[\d+\], (.*?), 32\)", source)
    assert {re.sub("_inner", "", name) for name, _ in shuffled} == {"max_tile_tile_warp_ptr", "sum_tile_tile_warp_ptr"}
    lanes = {lane for _, lane in shuffled}
    assert lanes == {"((((int)threadIdx.x) >> 2) * 4)"} | {f"(((((int)threadIdx.x) >> 2) * 4) + {c})" for c in (1, 2, 3)}
    assert not re.search(r"(?<!extern )__shared__ ", source)
    # Barriers only for the K and V tiles between the stages of a key tile (in the
    # kernel's body or the key-tile loop).
    assert max(_barrier_depths(source)) <= 2
    # The causal mask bounds the key tiles by the block's last row, the same for all its
    # warps: its first row sees the 4 tiles of 32 keys per 128 rows before the block's
    # 4 diagonal tiles in full. One software-pipelined loop over all of them (the last
    # in the pipeline's epilogue), each tile's copy of the scores branching on whether
    # the mask applies to it.
    loop = re.search(r"for \(int rj_0 = 0; rj_0 < \(\(\(\(\(int\)blockIdx.x\) & 1\) \* 4\) \+ 3\); \+\+rj_0\) \{", source)
    assert loop and "if (rj_0 < ((((int)blockIdx.x) & 1) * 4)) {" in source[loop.end():]
    assert "cp.async.wait_group 1;" in source


@pytest.mark.parametrize("variant, scores", [("global", "qk_warp"), ("alibi", "score_warp")])
def test_row_sum_adds_float32_exps(variant, scores):
    """The row sum adds exps computed in float32 from the scores (the Q·Kᵀ accumulators,
    or under ALiBi the scores computed into registers) and P·V's A operand holds them in
    fp16."""
    func = ops.attention(1, 1, 1, 128, 128, 64, dtype="float16", variant=VARIANTS[variant])
    sch = prefill.schedule_prefill(func)
    blocks = {b.name_hint: b for b in ir.blocks_in(sch.mod["main"].body.block)}

    def reads(name):
        return {(r.source.name, str(r.source.dtype)) for r in blocks[name].reads}

    assert ("exp_warp", "float16") in reads("pv_tile_update_o")
    assert reads("sum_tile_tile") == {(scores, "float32"), ("max_warp", "float32")}


@pytest.mark.parametrize("variant, kept", [("alibi", True), ("causal", True), ("softcap", False)])
def test_scores_with_a_position_bias_or_a_causal_mask_are_computed_once_into_registers(variant, kept):
    """Under ALiBi each score (its bias: index arithmetic and the head's slope) is
    computed once per key tile into registers, in the place of the Q·Kᵀ accumulators,
    and the max and the exps read it; so is a causal mask's score (the inner and
    boundary tiles then branch on one statement: the score's, masked or not). Otherwise
    the score is inlined into both. The CUDA source computes the slope (``powf``) once
    per score store: unmasked in the inner tiles' branch of the key loop, masked in the
    boundary tiles' branch and the pipeline's epilogue (a boundary tile)."""
    func = ops.attention(1, 2, 2, 256, 256, 64, dtype="float16", variant=VARIANTS[variant])
    assert prefill.position_bias(func) is (variant == "alibi")
    assert prefill.causal_mask(func) is (variant != "softcap")
    sch = prefill.schedule_prefill(func)
    scores = {
        b.writes[0].source.scope() for b in ir.blocks_in(sch.mod["main"].body.block) if b.name_hint.startswith("score")
    }
    assert scores == ({"warp"} if kept else set())
    if variant == "alibi":
        statements = [line.strip() for line in _source(sch.mod).splitlines() if "powf(" in line and "=" in line]
        # 32 rows x 64 keys per warp: 64 scores a lane in the inner tiles' branch.
        assert len([line for line in statements if line.startswith("score_warp_ptr[")]) == 64
        # The others are masked scores (selected or not by the mask).
        assert all(re.match(r"condval\w* = ", line) for line in statements if not line.startswith("score_warp_ptr["))
        # Neither the max nor the exps compute a bias.
        assert not any("max(" in line or "exp" in line for line in statements)


def _pipelined_loops(mod):
    """The loops of ``mod`` that TVM software-pipelines once ``prefill.build`` has applied
    the schedule's choices."""
    chosen = software_pipeline.apply_chosen_pipelines(mod)
    return [l for l in _loops(chosen["main"]) if software_pipeline.STAGES in l.annotations]


def test_unmasked_key_loop_prefetches_the_next_tile_asynchronously():
    """Without a mask the key-tile loop is software-pipelined FlashAttention-2's way: the
    next tile's K copy (cp.async) issued once this tile's Q·Kᵀ has read K, its V copy
    once P·V has read V, into the same shared buffers (not double-buffered); the next
    iteration's Q·Kᵀ waits for both."""
    func = ops.attention(1, 2, 2, 256, 256, 128, dtype="float16", variant=VARIANTS["global"])
    sch = prefill.schedule_prefill(func)
    assert _key_tile(sch) == 64
    loops = _pipelined_loops(sch.mod)
    assert len(loops) == 1 and list(loops[0].annotations["software_pipeline_async_stages"]) == [0]
    stages = list(loops[0].annotations["software_pipeline_stage"])
    assert stages[:2] == [0, 0] and set(stages[2:]) == {1}
    names = software_pipeline.statement_blocks(loops[0])
    scores = next(k for k, blocks in enumerate(names) if "qk_update_o" in blocks)
    order = list(loops[0].annotations["software_pipeline_order"])
    v_copy, k_copy = (names.index([f"{operand}_shared.dyn"]) for operand in "VK")
    rest = range(2, len(names))
    expected = [k for k in rest if k <= scores] + [k_copy] + [k for k in rest if k > scores] + [v_copy]
    assert sorted(range(len(names)), key=order.__getitem__) == expected
    source = _source(sch.mod)
    # 16-byte copies: 128 threads x 8 halves, 8 rounds each for K and V (64 keys x 128).
    assert source.count("cp.async.cg.shared.global [%0], [%1], %2;") >= 1
    body = source[source.index("main_kernel(half* __restrict__ K_ptr"):]
    loop = body[body.index("for (int rj_0 = 0; rj_0 < 3; ++rj_0) {"):]
    loop = loop[: loop.index("wait_group_0()")]  # (up to the last tile's, peeled)
    copies = {
        operand: [m.start() for m in re.finditer(rf"ptx_cp_async\w*\(buf_dyn_shmem_ptr, [^;]*{operand}_ptr", loop)]
        for operand in "KV"
    }
    mmas = [m.start() for m in re.finditer("mma.sync.aligned", loop)]
    commits = [m.start() for m in re.finditer(r"cp_async_commit_group\w*\(\);", loop)]
    waits = [m.start() for m in re.finditer(r"wait_group_1\(\);", loop)]
    assert len(copies["K"]) == len(copies["V"]) == 8 and len(mmas) == 16 + 128 and len(commits) == 2
    # (copy_waits.defer_copy_waits:) K's wait before Q·Kᵀ leaves V in flight, V's before
    # P·V leaves the next K in flight.
    assert len(waits) == 2
    assert waits[0] < mmas[0] and mmas[15] < min(copies["K"]) < max(copies["K"]) < commits[0] < waits[1] < mmas[16]
    assert mmas[-1] < min(copies["V"]) < max(copies["V"]) < commits[1]
    # One buffer each: the copies write the same shared memory every iteration.
    assert "rj_0 + 1) & 1)" not in loop and "rj_0 & 1)" not in loop
    # The loop reads Q first: Q's cp.async are a commit group of their own, before the
    # first K tile's and the first V tile's (async_prologue_copies, defer_copy_waits);
    # the loop's first wait leaves Q's and K's complete.
    q_copies = [m.start() for m in re.finditer(r"ptx_cp_async\w*\(buf_dyn_shmem_ptr, [^;]*Q_ptr", body)]
    commits = [m.start() for m in re.finditer(r"cp_async_commit_group\w*\(\);", body)]
    first_k, first_v = (
        min(m.start() for m in re.finditer(rf"ptx_cp_async\w*\(buf_dyn_shmem_ptr, [^;]*{operand}_ptr", body))
        for operand in "KV"
    )
    assert len(q_copies) == 16 and "*(uint4*)(Q_ptr" not in body
    assert max(q_copies) < commits[0] < first_k < commits[1] < first_v < commits[2] < body.index("for (int rj_0")
    # A window's inner tiles need not come in whole runs of a block's rows: not pipelined.
    window = VARIANTS["window"]
    masked = prefill.schedule_prefill(ops.attention(1, 2, 2, 1024, 1024, 128, dtype="float16", variant=window))
    assert not _pipelined_loops(masked.mod)


def test_interleaved_pipeline_refuses_a_loop_without_its_copies_first():
    """``interleaved_annotations`` names what the loop lacks rather than pipelining a loop
    whose statements are not the K and V copies followed by Q·Kᵀ."""

    @T.prim_func(s_tir=True)
    def two_stores(a: T.Buffer((4, 2), "float32"), b: T.Buffer((4, 2), "float32")):
        for i in range(4):
            for j in range(2):
                a[i, j] = T.float32(0)
            for j in range(2):
                b[i, j] = T.float32(1)

    with pytest.raises(ValueError, match="K and V tile copies first and one Q·Kᵀ statement"):
        software_pipeline.interleaved_annotations(two_stores.body)


@pytest.mark.parametrize(
    # 1000 keys: 16 tiles, the last one partly padding, the other 15 the inner tiles.
    "seq_kv, pad, tiles", [(1024, None, 16), (2048, None, 32), (1000, (128, 64), 15)]
)
def test_key_loops_of_constant_tiles_are_pipelined_by_default(seq_kv, pad, tiles):
    """``prefill.default_pipeline``: under mma.sync the key loop of a constant number of
    tiles is software-pipelined in single buffers (``INTERLEAVED``), whatever its length;
    under wgmma (double-buffered) up to ``PIPELINED_TILES`` key tiles (16 of 64 keys).
    Under a mask of padded keys only, the loop of the inner tiles (whole tiles, a constant
    number). Without the pipeline the choice's annotation goes and nothing else changes."""
    func = ops.attention(1, 1, 1, 128, seq_kv, 128, dtype="float16", variant=VARIANTS["global"], pad_to=pad)
    assert prefill.default_pipeline(func, 64) is True
    assert prefill.default_pipeline(func, 64, wgmma=True) is (tiles <= prefill.PIPELINED_TILES)
    for pipeline, choice in [(None, software_pipeline.INTERLEAVED), (False, 0)]:
        sch = prefill.schedule_prefill(func, prefill.PrefillConfig(pipeline=pipeline))
        (chosen,) = [l for l in _loops(sch.mod["main"]) if software_pipeline.CHOSEN in l.annotations]
        assert int(chosen.extent) == tiles
        assert int(chosen.annotations[software_pipeline.CHOSEN]) == choice
        assert [int(l.extent) for l in _pipelined_loops(sch.mod)] == ([tiles] if choice else [])
        applied = software_pipeline.apply_chosen_pipelines(sch.mod)
        assert not any(software_pipeline.CHOSEN in l.annotations for l in _loops(applied["main"]))
    unchosen = tvm.s_tir.Schedule(func, seed=1)
    prefill.apply_prefill_schedule(unchosen, 128, 64, 4, 5)
    assert tvm_ffi.structural_equal(applied, unchosen.mod)


@pytest.mark.parametrize(
    "heads_q, heads_kv, seq, heads", [(8, 2, 256, 4), (8, 1, 256, 4), (8, 2, 2048, 1), (4, 4, 256, 1), (8, 2, 250, 1)]
)
def test_gqa_thread_blocks_take_query_heads_that_share_each_key_tile(heads_q, heads_kv, seq, heads):
    """``prefill.default_heads``: under grouped-query attention of up to 1024 keys (whole
    tiles) each of a block's 4 warps takes 32 rows of its own query head of one group:
    the block copies Q of 4 heads once and each K and V tile once for all of them (their
    head is the block's group)."""
    func = ops.attention(
        1, heads_q, heads_kv, seq, seq, 128, dtype="float16", variant=VARIANTS["causal"], pad_to=(128, 64)
    )
    assert prefill.default_heads(func) == heads
    if heads == 1:
        return
    sch = prefill.schedule_prefill(func)
    copies = {}

    def visit(node):
        if isinstance(node, SBlockRealize) and any(r.source.scope() == "global" for r in node.block.reads):
            copies[node.block.reads[0].source.name] = node.iter_values[1]  # the head

    tvm_ffi.structural_walk(sch.mod["main"].body, visit)
    (block,) = [
        l for l in _loops(sch.mod["main"]) if l.thread_binding is not None and l.thread_binding.thread_tag == "blockIdx.x"
    ]
    analyzer = tvm.sym.Analyzer()
    analyzer.bind(block.loop_var, tvm.ir.Range(0, block.extent))
    groups_per_kv = heads_q // heads_kv // heads
    # K and V of the block's group: its head is the block's index / row tiles of a head.
    for name in ("K", "V"):
        assert all(v.same_as(block.loop_var) for v in vars_in(copies[name]))
        assert analyzer.can_prove_equal(copies[name], block.loop_var // (seq // 32) // groups_per_kv)
    # Q of 4 heads: a loop over them in the block's copy.
    (head,) = [v for v in vars_in(copies["Q"]) if not v.same_as(block.loop_var)]
    assert analyzer.can_prove_equal(copies["Q"] - head, block.loop_var // (seq // 32) * heads)
    (head_loop,) = [l for l in _loops(sch.mod["main"]) if l.loop_var.same_as(head)]
    assert int(head_loop.extent) == heads


def _loops(func):
    found = []
    tvm_ffi.structural_walk(func.body, lambda n: found.append(n) if isinstance(n, tvm.tirx.For) else None)
    return found


@pytest.mark.parametrize(
    "variant, seq_q, seq_kv", [("global", 128, 64), ("causal", 64, 64), ("alibi", 128, 64), ("global", 20, 30)]
)
def test_a_key_loop_of_one_tile_builds(variant, seq_q, seq_kv):
    """64 keys or fewer: one key tile. Its loop stays a loop (an annotation), else TVM's
    storage planner gives an fp16 operand an fp32 buffer's place and lowering fails.
    Under a mask there are no tiles to skip (with the scores kept, ``skip_masked_tiles``
    would refuse the one tile)."""
    func = ops.attention(
        1, 2, 2, seq_q, seq_kv, 128, dtype="float16", variant=VARIANTS[variant], pad_to=(128, 64)
    )
    sch = prefill.schedule_prefill(func)
    assert "tvm_cascade.keep_loop" in sch.mod.script()
    assert "mma.sync" in _source(sch.mod)


def test_compile_attention_pads_to_whole_tiles_of_the_config():
    """``compile_attention(config=...)`` pads the lengths to whole tiles of the config's
    (and of :data:`kernels.PAD_TO`, which the default schedule needs), so 256-row blocks
    compile at any query length (the GPU test checks the numbers)."""
    config = prefill.PrefillConfig(rows=256, keys=32, wgmma=True)
    assert kernels.padding("prefill", 4, 2, 300, 128) == (128, 64)
    assert kernels.padding("prefill", 4, 2, 300, 128, config) == (256, 64)
    compiled = kernels.compile_attention(1, 4, 2, 300, 333, 128, target=CUDA, config=config)
    assert "wgmma.mma_async" in compiled.mod.imports[0].inspect_source()


@pytest.mark.parametrize(
    "variant, seq_q, seq_kv",
    # 200 keys: the last tile's valid keys end at a whole column of the fragment layout,
    # where the mask's condition once let TVM's simplifier merge the lane's element offset
    # into the tile's (LowerWarpMemory then failed).
    [("causal", 200, 300), ("global", 130, 65), ("global", 130, 200)],
)
def test_lengths_that_are_not_whole_tiles_are_padded(variant, seq_q, seq_kv):
    """``ops.attention(pad_to=...)`` pads to whole tiles; the schedule inlines the pad
    blocks into the shared-memory copies, which load zeros past the inputs' ends, and the
    output rows past the query length are not stored."""
    func = ops.attention(
        1, 2, 1, seq_q, seq_kv, 128, dtype="float16", variant=VARIANTS[variant], pad_to=(128, 64)
    )
    sch = prefill.schedule_prefill(func)
    assert padded_inputs(tvm.s_tir.Schedule(func)) == ["Q_pad", "K_pad", "V_pad"]
    assert padded_inputs(sch) == []
    source = _source(sch.mod)
    assert len(re.findall(r'extern "C" __global__ void __launch_bounds__\(128\) \w+\(.*\{', source)) == 1
    # One copy step of all 128 threads covers 8 rows of 128 fp16 columns.
    step_rows = 128 * 8 // 128
    for operand, length in (("Q", seq_q), ("K", seq_kv), ("V", seq_kv)):
        # 128-bit loads, guarded (zeros otherwise) where a step can reach past the end;
        # or, where Q's copy is asynchronous (a pipelined loop of inner tiles reads it
        # first: 130 x 200), predicated cp.async that store zeros where the predicate fails.
        if length % step_rows:
            loaded = re.search(rf"if \(.*\) {{\n\s*condval\w* = \*\(uint4\*\)\({operand}_ptr", source)
            copied = re.search(rf"ptx_cp_async\w*_pred\w*\(buf_dyn_shmem_ptr, [^;]*{operand}_ptr, [^;]*< \d+\)\);", source)
            assert loaded or (copied and "@!p st.shared.v4.u32 [%0], {%4, %4, %4, %4};" in source)
    if seq_kv % step_rows == 0:
        # Keys in whole steps: the last key tile's steps are known to be in or out of
        # range, and those out of range store zeros without a guard.
        assert re.search(r"\n\s*\*\(uint4\*\)\(\(\(half\*\)buf_dyn_shmem_ptr\) \+ .*\) = make_uint4\(__pack_half2\(__float2half_rn\(0x0p\+0f", source)
    assert re.search(r"if \(.*\) \{\n\s*\*\(uint4\*\)\(out_ptr \+ ", source)
    # The padded keys are masked: the tiles before the last are computed without it, in
    # a key-tile loop of their own, or under a causal mask in a branch of the one loop
    # over all of a block's tiles.
    loops = re.findall(r"for \(int rj_0(_1)? = 0;", source)
    assert len(loops) == 1 and "if (rj_0 <" in source if variant == "causal" else len(loops) == 2


def _barrier_depths(source):
    """Brace depth of every ``__syncthreads`` in the kernel (1: the kernel's body)."""
    body = source[source.index("main_kernel(half* __restrict__ K_ptr"):]
    body = body[body.index("{"):]
    depth, depths = 0, []
    for k, c in enumerate(body):
        depth += (c == "{") - (c == "}")
        if body.startswith("__syncthreads", k):
            depths.append(depth)
    return depths


@pytest.mark.parametrize(
    "variant, level", [("global", 5), ("softcap", 5), ("window", 10), ("causal", 5), ("alibi", 5), ("gqa", 5)]
)
def test_default_register_level_follows_the_score(variant, level):
    """ptxas at register usage level 10 under a window mask, 5 otherwise, also with
    padded keys."""
    for pad in (None, (128, 64)):
        func = ops.attention(1, 2, 2, 250, 250, 64, dtype="float16", variant=VARIANTS[variant], pad_to=pad)
        assert prefill.default_register_usage_level(func) == level


def _key_tile(sch):
    """The key tile of the prefill schedule ``sch`` (its first split: the key loop's)."""
    return int(re.search(r"sch\.split\(loop=\w+, factors=\[None, (\d+)\]", str(sch.trace)).group(1))


def test_schedule_refuses_shapes_off_the_tiles():
    func = ops.attention(1, 1, 1, 200, 200, 128, dtype="float16", variant=VARIANTS["global"])
    with pytest.raises(ValueError, match="multiple of 128"):
        prefill.schedule_prefill(func)
    gqa = ops.attention(1, 8, 2, 256, 256, 128, dtype="float16", variant=VARIANTS["causal"])
    with pytest.raises(ValueError, match="3 query heads per thread block must divide its 4 warps"):
        prefill.schedule_prefill(gqa, prefill.PrefillConfig(heads=3))
    mha = ops.attention(1, 8, 8, 256, 256, 128, dtype="float16", variant=VARIANTS["causal"])
    with pytest.raises(ValueError, match=r"and the query heads that share a K and V head \(1\)"):
        prefill.schedule_prefill(mha, prefill.PrefillConfig(heads=4))
    padded = ops.attention(1, 8, 2, 130, 256, 128, dtype="float16", variant=VARIANTS["causal"], pad_to=(128, 64))
    assert prefill.default_heads(padded) == 1
    with pytest.raises(ValueError, match="multiple of 32 rows per head; got 130"):
        prefill.schedule_prefill(padded, prefill.PrefillConfig(heads=4))


def _replayed(func, trace, samples, decisions):
    """(``trace`` with ``decisions`` for its ``samples``, that trace replayed on ``func``)."""
    for inst, decision in zip(samples, decisions):
        trace = trace.with_decision(inst, decision, remove_postproc=True)
    replayed = tvm.s_tir.Schedule(func)
    trace.apply_to_schedule(replayed, remove_postproc=True)
    return trace, replayed


@in_a_process_ahead
def test_design_space_replays_under_every_decision_and_through_json():
    # Two row tiles: the second block has inner tiles, which run in pipelined groups.
    func = ops.attention(1, 2, 2, 256, 256, 128, dtype="float16", variant=VARIANTS["alibi"])
    sch = tvm.s_tir.Schedule(func, seed=1)
    prefill.prefill_design_space()(sch)
    samples = [i for i in sch.trace.insts if i.kind.name == "SampleCategorical"]
    choices = [prefill.KEY_TILES, prefill.PV_SPLITS, prefill.REGISTER_USAGE_LEVELS]
    assert [len(i.attrs[0]) for i in samples] == [len(c) for c in choices]
    # Every key tile and P·V split, each register level once (an annotation for the build).
    for decisions in itertools.product(range(len(prefill.KEY_TILES)), range(len(prefill.PV_SPLITS))):
        decisions += (sum(decisions) % len(prefill.REGISTER_USAGE_LEVELS),)
        trace, replayed = _replayed(func, sch.trace, samples, decisions)
        direct = tvm.s_tir.Schedule(func)
        values = [c[d] for c, d in zip(choices, decisions)]
        prefill.apply_prefill_schedule(direct, prefill.PrefillConfig().rows, *values)
        assert tvm_ffi.structural_equal(replayed.mod, direct.mod), decisions
    as_json = json.loads(json.dumps(cascade_trace.trace_to_json(trace, remove_postproc=True)))
    reloaded = tvm.s_tir.Schedule(func)
    cascade_trace.apply_json_to_schedule(as_json, reloaded)
    assert tvm_ffi.structural_equal(reloaded.mod, replayed.mod)
    assert "mma.sync" in _source(reloaded.mod)


@pytest.mark.parametrize("heads_q, heads_kv, seq_kv, pad", [(2, 2, 256, None), (2, 2, 250, (128, 64)), (8, 2, 256, None)])
@in_a_process_ahead
def test_design_space_samples_the_pipeline_of_a_key_loop_of_constant_tiles(heads_q, heads_kv, seq_kv, pad):
    """Without a mask (and under a mask of padded keys only: the inner tiles' loop) the
    key loop's software pipeline is a fourth decision; each replays into the schedule
    whose loop is annotated with that choice (with GQA: blocks of 4 query heads,
    ``prefill.default_heads``, in every sample)."""
    func = ops.attention(1, heads_q, heads_kv, 256, seq_kv, 128, dtype="float16", variant=VARIANTS["global"], pad_to=pad)
    sch = tvm.s_tir.Schedule(func, seed=1)
    prefill.prefill_design_space()(sch)
    samples = [i for i in sch.trace.insts if i.kind.name == "SampleCategorical"]
    choices = [prefill.KEY_TILES, prefill.PV_SPLITS, prefill.REGISTER_USAGE_LEVELS, prefill.PIPELINES]
    assert [[int(c) for c in i.attrs[0]] for i in samples] == [list(c) for c in choices]
    for decisions in [(0, 0, 0, 1), (1, 2, 1, 0), (0, 1, 0, 0)]:
        trace, replayed = _replayed(func, sch.trace, samples, decisions)
        direct = tvm.s_tir.Schedule(func)
        keys, pv_split, level, pipeline = (c[d] for c, d in zip(choices, decisions))
        heads = prefill.default_heads(func)
        assert heads == (4 if heads_q > heads_kv else 1)
        loop = prefill.apply_prefill_schedule(direct, prefill.PrefillConfig().rows, keys, pv_split, level, heads)
        direct.annotate(loop, software_pipeline.CHOSEN, pipeline)
        assert tvm_ffi.structural_equal(replayed.mod, direct.mod), decisions
        tiles = -(-seq_kv // keys) - (pad is not None)
        assert [int(l.extent) for l in _pipelined_loops(replayed.mod)] == ([tiles] if pipeline else [])


def test_tuned_records_reload_into_prefill_schedules(tmp_path):
    """Prefill configurations read a JSON database in the format
    ``python -m benchmarks.tune_prefill`` writes: the best record's schedule comes back."""
    func = ops.attention(1, 2, 1, 128, 128, 128, dtype="float16", variant=VARIANTS["causal"])
    traces = write_records(tmp_path, func, prefill.prefill_design_space(), CUDA, [(1, 2e-5), (5, 1e-5)])
    sch = kernels.schedule(func, CUDA, tmp_path)
    expected = tvm.s_tir.Schedule(func)
    traces[1].apply_to_schedule(expected, remove_postproc=True)
    assert tvm_ffi.structural_equal(sch.mod, expected.mod)
    other = ops.attention(1, 2, 1, 256, 256, 128, dtype="float16", variant=VARIANTS["causal"])
    assert kernels.tuned_schedule(other, CUDA, tmp_path) is None
    assert tvm_ffi.structural_equal(
        kernels.schedule(other, CUDA, tmp_path).mod, prefill.schedule_prefill(other).mod
    )


def test_checked_in_records_replay_into_prefill_schedules(monkeypatch):
    """The records under ``tvm_cascade/tuned/prefill`` (causal, batch 8, 32 heads, 1024
    rows; tuned on an H200) replay with today's schedules: on sm_90 the best is the
    warp-specialised kernel with 3 stages, overlap and ping-pong (0.257 ms; its other
    choices 0.271-0.352); elsewhere, the best tensor-core record, the heuristic schedule of
    64-key tiles, P·V in one pass, ptxas level 10 (0.277 ms when MetaSchedule measured it
    again beside the warp-specialised samples; four passes 0.278, the heuristic's level 5
    within 0.5%)."""
    monkeypatch.delenv("TVM_CASCADE_TUNED_PREFILL", raising=False)
    variant = VARIANTS["causal"]
    func = ops.attention(
        8, 32, 32, 1024, 1024, 128, dtype="float16", variant=variant, pad_to=kernels.PAD_TO["prefill"]
    )
    records = kernels.default_records("prefill")
    sch = kernels.tuned_schedule(func, CUDA, records)
    assert tvm_ffi.structural_equal(sch.mod, warp_specialized.schedule(func, variant).mod)
    sch = kernels.tuned_schedule(func, tvm.target.Target({"kind": "cuda", "arch": "sm_80"}), records)
    expected = prefill.schedule_prefill(func, prefill.PrefillConfig(keys=64, pv_split=1, register_usage_level=10))
    assert tvm_ffi.structural_equal(sch.mod, expected.mod)


def test_tuning_builder_processes_build_design_space_samples(monkeypatch):
    """MetaSchedule's builder processes, as ``kernels.tune`` starts them (fresh
    interpreters running ``kernels.builder_init``), build a sample of the design space:
    the build function is found there and the sample compiles. (Whether the sample's
    CUDA needs the tensor intrinsics the initializer registers is not checked: it
    compiles without them.)"""
    from tvm.s_tir import meta_schedule as ms

    # LocalBuilder's constructor starts a process of its own, running the initializer
    # (half a minute), only to look up the build function, which the build's process
    # looks up again (an error there is the result's error_msg).
    monkeypatch.setattr(ms.builder.LocalBuilder._cls, "_sanity_check", lambda self: None)
    func = ops.attention(1, 2, 2, 128, 128, 128, dtype="float16", variant=VARIANTS["global"])
    sch = tvm.s_tir.Schedule(func, seed=1)
    prefill.prefill_design_space()(sch)
    builder = ms.builder.LocalBuilder(
        f_build=tensor_cores.BUILD_FUNC, initializer=functools.partial(kernels.builder_init, ("tensor_core_prefill",)), timeout_sec=120, max_workers=1
    )
    result, = builder.build([ms.builder.BuilderInput(sch.mod, CUDA)])
    assert result.error_msg is None, result.error_msg
    assert Path(result.artifact_path).stat().st_size > 0


def test_prefill_kernels_compile_at_the_register_usage_level_of_their_schedule(monkeypatch):
    """``prefill.build`` compiles with ``TVM_CUDA_PTXAS_REG_LEVEL`` (which TVM's CUDA
    compile callback passes to ptxas) at the level the schedule annotated, restored
    afterwards, unless the user chose a level; without an annotation, TVM's own."""
    levels = []
    monkeypatch.setattr(tvm, "compile", lambda *args, **kwargs: levels.append(os.environ.get("TVM_CUDA_PTXAS_REG_LEVEL")))
    monkeypatch.delenv("TVM_CUDA_PTXAS_REG_LEVEL", raising=False)
    sch = tvm.s_tir.Schedule(ops.attention(1, 1, 1, 128, 64, 16, dtype="float16"))
    prefill.build(sch.mod, CUDA)
    sch.annotate(sch.get_loops(sch.get_sblock("max"))[0], prefill.REGISTER_USAGE_LEVEL, 7)
    prefill.build(sch.mod, CUDA)
    assert levels == [None, "7"] and "TVM_CUDA_PTXAS_REG_LEVEL" not in os.environ
    monkeypatch.setenv("TVM_CUDA_PTXAS_REG_LEVEL", "3")
    prefill.build(sch.mod, CUDA)
    assert levels[-1] == "3"


def test_prefill_kernels_fit_the_thread_blocks_per_multiprocessor_their_schedule_asks_for():
    """``PrefillConfig(min_blocks=2)`` annotates the thread-block loop and ``prefill.build``
    compiles the kernel with ``__launch_bounds__(threads, 2)``; without it, threads only;
    two functions asking for different counts are refused."""
    func = ops.attention(1, 2, 2, 256, 256, 128, dtype="float16")
    for min_blocks, bounds in ((None, "__launch_bounds__(128)"), (2, "__launch_bounds__(128, 2)")):
        sch = prefill.schedule_prefill(func, prefill.PrefillConfig(min_blocks=min_blocks))
        source = prefill.build(sch.mod, CUDA).mod.imports[0].inspect_source()
        assert source.count(bounds + " main_kernel(") == 2
    one, other = (tvm.s_tir.Schedule(ops.attention(1, 1, 1, 128, 64, 16, dtype="float16")) for _ in range(2))
    for sch, blocks in ((one, 1), (other, 2)):
        sch.annotate(sch.get_loops(sch.get_sblock("max"))[0], prefill.MIN_BLOCKS, blocks)
    mod = tvm.IRModule({"a": one.mod["main"].with_attr("global_symbol", "a"), "b": other.mod["main"].with_attr("global_symbol", "b")})
    with pytest.raises(ValueError, match=r"different thread blocks per multiprocessor \[1, 2\]"):
        prefill.build(mod, CUDA)
