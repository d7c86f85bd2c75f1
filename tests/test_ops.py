"""Tests for tvm_cascade.ops: unfused cascade compute definitions vs numpy float64.

Run with ``PYTHONPATH=python python -m pytest tests/test_ops.py -q`` (CPU, LLVM).
"""

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import te

from ahead import in_a_process_ahead
from tvm_cascade import ops
from tvm_cascade.ops import reference as ref
from tvm_cascade.ops import testing as tt

FP_TOL = {
    "float32": dict(rtol=2e-5, atol=2e-5),
    "float16": dict(rtol=2e-3, atol=2e-3),
    "bfloat16": dict(rtol=1.6e-2, atol=1.6e-2),
}

# (batch, heads_q, heads_kv, seq_q, seq_kv, head_dim)
SHAPES = {
    "prefill": (1, 4, 2, 24, 24, 16),  # GQA ratio 2
    "decode": (2, 4, 1, 2, 40, 32),  # MQA (ratio 4), two queries aligned to the end
    "decode1": (1, 8, 2, 1, 33, 16),  # GQA ratio 4, single query
}


def _run_attention(shape, dtype, seed=0, magnitude=1.0, **kwargs):
    func = ops.attention(*shape, dtype=dtype, **kwargs)
    q, k, v = tt.random_attention_inputs(*shape, dtype=dtype, seed=seed, magnitude=magnitude)
    (out,) = tt.run_prim_func(func, [q, k, v])
    return func, (q, k, v), out


def _check_attention_blocks(func, normalize_before_pv=False):
    expected = ops.ATTENTION_BLOCKS_NORMALIZE_FIRST if normalize_before_pv else ops.ATTENTION_BLOCKS
    assert tt.block_names(func) == list(expected)
    # intermediates are not parameters
    assert [p.name for p in func.params] == ["Q", "K", "V", "out"]
    # the block reordering keeps the function schedulable (debug_mask="all"
    # verifies the sref tree and the cached block info / dependencies)
    sch = tvm.s_tir.Schedule(func, debug_mask="all")
    for name in expected:
        sch.get_sblock(name)


# ---------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("variant", sorted(ops.VARIANTS))
def test_attention_variants(variant, phase, dtype):
    shape = SHAPES[phase]
    func, (q, k, v), out = _run_attention(shape, dtype, seed=17 * sorted(ops.VARIANTS).index(variant) + len(phase), variant=variant)
    _check_attention_blocks(func)
    assert out.dtype == np.dtype(dtype)
    expected = ref.attention_ref(q, k, v, variant=variant)
    assert np.all(np.isfinite(out.astype(np.float64)))
    np.testing.assert_allclose(out.astype(np.float64), expected, **FP_TOL[dtype])


@pytest.mark.parametrize(
    "variant,phase",
    [("causal", "prefill"), ("alibi", "decode1"), ("sliding_window", "decode1")],
)
def test_attention_bfloat16(variant, phase):
    """bfloat16 inputs/outputs work on the LLVM CPU target (fp32 accumulation;
    the test data is numpy ``ml_dtypes.bfloat16``)."""
    pytest.importorskip("ml_dtypes")
    func, (q, k, v), out = _run_attention(SHAPES[phase], "bfloat16", seed=7, variant=variant)
    assert str(func.params[0].dtype) == "bfloat16"
    expected = ref.attention_ref(q, k, v, variant=variant)
    np.testing.assert_allclose(out.astype(np.float64), expected, **FP_TOL["bfloat16"])


