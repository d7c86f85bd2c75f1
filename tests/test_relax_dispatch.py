"""``DispatchAttention`` (``tvm_cascade.relax.dispatch``): ``R.nn.attention`` on a CUDA
target becomes a call of the kernel library's family for it, lengths symbolic or not;
what no fast family serves is left as it is, with the reason logged. Compiled here with
nvcc (no GPU needed); the numerics run in ``test_relax_dispatch_gpu.py``."""
import logging
import re

import numpy as np
import pytest
import tvm
import tvm_ffi
from relax_attention_cases import SM90A, exported_sdpa, row_kernels_else_default
from tvm import relax, tirx

import tvm_cascade  # noqa: F401  (registers the "cascade" pipeline)
from tvm_cascade.analysis.chain import substitute
from tvm_cascade.library import AttentionSpec, MaskTensor
from tvm_cascade.library.tensor_core_decode import TensorCoreDecode
from tvm_cascade.ops import AttentionVariant
from tvm_cascade.relax.chain_spec import ChainAttention, read_chain
from tvm_cascade.relax.dispatch import LIBRARY_ATTR, DispatchAttention
from tvm_cascade.relax.testing import attention_module, bshd_projection_chain, chain_module

ATTENTION = tvm.ir.Op.get("relax.nn.attention")


def _dispatch(mod, target=SM90A):
    with tvm.target.Target(target):
        return DispatchAttention()(mod)


def _kernels(mod):
    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)}


def _calls(mod):
    return [b.value for blk in mod["main"].body.blocks for b in blk.bindings if isinstance(b.value, relax.Call)]


def _cuda_source(executable):
    modules = [executable.mod]
    while modules:
        m = modules.pop()
        if m.kind == "cuda":
            return m.inspect_source()
        modules += list(m.imports)
    raise AssertionError("no CUDA module")


def test_prefill_calls_the_warp_specialized_kernel():
    """A static prefill: one call of the warp-specialised family's bshd kernel, its
    persistent blocks (2 sequences x 8 heads x 3 row tiles) an argument."""
    mod = attention_module(2, 300, 300, 8, 2, 128)
    out = _dispatch(mod)
    (name, kernel), = _kernels(out).items()
    assert name == "attention_warp_specialized_prefill_bshd_h8x2_d128_float16_causal"
    assert kernel.attrs["target"].attrs["arch"] == "sm_90a" and bool(kernel.attrs["tirx.is_scheduled"])
    assert kernel.attrs[LIBRARY_ATTR] == "warp_specialized_prefill"

    bb = relax.BlockBuilder()
    gvar = bb.add_func(kernel, name)
    q, k, v = (relax.Var(p.name, p.ty) for p in mod["main"].params)
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            o = bb.emit_output(relax.call_tir(gvar, [q, k, v, tirx.IntImm("int32", 48)], q.ty))
        bb.emit_func_output(o)
    tvm.ir.assert_structural_equal(out, bb.get())


def test_decode_with_symbolic_keys_plans_in_the_graph():
    """One query over a symbolic number of keys: the tensor-core decode family, its
    chunk size an expression of the key length."""
    n = tirx.Var("n", "int64")
    out = _dispatch(attention_module(4, 1, n, 32, 8, 128))
    (name,) = _kernels(out)
    assert name.startswith("attention_tensor_core_decode_bshd_h32x8_d128")
    (call,) = _calls(out)
    q, k, v, chunk_keys = call.args[1].fields
    assert any(var.same_as(n) for var in tvm.tirx.analysis.undefined_vars(chunk_keys))
    spec = AttentionSpec.make(32, 8, 128, variant="causal", layout="bshd", target=tvm.target.Target(SM90A))
    for keys in (1, 700, 8000, 32768):  # the graph's plan is the call's
        want = TensorCoreDecode().plan(spec, 4, 1, keys, tvm.cuda(0))
        got = tvm.sym.Analyzer().simplify(substitute(chunk_keys, {n: tirx.IntImm("int64", keys)}))
        assert int(got) == want[0], keys


