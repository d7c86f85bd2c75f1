"""``python -m tvm_cascade demo``: plain attention in, FlashAttention-style TIR out."""
import numpy as np
import tvm

from . import ops
from .analysis.buffers import compacted_allocations
from .explain import explain_repair
from .ops import reference, testing
from .schedules.row_per_thread import bind_rows

SHAPE = dict(batch=1, heads_q=4, heads_kv=2, seq_q=48, seq_kv=100, head_dim=32)
VARIANT = "causal"
TILE = 32


def _fuse(sch, report):
    j0, _ = sch.split(sch.get_loops(sch.get_sblock("max"))[-1], [None, TILE])
    for name in ("sum", "pv"):
        fusion = explain_repair(sch, sch.get_sblock(name), j0)
        report(f"repair of '{name}' ({fusion.repair.method}): {name} <- {fusion.describe()}")
        for proof in fusion.repair.proofs:
            report(f"    proven: {proof}")
        sch.rolling_update(sch.get_sblock(name), j0)
    sch.compute_at(sch.get_sblock("score"), j0)
    sch.compute_at(sch.get_sblock("qk"), j0)


def _check(name, out, ref, tol, results):
    err = float(np.max(np.abs(out.astype("float64") - ref)))
    ok = bool(np.all(np.isfinite(out))) and err <= tol
    results.append(ok)
    print(f"[{'PASS' if ok else 'FAIL'}] {name}: max |error| vs numpy float64 = {err:.3g} (tolerance {tol:g})")


def run() -> int:
    results = []
    print(f"Plain {VARIANT} GQA attention, {SHAPE}, built with tvm_cascade.ops.attention")
    func = ops.attention(**SHAPE, variant=VARIANT)
    sch = tvm.s_tir.Schedule(func)
    _fuse(sch, print)
    print("\nFused TIR:")
    print(sch.mod.script())
    print("Schedule trace:")
    print(sch.trace)

    allocations = compacted_allocations(sch.mod)
    # Fused, every buffer along the key axis holds one tile; unfused, qk/score/exp hold
    # seq_q x seq_kv scores per head.
    spans_keys = {n: s for n, s in allocations.items() if SHAPE["seq_kv"] in s}
    results.append(not spans_keys)
    print(
        f"[{'PASS' if not spans_keys else 'FAIL'}] no buffer spans the {SHAPE['seq_kv']} keys "
        f"after TVM's buffer compaction: {allocations}"
    )

    q, k, v = testing.random_attention_inputs(**SHAPE, magnitude=3.0)
    ref = reference.attention_ref(q, k, v, variant=VARIANT)
    (out,) = testing.run_prim_func(sch.mod["main"], [q, k, v], target="llvm")
    _check("CPU (llvm), float32", out, ref, 1e-4, results)

    if tvm.cuda(0).exist:
        func16 = ops.attention(**SHAPE, variant=VARIANT, dtype="float16")
        sch16 = tvm.s_tir.Schedule(func16)
        _fuse(sch16, lambda _: None)
        bind_rows(sch16)
        q16, k16, v16 = (x.astype("float16") for x in (q, k, v))
        ref16 = reference.attention_ref(q16, k16, v16, variant=VARIANT)
        target = tvm.target.Target.from_device(tvm.cuda(0))
        (out16,) = testing.run_prim_func(sch16.mod["main"], [q16, k16, v16], target=target, dev=tvm.cuda(0))
        _check(f"CUDA ({tvm.cuda(0).device_name}), float16", out16, ref16, 2e-2, results)
    else:
        print("[SKIP] no CUDA GPU here: the CUDA build and run were not attempted")

    passed = all(results)
    print(f"\n{sum(results)} passed, {len(results) - sum(results)} failed")
    return 0 if passed else 1
