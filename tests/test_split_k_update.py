"""split_k_update: exact IR, errors that leave the schedule alone, traces."""
import numpy as np
import pytest
import tvm
import tvm_cascade  # noqa: F401
from tvm.script import tirx as T

from tvm_cascade import FusionError, ops
from tvm_cascade.ops import reference, testing

from test_rolling_update import _assert_trace_roundtrip, softmax_pv, two_sums, variance

# fmt: off
@T.prim_func(s_tir=True)
def softmax_pv_split(S: T.Buffer((8, 128), "float32"), V: T.Buffer((128, 64), "float32"), O: T.Buffer((8, 64), "float32")):
    # with T.sblock("root"):
    m = T.sblock_alloc_buffer((8,))
    e = T.sblock_alloc_buffer((8, 128))
    l = T.sblock_alloc_buffer((8,))
    m_partial = T.sblock_alloc_buffer((4, 8))
    l_partial = T.sblock_alloc_buffer((4, 8))
    O_partial = T.sblock_alloc_buffer((4, 8, 64))
    for i, j_0 in T.grid(8, 4):
        for j_1 in range(32):
            with T.sblock("max_partial"):
                v_chunk, vi, vj_in = T.axis.remap("SSR", [j_0, i, j_1])
                T.reads(S[vi, v_chunk * 32 + vj_in])
                T.writes(m_partial[v_chunk, vi])
                with T.init():
                    m_partial[v_chunk, vi] = T.float32(-340282346638528859811704183484516925440.0)
                m_partial[v_chunk, vi] = T.max(m_partial[v_chunk, vi], S[vi, v_chunk * 32 + vj_in])
        for j_1 in range(32):
            with T.sblock("exp"):
                vi = T.axis.spatial(8, i)
                vj = T.axis.spatial(128, j_0 * 32 + j_1)
                T.reads(S[vi, vj], m_partial[vj // 32, vi])
                T.writes(e[vi, vj])
                e[vi, vj] = T.exp(S[vi, vj] - m_partial[vj // 32, vi])
        for j_1 in range(32):
            with T.sblock("sum_partial"):
                v_chunk, vi, vj_in = T.axis.remap("SSR", [j_0, i, j_1])
                T.reads(e[vi, v_chunk * 32 + vj_in])
                T.writes(l_partial[v_chunk, vi])
                with T.init():
                    l_partial[v_chunk, vi] = T.float32(0.0)
                l_partial[v_chunk, vi] = l_partial[v_chunk, vi] + e[vi, v_chunk * 32 + vj_in]
        for ax0, j_1 in T.grid(64, 32):
            with T.sblock("pv_partial"):
                v_chunk, vi, vd, vj_in = T.axis.remap("SSSR", [j_0, i, ax0, j_1])
                T.reads(e[vi, v_chunk * 32 + vj_in], V[v_chunk * 32 + vj_in, vd])
                T.writes(O_partial[v_chunk, vi, vd])
                with T.init():
                    O_partial[v_chunk, vi, vd] = T.float32(0.0)
                O_partial[v_chunk, vi, vd] = O_partial[v_chunk, vi, vd] + e[vi, v_chunk * 32 + vj_in] * V[v_chunk * 32 + vj_in, vd]
    for ax0, chunk in T.grid(8, 4):
        with T.sblock("max"):
            vi, v_chunk = T.axis.remap("SR", [ax0, chunk])
            T.reads(m_partial[v_chunk, vi])
            T.writes(m[vi])
            with T.init():
                m[vi] = T.float32(-340282346638528859811704183484516925440.0)
            m[vi] = T.max(m[vi], m_partial[v_chunk, vi])
    for ax0, chunk in T.grid(8, 4):
        with T.sblock("sum"):
            vi, v_chunk = T.axis.remap("SR", [ax0, chunk])
            T.reads(l_partial[v_chunk, vi], m_partial[v_chunk, vi], m[vi])
            T.writes(l[vi])
            with T.init():
                l[vi] = T.float32(0.0)
            l[vi] = l[vi] + l_partial[v_chunk, vi] * T.exp(m_partial[v_chunk, vi] - m[vi])
    for ax0, ax1, chunk in T.grid(8, 64, 4):
        with T.sblock("pv"):
            vi, vd, v_chunk = T.axis.remap("SSR", [ax0, ax1, chunk])
            T.reads(O_partial[v_chunk, vi, vd], m_partial[v_chunk, vi], m[vi])
            T.writes(O[vi, vd])
            with T.init():
                O[vi, vd] = T.float32(0.0)
            O[vi, vd] = O[vi, vd] + O_partial[v_chunk, vi, vd] * T.exp(m_partial[v_chunk, vi] - m[vi])
# fmt: on


def _split_chunks(func, chunks):
    sch = tvm.s_tir.Schedule(func, debug_mask="all")
    j = sch.get_loops(sch.get_sblock("max"))[-1]
    j0, _ = sch.split(j, [chunks, None])
    return sch, j0


def test_exact_ir_softmax_sum_pv():
    sch, j0 = _split_chunks(softmax_pv, 4)
    for name in ("max", "sum", "pv"):
        sch.split_k_update(sch.get_sblock(name), j0)
    tvm.ir.assert_structural_equal(
        sch.mod["main"].without_attr("global_symbol"),
        softmax_pv_split.without_attr("global_symbol"),
    )
    assert "sch.split_k_update(block=b7, loop=l3)" in str(sch.trace)
    _assert_trace_roundtrip(sch, softmax_pv)


def test_exact_ir_numerics():
    rng = np.random.default_rng(0)
    s = (rng.standard_normal((8, 128)) * 8).astype("float32")
    v = rng.standard_normal((128, 64)).astype("float32")
    (out,) = testing.run_prim_func(softmax_pv_split, [s, v])
    s64 = s.astype("float64")
    p = np.exp(s64 - s64.max(axis=1, keepdims=True))
    np.testing.assert_allclose(out, p @ v, rtol=1e-5, atol=1e-4)


# fmt: off
@T.prim_func(s_tir=True)
def logsumexp_ragged_split(X: T.Buffer((2, 10), "float32"), out: T.Buffer((2,), "float32")):
    max = T.sblock_alloc_buffer((2,))
    sum = T.sblock_alloc_buffer((2,))
    max_partial = T.sblock_alloc_buffer((3, 2))
    sum_partial = T.sblock_alloc_buffer((3, 2))
    for i, rj_0 in T.grid(2, 3):
        for rj_1 in range(4):
            with T.sblock("max_partial"):
                v_chunk, v_i, v_rj_in = T.axis.remap("SSR", [rj_0, i, rj_1])
                T.reads(X[v_i, T.min(v_chunk * 4, 6) + v_rj_in])
                T.writes(max_partial[v_chunk, v_i])
                with T.init():
                    max_partial[v_chunk, v_i] = T.float32(-340282346638528859811704183484516925440.0)
                max_partial[v_chunk, v_i] = T.max(max_partial[v_chunk, v_i], T.Select(T.min(v_chunk * 4, 6) + v_rj_in >= v_chunk * 4, X[v_i, T.min(v_chunk * 4, 6) + v_rj_in], T.float32(-340282346638528859811704183484516925440.0)))
        for rj_1 in range(4):
            with T.sblock("sum_partial"):
                v_chunk, v_i, v_rj_in = T.axis.remap("SSR", [rj_0, i, rj_1])
                T.reads(X[v_i, T.min(v_chunk * 4, 6) + v_rj_in], max_partial[v_chunk, v_i])
                T.writes(sum_partial[v_chunk, v_i])
                with T.init():
                    sum_partial[v_chunk, v_i] = T.float32(0.0)
                sum_partial[v_chunk, v_i] = sum_partial[v_chunk, v_i] + T.Select(T.min(v_chunk * 4, 6) + v_rj_in >= v_chunk * 4, T.exp(X[v_i, T.min(v_chunk * 4, 6) + v_rj_in] - max_partial[v_chunk, v_i]), T.float32(0.0))
    for ax0, chunk in T.grid(2, 3):
        with T.sblock("max"):
            v_i, v_chunk = T.axis.remap("SR", [ax0, chunk])
            T.reads(max_partial[v_chunk, v_i])
            T.writes(max[v_i])
            with T.init():
                max[v_i] = T.float32(-340282346638528859811704183484516925440.0)
            max[v_i] = T.max(max[v_i], max_partial[v_chunk, v_i])
    for ax0, chunk in T.grid(2, 3):
        with T.sblock("sum"):
            v_i, v_chunk = T.axis.remap("SR", [ax0, chunk])
            T.reads(sum_partial[v_chunk, v_i], max_partial[v_chunk, v_i], max[v_i])
            T.writes(sum[v_i])
            with T.init():
                sum[v_i] = T.float32(0.0)
            sum[v_i] = sum[v_i] + sum_partial[v_chunk, v_i] * T.exp(max_partial[v_chunk, v_i] - max[v_i])
    for i in range(2):
        with T.sblock("out"):
            v_i = T.axis.spatial(2, i)
            T.reads(max[v_i], sum[v_i])
            T.writes(out[v_i])
            out[v_i] = max[v_i] + T.log(sum[v_i])
# fmt: on


def test_exact_ir_chunks_that_do_not_divide_the_row():
    """10 positions in 3 chunks of 4: the last chunk reads positions 6..9 (the window
    that ends the row, contiguous) and folds only 8 and 9 (the reducer's identity where
    the chunk before has folded), with no predicate on the chunk loop."""
    sch = tvm.s_tir.Schedule(ops.logsumexp(2, 10))
    sch.compute_inline(sch.get_sblock("exp"))
    chunk = sch.split(sch.get_loops(sch.get_sblock("max"))[-1], [3, None])[0]
    for name in ("max", "sum"):
        sch.split_k_update(sch.get_sblock(name), chunk)
    tvm.ir.assert_structural_equal(
        sch.mod["main"].without_attr("global_symbol"),
        logsumexp_ragged_split.with_attr("tirx.noalias", True).without_attr("global_symbol"),
    )
    x = (np.random.default_rng(2).standard_normal((2, 10)) * 4).astype("float32")
    (out,) = testing.run_prim_func(logsumexp_ragged_split, [x])
    np.testing.assert_allclose(out, reference.logsumexp_ref(x), rtol=1e-6)


def _assert_refused(func, chunks, done, block, match, loop_of=None):
    sch, j0 = _split_chunks(func, chunks)
    for name in done:
        sch.split_k_update(sch.get_sblock(name), j0)
    loop = j0 if loop_of is None else loop_of(sch)
    block_rv = sch.get_sblock(block)
    before = sch.mod
    trace_len = len(sch.trace.insts)
    with pytest.raises(FusionError, match=match) as info:
        sch.split_k_update(block_rv, loop)
    tvm.ir.assert_structural_equal(sch.mod, before)
    assert len(sch.trace.insts) == trace_len
    assert f"'{block}'" in str(info.value)


def test_refuses_non_reduction_block():
    _assert_refused(softmax_pv, 4, ["max"], "exp", "not a reduction block")


def test_refuses_a_later_reduction_before_the_first():
    _assert_refused(softmax_pv, 4, [], "sum", "apply split_k_update to the first reduction")


def test_refuses_loop_that_is_not_the_chunk_loop():
    _assert_refused(
        softmax_pv,
        4,
        [],
        "max",
        "does not drive its reduction iterator",
        loop_of=lambda sch: sch.get_loops(sch.get_sblock("max"))[0],
    )


def test_refuses_block_reading_no_earlier_result():
    _assert_refused(two_sums, 4, ["max"], "plain_sum", "reads no result")


def test_refuses_combiner_without_repair():
    _assert_refused(variance, 4, ["max"], "spread", "has no repair")


def test_decode_attention_all_variants_fp16():
    for variant in ("global", "causal", "alibi", "softcap", "sliding_window"):
        func = ops.attention(1, 8, 2, 1, 45, 32, variant=variant, dtype="float16")
        sch, j0 = _split_chunks(func, 8)
        for name in ("max", "sum", "pv"):
            sch.split_k_update(sch.get_sblock(name), j0)
        q, k, v = testing.random_attention_inputs(1, 8, 2, 1, 45, 32, dtype="float16", magnitude=3)
        (out,) = testing.run_prim_func(sch.mod["main"], [q, k, v])
        ref = reference.attention_ref(q, k, v, variant=variant)
        np.testing.assert_allclose(out.astype("float64"), ref, atol=1e-2, err_msg=variant)


@pytest.mark.parametrize("variant, normalize", [("causal", False), ("alibi", True), ("sliding_window", False)])
def test_flash_decoding_rolls_within_chunks(variant, normalize):
    """Split-k across chunks, rolling update within each chunk."""
    shape = (1, 4, 2, 1, 77, 16)
    func = ops.attention(*shape, variant=variant, normalize_before_pv=normalize)
    sch = tvm.s_tir.Schedule(func, debug_mask="all")
    j0, j1, _ = sch.split(sch.get_loops(sch.get_sblock("max"))[-1], [4, None, 4])
    sch.rolling_update(sch.get_sblock("sum"), j1)
    sch.rolling_update(sch.get_sblock("pv"), j1)
    for name in ("max", "sum", "pv"):
        sch.split_k_update(sch.get_sblock(name), j0)
    sch.compute_at(sch.get_sblock("score"), j1)
    sch.compute_at(sch.get_sblock("qk"), j1)
    # Running state is private to each chunk: the snapshots gained a chunk dimension.
    allocs = {b.name: [int(x) for x in b.shape] for b in sch.mod["main"].body.block.alloc_buffers}
    assert allocs["max_prev_partial"] == [4, 1, 4, 1]
    assert "max_prev" not in allocs
    _assert_trace_roundtrip(sch, func)
    q, k, v = testing.random_attention_inputs(*shape, magnitude=3)
    (out,) = testing.run_prim_func(sch.mod["main"], [q, k, v])
    ref = reference.attention_ref(q, k, v, variant=variant, normalize_before_pv=normalize)
    np.testing.assert_allclose(out, ref, atol=1e-5)


def test_refuses_a_block_already_split():
    _assert_refused(softmax_pv, 4, ["max", "sum"], "sum", "already split: it combines the chunk partials of block 'sum_partial'")


def test_row_loops_below_the_chunk_loop_are_copied_for_each_block():
    """GQA decode puts a group's query heads below the chunk loop: each block moved
    there gets its own copy of the head loop, so one thread can serve the whole group."""
    shape = (2, 8, 2, 1, 64, 16)
    func = ops.attention(*shape, variant="alibi")
    sch = tvm.s_tir.Schedule(func, debug_mask="all")
    _, h, i, j = sch.get_loops(sch.get_sblock("max"))
    _, g = sch.split(h, [2, 4])
    j0, _ = sch.split(j, [4, None])
    sch.reorder(i, j0, g)
    for name in ("max", "sum", "pv"):
        sch.split_k_update(sch.get_sblock(name), j0)
    chunk_loop = sch.get(j0)
    for name in ("max_partial", "exp", "sum_partial", "pv_partial"):
        loops = [sch.get(l) for l in sch.get_loops(sch.get_sblock(name))]
        below = loops[[k for k, l in enumerate(loops) if l.same_as(chunk_loop)][0] + 1 :]
        assert below[0].loop_var.name.startswith("h_1") and int(below[0].extent) == 4, name
    q, k, v = testing.random_attention_inputs(*shape, magnitude=3)
    (out,) = testing.run_prim_func(sch.mod["main"], [q, k, v])
    np.testing.assert_allclose(out, reference.attention_ref(q, k, v, variant="alibi"), atol=1e-5)


def test_one_argument_form_infers_the_chunk_loop():
    """``split_k_update(block)`` splits across the outer loop of the split of the first
    reduction's key loop, for that reduction and the later ones: the exact IR of the
    explicit form, and a trace that replays."""
    sch = tvm.s_tir.Schedule(softmax_pv, debug_mask="all")
    sch.split(sch.get_loops(sch.get_sblock("max"))[-1], [4, None])
    for name in ("max", "sum", "pv"):
        sch.split_k_update(sch.get_sblock(name))
    tvm.ir.assert_structural_equal(
        sch.mod["main"].without_attr("global_symbol"), softmax_pv_split.without_attr("global_symbol")
    )
    _assert_trace_roundtrip(sch, softmax_pv)
    unsplit = tvm.s_tir.Schedule(softmax_pv, debug_mask="all")
    with pytest.raises(FusionError, match="block 'max': the key loop 'j' around 'max' is not split"):
        unsplit.split_k_update(unsplit.get_sblock("max"))
