"""tvm-cascade kernels as callables on PyTorch CUDA tensors, for the benchmark harness.

Decode kernels use the best record of a MetaSchedule JSON database when it has one for
the configuration (``TVM_CASCADE_TUNED``, default ``benchmarks/tuned/decode`` of a source
checkout, written by ``python -m benchmarks.tune_decode``), else the heuristic schedule.
Prefill kernels likewise use ``benchmarks/tuned/prefill`` (``TVM_CASCADE_TUNED_PREFILL``,
written by ``python -m benchmarks.tune_prefill``), else the tensor-core schedule of
:mod:`tvm_cascade.schedules.prefill` with its default choices.
"""
import os
from pathlib import Path

import tvm

from . import ops
from .ops.variants import AttentionVariant
from .schedules.decode import schedule_decode
from .schedules import prefill
from .trace import JSONDatabase

_TUNED = Path(__file__).resolve().parents[2] / "benchmarks" / "tuned" / "decode"
_TUNED_PREFILL = _TUNED.parent / "prefill"

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
    if kind not in ("decode", "prefill"):
        raise ValueError(f"unknown attention kind {kind!r}")
    func = ops.attention(
        batch, heads_q, heads_kv, seq_q, seq_kv, head_dim, dtype=dtype, variant=VARIANTS[variant]
    )
    dev = tvm.cuda(0)
    target = tvm.target.Target.from_device(dev)
    if kind == "prefill":
        prefill.cuda_intrinsics()  # the tuned records name them
        sch = tuned_schedule(func, target, os.environ.get("TVM_CASCADE_TUNED_PREFILL", _TUNED_PREFILL))
        if sch is None:
            sch = prefill.schedule_prefill(func)
        lib = prefill.build(sch.mod, target)
    else:
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


def tuned_schedule(func, target, work_dir=None):
    """The best tuned schedule of ``func`` for ``target`` in the tuning database at
    ``work_dir`` (default: ``TVM_CASCADE_TUNED``, else the decode records), or None."""
    work_dir = Path(work_dir or os.environ.get("TVM_CASCADE_TUNED", _TUNED))
    if not (work_dir / "database_tuning_record.json").exists():
        return None
    database = JSONDatabase(work_dir=str(work_dir), allow_missing=False)
    return database.query_schedule(tvm.IRModule({"main": func}), target, "main")
