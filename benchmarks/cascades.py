"""Cascaded reductions beyond attention on the GPU: log-sum-exp and cross-entropy over a
vocabulary, MoE routing (softmax over the experts, then top-k), as one tvm-cascade kernel
each, beside PyTorch eager, ``torch.compile`` (compiled for each shape:
:func:`benchmarks.peers.compiled_per_shape`) and stock TVM (the unfused Relax graph
through TVM's default CUDA pipeline), timed side by side on one GPU. "tvm, cascade
pipeline" is that Relax graph compiled with ``relax_pipeline="cascade"``: what a Relax
user gets (its cross-entropy, log-sum-exp and top-k on tvm-cascade's kernels,
``relax/row_dispatch.py``).

    python -m benchmarks.cascades [--out DIR] [--only NAME ...] [--tune TRIALS] [--records DIR]

tvm-cascade's kernel is the unfused function of :mod:`tvm_cascade.ops.cascades`
scheduled by :func:`tvm_cascade.schedules.rows.schedule_rows` with
:func:`~tvm_cascade.schedules.rows.plan_rows`' arguments. Every output is checked first
against float64 PyTorch on the GPU (top-k: the chosen experts' probabilities equal the
reference's k largest, and each is the probability of the expert named); a peer that is
wrong or fails shows its reason instead of a time. "tvm-cascade (tuned)" is the unfused
function from its best MetaSchedule record (:mod:`benchmarks.tuned_peer`: the package's
records, or ``--records DIR``; ``--tune TRIALS`` tunes into them first, xgboost's cost
model where it is installed, else random sampling; the record's fusion instructions
are in the JSON). Times are medians of CUDA-event timed calls with the L2 cache flushed
before each (:func:`benchmarks.timing.bench`). Prints a progress line per shape and a
table; writes ``cascades.json``, ``cascades.md`` and (with matplotlib) ``cascades.png``.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from . import tuned_peer
from .peers import compiled_per_shape
from .report import grouped_bars
from .timing import bench
from .tuned_peer import TUNED

PEERS = ("tvm-cascade", "torch", "torch.compile", "tvm", "tvm, cascade pipeline")
#: (name, workload, rows (tokens), row length (classes, experts), top-k, dtype)
SHAPES = (
    ("cross-entropy 1024 x 128256 bf16", "cross_entropy", 1024, 128256, 0, "bfloat16"),
    ("cross-entropy 8192 x 128256 bf16", "cross_entropy", 8192, 128256, 0, "bfloat16"),
    ("cross-entropy 16384 x 128256 bf16", "cross_entropy", 16384, 128256, 0, "bfloat16"),
    ("cross-entropy 4096 x 151936 bf16", "cross_entropy", 4096, 151936, 0, "bfloat16"),
    ("log-sum-exp 1024 x 128256 bf16", "logsumexp", 1024, 128256, 0, "bfloat16"),
    ("log-sum-exp 8192 x 128256 bf16", "logsumexp", 8192, 128256, 0, "bfloat16"),
    ("moe routing 4096 x 64 top-2 fp16", "moe_routing", 4096, 64, 2, "float16"),
    ("moe routing 16384 x 128 top-8 fp16", "moe_routing", 16384, 128, 8, "float16"),
    ("moe routing 16384 x 256 top-8 fp16", "moe_routing", 16384, 256, 8, "float16"),
    ("moe routing 4096 x 4096 top-8 fp16", "moe_routing", 4096, 4096, 8, "float16"),
)
TOLERANCE = {"atol": 2e-3, "rtol": 2e-3}


def unfused(workload: str, rows: int, n: int, top_k: int, dtype: str):
    """The unfused PrimFunc of ``workload`` (:mod:`tvm_cascade.ops.cascades`)."""
    from tvm_cascade.ops import cascades

    if workload == "moe_routing":
        return cascades.moe_routing(rows, n, top_k, dtype)
    return getattr(cascades, workload)(rows, n, dtype)


def cascade_kernel(workload, rows, n, top_k, dtype, target):
    import tvm

    from tvm_cascade.schedules.rows import plan_rows, schedule_rows

    sch = tvm.s_tir.Schedule(unfused(workload, rows, n, top_k, dtype))
    schedule_rows(sch, **plan_rows(n, dtype))
    return tvm.compile(sch.mod, target=target)["main"]


def tuned_kernel(workload, rows, n, top_k, dtype, target, trials: int, records: Optional[Path], logs: Path):
    """:func:`benchmarks.tuned_peer.tuned_kernel` of the unfused function (xgboost's cost
    model where it is installed, else random sampling), and what its record chose."""
    import importlib.util

    from tvm.s_tir import meta_schedule as ms

    cost_model = "xgb" if importlib.util.find_spec("xgboost") else "random"
    runner = ms.runner.LocalRunner(f_alloc_argument=arguments_in_range)
    kernel, sch = tuned_peer.tuned_kernel(unfused(workload, rows, n, top_k, dtype), target, trials, records, logs,
                                          cost_model=cost_model, runner=runner)
    fusions = [i.kind.name for i in sch.trace.insts if i.kind.name in ("RollingUpdate", "SplitKUpdate")]
    return kernel, {"fusions": fusions, **({"cost_model": cost_model, "trials": trials} if trials else {})}


def arguments_in_range(device, args_info, alloc_repeat):
    """The arguments MetaSchedule's runner measures a candidate with: zeros, made in
    numpy (no device-side random fill, whose dtypes vary by device), so that index inputs
    (labels) stay in range. These kernels take as long on any values."""
    import numpy as np
    import tvm

    def zeros(dtype, shape):
        if dtype == "bfloat16":
            import ml_dtypes

            return np.zeros(shape, ml_dtypes.bfloat16)
        return np.zeros(shape, dtype)

    return [[tvm.runtime.tensor(zeros(dtype, shape), device) for _, dtype, shape in args_info] for _ in range(alloc_repeat)]


def relax_graph(workload: str, rows: int, n: int, top_k: int, dtype: str):
    """The workload as a Relax user writes it: float32 statistics of the logits."""
    from tvm import relax
    from tvm.relax import op as R

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((rows, n), dtype))
    params = [x]
    if workload == "cross_entropy":
        labels = relax.Var("labels", relax.TensorType((rows,), "int32"))
        params.append(labels)
    with bb.function("main", params):
        with bb.dataflow():
            xf = bb.emit(R.astype(x, "float32"))
            if workload == "moe_routing":
                prob = bb.emit(R.nn.softmax(xf, axis=-1))
                top = bb.emit(R.topk(prob, top_k, axis=-1, ret_type="both", largest=True, dtype="int32"))
                out = bb.emit_output(relax.Tuple([prob, relax.TupleGetItem(top, 0), relax.TupleGetItem(top, 1)]))
            elif workload == "cross_entropy":  # the negative log-likelihood of log-softmax
                log_prob = bb.emit(R.nn.log_softmax(xf, axis=-1))
                picked = R.gather_elements(log_prob, R.expand_dims(labels, 1), axis=1)
                out = bb.emit_output(bb.emit(R.negative(R.squeeze(picked, axis=[1]))))
            else:
                m = bb.emit(R.max(xf, axis=-1, keepdims=True))
                lse = R.add(R.log(R.sum(R.exp(R.subtract(xf, m)), axis=-1)), R.squeeze(m, axis=[1]))
                out = bb.emit_output(bb.emit(lse))
        bb.emit_func_output(out)
    return bb.get()


def stock_tvm(workload, rows, n, top_k, dtype, target, pipeline: str = "default"):
    import tvm
    from tvm import relax

    executable = tvm.compile(relax_graph(workload, rows, n, top_k, dtype), target=target, relax_pipeline=pipeline)
    return relax.VirtualMachine(executable, tvm.cuda(0))["main"]


def torch_fn(workload: str, top_k: int):
    """The workload in PyTorch, in float32 as tvm-cascade's kernel computes it."""
    import torch
    import torch.nn.functional as F

    if workload == "cross_entropy":
        return lambda x, labels: F.cross_entropy(x.float(), labels.long(), reduction="none")
    if workload == "logsumexp":
        return lambda x: torch.logsumexp(x.float(), dim=-1)

    def route(x):
        prob = torch.softmax(x.float(), dim=-1)
        value, index = torch.topk(prob, top_k, dim=-1)
        return prob, value, index

    return route


