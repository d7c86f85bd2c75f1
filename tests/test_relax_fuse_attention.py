"""The Relax side: attention patterns fuse into one kernel through relax_pipeline="cascade"
on the CPU, numerics match numpy, and modules without attention compile unchanged."""

import logging

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax
from tvm.script import relax as R

import tvm_cascade  # noqa: F401
from relax_attention_cases import row_kernels_else_default
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


def _gqa_chain_f16():
    """:func:`_gqa_chain` in float16, the softmax in float32."""

    @R.function
    def main(
        q: R.Tensor((1, 8, 4, 16), "float16"),
        k: R.Tensor((1, 2, "n", 16), "float16"),
        v: R.Tensor((1, 2, "n", 16), "float16"),
        mask: R.Tensor((1, 1, 4, "n"), "float16"),
    ):
        with R.dataflow():
            kt = R.permute_dims(R.repeat(k, 4, axis=1), [0, 1, 3, 2])
            s = R.add(R.multiply(R.matmul(q, kt), R.const(0.25, "float16")), mask)
            p = R.astype(R.nn.softmax(R.astype(s, "float32"), axis=-1), "float16")
            o = R.matmul(p, R.repeat(v, 4, axis=1))
            R.output(o)
        return o

    return main


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


def _flattened_bmm_chain_f16():
    """:func:`_flattened_bmm_chain` in float16 as TVM imports a 16-bit model's
    ``torch.export``ed matmuls with float32 accumulation cast back (``examples/
    torch_export.py``'s converters): flattened, bmm into float32, cast, unflattened."""

    @R.function
    def main(
        q: R.Tensor((1, 4, 8, 16), "float16"),
        k: R.Tensor((1, 4, 32, 16), "float16"),
        v: R.Tensor((1, 4, 32, 16), "float16"),
    ):
        with R.dataflow():
            kt = R.permute_dims(k, [0, 1, 3, 2])
            qf = R.reshape(R.broadcast_to(q, R.shape([1, 4, 8, 16])), R.shape([4, 8, 16]))
            kf = R.reshape(R.broadcast_to(kt, R.shape([1, 4, 16, 32])), R.shape([4, 16, 32]))
            s = R.astype(R.matmul(qf, kf, out_dtype="float32"), "float16")
            s = R.divide(R.reshape(s, R.shape([1, 4, 8, 32])), R.const(4.0, "float16"))
            p = R.nn.softmax(s, axis=-1)
            pf = R.reshape(R.broadcast_to(p, R.shape([1, 4, 8, 32])), R.shape([4, 8, 32]))
            vf = R.reshape(R.broadcast_to(v, R.shape([1, 4, 32, 16])), R.shape([4, 32, 16]))
            o = R.astype(R.matmul(pf, vf, out_dtype="float32"), "float16")
            o = R.reshape(o, R.shape([1, 4, 8, 16]))
            R.output(o)
        return o

    return tvm.IRModule({"main": main})


def _folded_chain_f16():
    """What :func:`.canonicalize.fold_batched_matmuls` makes of
    :func:`_flattened_bmm_chain_f16`."""

    @R.function
    def main(
        q: R.Tensor((1, 4, 8, 16), "float16"),
        k: R.Tensor((1, 4, 32, 16), "float16"),
        v: R.Tensor((1, 4, 32, 16), "float16"),
    ):
        with R.dataflow():
            kt = R.permute_dims(k, [0, 1, 3, 2])
            s = R.divide(R.astype(R.matmul(q, kt, out_dtype="float32"), "float16"), R.const(4.0, "float16"))
            p = R.nn.softmax(s, axis=-1)
            o = R.astype(R.matmul(p, v, out_dtype="float32"), "float16")
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


def test_flattened_bmm_with_casts_folds_fuses_and_matches_numpy():
    """A 16-bit model's flattened bmm accumulated in float32 and cast back folds to one
    matmul with the cast after it; the chain fuses and matches numpy."""
    from tvm_cascade.relax.canonicalize import fold_batched_matmuls

    mod = _flattened_bmm_chain_f16()
    tvm.ir.assert_structural_equal(relax.transform.Normalize()(fold_batched_matmuls(mod)),
                                   relax.transform.Normalize()(_folded_chain_f16()))
    assert len(_fused(_lower(mod, "cascade"))) == 1
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal(s).astype("float16") for s in [(1, 4, 8, 16), (1, 4, 32, 16), (1, 4, 32, 16)])
    expected = _attention_ref(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), 0.25, 0.0)
    np.testing.assert_allclose(_run(mod, "cascade", [q, k, v]), expected, rtol=1e-2, atol=5e-3)


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
    assert bool(func.attrs["tirx.is_scheduled"])
    assert _blocks_outside_threads(func) == []
    partials = [b for b in _block_names(func) if b.endswith("_partial")]
    assert bool(partials) == (method == "split_k")