@pytest.mark.parametrize(
    "shape, dtype, mask, reason",
    [
        ((2, 64, 64, 4, 4, 64), "float32", "BottomRight", "no fast kernel family"),
        ((2, 4, 1000, 4, 4, 64), "float16", "TopLeft", "TopLeft mask over 4 queries and 1000 keys"),
        ((2, "n", "m", 4, 4, 64), "float16", "BottomRight", "more queries than keys is not served"),
        ((2, 64, 64, 4, 4, 100), "float16", None, "no fast kernel family"),
    ],
)
def test_what_no_fast_kernel_serves_is_left_and_logged(shape, dtype, mask, reason, caplog):
    shape = [tirx.Var(x, "int64") if isinstance(x, str) else x for x in shape]
    mod = attention_module(*shape, dtype=dtype, causal_mask=mask)
    with caplog.at_level(logging.INFO, logger="tvm_cascade.relax"):
        out = _dispatch(mod)
    tvm.ir.assert_structural_equal(out, mod)
    assert reason in caplog.text


@pytest.mark.parametrize("seq_q, family", [(64, "warp_specialized_prefill"), (1, "tensor_core_decode")])
def test_a_head_dim_between_the_kernels_runs_the_next_kernels(seq_q, family):
    """Head dim 96 (Phi-3's) runs the head dim 128 kernels: the warp-specialised
    prefill's, and the tensor-core decode's for decode."""
    out = _dispatch(attention_module(2, seq_q, 64, 32, 32, 96, dtype="float16", causal_mask="BottomRight"))
    (name,) = _kernels(out)
    assert name == f"attention_{family}_bshd_h32x32_d96_float16_causal"


def test_cpu_targets_are_left_alone():
    mod = attention_module(2, 64, 64, 4, 4, 64)
    tvm.ir.assert_structural_equal(_dispatch(mod, "llvm"), mod)


def test_symbolic_causal_prefill_and_the_cascade_pipeline_compile():
    """The cascade pipeline dispatches a prefill of symbolic length (``TopLeft`` over as
    many queries as keys) and a static decode, and nvcc compiles the kernels."""
    n = tirx.Var("n", "int64")
    for mod, family in ((attention_module(1, n, n, 16, 8, 64, "bfloat16", "TopLeft"), "warp_specialized_prefill"),
                        (attention_module(8, 1, 4096, 16, 8, 256), "split_k_decode")):
        executable = tvm.compile(mod, target=tvm.target.Target(SM90A), relax_pipeline="cascade")
        assert f"attention_{family}_bshd" in _cuda_source(executable)


def test_transposes_from_bhsd_fold_into_the_kernel():
    """torch.export's SDPA form, ``permute_dims`` to bshd around ``R.nn.attention``: the
    bhsd kernel reads the tensors before the transposes, and none is left."""
    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType((2, 8, 300, 128), "float16"))
    k, v = (relax.Var(n, relax.TensorType((2, 2, 300, 128), "float16")) for n in "kv")
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            bshd = [bb.emit(relax.op.permute_dims(x, [0, 2, 1, 3])) for x in (q, k, v)]
            o = bb.emit(relax.op.nn.attention(*bshd, causal_mask="TopLeft"))
            result = bb.emit_output(relax.op.permute_dims(o, [0, 2, 1, 3]))
        bb.emit_func_output(result)
    out = _dispatch(bb.get())
    (name, kernel), = _kernels(out).items()
    assert name == "attention_warp_specialized_prefill_bhsd_h8x2_d128_float16_causal"

    bb = relax.BlockBuilder()
    gvar = bb.add_func(kernel, name)
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            result = bb.emit_output(relax.call_tir(gvar, [q, k, v, tirx.IntImm("int32", 48)], q.ty))
        bb.emit_func_output(result)
    tvm.ir.assert_structural_equal(out, bb.get())


