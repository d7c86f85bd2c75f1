"""RMSNorm + GEMM on the GPU: tvm-cascade's one kernel (the norm's row scale moved
after the sum, its sum of squares folded from the GEMM's tiles of X:
:mod:`tvm_cascade.schedules.scaled_gemm`; the warp-specialised TMA and wgmma kernel on
an H100 or H200, :mod:`tvm_cascade.schedules.warp_specialized_gemm`, and beside it the
mma.sync kernel other GPUs run) beside PyTorch eager (``F.rms_norm`` then
``@``), ``torch.compile`` of the same (compiled for each shape), stock TVM (``R.nn.rms_norm`` then ``R.matmul``
through TVM's default CUDA pipeline; "tvm, cascade pipeline": the same graph through
``relax_pipeline="cascade"``, which dispatches it to the kernel) and cuBLAS's GEMM alone
on the normalised input (``torch.matmul``: what the fused kernel would take if the norm
cost nothing).

    python -m benchmarks.scaled_gemm [--out DIR] [--only NAME ...] [--tune TRIALS] [--records DIR]

X is [M, K] float16 (bfloat16 where the shape says so), gamma [K], W [K, N]; the output
[M, N] of the same dtype. Every output is checked first against float64 PyTorch
(largest error under 1% of the largest output); a peer that is wrong or fails shows its
reason instead of a time. Times are medians of
CUDA-event timed calls with the L2 cache flushed before each
(:func:`benchmarks.timing.bench`). Prints a progress line per shape and a table; writes
``scaled_gemm.json`` and ``scaled_gemm.md``. With ``--records DIR`` or ``--tune
TRIALS``, "tvm-cascade (tuned)" is the unfused ``ops.rmsnorm_gemm`` from its best
MetaSchedule record in ``DIR`` (:mod:`benchmarks.tuned_peer`; the package's records,
``python/tvm_cascade/tuned/cascades``, hold 2048 x 4096 x 14336 in float16), ``--tune``
tuning into it first (random cost model); its
row names the kernel the record chose.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from . import tuned_peer
from .cascades import _reason, eager
from .peers import compiled_per_shape
from .timing import bench
from .tuned_peer import TUNED

PEERS = ("tvm-cascade", "tvm-cascade mma.sync", "torch", "torch.compile", "tvm", "tvm, cascade pipeline", "cuBLAS GEMM alone")
#: (name, M, K, N[, dtype]) (float16 unless named)
SHAPES = (
    ("rmsnorm+gemm 1 x 4096 x 14336", 1, 4096, 14336),  # one sequence's decode step
    ("rmsnorm+gemm 16 x 4096 x 14336", 16, 4096, 14336),  # a decode step's rows
    ("rmsnorm+gemm 16 x 4096 x 6144", 16, 4096, 6144),
    ("rmsnorm+gemm 16 x 4096 x 4096", 16, 4096, 4096),
    ("rmsnorm+gemm 16 x 14336 x 4096", 16, 14336, 4096),  # the down projection
    ("rmsnorm+gemm 16 x 4096 x 14336 bf16", 16, 4096, 14336, "bfloat16"),
    ("rmsnorm+gemm 2048 x 4096 x 14336", 2048, 4096, 14336),
    ("rmsnorm+gemm 8192 x 4096 x 14336", 8192, 4096, 14336),
    ("rmsnorm+gemm 2048 x 4096 x 4096", 2048, 4096, 4096),
    ("rmsnorm+gemm 2048 x 4096 x 6144", 2048, 4096, 6144),  # Llama-3-8B's fused QKV projection
    ("rmsnorm+gemm 2000 x 4096 x 14336", 2000, 4096, 14336),
    ("rmsnorm+gemm 2048 x 4096 x 14336 bf16", 2048, 4096, 14336, "bfloat16"),
)
EPS = 1e-6
RELATIVE_ERROR = 1e-2


def stock_tvm(m, k, n, target, pipeline="default", dtype="float16"):
    import tvm
    from tvm import relax
    from tvm.relax import op as R

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((m, k), dtype))
    gamma = relax.Var("gamma", relax.TensorType((k,), dtype))
    w = relax.Var("w", relax.TensorType((k, n), dtype))
    with bb.function("main", [x, gamma, w]):
        with bb.dataflow():
            normed = bb.emit(R.nn.rms_norm(x, gamma, axes=[-1], epsilon=EPS))
            out = bb.emit_output(bb.emit(R.matmul(normed, w)))
        bb.emit_func_output(out)
    return relax.VirtualMachine(tvm.compile(bb.get(), target=target, relax_pipeline=pipeline), tvm.cuda(0))["main"]


def tuned_kernel(m, k, n, dtype, target, trials: int, records: Optional[Path], logs: Path):
    """:func:`benchmarks.tuned_peer.tuned_kernel` of the unfused function (random cost
    model), and what its record chose (the warp-specialised kernel's choices, or its
    trace's instruction kinds)."""
    from tvm_cascade.ops import cascades
    from tvm_cascade.schedules import warp_specialized_gemm as ws

    func = cascades.rmsnorm_gemm(m, n, k, eps=EPS, dtype=dtype)
    kernel, sch = tuned_peer.tuned_kernel(func, target, trials, records, logs, cost_model="random")
    config = ws.chosen_config(sch.mod)
    record = {"kernel": "warp-specialised", "cols": config.cols, "stages": config.stages, "group": config.group} if config else {
        "kernel": "other", "instructions": sorted({i.kind.name for i in sch.trace.insts})
    }
    return kernel, {**record, **({"trials": trials} if trials else {})}


def run_shape(shape, tune: int = 0, work_dir: Optional[Path] = None, records: Optional[Path] = None) -> List[Dict]:
    import torch
    import torch.nn.functional as F
    import tvm

    from tvm_cascade.ops import cascades
    from tvm_cascade.schedules import scaled_gemm

    name, m, k, n, *named_dtype = shape
    dtype = named_dtype[0] if named_dtype else "float16"
    torch_dtype = getattr(torch, dtype)
    target = tvm.target.Target.from_device(tvm.cuda(0))
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch_dtype)
    gamma = (1 + 0.1 * torch.randn(k, device="cuda")).to(torch_dtype)
    w = (torch.randn(k, n, device="cuda") / k**0.5).to(torch_dtype)
    x64 = x.double()
    ref = (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS) * gamma.double()) @ w.double()
    normed = F.rms_norm(x, (k,), gamma, EPS)
    out = torch.empty(m, n, device="cuda", dtype=torch_dtype)

    def ours():
        sch = scaled_gemm.schedule_for_target(cascades.rmsnorm_gemm(m, n, k, eps=EPS, dtype=dtype), target)
        return _kernel_call(scaled_gemm.build(sch.mod, target)["main"])

    def mma_sync():
        pad = None if m % 32 == 0 else (128 if m >= 128 else 32)  # as the cascade pipeline pads
        sch = scaled_gemm.schedule_scaled_gemm(cascades.rmsnorm_gemm(m, n, k, eps=EPS, dtype=dtype, pad_rows=pad))
        return _kernel_call(scaled_gemm.build(sch.mod, target)["main"])

    def _kernel_call(kernel):
        tvm_args = [tvm.runtime.from_dlpack(t) for t in (x, gamma, w, out)]
        return (lambda: kernel(*tvm_args)), (lambda: out)

    def tvm_vm(pipeline):
        def build():
            vm = stock_tvm(m, k, n, target, pipeline, dtype)
            tvm_args = [tvm.runtime.from_dlpack(t) for t in (x, gamma, w)]
            box = {}

            def call():
                box["out"] = vm(*tvm_args)

            return call, (lambda: torch.from_dlpack(box["out"]))

        return build

    tuning = {}

    def tuned():
        kernel, tuning["record"] = tuned_kernel(m, k, n, dtype, target, tune, records, work_dir / name.replace(" ", "_"))
        return _kernel_call(kernel)

    norm_gemm = lambda a, g, b: F.rms_norm(a, (k,), g, EPS) @ b  # noqa: E731
    builders = {
        "tvm-cascade": ours, "tvm-cascade mma.sync": mma_sync, "torch": eager(norm_gemm, x, gamma, w),
        "torch.compile": eager(compiled_per_shape(norm_gemm), x, gamma, w), "tvm": tvm_vm("default"),
        "tvm, cascade pipeline": tvm_vm("cascade"),
        "cuBLAS GEMM alone": eager(torch.matmul, normed, w),
        TUNED: tuned,
    }
    results = []
    for peer in PEERS + ((TUNED,) if tune or records is not None else ()):
        row = {"shape": name, "peer": peer}
        try:
            call, result = builders[peer]()
            call()
            torch.cuda.synchronize()
            error = (result().double() - ref).abs().max().item() / ref.abs().max().item()
            row["relative error"] = error
            if error > RELATIVE_ERROR:
                row["error"] = f"off by {error:.2e} of the largest output"
            else:
                row["ms"] = bench(call)
                row["TFLOP/s"] = 2 * m * n * k / row["ms"] / 1e9
        except Exception as err:  # a peer that fails shows why, the others still run
            row["error"] = _reason(err)
        if peer == TUNED:
            row.update(tuning.get("record", {}))
        results.append(row)
    by_peer = {r["peer"]: r.get("ms") for r in results}
    for row in results:
        for base in ("torch.compile", "cuBLAS GEMM alone"):
            row[f"vs {base}"] = by_peer[base] / row["ms"] if by_peer.get(base) and row.get("ms") else None
    return results


def markdown(results: List[Dict]) -> str:
    peers = [p for p in PEERS + (TUNED,) if any(r["peer"] == p for r in results)]
    lines = [
        "| shape | " + " | ".join(f"{p} ms" for p in peers) + " | tvm-cascade TFLOP/s | vs torch.compile | vs cuBLAS GEMM alone |",
        "|---|" + "---|" * (len(peers) + 3),
    ]
    for shape in dict.fromkeys(r["shape"] for r in results):
        rows = {r["peer"]: r for r in results if r["shape"] == shape}
        cells = [f"{rows[p]['ms']:.4f}" if rows.get(p, {}).get("ms") else "fails" for p in peers]
        ours = rows["tvm-cascade"]
        extra = [f"{ours['TFLOP/s']:.0f}" if ours.get("ms") else "--"]
        extra += [f"{ours[c]:.2f}x" if ours.get(c) else "--" for c in ("vs torch.compile", "vs cuBLAS GEMM alone")]
        lines.append(f"| {shape} | " + " | ".join(cells + extra) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    tuned_peer.main("benchmarks.scaled_gemm", __doc__, "scaled_gemm.json and .md", SHAPES, run_shape, markdown,
                    list(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