def test_gpu_pipeline_leaves_what_no_fast_kernel_serves_to_the_default_lowering():
    """On a GPU the cascade pipeline does not fuse an attention the kernel library does
    not take (here: a mask tensor input, fp32): the module is lowered as the default
    pipeline lowers it, but for its softmax over the 1024 keys, one block per row."""
    with CUDA:
        cascade = relax.get_pipeline("cascade")(_static_gqa_chain(1024))
        default = relax.get_default_pipeline(CUDA)(_static_gqa_chain(1024))
    assert _fused(cascade) == []
    assert row_kernels_else_default(cascade, default) == ["softmax"]


def test_a_group_tvm_cannot_lower_is_left_and_logged(caplog):
    """``torch.export``'s SDPA with a dynamic length: its group holds the GQA broadcast to
    a symbolic shape, which LegalizeOps leaves; the module is returned as it is."""
    pytest.importorskip("torch")
    from relax_attention_cases import exported_sdpa

    mod = exported_sdpa(1, 32, 4, 2, 16, dtype="float32", decompose=True, dynamic=True)
    with caplog.at_level(logging.INFO, logger="tvm_cascade.relax"), LLVM:
        tvm.ir.assert_structural_equal(FuseAttention()(mod), mod)
    assert "attention left unfused: TVM could not lower its group to one PrimFunc" in caplog.text


def _fused_for_gpu(mod, target):
    """``mod`` with :class:`FuseAttention`'s GPU kernels (applied explicitly: the cascade
    pipeline leaves such attention to the default lowering on GPUs), compiled by the
    default pipeline."""
    with target:
        mod = FuseAttention()(mod)
    return tvm.compile(mod, target, relax_pipeline="default")


def _allocations(func):
    """(name, scope, shape) of every buffer ``func``'s blocks allocate."""
    found = []

    def visit(node):
        if isinstance(node, tvm.s_tir.stmt.SBlock):
            for buf in node.alloc_buffers:
                found.append((buf.name, str(buf.ty.storage_scope), list(buf.ty.shape)))

    tvm_ffi.structural_walk(func.body, visit)
    return found


def test_gpu_target_fuses_symbolic_keys_with_static_tiles():
    with CUDA:
        lowered = relax.get_default_pipeline(CUDA)(FuseAttention()(_gqa_chain()))
    (name,) = _fused(lowered)
    func = lowered[name]
    assert bool(func.attrs["tirx.is_scheduled"])
    assert _blocks_outside_threads(func) == []
    assert not any(b.endswith("_partial") for b in _block_names(func))  # rolling
    # The scores of a tile are shared by the row's lanes: the key axis is split into
    # (tile, key in the tile), so that one tile has a static size.
    shared = [a for a in _allocations(func) if a[1] == "shared"]
    assert shared and all(
        isinstance(shape[-1], tvm.tirx.IntImm) and shape[-1].value == 64 for _, _, shape in shared
    )
    exe = tvm.compile(lowered, CUDA, relax_pipeline=None)  # nvcc accepts the kernel
    source = exe.mod.imports[0].imports[0].inspect_source()
    assert "int64_t n" in source and "__shared__" in source


def test_gpu_split_k_over_symbolic_keys_is_left_to_the_default_schedule():
    with CUDA:
        grouped = FuseAttention(method="split_k")(_gqa_chain())
    assert _fused(grouped) == []


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
    exe = _fused_for_gpu(mod, target)
    vm = relax.VirtualMachine(exe, tvm.cuda(0))
    out = vm["main"](*(tvm.runtime.tensor(a, tvm.cuda(0)) for a in (q, k, v, mask))).numpy()
    expected = _attention_ref(q, k, v, 0.25, mask)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not tvm.cuda(0).exist, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_gpu_symbolic_keys_match_numpy_at_two_lengths(dtype):
    mod = tvm.IRModule({"main": _gqa_chain_f16()}) if dtype == "float16" else _gqa_chain()
    target = tvm.target.Target.from_device(tvm.cuda(0))
    exe = _fused_for_gpu(mod, target)
    vm = relax.VirtualMachine(exe, tvm.cuda(0))
    tol = 2e-2 if dtype == "float16" else 1e-4
    for keys in (100, 1000):
        rng = np.random.default_rng(keys)
        q = rng.standard_normal((1, 8, 4, 16)).astype(dtype)
        k = rng.standard_normal((1, 2, keys, 16)).astype(dtype)
        v = rng.standard_normal((1, 2, keys, 16)).astype(dtype)
        visible = np.arange(keys)[None, :] <= (keys - 4 + np.arange(4))[:, None]
        mask = np.where(visible, 0.0, -1e4).astype(dtype)[None, None]
        args = [tvm.runtime.tensor(a, tvm.cuda(0)) for a in (q, k, v, mask)]
        out = vm["main"](*args).numpy().astype(np.float64)
        expected = _attention_ref(q, k, v, 0.25, mask.astype(np.float64))
        np.testing.assert_allclose(out, expected, rtol=tol, atol=tol)


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
    exe = _fused_for_gpu(mod, target)
    vm = relax.VirtualMachine(exe, tvm.cuda(0))
    out = vm["main"](*(tvm.runtime.tensor(a, tvm.cuda(0)) for a in (q, k, v))).numpy()
    np.testing.assert_allclose(out, expected.transpose(0, 2, 1, 3), rtol=1e-4, atol=1e-5)