def test_torch_export_sdpa_runs_one_kernel():
    """``torch.export`` of causal SDPA with GQA: the cascade pipeline's module calls the
    bhsd kernel on the exported function's own inputs, no transpose kernel around it."""
    pytest.importorskip("torch")
    out = _dispatch(exported_sdpa(2, 300, 8, 2, 128))
    (name,) = _kernels(out)
    assert name == "attention_warp_specialized_prefill_bhsd_h8x2_d128_float16_causal"
    ops = [c.op.name for c in _calls(out) if isinstance(c.op, tvm.ir.Op)]
    assert "relax.permute_dims" not in ops and "relax.nn.attention" not in ops, ops


def _read(mod):
    """``read_chain`` of the function's last matmul."""
    func = mod["main"]
    var2val = relax.analysis.get_var2val(func)
    (root,) = [c for c in _calls(mod) if c.op.name == "relax.matmul" and c.ty.ndim == 4 and
               tvm_ffi.structural_equal(c.ty.shape.values[-1], func.params[0].ty.shape.values[-1])][-1:]
    return read_chain(root, var2val.get)


@pytest.mark.parametrize(
    "kwargs, variant",
    [
        (dict(mask="causal"), AttentionVariant("causal", causal=True)),
        (dict(mask=("window", 5), gqa="broadcast"), AttentionVariant("window", causal=True, window=5)),
        (dict(mask=None, softcap=30.0), AttentionVariant("global", softcap=30.0)),
        (dict(mask="causal", softcap=50.0, scale=0.25), AttentionVariant("causal", causal=True, softcap=50.0)),
    ],
)
def test_chains_read_as_library_variants(kwargs, variant):
    """A chain's scale (constants on the scores, a softcap's cap folded in), its GQA
    source tensors and its mask, known by value, as the library's variant."""
    mod = chain_module(2, 12, 20, 8, 2, 64, **kwargs)
    chain = _read(mod)
    assert isinstance(chain, ChainAttention), chain
    q, k, v = mod["main"].params[:3]
    assert chain.q.same_as(q) and chain.k.same_as(k) and chain.v.same_as(v)
    assert chain.variant == variant
    scale = float(np.float16(kwargs.get("scale", 1 / 8)))  # the constant's half value
    assert chain.scale == pytest.approx(scale)


def test_a_mask_no_variant_expresses_is_read_as_a_tensor():
    """A chain adding constants that are no variant's mask (a bias, say): the kernel
    reads them as a float mask tensor, which the call passes."""
    mod = chain_module(2, 12, 20, 8, 2, 64, mask="bias")
    chain = _read(mod)
    assert chain.variant == AttentionVariant("global") and chain.mask_tensor == MaskTensor("float32", False, False, True)
    assert isinstance(chain.mask, tvm.ir.expr.Constant) and [int(n) for n in chain.mask.ty.shape.values] == [12, 20]
    (call,) = [c for c in _calls(_dispatch(mod)) if c.op.name == "relax.call_tir"]
    assert [int(n) for n in call.args[1].fields[3].ty.shape.values] == [1, 1, 12, 20]


@pytest.mark.parametrize("form", [True, MaskTensor("bool"), MaskTensor("float32", heads=True, queries=False)],
                         ids=["2d-float32", "bool", "float32-per-head"])
def test_a_mask_tensor_input_is_read_by_the_kernels(form):
    """A chain adding a mask tensor parameter (or a boolean ``where`` over one): decode
    calls the tensor-core decode kernel with the mask as its fourth tensor (a 2-d mask
    reshaped to four axes), prefill the warp-specialised kernel."""
    mod = chain_module(2, 1, 700, 8, 2, 128, mask=None, mask_input=form)
    chain = _read(mod)
    assert isinstance(chain, ChainAttention) and chain.mask.same_as(mod["main"].params[3])
    out = _dispatch(mod)
    (name, kernel), = _kernels(out).items()
    assert name.startswith("attention_tensor_core_decode_bhsd_h8x2_d128_float16_global_mask")
    assert [p.name for p in kernel.params][3] == "mask"
    call = [c for c in _calls(out) if c.op.name == "relax.call_tir"][0]
    mask_arg = call.args[1].fields[3]
    if form is True:
        assert [int(n) for n in mask_arg.ty.shape.values] == [1, 1, 1, 700]
    else:
        assert mask_arg.same_as(mod["main"].params[3])
    (name,) = _kernels(_dispatch(chain_module(2, 30, 700, 8, 2, 128, mask=None, mask_input=form)))
    assert name.startswith("attention_warp_specialized_prefill_bhsd_h8x2_d128_float16_global_mask")


