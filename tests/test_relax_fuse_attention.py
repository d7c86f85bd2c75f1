"""The Relax side: attention patterns fuse into one kernel through relax_pipeline="cascade"
on the CPU, numerics match numpy, and modules without attention compile unchanged."""

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax
from tvm.script import relax as R

import tvm_cascade  # noqa: F401
from tvm_cascade.relax import FuseAttention

LLVM = tvm.target.Target({"kind": "llvm"})


def _gqa_chain():
    """Hand-written GQA attention (8 query heads, 2 KV heads) with scale and additive mask
    over a symbolic key count."""

    @R.function
    def main(
        q: R.Tensor((1, 8, 4, 16), "float32"),
        k: R.Tensor((1, 2, "n", 16), "float32"),
        v: R.Tensor((1, 2, "n", 16), "float32"),
        mask: R.Tensor((1, 1, 4, "n"), "float32"),
    ):
        with R.dataflow():
            kt = R.permute_dims(R.repeat(k, 4, axis=1), [0, 1, 3, 2])
            s = R.add(R.multiply(R.matmul(q, kt), R.const(0.25, "float32")), mask)
            o = R.matmul(R.nn.softmax(s, axis=-1), R.repeat(v, 4, axis=1))
            R.output(o)
        return o

    return tvm.IRModule({"main": main})


def _attention_op():
    @R.function
    def main(
        q: R.Tensor((1, 16, 2, 8), "float32"),
        k: R.Tensor((1, 96, 2, 8), "float32"),
        v: R.Tensor((1, 96, 2, 8), "float32"),
    ):
        with R.dataflow():
            o = R.nn.attention(q, k, v)
            R.output(o)
        return o

    return tvm.IRModule({"main": main})


def _flattened_bmm_chain():
    """The form torch.export gives 4-D matmuls (broadcast, flatten to 3-D, bmm, unflatten),
    with the GQA repeat as expand_dims/broadcast_to/reshape and a where mask."""

    @R.function
    def main(
        q: R.Tensor((1, 4, 8, 16), "float32"),
        k: R.Tensor((1, 2, 32, 16), "float32"),
        v: R.Tensor((1, 2, 32, 16), "float32"),
        hidden: R.Tensor((8, 32), "bool"),
    ):
        with R.dataflow():
            kr = R.reshape(
                R.broadcast_to(R.expand_dims(k, [2]), R.shape([1, 2, 2, 32, 16])),
                R.shape([1, 4, 32, 16]),
            )
            vr = R.reshape(
                R.broadcast_to(R.expand_dims(v, [2]), R.shape([1, 2, 2, 32, 16])),
                R.shape([1, 4, 32, 16]),
            )
            kt = R.permute_dims(kr, [0, 1, 3, 2])
            qf = R.reshape(R.broadcast_to(q, R.shape([1, 4, 8, 16])), R.shape([4, 8, 16]))
            kf = R.reshape(R.broadcast_to(kt, R.shape([1, 4, 16, 32])), R.shape([4, 16, 32]))
            s = R.reshape(R.matmul(qf, kf), R.shape([1, 4, 8, 32]))
            s = R.where(
                hidden, R.const(float("-inf"), "float32"), R.divide(s, R.const(4.0, "float32"))
            )
            p = R.nn.softmax(s, axis=-1)
            pf = R.reshape(R.broadcast_to(p, R.shape([1, 4, 8, 32])), R.shape([4, 8, 32]))
            vf = R.reshape(R.broadcast_to(vr, R.shape([1, 4, 32, 16])), R.shape([4, 32, 16]))
            o = R.reshape(R.matmul(pf, vf), R.shape([1, 4, 8, 16]))
            R.output(o)
        return o

    return tvm.IRModule({"main": main})


def _causal_attention_op():
    @R.function
    def main(
        q: R.Tensor((1, 8, 2, 8), "float32"),
        k: R.Tensor((1, 80, 2, 8), "float32"),
        v: R.Tensor((1, 80, 2, 8), "float32"),
    ):
        with R.dataflow():
            o = R.nn.attention(q, k, v, causal_mask="BottomRight")
            R.output(o)
        return o

    return tvm.IRModule({"main": main})


def _no_attention():
    @R.function
    def main(x: R.Tensor((4, 32), "float32"), w: R.Tensor((32, 16), "float32")):
        with R.dataflow():
            y = R.nn.softmax(R.nn.relu(R.matmul(x, w)), axis=0)
            R.output(y)
        return y

    return tvm.IRModule({"main": main})


def _lower(mod, pipeline):
    with LLVM:
        return relax.get_pipeline(pipeline)(mod)


def _fused(mod):
    return [
        gv.name_hint
        for gv, f in mod.functions_items()
        if isinstance(f, tvm.tirx.PrimFunc)
        and f.attrs is not None
        and "tvm_cascade.fused" in f.attrs
    ]


