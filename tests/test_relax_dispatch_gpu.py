"""Relax modules compiled with ``relax_pipeline="cascade"`` on a CUDA GPU (skipped
without one): ``R.nn.attention`` runs the kernel library's kernels (prefill and decode,
static and symbolic lengths, GQA, fp16 and bf16, head dims 64/128/256) and matches
float64 numpy."""
import numpy as np
import pytest
import tvm
from library_cases import MASKS, check, masked_case
from relax_attention_cases import exported_sdpa, random_inputs, reference, run
from tvm import relax, tirx

import tvm_cascade  # noqa: F401
from tvm_cascade.library import MaskTensor
from tvm_cascade.ops import AttentionVariant
from tvm_cascade.relax.dispatch import serving
from tvm_cascade.relax.testing import attention_module, bshd_projection_chain, chain_module, mask_values

pytestmark = pytest.mark.skipif(not tvm.cuda(0).exist, reason="needs a CUDA GPU")


@pytest.mark.parametrize(
    "batch, seq_q, seq_kv, heads_q, heads_kv, head_dim, dtype, mask, symbolic",
    [
        (2, 300, 300, 8, 2, 128, "float16", "BottomRight", False),  # prefill, GQA 4
        (1, 1000, 1000, 16, 8, 64, "bfloat16", "TopLeft", True),  # symbolic prefill
        (2, 129, 700, 8, 8, 256, "float16", "BottomRight", False),  # chunked prefill
        (3, 1, 3000, 32, 8, 128, "float16", "BottomRight", True),  # decode, symbolic keys
        (4, 4, 777, 16, 4, 64, "bfloat16", "BottomRight", False),  # speculative decode
        (2, 1, 4096, 16, 8, 256, "float16", "BottomRight", False),  # head dim 256 decode
        (2, 200, 200, 4, 4, 128, "float16", None, False),  # no mask
    ],
)
def test_cascade_pipeline_runs_library_kernels(batch, seq_q, seq_kv, heads_q, heads_kv, head_dim, dtype, mask, symbolic):
    target = tvm.target.Target.from_device(tvm.cuda(0))
    shape = (batch, seq_q, seq_kv)
    if symbolic:  # the query and key lengths (one length where they are as many)
        n, m = tirx.Var("n", "int64"), tirx.Var("m", "int64")
        shape = (batch, n if seq_q == seq_kv else seq_q, n if seq_q == seq_kv else m)
    mod = attention_module(*shape, heads_q, heads_kv, head_dim, dtype, mask)
    call = mod["main"].body.blocks[0].bindings[0].value
    assert not isinstance(serving(call, target), str), serving(call, target)
    executable = tvm.compile(mod, target=target, relax_pipeline="cascade")
    q, k, v = random_inputs(batch, seq_q, seq_kv, heads_q, heads_kv, head_dim, dtype)
    out = run(executable, tvm.cuda(0), q, k, v)
    check(out.astype(np.float64), reference(q, k, v, "causal" if mask is not None else "global"), dtype)


@pytest.mark.parametrize("heads_q, heads_kv, seq", [(8, 2, 300), (4, 4, 1000)])
def test_torch_export_sdpa_on_the_library_kernel(heads_q, heads_kv, seq):
    """``torch.export`` of causal SDPA (GQA through ``enable_gqa``), SDPA kept whole:
    the cascade pipeline's module matches float64 numpy."""
    pytest.importorskip("torch")
    target = tvm.target.Target.from_device(tvm.cuda(0))
    executable = tvm.compile(exported_sdpa(2, seq, heads_q, heads_kv, 128), target=target, relax_pipeline="cascade")
    q, k, v = random_inputs(2, seq, seq, heads_q, heads_kv, 128, "float16")
    bhsd = [np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v)]
    vm = relax.VirtualMachine(executable, tvm.cuda(0))
    (out,) = vm["main"](*(tvm.runtime.tensor(x, tvm.cuda(0)) for x in bhsd))
    check(out.numpy().transpose(0, 2, 1, 3).astype(np.float64), reference(q, k, v, "causal"), "float16")