def _chain_with_mask(shape, dtype, op="add"):
    """A decode chain over 4 heads and 100 keys whose scores meet a mask parameter of
    ``shape`` and ``dtype`` by ``op``: ``"add"``, ``"where"`` (``where(mask, s, -inf)``)
    or ``"where-inverted"`` (``where(mask, -inf, s)``)."""
    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType((1, 4, 1, 64), "float16"))
    k, v = (relax.Var(n, relax.TensorType((1, 4, 100, 64), "float16")) for n in "kv")
    mask = relax.Var("mask", relax.TensorType(shape, dtype))
    with bb.function("main", [q, k, v, mask]):
        with bb.dataflow():
            kt = bb.emit(relax.op.permute_dims(k, [0, 1, 3, 2]))
            s = bb.emit(relax.op.astype(bb.emit(relax.op.matmul(q, kt)), "float32"))
            fill = relax.const(float("-inf"), "float32")
            s = bb.emit({"add": lambda: relax.op.add(s, mask), "where": lambda: relax.op.where(mask, s, fill),
                         "where-inverted": lambda: relax.op.where(mask, fill, s)}[op]())
            p = bb.emit(relax.op.astype(bb.emit(relax.op.nn.softmax(s, axis=-1)), "float16"))
            out = bb.emit_output(relax.op.matmul(p, v))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize(
    "shape, dtype, op, reason",
    [
        ((2, 1, 1, 100), "float32", "add", r"a mask tensor of shape \[2, 1, 1, 100\]: \[b or 1, h or 1, sq or 1, skv\]"),
        ((100,), "float32", "add", r"a mask tensor that is not \[b, h, sq, skv\]"),
        ((1, 1, 1, 100), "bool", "where-inverted", "does not hide keys with -inf where the tensor is False"),
    ],
)
def test_mask_tensors_the_kernel_does_not_read(shape, dtype, op, reason, caplog):
    """Mask tensors of other shapes or forms are named and left to the default lowering."""
    mod = _chain_with_mask(shape, dtype, op)
    assert re.search(reason, _read(mod)), _read(mod)
    with caplog.at_level(logging.INFO, logger="tvm_cascade.relax"):
        tvm.ir.assert_structural_equal(_dispatch(mod), mod)
    assert re.search(reason, caplog.text)


def test_a_chain_becomes_one_kernel_call():
    """A causal GQA chain in fp16 with a float32 softmax: one call of the bhsd kernel on
    the function's q, k, v; the chain's other bindings are gone."""
    mod = chain_module(2, 300, 300, 8, 2, 128)
    out = _dispatch(mod)
    (name, kernel), = _kernels(out).items()
    assert name == "attention_warp_specialized_prefill_bhsd_h8x2_d128_float16_causal"
    bb = relax.BlockBuilder()
    gvar = bb.add_func(kernel, name)
    q, k, v = mod["main"].params
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            result = bb.emit_output(relax.call_tir(gvar, [q, k, v, tirx.IntImm("int32", 48)], q.ty))
        bb.emit_func_output(result)
    tvm.ir.assert_structural_equal(out, bb.get())


def test_torch_export_decomposed_sdpa_is_one_kernel():
    """``torch.export``'s default (SDPA decomposed into a float32 chain with a mask of
    ``arange`` comparisons): one kernel call on the exported function's inputs, no cast or
    transpose left."""
    pytest.importorskip("torch")
    out = _dispatch(exported_sdpa(2, 300, 8, 2, 128, decompose=True))
    (name,) = _kernels(out)
    assert name == "attention_warp_specialized_prefill_bhsd_h8x2_d128_float16_causal"
    assert [c.op.name for c in _calls(out) if isinstance(c.op, tvm.ir.Op)] == ["relax.call_tir"]