def _run(mod, pipeline, args):
    exe = tvm.compile(mod, LLVM, relax_pipeline=pipeline)
    vm = relax.VirtualMachine(exe, tvm.cpu())
    return vm["main"](*(tvm.runtime.tensor(a, tvm.cpu()) for a in args)).numpy()


def _attention_ref(q, k, v, scale, mask=0.0):
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = q.astype(np.float64) @ k.swapaxes(-1, -2) * scale + mask
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("keys", [40, 200])
def test_gqa_chain_fuses_and_matches_numpy_for_symbolic_keys(keys):
    mod = _gqa_chain()
    assert len(_fused(_lower(mod, "cascade"))) == 1
    rng = np.random.default_rng(keys)
    q = rng.standard_normal((1, 8, 4, 16)).astype("float32")
    k = rng.standard_normal((1, 2, keys, 16)).astype("float32")
    v = rng.standard_normal((1, 2, keys, 16)).astype("float32")
    visible = np.arange(keys)[None, :] <= (keys - 4 + np.arange(4))[:, None]
    mask = np.where(visible, 0.0, -1e4).astype("float32")[None, None]
    expected = _attention_ref(q, k, v, 0.25, mask)
    cascade = _run(mod, "cascade", [q, k, v, mask])
    default = _run(mod, "default", [q, k, v, mask])
    np.testing.assert_allclose(cascade, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(cascade, default, rtol=1e-4, atol=1e-5)


def test_attention_op_fuses_and_matches_numpy():
    mod = _attention_op()
    fused = _lower(mod, "cascade")
    assert len(_fused(fused)) == 1
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 16, 2, 8)).astype("float32")
    k = rng.standard_normal((1, 96, 2, 8)).astype("float32")
    v = rng.standard_normal((1, 96, 2, 8)).astype("float32")
    bhsd = [t.transpose(0, 2, 1, 3) for t in (q, k, v)]
    expected = _attention_ref(*bhsd, 1 / np.sqrt(8)).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(_run(mod, "cascade", [q, k, v]), expected, rtol=1e-4, atol=1e-5)


def test_flattened_bmm_chain_fuses_and_matches_numpy():
    mod = _flattened_bmm_chain()
    assert len(_fused(_lower(mod, "cascade"))) == 1
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 4, 8, 16)).astype("float32")
    k = rng.standard_normal((1, 2, 32, 16)).astype("float32")
    v = rng.standard_normal((1, 2, 32, 16)).astype("float32")
    hidden = np.arange(32)[None, :] > (24 + np.arange(8))[:, None]
    expected = _attention_ref(q, k, v, 0.25, np.where(hidden, -np.inf, 0.0))
    np.testing.assert_allclose(
        _run(mod, "cascade", [q, k, v, hidden]), expected, rtol=1e-4, atol=1e-5
    )


def test_causal_attention_op_fuses_and_matches_numpy():
    mod = _causal_attention_op()
    assert len(_fused(_lower(mod, "cascade"))) == 1
    rng = np.random.default_rng(3)
    q, k, v = (
        rng.standard_normal(s).astype("float32")
        for s in [(1, 8, 2, 8), (1, 80, 2, 8), (1, 80, 2, 8)]
    )
    hidden = np.arange(80)[None, :] > (72 + np.arange(8))[:, None]  # bottom-right aligned
    bhsd = [t.transpose(0, 2, 1, 3) for t in (q, k, v)]
    mask = np.where(hidden, -np.inf, 0.0)
    expected = _attention_ref(*bhsd, 1 / np.sqrt(8), mask).transpose(0, 2, 1, 3)
    cascade = _run(mod, "cascade", [q, k, v])
    np.testing.assert_allclose(cascade, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(cascade, _run(mod, "default", [q, k, v]), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("method", ["rolling", "split_k"])
def test_both_methods_match_numpy(method):
    mod = _attention_op()
    with LLVM:
        fused = FuseAttention(tile=32, method=method, chunks=4)(mod)
    funcs = [f for _, f in fused.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert len(funcs) == 1 and "tvm_cascade.fused" in funcs[0].attrs
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 16, 2, 8)).astype("float32")
    k = rng.standard_normal((1, 96, 2, 8)).astype("float32")
    v = rng.standard_normal((1, 96, 2, 8)).astype("float32")
    bhsd = [t.transpose(0, 2, 1, 3) for t in (q, k, v)]
    expected = _attention_ref(*bhsd, 1 / np.sqrt(8)).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(_run(fused, "default", [q, k, v]), expected, rtol=1e-4, atol=1e-5)


def test_model_without_attention_compiles_unchanged():
    mod = _no_attention()
    with LLVM:
        assert FuseAttention()(mod).same_as(mod)
    assert tvm_ffi.structural_equal(_lower(mod, "cascade"), _lower(mod, "default"))


def test_softmax_over_another_axis_is_left_alone():
    @R.function
    def main(q: R.Tensor((1, 2, 8, 4), "float32"), k: R.Tensor((1, 2, 8, 4), "float32")):
        with R.dataflow():
            s = R.matmul(q, R.permute_dims(k, [0, 1, 3, 2]))
            o = R.matmul(R.nn.softmax(s, axis=2), k)
            R.output(o)
        return o

    mod = tvm.IRModule({"main": main})
    assert _fused(_lower(mod, "cascade")) == []
    assert tvm_ffi.structural_equal(_lower(mod, "cascade"), _lower(mod, "default"))


def test_pipeline_is_registered():
    assert isinstance(relax.get_pipeline("cascade"), tvm.transform.Pass)


CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})