def inputs(workload, rows, n, dtype):
    import torch

    torch.manual_seed(0)
    x = (torch.randn(rows, n, device="cuda") * 3).to(getattr(torch, dtype))
    if workload == "cross_entropy":
        return [x, torch.randint(0, n, (rows,), device="cuda", dtype=torch.int32)]
    return [x]


def outputs(workload, rows, n, top_k):
    """Empty output tensors of tvm-cascade's kernel, in parameter order."""
    import torch

    if workload != "moe_routing":
        return [torch.empty(rows, device="cuda", dtype=torch.float32)]
    return [
        torch.empty(rows, n, device="cuda", dtype=torch.float32),
        torch.empty(rows, top_k, device="cuda", dtype=torch.float32),
        torch.empty(rows, top_k, device="cuda", dtype=torch.int32),
    ]


def check(workload, got, args, top_k) -> Optional[str]:
    """None where ``got`` (the outputs as torch tensors) matches float64 PyTorch, else why."""
    import torch

    x = args[0].double()
    if workload == "moe_routing":
        prob, value, index = (g.double() if g.is_floating_point() else g for g in got)
        ref = torch.softmax(x, dim=-1)
        ref_value = torch.topk(ref, top_k, dim=-1).values
        named = torch.gather(ref, 1, index.long())
        pairs = (("prob", prob, ref), ("top-k prob", value, ref_value), ("prob of the named experts", named, value))
    else:
        ref = torch.logsumexp(x, dim=-1)
        if workload == "cross_entropy":
            ref = ref - torch.gather(x, 1, args[1].long()[:, None])[:, 0]
        pairs = (("out", got[0].double(), ref),)
    for what, a, b in pairs:
        if not torch.allclose(a, b, **TOLERANCE):
            return f"{what} off by {(a - b).abs().max().item():.2e}"
    return None