@pytest.mark.parametrize(
    "variant,phase,dtype",
    [("causal", "prefill", "float32"), ("softcap", "decode", "float16")],
)
def test_attention_normalize_before_pv(variant, phase, dtype):
    func, (q, k, v), out = _run_attention(
        SHAPES[phase], dtype, seed=3, variant=variant, normalize_before_pv=True
    )
    _check_attention_blocks(func, normalize_before_pv=True)
    expected = ref.attention_ref(q, k, v, variant=variant, normalize_before_pv=True)
    np.testing.assert_allclose(out.astype(np.float64), expected, **FP_TOL[dtype])


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("phase", ["prefill", "decode", "decode1"])
@pytest.mark.parametrize("variant", sorted(ops.VARIANTS))
@in_a_process_ahead
def test_attention_padded_to_whole_tiles(variant, phase, dtype):
    """``pad_to`` computes over lengths rounded up to whole tiles (here 16 rows, 32 keys:
    24 -> 32 rows, 24/40/33 -> 32/64/64 keys) and gives the unpadded result."""
    shape = SHAPES[phase]
    func, (q, k, v), out = _run_attention(shape, dtype, seed=5, variant=variant, pad_to=(16, 32))
    names = tt.block_names(func)
    assert names[: names.index("qk")] == [
        name for name, length, tile in (("Q_pad", shape[3], 16), ("K_pad", shape[4], 32), ("V_pad", shape[4], 32))
        if length % tile
    ]
    assert names[names.index("qk") :] == list(ops.ATTENTION_BLOCKS)
    assert [p.name for p in func.params] == ["Q", "K", "V", "out"]
    np.testing.assert_allclose(
        out.astype(np.float64), ref.attention_ref(q, k, v, variant=variant), **FP_TOL[dtype]
    )


def test_attention_padding_whole_tiles_is_the_identity():
    plain = ops.attention(1, 4, 2, 32, 64, 16, variant="causal")
    padded = ops.attention(1, 4, 2, 32, 64, 16, variant="causal", pad_to=(16, 32))
    assert tvm_ffi.structural_equal(plain, padded)


def test_attention_padding_a_row_that_sees_no_key_averages_the_padded_keys():
    """The documented exception: with every key masked, the row's weights are all equal,
    padded keys (zero V rows) included."""
    func = ops.attention(1, 1, 1, 2, 3, 4, mask_mod=lambda b, h, i, j: i > 0, pad_to=(1, 4))
    q, k, v = tt.random_attention_inputs(1, 1, 1, 2, 3, 4, dtype="float32", seed=1)
    (out,) = tt.run_prim_func(func, [q, k, v])
    np.testing.assert_allclose(out[0, 0, 0], v[0, 0].sum(axis=0) / 4, rtol=1e-6)
    np.testing.assert_allclose(out[0, 0, 1], ref.attention_ref(q, k, v)[0, 0, 1], rtol=1e-5)


def test_attention_explicit_scale_matches_reference():
    shape = SHAPES["prefill"]
    func, (q, k, v), out = _run_attention(shape, "float32", seed=11, scale=0.7, variant="causal")
    np.testing.assert_allclose(out, ref.attention_ref(q, k, v, variant="causal", scale=0.7), **FP_TOL["float32"])
    # and the scale really matters
    assert not np.allclose(out, ref.attention_ref(q, k, v, variant="causal"), atol=1e-3)