def test_a_mask_graph_shared_by_layers_is_computed_once(monkeypatch):
    """Two chains (a model's layers) adding one causal mask built of ``arange``s: the
    mask is computed on the CPU once, and both become kernel calls."""
    import tvm_cascade.relax.chain_spec as chain_spec

    computed = []
    evaluator = chain_spec._evaluator
    monkeypatch.setattr(chain_spec, "_evaluator", lambda var, lookup: computed.append(var) or evaluator(var, lookup))
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 4, 64, 64), "float16"))
    with bb.function("main", [x]):
        with bb.dataflow():
            rows = bb.emit(relax.op.expand_dims(bb.emit(relax.op.arange(0, 64, 1, "int64")), axis=[-1]))
            cols = bb.emit(relax.op.expand_dims(bb.emit(relax.op.arange(0, 64, 1, "int64")), axis=[-2]))
            seen = bb.emit(relax.op.less_equal(bb.emit(relax.op.subtract(cols, rows)), relax.const(0, "int64")))
            mask = bb.emit(relax.op.where(seen, relax.const(0.0, "float16"), relax.const(float("-inf"), "float16")))
            h = x
            for _ in range(2):
                s = bb.emit(relax.op.multiply(bb.emit(relax.op.matmul(h, bb.emit(relax.op.permute_dims(h, [0, 1, 3, 2])))),
                                              relax.const(0.125, "float16")))
                p = bb.emit(relax.op.nn.softmax(bb.emit(relax.op.add(s, mask)), axis=-1))
                h = bb.emit(relax.op.matmul(p, h))
            out = bb.emit_output(h)
        bb.emit_func_output(out)
    dispatched = _dispatch(bb.get())
    assert len(computed) == 1
    assert [c.op.name for c in _calls(dispatched) if isinstance(c.op, tvm.ir.Op)] == ["relax.call_tir"] * 2


def test_torch_export_with_a_dynamic_length_is_one_kernel():
    """``torch.export`` with the sequence length dynamic: the decomposed SDPA's mask is a
    graph over the shape variable; computed at several lengths it is causal at each, and
    the chain is one call of the kernel whose lengths are runtime values."""
    pytest.importorskip("torch")
    out = _dispatch(exported_sdpa(2, 300, 8, 2, 128, decompose=True, dynamic=True))
    (name,) = _kernels(out)
    assert name == "attention_warp_specialized_prefill_bhsd_h8x2_d128_float16_causal"
    (call,) = [c for c in _calls(out) if isinstance(c.op, tvm.ir.Op)]
    assert call.op.name == "relax.call_tir" and not isinstance(call.ty.shape.values[2], tirx.IntImm)