def measure(peer, build, workload, args, top_k, bytes_moved) -> Dict:
    import torch

    row = {"peer": peer}
    try:
        call, result = build()
        call()
        torch.cuda.synchronize()
        row["error"] = check(workload, result(), args, top_k)
        if row["error"] is None:
            row["ms"] = bench(call)
            row["GB/s"] = bytes_moved / row["ms"] / 1e6
    except Exception as err:  # a peer that fails shows why, the others still run
        row["error"] = _reason(err)
    return row


def eager(f, *args, result=lambda out: out):
    """A peer's build function for ``f(*args)`` run as it is (PyTorch eager or compiled):
    ``(call, read)``, ``read()`` giving ``result`` of the last call's output."""

    def build():
        box = {}

        def call():
            box["out"] = f(*args)

        return call, (lambda: result(box["out"]))

    return build


def _reason(err: Exception) -> str:
    """The error's last line, or where it was raised if it has no message."""
    import traceback

    lines = str(err).strip().splitlines()
    if lines:
        return f"{type(err).__name__}: {lines[-1][:200]}"
    frame = traceback.extract_tb(err.__traceback__)[-1]
    return f"{type(err).__name__} in {Path(frame.filename).parent.name}/{Path(frame.filename).name}:{frame.lineno} ({frame.name})"