def test_attention_all_rows_masked_gives_mean_of_v():
    """window=0 masks every key: every row is fully masked, scores are the
    lowest finite float32 (not -inf), so the output is the mean of V."""
    shape = SHAPES["decode"]
    variant = ops.AttentionVariant("no_keys", causal=True, window=0)
    func, (q, k, v), out = _run_attention(shape, "float32", seed=5, variant=variant)
    assert np.all(np.isfinite(out))
    group = shape[1] // shape[2]
    mean_v = np.repeat(v.astype(np.float64).mean(axis=2, keepdims=True), group, axis=1)
    expected = np.broadcast_to(mean_v, out.shape)
    np.testing.assert_allclose(out, expected, **FP_TOL["float32"])
    np.testing.assert_allclose(ref.attention_ref(q, k, v, variant=variant), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_attention_custom_mods_one_row_fully_masked(dtype):
    """User-supplied FlexAttention callables: causal mask that additionally
    hides every key from query 5, and a per-head additive bias score_mod."""
    shape = SHAPES["prefill"]
    hidden_q = 5

    def te_mask(b, h, q_idx, kv_idx):
        return te.all(kv_idx <= q_idx, q_idx != hidden_q)

    def te_score(score, b, h, q_idx, kv_idx):
        return score + (h - b).astype("float32") * 0.25

    def np_mask(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx != hidden_q)

    def np_score(score, b, h, q_idx, kv_idx):
        return score + (h - b) * 0.25

    func, (q, k, v), out = _run_attention(shape, dtype, seed=9, mask_mod=te_mask, score_mod=te_score)
    _check_attention_blocks(func)
    out64 = out.astype(np.float64)
    assert np.all(np.isfinite(out64))
    expected = ref.attention_ref(q, k, v, mask_mod=np_mask, score_mod=np_score)
    np.testing.assert_allclose(out64, expected, **FP_TOL[dtype])
    group = shape[1] // shape[2]
    mean_v = np.repeat(v.astype(np.float64).mean(axis=2), group, axis=1)
    np.testing.assert_allclose(out64[:, :, hidden_q, :], mean_v, **FP_TOL[dtype])
    # the other rows are not the mean (the masking really is row-specific)
    assert not np.allclose(out64[:, :, hidden_q + 1, :], mean_v, atol=1e-2)


@pytest.mark.parametrize(
    "variant,dtype", [("global", "float32"), ("causal", "float16"), ("softcap", "float32")]
)
def test_attention_large_logits(variant, dtype):
    """Scores of magnitude ~1e4 must not overflow to inf/NaN."""
    shape = SHAPES["prefill"]
    func, (q, k, v), out = _run_attention(shape, dtype, seed=13, magnitude=100.0, variant=variant)
    q64, k64 = q.astype(np.float64), k.astype(np.float64)
    scores = np.einsum("bhid,bhjd->bhij", q64, np.repeat(k64, 2, axis=1)) / np.sqrt(shape[-1])
    assert np.abs(scores).max() > 5e3  # the test really exercises large logits
    out64 = out.astype(np.float64)
    assert np.all(np.isfinite(out64))
    # softmax is nearly one-hot here; fp32 score rounding (~1e-3 absolute)
    # can shift near-ties slightly, hence the looser tolerance.
    np.testing.assert_allclose(out64, ref.attention_ref(q, k, v, variant=variant), rtol=2e-2, atol=2e-2)


def test_attention_rejects_bad_heads_and_mixed_mods():
    with pytest.raises(ValueError):
        ops.attention(1, 3, 2, 4, 4, 8)
    with pytest.raises(ValueError):
        ops.attention(1, 2, 2, 4, 4, 8, variant="causal", mask_mod=lambda b, h, i, j: i >= j)
    with pytest.raises(ValueError):
        ops.get_variant("no_such_variant")


def test_attention_tir_reduction_forms():
    """The reductions are standard `+` / `max` updates of their own buffers."""
    script = ops.attention(1, 2, 1, 4, 6, 8, variant="causal").script()
    assert "qk[v_b, v_h, v_i, v_j] = qk[v_b, v_h, v_i, v_j] + " in script
    assert "max[v_b, v_h, v_i] = T.max(max[v_b, v_h, v_i], score[" in script
    assert "sum[v_b, v_h, v_i] = sum[v_b, v_h, v_i] + exp[" in script
    assert "pv[v_b, v_h, v_i, v_d] = pv[v_b, v_h, v_i, v_d] + exp[" in script
    assert "-inf" not in script
    # masked scores are the lowest finite float32, i.e. the `max` identity
    lowest = tvm.tirx.min_value("float32").script()
    score_line = next(line for line in script.splitlines() if "score[v_b, v_h, v_i, v_j] = " in line)
    assert "T.Select(" in score_line and score_line.rstrip().endswith(lowest + ")")


def test_reference_masks_match_definition():
    """Independent loop-based check of the numpy variant masks / ALiBi bias."""
    seq_q, seq_kv, heads = 3, 7, 4
    for name, window in [("causal", None), ("sliding_window", ops.VARIANTS["sliding_window"].window)]:
        _, mask = ref.np_mods(name, heads, seq_q, seq_kv)
        grid = mask(0, 0, np.arange(seq_q)[:, None], np.arange(seq_kv)[None, :])
        for i in range(seq_q):
            for j in range(seq_kv):
                last_visible = i + seq_kv - seq_q
                want = j <= last_visible and (window is None or last_visible - j < window)
                assert bool(grid[i, j]) == want, (name, i, j)
    score_mod, _ = ref.np_mods("alibi", heads, seq_q, seq_kv)
    for h in range(heads):
        bias = score_mod(0.0, 0, h, 2, 1)
        assert bias == pytest.approx(2.0 ** (-8.0 * (h + 1) / heads) * (1 - (2 + seq_kv - seq_q)))


# ---------------------------------------------------------------------------
# Other cascades
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,scale", [("float32", 1e4), ("float16", 4.0)])
def test_logsumexp(dtype, scale):
    rows, n = 6, 37
    func = ops.logsumexp(rows, n, dtype)
    assert tt.block_names(func) == list(ops.LOGSUMEXP_BLOCKS)
    assert [p.name for p in func.params] == ["X", "out"]
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((rows, n)) * scale).astype(dtype)
    (out,) = tt.run_prim_func(func, [x])
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, ref.logsumexp_ref(x), rtol=1e-5, atol=1e-5)