@pytest.mark.parametrize(
    "batch, seq_q, seq_kv, heads_q, heads_kv, head_dim, dtype, kwargs, variant",
    [
        (2, 300, 300, 8, 2, 128, "float16", dict(mask="causal"), AttentionVariant("c", causal=True)),
        (1, 1000, 1000, 16, 8, 64, "bfloat16", dict(mask=("window", 256), gqa="broadcast"),
         AttentionVariant("w", causal=True, window=256)),
        (2, 200, 200, 8, 8, 128, "float16", dict(mask=None, softcap=30.0), AttentionVariant("s", softcap=30.0)),
        (4, 1, 777, 32, 8, 128, "float16", dict(mask="causal"), AttentionVariant("c", causal=True)),
        (2, 129, 700, 16, 8, 256, "float16", dict(mask="causal"), AttentionVariant("c", causal=True)),
        (2, 300, 300, 8, 2, 128, "float16", dict(mask="causal", alibi=2.0 ** (-np.arange(1, 9))),
         AttentionVariant("a", causal=True, alibi=True)),
        (4, 1, 777, 32, 8, 128, "float16", dict(mask="causal", alibi=2.0 ** (-np.arange(1, 33) / 4)),
         AttentionVariant("a", causal=True, alibi=True)),
    ],
)
def test_hand_written_chains_on_the_library_kernels(batch, seq_q, seq_kv, heads_q, heads_kv, head_dim, dtype, kwargs,
                                                    variant):
    """Hand-written attention chains (constant masks, GQA repeats, float32 softmax,
    softcap, BLOOM's ALiBi bias) through the cascade pipeline match float64 numpy."""
    target = tvm.target.Target.from_device(tvm.cuda(0))
    mod = chain_module(batch, seq_q, seq_kv, heads_q, heads_kv, head_dim, dtype, **kwargs)
    executable = tvm.compile(mod, target=target, relax_pipeline="cascade")
    q, k, v = random_inputs(batch, seq_q, seq_kv, heads_q, heads_kv, head_dim, dtype)
    out = run(executable, tvm.cuda(0), *(np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v)))
    scale = float(np.float16(head_dim ** -0.5))  # the chain's constant
    check(out.transpose(0, 2, 1, 3).astype(np.float64), reference(q, k, v, variant, scale), dtype)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_torch_export_decomposed_sdpa_on_the_library_kernel(dynamic):
    """The decomposed SDPA of ``torch.export``, its length static or dynamic (one
    executable run at two lengths)."""
    pytest.importorskip("torch")
    target = tvm.target.Target.from_device(tvm.cuda(0))
    executable = tvm.compile(exported_sdpa(2, 300, 8, 2, 128, decompose=True, dynamic=dynamic), target=target,
                             relax_pipeline="cascade")
    vm = relax.VirtualMachine(executable, tvm.cuda(0))
    for seq in (300, 77) if dynamic else (300,):
        q, k, v = random_inputs(2, seq, seq, 8, 2, 128, "float16")
        (out,) = vm["main"](*(tvm.runtime.tensor(np.ascontiguousarray(x.transpose(0, 2, 1, 3)), tvm.cuda(0))
                              for x in (q, k, v)))
        check(out.numpy().transpose(0, 2, 1, 3).astype(np.float64), reference(q, k, v, "causal"), "float16")


@pytest.mark.parametrize("seq_q, seq_kv", [(1, 3000), (700, 700)], ids=["decode", "prefill"])
def test_window_size_on_the_library_kernels(seq_q, seq_kv):
    """``R.nn.attention(..., causal_mask="BottomRight", window_size=W)``: a query sees
    itself and the W - 1 keys before it."""
    target = tvm.target.Target.from_device(tvm.cuda(0))
    mod = attention_module(2, seq_q, seq_kv, 16, 4, 128, window_size=256)
    executable = tvm.compile(mod, target=target, relax_pipeline="cascade")
    q, k, v = random_inputs(2, seq_q, seq_kv, 16, 4, 128, "float16")
    out = run(executable, tvm.cuda(0), q, k, v)
    variant = AttentionVariant("w", causal=True, window=256)
    check(out.astype(np.float64), reference(q, k, v, variant), "float16")


