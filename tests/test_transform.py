"""tvm_cascade.transform.FuseCascadedReductions: fusion without a hand-written schedule."""
import logging

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax, te, tirx
from tvm.script import relax as R

import tvm_cascade  # noqa: F401  (adds the primitives)
from tvm_cascade import ops
from tvm_cascade.ops import reference
from tvm_cascade.ops import testing as tt
from tvm_cascade.transform import FuseCascadedReductions, fuse_cascaded_reductions

FUSED = "tvm_cascade.fused"


def _fused(mod, **kwargs):
    return FuseCascadedReductions(**kwargs)(mod)


def _main(func):
    return tvm.IRModule({"main": func.with_attr("global_symbol", "main")})


def _legalized_attention(q_shape, kv_shape, causal_mask=None):
    """R.nn.attention (BSNH layout) legalised by TVM: one PrimFunc with the softmax blocks."""
    bb = relax.BlockBuilder()
    q = relax.Var("q", R.Tensor(q_shape, "float32"))
    k = relax.Var("k", R.Tensor(kv_shape, "float32"))
    v = relax.Var("v", R.Tensor(kv_shape, "float32"))
    with bb.function("main", [q, k, v]):
        bb.emit_func_output(bb.emit(relax.op.nn.attention(q, k, v, causal_mask=causal_mask)))
    mod = relax.transform.LegalizeOps()(bb.get())
    (func,) = [f for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    return _main(func)


def _attention_bsnh_ref(q, k, v, causal_mask):
    Q, K, V = (x.transpose(0, 2, 1, 3).astype(np.float64) for x in (q, k, v))
    s = Q @ K.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
    sq, skv = s.shape[-2:]
    if causal_mask is not None:
        offset = skv - sq if causal_mask == "BottomRight" else 0
        s = np.where(np.arange(skv)[None, :] <= np.arange(sq)[:, None] + offset, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True) @ V).transpose(0, 2, 1, 3)


def _run(mod, inputs, out_shape):
    lib = tvm.compile(mod, target={"kind": "llvm"})
    dev = tvm.cpu()
    args = [tvm.runtime.tensor(x, dev) for x in inputs]
    args.append(tvm.runtime.tensor(np.zeros(out_shape, "float32"), dev))
    lib["main"](*args)
    return args[-1].numpy()


@pytest.mark.parametrize("method", ["rolling", "split_k"])
@pytest.mark.parametrize("causal_mask", [None, "TopLeft", "BottomRight"])
def test_legalized_relax_attention(method, causal_mask):
    q_shape, kv_shape = (1, 12, 2, 16), (1, 37, 2, 16)
    mod = _legalized_attention(q_shape, kv_shape, causal_mask)
    fused = _fused(mod, tile=8, method=method, chunks=4)
    assert list(fused["main"].attrs[FUSED]) == _expected_fused(causal_mask)
    assert FUSED not in (mod["main"].attrs or {})  # the input module is left alone
    rng = np.random.default_rng(7)
    inputs = [rng.standard_normal(s).astype("float32") for s in (q_shape, kv_shape, kv_shape)]
    out = _run(fused, inputs, q_shape)
    np.testing.assert_allclose(out, _attention_bsnh_ref(*inputs, causal_mask), rtol=1e-5, atol=1e-5)


def _expected_fused(causal_mask):
    # TOPI masks the scores, then the exponentials: select(causal, exp(s - m), 0).
    if causal_mask is None:
        return ["T_softmax_expsum", "T_batch_matmul_NN"]
    return ["trilu_red_1", "T_batch_matmul_NN"]


def test_symbolic_key_length():
    n = tirx.Var("n", "int64")
    q_shape = (1, 4, 2, 16)
    mod = _legalized_attention(q_shape, (1, n, 2, 16))
    fused = _fused(mod, tile=8)
    assert list(fused["main"].attrs[FUSED]) == ["T_softmax_expsum", "T_batch_matmul_NN"]
    for length in (5, 29):
        rng = np.random.default_rng(length)
        kv = (1, length, 2, 16)
        inputs = [rng.standard_normal(s).astype("float32") for s in (q_shape, kv, kv)]
        out = _run(fused, inputs, q_shape)
        np.testing.assert_allclose(out, _attention_bsnh_ref(*inputs, None), rtol=1e-5, atol=1e-5)


def test_same_ir_as_the_hand_written_schedule():
    func = ops.attention(1, 2, 2, 16, 40, 8, variant="causal")
    expected = tvm.s_tir.Schedule(func)
    j0, _ = expected.split(expected.get_loops(expected.get_sblock("max"))[-1], [None, 16], preserve_unit_iters=True)
    expected.rolling_update(expected.get_sblock("sum"), j0)
    expected.rolling_update(expected.get_sblock("pv"), j0)
    expected.compute_at(expected.get_sblock("score"), j0, preserve_unit_loops=True)
    expected.compute_at(expected.get_sblock("qk"), j0, preserve_unit_loops=True)

    sch = tvm.s_tir.Schedule(func)
    (chain,) = fuse_cascaded_reductions(sch, tile=16, method="rolling")
    assert (chain.root, chain.blocks, chain.method) == ("max", ("sum", "pv"), "rolling")
    assert sch.get(chain.loop).loop_var.name == "rj_0"
    tvm_ffi.structural_equal(sch.mod, expected.mod, map_free_vars=True) or pytest.fail(
        sch.mod.script()
    )


