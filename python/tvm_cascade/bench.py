"""tvm-cascade kernels as callables on PyTorch CUDA tensors, for the benchmark harness."""
import tvm

from . import ops
from .ops.variants import AttentionVariant
from .schedules.decode import schedule_decode

#: The harness's variant names, in tvm_cascade.ops terms (softcap 50, window 256 keys).
VARIANTS = {
    "global": AttentionVariant("global"),
    "causal": AttentionVariant("causal", causal=True),
    "alibi": AttentionVariant("alibi", causal=True, alibi=True),
    "gqa": AttentionVariant("gqa", causal=True),
    "softcap": AttentionVariant("softcap", softcap=50.0),
    "window": AttentionVariant("window", causal=True, window=256),
}


def build_attention(kind, variant, batch, heads_q, heads_kv, seq_q, seq_kv, head_dim, dtype):
    """Compile one attention configuration for the current CUDA GPU; returns
    ``fn(q, k, v) -> out`` on torch tensors (q[b, hq, sq, d], k/v[b, hkv, skv, d])."""
    if kind != "decode":
        raise NotImplementedError(
            "tvm-cascade has no tensor-core prefill schedule yet (the prefill issue)"
        )
    func = ops.attention(
        batch, heads_q, heads_kv, seq_q, seq_kv, head_dim, dtype=dtype, variant=VARIANTS[variant]
    )
    sch = schedule_decode(func, heads_q, heads_kv, head_dim)
    dev = tvm.cuda(0)
    lib = tvm.compile(sch.mod, target=tvm.target.Target.from_device(dev))
    kernel = lib["main"]

    def run(q, k, v):
        import torch

        out = torch.empty_like(q)
        kernel(*(tvm.runtime.from_dlpack(t) for t in (q, k, v, out)))
        return out

    return run