def _static_gqa_chain(keys):
    """The GQA chain of :func:`_gqa_chain` with a static key count (GPU schedules need one)."""
    return tvm.IRModule({"main": _gqa_chain()["main"].bind_symbolic_vars({"n": keys})})


def _blocks_outside_threads(func):
    """Names of the blocks of ``func`` that no thread-bound loop encloses."""
    found = []

    def visit(stmt, bound):
        if isinstance(stmt, tvm.tirx.For):
            visit(stmt.body, bound or stmt.kind == tvm.tirx.ForKind.THREAD_BINDING)
        elif isinstance(stmt, tvm.tirx.SeqStmt):
            for item in stmt:
                visit(item, bound)
        elif isinstance(stmt, tvm.s_tir.stmt.SBlockRealize):
            if not bound and stmt.block.name_hint != "root":
                found.append(stmt.block.name_hint)
            visit(stmt.block.body, bound)
        elif hasattr(stmt, "body"):
            visit(stmt.body, bound)

    visit(func.body, False)
    return found


def _block_names(func):
    names = []
    tvm_ffi.structural_walk(
        func.body,
        lambda n: names.append(n.name_hint) if isinstance(n, tvm.s_tir.stmt.SBlock) else None,
    )
    return names


@pytest.mark.parametrize("method", ["rolling", "split_k"])
def test_gpu_target_gets_a_scheduled_fused_kernel(method):
    mod = _static_gqa_chain(256)
    with CUDA:
        grouped = FuseAttention(method=method)(mod)
    (name,) = _fused(grouped)
    func = grouped[name]
    assert bool(func.attrs["tir.is_scheduled"])
    assert _blocks_outside_threads(func) == []
    partials = [b for b in _block_names(func) if b.endswith("_partial")]
    assert bool(partials) == (method == "split_k")


def test_gpu_pipeline_schedules_the_fused_kernel():
    with CUDA:
        lowered = relax.get_pipeline("cascade")(_static_gqa_chain(1024))
    (name,) = _fused(lowered)
    assert _blocks_outside_threads(lowered[name]) == []


def test_gpu_target_leaves_symbolic_keys_to_the_default_schedule():
    with CUDA:
        lowered = relax.get_pipeline("cascade")(_gqa_chain())
    assert _fused(lowered) == []


@pytest.mark.skipif(not tvm.cuda(0).exist, reason="needs a CUDA GPU")
@pytest.mark.parametrize("keys", [64, 1024])
def test_gpu_numerics_match_numpy(keys):
    mod = _static_gqa_chain(keys)
    target = tvm.target.Target.from_device(tvm.cuda(0))
    rng = np.random.default_rng(keys)
    q = rng.standard_normal((1, 8, 4, 16)).astype("float32")
    k = rng.standard_normal((1, 2, keys, 16)).astype("float32")
    v = rng.standard_normal((1, 2, keys, 16)).astype("float32")
    mask = np.zeros((1, 1, 4, keys), "float32")
    mask[..., : keys // 3] = -1e4
    exe = tvm.compile(mod, target, relax_pipeline="cascade")
    vm = relax.VirtualMachine(exe, tvm.cuda(0))
    out = vm["main"](*(tvm.runtime.tensor(a, tvm.cuda(0)) for a in (q, k, v, mask))).numpy()
    expected = _attention_ref(q, k, v, 0.25, mask)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not tvm.cuda(0).exist, reason="needs a CUDA GPU")
def test_gpu_causal_attention_op_matches_numpy():
    mod = _causal_attention_op()
    target = tvm.target.Target.from_device(tvm.cuda(0))
    rng = np.random.default_rng(4)
    q, k, v = (
        rng.standard_normal(s).astype("float32")
        for s in [(1, 8, 2, 8), (1, 80, 2, 8), (1, 80, 2, 8)]
    )
    hidden = np.arange(80)[None, :] > (72 + np.arange(8))[:, None]
    bhsd = [t.transpose(0, 2, 1, 3) for t in (q, k, v)]
    expected = _attention_ref(*bhsd, 1 / np.sqrt(8), np.where(hidden, -np.inf, 0.0))
    exe = tvm.compile(mod, target, relax_pipeline="cascade")
    vm = relax.VirtualMachine(exe, tvm.cuda(0))
    out = vm["main"](*(tvm.runtime.tensor(a, tvm.cuda(0)) for a in (q, k, v))).numpy()
    np.testing.assert_allclose(out, expected.transpose(0, 2, 1, 3), rtol=1e-4, atol=1e-5)