def test_cross_entropy():
    rows, n = 8, 50
    func = ops.cross_entropy(rows, n)
    assert tt.block_names(func) == list(ops.CROSS_ENTROPY_BLOCKS)
    assert [p.name for p in func.params] == ["X", "labels", "out"]
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((rows, n)) * 3).astype("float32")
    x[0] *= 1e4 / np.abs(x[0]).max()  # a row of large logits
    labels = rng.integers(0, n, size=rows).astype("int32")
    (out,) = tt.run_prim_func(func, [x, labels])
    expected = ref.cross_entropy_ref(x, labels)
    assert np.all(np.isfinite(out)) and np.all(expected >= 0)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=2e-4)


def test_absmax_quant_gemm():
    M, N, K = 5, 12, 40
    func = ops.absmax_quant_gemm(M, N, K)
    assert tt.block_names(func) == list(ops.ABSMAX_QUANT_GEMM_BLOCKS)
    assert [p.name for p in func.params] == ["X", "W", "out"]
    rng = np.random.default_rng(3)
    x = rng.standard_normal((M, K)).astype("float32")
    x[1] *= 1e3
    x[2] = 0.0  # exercises the eps clamp
    w = rng.standard_normal((K, N)).astype("float32")
    (out,) = tt.run_prim_func(func, [x, w])
    expected = ref.absmax_quant_gemm_ref(x, w)
    np.testing.assert_allclose(expected, x.astype(np.float64) @ w.astype(np.float64), rtol=1e-9, atol=1e-9)
    row_mag = np.maximum(np.abs(x).max(axis=1, keepdims=True), 1.0)  # errors scale with the row
    np.testing.assert_allclose(out / row_mag, expected / row_mag, rtol=1e-5, atol=1e-5)
    assert np.all(out[2] == 0.0)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_rmsnorm_gemm(dtype):
    M, N, K = 6, 10, 48
    func = ops.rmsnorm_gemm(M, N, K, dtype=dtype)
    assert tt.block_names(func) == list(ops.RMSNORM_GEMM_BLOCKS)
    assert [p.name for p in func.params] == ["X", "gamma", "W", "out"]
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((M, K)) * 5).astype(dtype)
    gamma = rng.uniform(0.5, 1.5, size=K).astype(dtype)
    w = (rng.standard_normal((K, N)) / np.sqrt(K)).astype(dtype)
    (out,) = tt.run_prim_func(func, [x, gamma, w])
    np.testing.assert_allclose(out.astype(np.float64), ref.rmsnorm_gemm_ref(x, gamma, w), **FP_TOL[dtype])