def _arange_mask_chain(length, seen, dtype="float16", mask_dtype="float32", fill=-1e9):
    """Self-attention over ``length`` positions (symbolic or not) of ``dtype`` whose
    additive mask is ``where(seen(rows, cols), 0, fill)`` in ``mask_dtype``, the type the
    softmax computes in: ``rows``/``cols`` the [n, 1] and [1, n] ``arange``s of the
    queries and keys (emitted relax expressions)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 4, length, 64), dtype))
    with bb.function("main", [x]):
        with bb.dataflow():
            rows = bb.emit(relax.op.expand_dims(bb.emit(relax.op.arange(0, length, 1, "int64")), axis=[-1]))
            cols = bb.emit(relax.op.expand_dims(bb.emit(relax.op.arange(0, length, 1, "int64")), axis=[-2]))
            mask = bb.emit(relax.op.where(bb.emit(seen(bb, rows, cols)), relax.const(0.0, mask_dtype),
                                          relax.const(fill, mask_dtype)))
            s = bb.emit(relax.op.matmul(x, bb.emit(relax.op.permute_dims(x, [0, 1, 3, 2]))))
            if mask_dtype != dtype:
                s = bb.emit(relax.op.astype(s, mask_dtype))
            p = bb.emit(relax.op.nn.softmax(bb.emit(relax.op.add(s, mask)), axis=-1))
            if mask_dtype != dtype:
                p = bb.emit(relax.op.astype(p, dtype))
            out = bb.emit_output(relax.op.matmul(p, x))
        bb.emit_func_output(out)
    return bb.get()


def _causal_rows(bb, rows, cols):
    return relax.op.less_equal(bb.emit(relax.op.subtract(cols, rows)), relax.const(0, "int64"))


def _window_rows(width):
    def seen(bb, rows, cols):
        within = bb.emit(relax.op.less(bb.emit(relax.op.subtract(rows, cols)), relax.const(width, "int64")))
        return relax.op.logical_and(bb.emit(_causal_rows(bb, rows, cols)), within)

    return seen


def _causal_below(threshold):
    """Causal for the first ``threshold`` queries, every key seen by the later ones."""

    def seen(bb, rows, cols):
        late = bb.emit(relax.op.greater_equal(rows, relax.const(threshold, "int64")))
        return relax.op.logical_or(bb.emit(_causal_rows(bb, rows, cols)), late)

    return seen


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_mask_of_minus_ten_thousand_in_the_models_type_is_causal(dtype):
    """A causal ``where(seen, 0, -1e4)`` in the model's type (bfloat16 rounds -1e4 to
    -9984) hides keys: the chain is the causal variant, no mask tensor read."""
    mod = _arange_mask_chain(300, _causal_rows, dtype=dtype, mask_dtype=dtype, fill=-1e4)
    assert list(_kernels(_dispatch(mod))) == [f"attention_warp_specialized_prefill_bhsd_h4x4_d64_{dtype}_causal"]


def test_masks_over_a_symbolic_length_are_read_at_several_lengths():
    """A mask built of ``arange``s over a symbolic length: causal, or a sliding window
    whose width shows only at lengths past it, is the library's variant; a mask that is
    causal only below a threshold (a constant of its graph), one that is no variant at
    any length and one too long to check are read as a mask tensor, computed in the
    graph."""
    n = tirx.Var("n", "int64")
    assert _read(_arange_mask_chain(n, _causal_rows)).variant == AttentionVariant("causal", causal=True)
    window = _read(_arange_mask_chain(n, _window_rows(40)))
    assert window.variant == AttentionVariant("window", causal=True, window=40) and window.mask is None
    prefix = lambda bb, rows, cols: relax.op.less(cols, relax.const(3, "int64"))  # noqa: E731
    for seen, queries in ((_causal_below(100), True), (prefix, False), (_window_rows(10000), True)):
        chain = _read(_arange_mask_chain(n, seen))
        assert chain.variant == AttentionVariant("global")
        assert chain.mask_tensor == MaskTensor("float32", False, False, queries)
        assert not isinstance(chain.mask, tvm.ir.expr.Constant)


def test_chunked_prefill_over_a_symbolic_past_is_served():
    """``n`` new queries over ``past + n`` keys (chunked prefill, both symbolic): shape
    variables are sizes, so there are provably no more queries than keys."""
    n, past = tirx.Var("n", "int64"), tirx.Var("past", "int64")
    out = _dispatch(attention_module(1, n, past + n, 8, 2, 128))
    (name,) = _kernels(out)
    assert name.startswith("attention_warp_specialized_prefill_bshd")


def _attention_bias(bias_shape, causal_mask):
    bb = relax.BlockBuilder()
    q, k, v = (relax.Var(n, relax.TensorType((2, 64, 4, 64), "float16")) for n in "qkv")
    bias = relax.Var("bias", relax.TensorType(bias_shape, "float16"))
    with bb.function("main", [q, k, v, bias]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.attention(q, k, v, bias=bias, causal_mask=causal_mask))
        bb.emit_func_output(out)
    return bb.get()


def test_attention_with_a_bias_reads_it_as_a_mask_tensor():
    """``R.nn.attention_bias``: the bias is the kernel's float mask tensor (broadcast
    over the axes it has 1 of)."""
    mod = _attention_bias((2, 1, 64, 64), "BottomRight")
    out = _dispatch(mod)
    (name, kernel), = _kernels(out).items()
    assert name == "attention_warp_specialized_prefill_bshd_h4x4_d64_float16_causal_maskfloat16_b1qk"
    (call,) = [c for c in _calls(out) if c.op.name == "relax.call_tir"]
    assert [a.name for a in call.args[1].fields[:4]] == ["q", "k", "v", "bias"]
    assert [p.name for p in kernel.params][3] == "mask"


def test_a_key_padding_mask_of_one_row_is_not_causal():
    """A mask of one row for every query ([1, skv]: keys hidden from all) broadcasts to
    the scores and is no variant of the library's: a mask tensor of one query row; one
    that hides nothing is global, no mask."""
    for hidden in (3, 0):
        values = np.zeros((1, 20), "float32")
        values[0, :hidden] = -np.inf
        bb = relax.BlockBuilder()
        q, k, v = (relax.Var(n, relax.TensorType((1, 4, 12, 64), "float16") if n == "q" else
                             relax.TensorType((1, 4, 20, 64), "float16")) for n in "qkv")
        with bb.function("main", [q, k, v]):
            with bb.dataflow():
                s = bb.emit(relax.op.matmul(q, bb.emit(relax.op.permute_dims(k, [0, 1, 3, 2]))))
                s = bb.emit(relax.op.add(bb.emit(relax.op.astype(s, "float32")), relax.const(values)))
                p = bb.emit(relax.op.astype(bb.emit(relax.op.nn.softmax(s, axis=-1)), "float16"))
                out = bb.emit_output(relax.op.matmul(p, v))
            bb.emit_func_output(out)
        chain = _read(bb.get())
        assert chain.variant == AttentionVariant("global")
        assert chain.mask_tensor == (MaskTensor("float32", False, False, False) if hidden else None)


def test_gpu_targets_other_than_cuda_leave_attention_to_the_default_lowering():
    """ROCm has none of the library's kernels: the cascade pipeline lowers attention there
    as the default pipeline does (``FuseAttention`` remains for explicit use), but for
    its softmax, one block per row."""
    rocm = tvm.target.Target({"kind": "rocm", "mcpu": "gfx942"})
    mod = chain_module(1, 64, 256, 8, 2, 64)
    with rocm:
        rows = row_kernels_else_default(relax.get_pipeline("cascade")(mod), relax.get_default_pipeline(rocm)(mod))
    assert len(rows) == 1 and "softmax" in rows[0]


def test_a_window_size_is_the_library_sliding_window():
    """``window_size=W`` with the BottomRight mask (a query sees itself and the W - 1 keys
    before it, as TVM's CUTLASS lowering reads it) runs the library's window variant;
    with TopLeft it is left."""
    out = _dispatch(attention_module(2, 1, 8000, 32, 8, 128, window_size=4096))
    (name,) = _kernels(out)
    assert name == "attention_tensor_core_decode_bshd_h32x8_d128_float16_window4096"
    mod = attention_module(2, 64, 64, 4, 4, 64, causal_mask="TopLeft", window_size=16)
    tvm.ir.assert_structural_equal(_dispatch(mod), mod)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_a_chain_of_bshd_projections_reads_them_where_they_are(dtype):
    """Q, K and V transposed from bshd are the bshd kernel's inputs, and its output is the
    function's: no transpose, and no cast, is left around the kernel."""
    out = _dispatch(bshd_projection_chain(2, 64, 8, 2, 128, dtype))
    (name,) = _kernels(out)
    assert name == "attention_warp_specialized_prefill_bshd_h8x2_d128_float16_global"
    (call,) = _calls(out)
    assert call.op.name == "relax.call_tir" and [a.name for a in call.args[1].fields[:3]] == ["q", "k", "v"]
    (binding,) = [b for blk in out["main"].body.blocks for b in blk.bindings]
    assert out["main"].body.body.same_as(binding.var)


def _alibi_slopes(heads):
    return 2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)


