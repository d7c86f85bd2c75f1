"""tvm-cascade kernels as callables on PyTorch CUDA tensors, for the benchmark harness.

:func:`build_attention` compiles each configuration by
:func:`tvm_cascade.kernels.compile_attention`: with the best record of the tuning
databases (the user's, then ``tvm_cascade/tuned/decode`` and ``tvm_cascade/tuned/prefill``
shipped with the package, or ``TVM_CASCADE_TUNED`` / ``TVM_CASCADE_TUNED_PREFILL``), else
the heuristic decode or tensor-core prefill schedule. :func:`build_runtime_attention`
takes the kernel of runtime lengths, :func:`tvm_cascade.kernels.attention_kernel`, for
the same configuration, so that the two are timed side by side.
"""
from .kernels import attention_kernel, compile_attention
from .ops.variants import AttentionVariant

#: The harness's variant names, in tvm_cascade.ops terms (softcap 50, window 256 keys).
VARIANTS = {
    "global": AttentionVariant("global"),
    "causal": AttentionVariant("causal", causal=True),
    "alibi": AttentionVariant("alibi", causal=True, alibi=True),
    "gqa": AttentionVariant("gqa", causal=True),
    "softcap": AttentionVariant("softcap", softcap=50.0),
    "window": AttentionVariant("window", causal=True, window=256),
}


def build_attention(kind, variant, batch, heads_q, heads_kv, seq_q, seq_kv, head_dim, dtype, config=None):
    """Compile one attention configuration for the current CUDA GPU (``config``: the
    heuristic schedule's choices, see :func:`~tvm_cascade.kernels.compile_attention`);
    returns ``fn(q, k, v) -> out`` on torch tensors (q[b, hq, sq, d], k/v[b, hkv, skv, d])."""
    from .kernels import kind_of

    if kind not in ("decode", "prefill"):
        raise ValueError(f"unknown attention kind {kind!r}")
    if kind_of(seq_q) != kind:
        raise ValueError(f"{seq_q} query rows are served by the {kind_of(seq_q)} schedule, not {kind}")
    return on_torch(compile_attention(
        batch, heads_q, heads_kv, seq_q, seq_kv, head_dim, variant=VARIANTS[variant], dtype=dtype, config=config
    ))


def on_torch(executable):
    """``fn(q, k, v) -> out`` on torch tensors for a compiled attention module whose
    ``"main"`` takes ``q, k, v, out`` (:func:`~tvm_cascade.kernels.compile_attention`'s)."""
    import tvm

    kernel = executable["main"]

    def run(q, k, v):
        import torch

        out = torch.empty_like(q)
        kernel(*(tvm.runtime.from_dlpack(t) for t in (q, k, v, out)))
        return out

    return run


def build_runtime_attention(variant, heads_q, heads_kv, head_dim, dtype, q, k, v, target="cuda"):
    """The kernel of runtime lengths (:func:`~tvm_cascade.kernels.attention_kernel`, bhsd)
    for the harness's ``variant`` and ``q, k, v`` (torch tensors on ``target``'s device),
    planned once for their shapes; returns ``(fn(q, k, v) -> out, the family that runs
    them)``."""
    kernel = attention_kernel(heads_q, heads_kv, head_dim, variant=VARIANTS[variant], dtype=dtype, target=target)
    plan = kernel.plan(q, k, v)

    def run(q, k, v):
        return kernel(q, k, v, plan=plan)

    return run, plan.family.name