def test_moe_routing_with_topk():
    tokens, experts, top_k = 9, 16, 3
    func = ops.moe_routing(tokens, experts, top_k)
    assert tt.block_names(func) == list(ops.MOE_ROUTING_BLOCKS) + ["top0", "top1", "top2", *ops.MOE_TOPK_BLOCKS]
    assert [p.name for p in func.params][0] == "logits"
    rng = np.random.default_rng(5)
    logits = (rng.standard_normal((tokens, experts)) * 2).astype("float32")
    logits[0, [3, 7]] = logits[0].max() + 1  # a tie goes to the lower expert index
    prob, topv, topi = tt.run_prim_func(func, [logits])
    rprob, rtopv, rtopi = ref.moe_routing_ref(logits, top_k)
    np.testing.assert_allclose(prob, rprob, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(topi, rtopi)
    np.testing.assert_allclose(topv, rtopv, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(rtopi, np.argsort(-logits, axis=1, kind="stable")[:, :top_k])


@pytest.mark.parametrize("dtype, experts", [("float16", 48), ("bfloat16", 48), ("float32", 48), ("float16", 70000)])
def test_moe_routing_ranks_the_logits_exactly(dtype, experts):
    """The rounds' keys (16-bit logits and the index in an int32; float32 logits, or
    more than 2**16 experts, in an int64) order the experts as their float64 logits
    do: equal logits (+0 and -0 among them) by index, and two logits one unit in the
    last place apart stay apart where the row's maximum is so large that ``x - m`` in
    float32 would merge them."""
    tokens, top_k = 3, 4
    dt = tt.np_dtype(dtype)
    bits = np.uint32 if dtype == "float32" else np.uint16
    logits = np.random.default_rng(8).standard_normal((tokens, experts)).astype(dt)
    logits[0, [9, 2]] = 8.0  # a tie: 2 first
    logits[1, :] = -1.0
    logits[1, [0, 5, 6, 7]] = [1.0, -0.0, 0.0, -0.0]  # equal zeros: by index
    logits[2, :] = -3.0
    half = np.array([0.5], dt)
    logits[2, [1, 4]] = [half[0], (half.view(bits) + 1).view(dt)[0]]  # 4 first
    logits[2, 30] = {"float16": 2.0**15, "bfloat16": 2.0**17, "float32": 2.0**26}[dtype]
    prob, topv, topi = tt.run_prim_func(ops.moe_routing(tokens, experts, top_k, dtype=dtype), [logits])
    np.testing.assert_array_equal(topi, np.argsort(-logits.astype(np.float64), axis=1, kind="stable")[:, :top_k])
    np.testing.assert_array_equal(topi[:, :3], [[2, 9, topi[0, 2]], [0, 5, 6], [30, 4, 1]])
    np.testing.assert_array_equal(topv, np.take_along_axis(prob, topi, axis=1))


def test_moe_routing_softmax_only():
    tokens, experts = 4, 8
    func = ops.moe_routing(tokens, experts, 2, dtype="float16", with_topk=False)
    assert tt.block_names(func) == list(ops.MOE_ROUTING_BLOCKS)
    assert [p.name for p in func.params] == ["logits", "prob"]
    logits = np.random.default_rng(6).standard_normal((tokens, experts)).astype("float16")
    (prob,) = tt.run_prim_func(func, [logits])
    np.testing.assert_allclose(prob, ref.softmax_ref(logits), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(prob.sum(axis=1), 1.0, rtol=1e-5)


# ---------------------------------------------------------------------------
# testing helpers
# ---------------------------------------------------------------------------


def test_run_prim_func_validates_inputs():
    func = ops.logsumexp(2, 3)
    with pytest.raises(ValueError):
        tt.run_prim_func(func, [np.zeros((2, 4), "float32")])
    with pytest.raises(ValueError):
        tt.run_prim_func(func, [np.zeros((2, 3), "float64")])
    q, k, v = tt.random_attention_inputs(1, 4, 2, 3, 5, 8, dtype="float16", seed=0)
    assert q.shape == (1, 4, 3, 8) and k.shape == v.shape == (1, 2, 5, 8)
    assert q.dtype == np.float16