def _safe_softmax_chain(guarded=float("-inf")):
    """What ``torch.export`` makes of ``F.scaled_dot_product_attention`` with a boolean
    mask: both Q and Kᵀ scaled, the mask as ``where(mask, 0, -inf)``, and PyTorch's safe
    softmax (rows whose scores all equal ``guarded``, -inf, give zeros)."""
    minus_inf = R.const(float("-inf"), "float32")
    compared = R.const(guarded, "float32")

    @R.function
    def main(
        q: R.Tensor((1, 4, 8, 16), "float32"),
        k: R.Tensor((1, 4, 32, 16), "float32"),
        v: R.Tensor((1, 4, 32, 16), "float32"),
        visible: R.Tensor((8, 32), "bool"),
    ):
        with R.dataflow():
            scale = R.const(0.5, "float32")
            bias = R.where(visible, R.const(0.0, "float32"), minus_inf)
            kt = R.multiply(R.permute_dims(k, [0, 1, 3, 2]), scale)
            s = R.add(R.matmul(R.multiply(q, scale), kt), bias)
            p = R.nn.softmax(s, axis=-1)
            alive = R.astype(R.logical_not(R.equal(s, compared)), "int8")
            dead = R.logical_not(R.astype(R.max(alive, axis=[-1], keepdims=True), "bool"))
            p = R.where(dead, R.full_like(p, R.const(0.0, "float32")), p)
            o = R.matmul(p, v)
            R.output(o)
        return o

    return tvm.IRModule({"main": main})


def _safe_attention_ref(q, k, v, visible):
    s = q.astype(np.float64) @ k.swapaxes(-1, -2) / 4 + np.where(visible, 0.0, -np.inf)
    alive = visible.any(-1)[:, None]
    p = np.exp(s - np.where(alive, s.max(-1, keepdims=True), 0.0))
    p = np.where(alive, p / np.where(alive, p.sum(-1, keepdims=True), 1.0), 0.0)
    return p @ v


def test_safe_softmax_chain_fuses_and_zeroes_fully_masked_rows():
    mod = _safe_softmax_chain()
    assert len(_fused(_lower(mod, "cascade"))) == 1
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 4, 8, 16)).astype("float32")
    k = rng.standard_normal((1, 4, 32, 16)).astype("float32")
    v = rng.standard_normal((1, 4, 32, 16)).astype("float32")
    visible = rng.random((8, 32)) > 0.4
    visible[3] = False  # a row with no visible key: zeros, not NaN
    expected = _safe_attention_ref(q, k, v, visible)
    cascade = _run(mod, "cascade", [q, k, v, visible])
    assert not np.isnan(cascade).any()
    np.testing.assert_allclose(cascade, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(cascade, _run(mod, "default", [q, k, v, visible]), atol=1e-5)


def test_guard_other_than_minus_inf_is_left_alone():
    mod = _safe_softmax_chain(guarded=0.0)
    assert _fused(_lower(mod, "cascade")) == []
    assert tvm_ffi.structural_equal(_lower(mod, "cascade"), _lower(mod, "default"))


@pytest.mark.parametrize("form", ["causal", "mask", "gqa"])
def test_torch_sdpa_fuses_and_matches_pytorch(form):
    torch = pytest.importorskip("torch")
    from tvm.relax.frontend.torch import from_exported_program

    class Attention(torch.nn.Module):
        def forward(self, q, k, v, mask):
            if form == "mask":
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=form == "gqa"
            )

    torch.manual_seed(0)
    heads_kv = 2 if form == "gqa" else 4
    q = torch.randn(1, 4, 16, 8)
    k, v = torch.randn(1, heads_kv, 40, 8), torch.randn(1, heads_kv, 40, 8)
    mask = torch.rand(16, 40) > 0.3
    mask[5] = False  # fully masked: SDPA gives zeros
    args = (q, k, v, mask)
    with torch.no_grad():
        expected = Attention()(*args).double().numpy()
        program = torch.export.export(Attention(), args)
    mod = from_exported_program(program)
    assert len(_fused(_lower(mod, "cascade"))) == 1
    exe = tvm.compile(mod, LLVM, relax_pipeline="cascade")
    vm = relax.VirtualMachine(exe, tvm.cpu())
    out = vm["main"](*(tvm.runtime.tensor(a.numpy(), tvm.cpu()) for a in args))[0].numpy()
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)