def run_shape(shape, tune: int = 0, work_dir: Optional[Path] = None, records: Optional[Path] = None) -> List[Dict]:
    import torch
    import tvm

    name, workload, rows, n, top_k, dtype = shape
    target = tvm.target.Target.from_device(tvm.cuda(0))
    args = inputs(workload, rows, n, dtype)
    outs = outputs(workload, rows, n, top_k)
    element = torch.finfo(getattr(torch, dtype)).bits // 8
    bytes_moved = rows * n * element + sum(o.numel() * o.element_size() for o in outs)
    fn = torch_fn(workload, top_k)
    as_list = lambda r: list(r) if isinstance(r, tuple) else [r]  # noqa: E731

    def on_tensors(kernel):
        """``kernel`` called on the shape's inputs and outputs (TVM tensors over torch's)."""
        tvm_args = [tvm.runtime.from_dlpack(t) for t in args + outs]
        return (lambda: kernel(*tvm_args)), (lambda: outs)

    def ours():
        return on_tensors(cascade_kernel(workload, rows, n, top_k, dtype, target))

    def tvm_vm(pipeline):
        def build():
            vm = stock_tvm(workload, rows, n, top_k, dtype, target, pipeline)
            tvm_args = [tvm.runtime.from_dlpack(t) for t in args]
            box = {}

            def call():
                box["out"] = vm(*tvm_args)

            def result():
                out = box["out"]
                items = [out[k] for k in range(len(out))] if workload == "moe_routing" else [out]
                return [torch.from_dlpack(t) for t in items]

            return call, result

        return build

    tuning = {}

    def tuned():
        kernel, tuning["record"] = tuned_kernel(
            workload, rows, n, top_k, dtype, target, tune, records, work_dir / name.replace(" ", "_")
        )
        return on_tensors(kernel)

    builders = {
        "tvm-cascade": ours, "torch": eager(fn, *args, result=as_list),
        "torch.compile": eager(compiled_per_shape(fn), *args, result=as_list),
        "tvm": tvm_vm("default"), "tvm, cascade pipeline": tvm_vm("cascade"),
    }
    builders[TUNED] = tuned
    results = []
    for peer in PEERS + (TUNED,):
        row = {"shape": name, **measure(peer, builders[peer], workload, args, top_k, bytes_moved)}
        if peer == TUNED:
            row.update(tuning.get("record", {}))
        results.append(row)
    compiled = next(r.get("ms") for r in results if r["peer"] == "torch.compile")
    for row in results:
        row["vs torch.compile"] = compiled / row["ms"] if compiled and row.get("ms") else None
    return results


def _peers(results: List[Dict]) -> List[str]:
    return list(dict.fromkeys(r["peer"] for r in results))


def markdown(results: List[Dict]) -> str:
    peers = _peers(results)
    lines = [
        "| shape | " + " | ".join(f"{p} ms" for p in peers) + " | tvm-cascade GB/s | vs torch.compile |",
        "|---|" + "---|" * (len(peers) + 2),
    ]
    for shape in dict.fromkeys(r["shape"] for r in results):
        rows = {r["peer"]: r for r in results if r["shape"] == shape}
        cells = [f"{rows[p]['ms']:.4f}" if rows.get(p, {}).get("ms") else "fails" if p in rows else "--" for p in peers]
        ours = rows["tvm-cascade"]
        gbps = f"{ours['GB/s']:.0f}" if ours.get("ms") else "--"
        speed = f"{ours['vs torch.compile']:.2f}x" if ours.get("vs torch.compile") else "--"
        lines.append(f"| {shape} | " + " | ".join(cells) + f" | {gbps} | {speed} |")
    return "\n".join(lines) + "\n"


def plot(results: List[Dict], path: Path) -> bool:
    """Bars of each peer's speed relative to ``torch.compile``; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    shapes = list(dict.fromkeys(r["shape"] for r in results))
    speed = {(r["shape"], r["peer"]): r.get("vs torch.compile") for r in results}
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(shapes)), 4.5))
    series = {peer: [speed.get((shape, peer)) for shape in shapes] for peer in _peers(results)}
    grouped_bars(ax, shapes, series, "speed vs torch.compile (x, log)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv: Optional[Sequence[str]] = None) -> int:
    results, args = tuned_peer.main("benchmarks.cascades", __doc__, "cascades.json, .md and .png", SHAPES, run_shape, markdown,
                                    list(sys.argv[1:] if argv is None else argv), tolerance=TOLERANCE)
    if results is not None:
        plot(results, args.out / "cascades.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