@pytest.mark.parametrize("form", MASKS, ids=lambda m: m.describe())
@pytest.mark.parametrize("seq_q", [1, 300], ids=["decode", "prefill"])
def test_a_mask_tensor_input_on_the_library_kernels(form, seq_q):
    """A chain adding a model's mask tensor (or a boolean ``where`` over one) through the
    cascade pipeline runs the decode or prefill kernel reading the mask and matches
    float64 numpy; a row the mask hides entirely gives zeros."""
    target = tvm.target.Target.from_device(tvm.cuda(0))
    mod = chain_module(3, seq_q, 1000, 8, 2, 128, "float16", mask=None, mask_input=form)
    executable = tvm.compile(mod, target=target, relax_pipeline="cascade")
    (q, k, v, m), ref = masked_case(form, 3, 8, 2, seq_q, 1000, 128, "float16", np.random.default_rng(6))
    check(run(executable, tvm.cuda(0), q, k, v, m), ref, "float16")


def test_attention_bias_on_the_library_kernel():
    """``R.nn.attention`` with a bias (bshd tensors, a ``[b, 1, sq, skv]`` float16 bias)
    through the cascade pipeline: the prefill kernel reads the bias as its mask tensor
    and matches float64 numpy."""
    form = MaskTensor("float16")
    (q, k, v, m), ref = masked_case(form, 2, 8, 2, 300, 300, 128, "float16", np.random.default_rng(7))
    bb = relax.BlockBuilder()
    params = [relax.Var(n, relax.TensorType(x.transpose(0, 2, 1, 3).shape, "float16")) for n, x in zip("qkv", (q, k, v))]
    bias = relax.Var("bias", relax.TensorType(m.shape, "float16"))
    with bb.function("main", [*params, bias]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.attention(*params, bias=bias))
        bb.emit_func_output(out)
    target = tvm.target.Target.from_device(tvm.cuda(0))
    executable = tvm.compile(bb.get(), target=target, relax_pipeline="cascade")
    bshd = [np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v)]
    check(run(executable, tvm.cuda(0), *bshd, m).transpose(0, 2, 1, 3), ref, "float16")


@pytest.mark.parametrize("seq_q", [1, 300], ids=["decode", "prefill"])
def test_a_constant_bias_on_the_library_kernels(seq_q):
    """A chain adding constants that are no variant's mask (a random bias): the kernel
    reads the constant as its float mask tensor and matches float64 numpy."""
    target = tvm.target.Target.from_device(tvm.cuda(0))
    mod = chain_module(2, seq_q, 700, 8, 2, 128, "float16", mask="bias")
    executable = tvm.compile(mod, target=target, relax_pipeline="cascade")
    q, k, v = random_inputs(2, seq_q, 700, 8, 2, 128, "float16")
    out = run(executable, tvm.cuda(0), *(np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v)))
    scale = float(np.float16(128 ** -0.5))  # the chain's constant
    keys, values = (np.repeat(x.astype(np.float64), 4, axis=2) for x in (k, v))
    scores = np.einsum("bqhd,bkhd->bhqk", q.astype(np.float64), keys) * scale + mask_values("bias", seq_q, 700)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    expected = np.einsum("bhqk,bkhd->bhqd", probs / probs.sum(-1, keepdims=True), values)
    check(out, expected, "float16")


@pytest.mark.parametrize("seq, accumulate", [(300, "float32"), (1, "float16")])
def test_a_chain_of_bshd_projections_on_the_bshd_kernel(seq, accumulate):
    """A chain over Q, K and V transposed from bshd parameters runs the bshd kernel on
    the parameters themselves (no transpose or cast around it) and matches float64
    numpy."""
    target = tvm.target.Target.from_device(tvm.cuda(0))
    executable = tvm.compile(bshd_projection_chain(2, seq, 8, 2, 128, accumulate), target=target,
                             relax_pipeline="cascade")
    q, k, v = random_inputs(2, seq, seq, 8, 2, 128, "float16")
    scale = float(np.dtype(accumulate).type(128 ** -0.5))  # the chain's constant
    check(run(executable, tvm.cuda(0), q, k, v).astype(np.float64), reference(q, k, v, "global", scale), "float16")