@pytest.mark.parametrize("variant", ["global", "alibi", "softcap", "sliding_window"])
def test_attention_variants_auto(variant):
    # 2 x 4 x 3 = 24 rows, 48 keys: auto picks split-k; a long query picks rolling.
    for seq_q, method in ((3, "split_k"), (64, "rolling")):
        func = ops.attention(2, 4, 2, seq_q, 48, 16, variant=variant)
        sch = tvm.s_tir.Schedule(func, debug_mask="all")
        (chain,) = fuse_cascaded_reductions(sch, tile=16, chunks=4)
        assert chain.method == method and chain.blocks == ("sum", "pv")
        inputs = tt.random_attention_inputs(2, 4, 2, seq_q, 48, 16, "float32", seed=3)
        (out,) = tt.run_prim_func(sch.mod["main"], inputs)
        ref = reference.attention_ref(*inputs, variant=variant)
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)


def test_non_attention_cascades():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 200)).astype("float32") * 20
    mod = _fused(_main(ops.logsumexp(3, 200)), chunks=8)
    assert list(mod["main"].attrs[FUSED]) == ["sum"]
    (out,) = tt.run_compiled(tvm.compile(mod, target="llvm"), mod["main"], [x])
    np.testing.assert_allclose(out, reference.logsumexp_ref(x), rtol=1e-5, atol=1e-5)

    x, gamma, w = (rng.standard_normal(s).astype("float32") for s in ((16, 24), (24,), (24, 8)))
    mod = _fused(_main(ops.rmsnorm_gemm(16, 8, 24)), tile=8, method="rolling")
    assert list(mod["main"].attrs[FUSED]) == ["gemm"]
    (out,) = tt.run_compiled(tvm.compile(mod, target="llvm"), mod["main"], [x, gamma, w])
    np.testing.assert_allclose(out, reference.rmsnorm_gemm_ref(x, gamma, w), rtol=1e-4, atol=1e-4)


def _variance():
    X = te.placeholder((4, 32), "float32", name="X")
    r1, r2 = te.reduce_axis((0, 32), "r1"), te.reduce_axis((0, 32), "r2")
    mean = te.compute((4,), lambda i: te.sum(X[i, r1] / 32, axis=r1), name="mean")
    var = te.compute(
        (4,), lambda i: te.sum((X[i, r2] - mean[i]) * (X[i, r2] - mean[i]), axis=r2), name="var"
    )
    return te.create_prim_func([X, var])


def test_unfusable_chain_is_left_alone_and_logged(caplog):
    mod = _main(_variance())
    with caplog.at_level(logging.DEBUG, logger="tvm_cascade.transform"):
        out = _fused(mod, method="rolling")
    tvm.ir.assert_structural_equal(out, mod)
    assert "'var' not fused into 'mean'" in caplog.text and "no repair" in caplog.text


def test_functions_without_chains_or_already_scheduled_are_unchanged():
    A = te.placeholder((8, 16), "float32", name="A")
    B = te.placeholder((16, 4), "float32", name="B")
    k = te.reduce_axis((0, 16), "k")
    C = te.compute((8, 4), lambda i, j: te.sum(A[i, k] * B[k, j], axis=k), name="C")
    plain = _main(te.create_prim_func([A, B, C]))
    tvm.ir.assert_structural_equal(_fused(plain), plain)

    scheduled = _main(ops.logsumexp(2, 64).with_attr("tirx.is_scheduled", True))
    tvm.ir.assert_structural_equal(_fused(scheduled), scheduled)


def test_bad_arguments():
    with pytest.raises(ValueError, match="method"):
        FuseCascadedReductions(method="fast")
    with pytest.raises(ValueError, match="positive"):
        fuse_cascaded_reductions(tvm.s_tir.Schedule(ops.logsumexp(2, 8)), tile=0)


def test_float16_chain_with_casts():
    # float16 in and out, the softmax in float32: the casts on either side have the same
    # loop nest and different dtypes, and must not be taken for one another.
    rows, keys, dim = 6, 40, 8
    S = te.placeholder((rows, keys), "float16", name="S")
    V = te.placeholder((keys, dim), "float16", name="V")
    r = [te.reduce_axis((0, keys), f"r{k}") for k in range(3)]
    s32 = te.compute((rows, keys), lambda i, j: S[i, j].astype("float32"), name="cast_in")
    m = te.compute((rows,), lambda i: te.max(s32[i, r[0]], axis=r[0]), name="max")
    e = te.compute((rows, keys), lambda i, j: te.exp(s32[i, j] - m[i]), name="exp")
    l = te.compute((rows,), lambda i: te.sum(e[i, r[1]], axis=r[1]), name="sum")
    p16 = te.compute((rows, keys), lambda i, j: (e[i, j] / l[i]).astype("float16"), name="cast_out")
    o = te.compute(
        (rows, dim),
        lambda i, d: te.sum(p16[i, r[2]].astype("float32") * V[r[2], d].astype("float32"), axis=r[2]),
        name="pv",
    )
    mod = _fused(_main(te.create_prim_func([S, V, o])), tile=16, method="rolling")
    assert list(mod["main"].attrs[FUSED]) == ["sum", "pv"]
    rng = np.random.default_rng(5)
    s = (rng.standard_normal((rows, keys)) * 3).astype("float16")
    v = rng.standard_normal((keys, dim)).astype("float16")
    (out,) = tt.run_compiled(tvm.compile(mod, target="llvm"), mod["main"], [s, v])
    p = np.exp(s - s.max(1, keepdims=True).astype(np.float64))
    ref = (p / p.sum(1, keepdims=True)) @ v.astype(np.float64)
    np.testing.assert_allclose(out, ref, rtol=2e-3, atol=2e-3)
