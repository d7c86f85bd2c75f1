"""tvm-cascade kernels as callables on PyTorch CUDA tensors, for the benchmark harness.

Decode kernels use the best record of a MetaSchedule JSON database when it has one for
the configuration (``TVM_CASCADE_TUNED``, default ``benchmarks/tuned/decode`` of a source
checkout, written by ``python -m benchmarks.tune_decode``), else the heuristic schedule.
"""
import os
from pathlib import Path

import tvm

from . import ops
from .ops.variants import AttentionVariant
from .schedules.decode import schedule_decode
from .trace import JSONDatabase

_TUNED = Path(__file__).resolve().parents[2] / "benchmarks" / "tuned" / "decode"

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
    dev = tvm.cuda(0)
    target = tvm.target.Target.from_device(dev)
    sch = tuned_schedule(func, target)
    if sch is None:
        sch = schedule_decode(func, heads_q, heads_kv, head_dim, dev.multi_processor_count)
    lib = tvm.compile(sch.mod, target=target)
    kernel = lib["main"]

    def run(q, k, v):
        import torch

        out = torch.empty_like(q)
        kernel(*(tvm.runtime.from_dlpack(t) for t in (q, k, v, out)))
        return out

    return run


def tuned_schedule(func, target):
    """The best tuned schedule of ``func`` for ``target`` in the tuning database, or None."""
    work_dir = Path(os.environ.get("TVM_CASCADE_TUNED", _TUNED))
    if not (work_dir / "database_tuning_record.json").exists():
        return None
    database = JSONDatabase(work_dir=str(work_dir), allow_missing=False)
    return database.query_schedule(tvm.IRModule({"main": func}), target, "main")