def test_an_alibi_bias_is_the_alibi_variant():
    """A chain adding BLOOM's ALiBi bias (``slope_h * j``) and a causal mask is the
    library's causal ALiBi variant: the kernel computes the bias, no tensor is read."""
    mod = chain_module(2, 64, 64, 8, 2, 128, mask="causal", alibi=_alibi_slopes(8))
    chain = _read(mod)
    assert chain.variant == AttentionVariant("causal", causal=True, alibi=True) and chain.mask is None
    (name,) = _kernels(_dispatch(mod))
    assert name == "attention_warp_specialized_prefill_bhsd_h8x2_d128_float16_causal_alibi"


def test_a_bias_of_other_slopes_is_a_mask_tensor():
    """Other slopes (twice the library's) are no ALiBi of the library's: alone, the bias
    is a float mask tensor of a plane per head; beside a causal mask, a second mask, and
    the chain is left as it is. (A causal mask, all 0 and -inf, is no ALiBi either.)"""
    mod = chain_module(2, 64, 64, 8, 2, 128, mask=None, alibi=2 * _alibi_slopes(8))
    chain = _read(mod)
    assert chain.variant == AttentionVariant("global") and chain.mask_tensor == MaskTensor("float32", False, True, False)
    causal = chain_module(2, 64, 64, 8, 2, 128, mask="causal", alibi=2 * _alibi_slopes(8))
    assert "more than one mask" in _read(causal)


def test_bloom_alibi_computes_the_library_alibi():
    """What ``_adds_alibi`` relies on: attention with BLOOM's bias ``slope_h * j`` (the
    chain, run by TVM's default pipeline on the CPU) is the library's ALiBi variant
    (``slope_h * (j - i)``, the float64 reference), prefill and decode."""
    from relax_attention_cases import random_inputs, reference, run

    for batch, seq_q, seq_kv in ((2, 30, 30), (2, 1, 77)):
        mod = chain_module(batch, seq_q, seq_kv, 8, 2, 64, "float32", mask="causal", alibi=_alibi_slopes(8))
        q, k, v = random_inputs(batch, seq_q, seq_kv, 8, 2, 64, "float32")
        out = run(tvm.compile(mod, target="llvm"), tvm.cpu(), *(np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v)))
        expected = reference(q, k, v, AttentionVariant("a", causal=True, alibi=True), 64 ** -0.5)
        np.testing.assert_allclose(out.transpose(0, 2, 1, 3), expected, rtol=1e-5, atol=1e-5)


def test_an_alibi_bias_over_a_symbolic_length():
    """ALiBi and a causal ``where`` built from ``arange`` over the symbolic length (as a
    model exported with a dynamic length computes them) are the causal ALiBi variant."""
    n = tirx.Var("n", "int64")
    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType((1, 8, n, 64), "float16"))
    k, v = (relax.Var(name, relax.TensorType((1, 2, n, 64), "float16")) for name in "kv")
    slopes = _alibi_slopes(8).astype("float32").reshape(1, 8, 1, 1)
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            kt = bb.emit(relax.op.permute_dims(bb.emit(relax.op.repeat(k, 4, axis=1)), [0, 1, 3, 2]))
            s = bb.emit(relax.op.multiply(bb.emit(relax.op.matmul(q, kt)), relax.const(0.125, "float16")))
            s = bb.emit(relax.op.astype(s, "float32"))
            pos = bb.emit(relax.op.arange(0, n, 1, "int64"))
            s = bb.emit(relax.op.add(s, bb.emit(relax.op.multiply(relax.const(slopes), bb.emit(relax.op.astype(pos, "float32"))))))
            seen = bb.emit(relax.op.less_equal(bb.emit(relax.op.expand_dims(pos, [0])), bb.emit(relax.op.expand_dims(pos, [1]))))
            s = bb.emit(relax.op.where(seen, s, relax.const(float("-inf"), "float32")))
            p = bb.emit(relax.op.astype(bb.emit(relax.op.nn.softmax(s, axis=-1)), "float16"))
            out = bb.emit_output(relax.op.matmul(p, bb.emit(relax.op.repeat(v, 4, axis=1))))
        bb.emit_func_output(out)
    mod = bb.get()
    assert _read(mod).variant == AttentionVariant("causal", causal=True, alibi=True)
    (name,) = _kernels(_dispatch(mod))
    assert name == "attention_warp_specialized_prefill_bhsd_h8x2_d64_float16_causal_alibi"
