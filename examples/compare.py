"""Shared by the examples: compile a Relax module with TVM's default pipeline and with
``relax_pipeline="cascade"``, run both, check them, time them."""

import argparse

import numpy as np
import tvm
from tvm import relax

from tvm_cascade.relax.dispatch import LIBRARY_ATTR
from tvm_cascade.transform.pass_ import FUSED_ATTR


def block_arguments(doc: str) -> argparse.ArgumentParser:
    """The command line both examples take: target, block size, heads, timing."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--target", default="llvm", choices=["llvm", "cuda"])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads-q", type=int, default=8)
    parser.add_argument("--heads-kv", type=int, default=2)
    parser.add_argument("--time", action="store_true", help="time both modules (GPU)")
    return parser


class Compiled:
    """An executable with the module its pipeline produced (to count fused kernels)."""

    def __init__(self, mod, pipeline, target):
        with target:
            self.mod = relax.get_pipeline(pipeline)(mod) if pipeline == "cascade" else None
        # The cascade module is compiled from the pipeline's output (the same passes
        # tvm.compile(..., relax_pipeline="cascade") runs); the default one by name.
        if self.mod is not None:
            self.exe = tvm.compile(self.mod, target, relax_pipeline=None)
        else:
            self.exe = tvm.compile(mod, target, relax_pipeline=pipeline)


def compile_both(mod, target_kind):
    """(default, cascade) compiled modules and the target."""
    if target_kind == "cuda":
        dev = tvm.cuda(0)
        target = tvm.target.Target.from_device(dev)
    else:
        target = tvm.target.Target({"kind": "llvm"})
    return Compiled(mod, "default", target), Compiled(mod, "cascade", target), target


def count_attention_kernels(mod) -> int:
    """PrimFuncs of ``mod`` that the cascade pipeline made of attention: fused by
    ``FuseAttention`` (CPUs) or the kernel library's (GPUs)."""
    return sum(
        1
        for _, f in mod.functions_items()
        if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None
        and (FUSED_ATTR in f.attrs or LIBRARY_ATTR in f.attrs)
    )


def run_both(default, cascade, target, args, func="main", timed=False):
    """Outputs of both modules on ``args`` (numpy), and their median latencies in ms
    (None unless ``timed``)."""
    dev = tvm.cuda(0) if target.kind.name == "cuda" else tvm.cpu(0)
    tensors = [tvm.runtime.tensor(a, dev) for a in args]
    outs, times = [], []
    for compiled in (default, cascade):
        vm = relax.VirtualMachine(compiled.exe, dev)
        out = vm[func](*tensors)
        # from_exported_program returns a tuple of outputs; the examples have one.
        outs.append((out if hasattr(out, "numpy") else out[0]).numpy())
        if timed:
            # As many calls a repeat as take about 50 ms (a slow module is not called
            # hundreds of times).
            once = vm.time_evaluator(func, dev, number=1, repeat=1)(*tensors).mean
            timer = vm.time_evaluator(func, dev, number=max(1, min(20, int(0.05 / once))), repeat=10, min_repeat_ms=50)
            times.append(float(np.median(timer(*tensors).results)) * 1e3)
    return outs, (times if timed else None)


def _event_median(calls, run):
    """Median ms between two CUDA events over ``calls`` runs of ``run(begin, end)``, which
    calls ``begin()`` before the work it times and ``end()`` after it. ``begin`` queues a
    sleep kernel first, so the work is queued while the GPU sleeps and its time excludes
    the host's (the checks and launch of a call)."""
    import torch

    times = []
    for _ in range(calls):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def begin(start=start):
            torch.cuda._sleep(1_000_000)
            start.record()

        run(begin, stop.record)
        times.append((start, stop))
    torch.cuda.synchronize()
    return float(np.median([start.elapsed_time(stop) for start, stop in times]))


def attention_in_module(compiled, args, func="main", calls=20):
    """Median ms of the kernel library's attention kernel (one a call) in a call of
    ``func`` of the cascade module, between CUDA events a VM instrument records around
    it."""
    names = {
        str(f.attrs["global_symbol"]) for _, f in compiled.mod.functions_items()
        if isinstance(f, tvm.tirx.PrimFunc) and f.attrs is not None and LIBRARY_ATTR in f.attrs
    }
    dev = tvm.cuda(0)
    vm = relax.VirtualMachine(compiled.exe, dev)
    tensors = [tvm.runtime.tensor(a, dev) for a in args]
    vm[func](*tensors)  # warm-up

    def run(begin, end):
        def instrument(_, symbol, before, *rest):
            if symbol in names:
                begin() if before else end()
            return 0

        vm.set_instrument(instrument)
        vm[func](*tensors)

    return _event_median(calls, run)


def standalone_attention(kernel, tensors, calls=20, written=False):
    """Median ms of ``kernel`` (``kernels.attention_kernel``) on torch ``tensors`` (q, k,
    v, ...), timed as :func:`attention_in_module` times it in a module, with the L2 cache
    flushed before each call by reading 256 MiB, as the benchmarks do (a repeated call
    alone would find its inputs in the cache); or, ``written``, with K and V written just
    before (copied from copies of themselves), as in a module whose K/V a concatenation
    or a cache update has just written: their dirty lines' write-back to HBM then runs
    during the call (``python -m benchmarks.attention_cache_state``)."""
    import torch

    plan = kernel.plan(*tensors)
    out = kernel(*tensors, plan=plan)
    if written:
        copies = [t.clone() for t in tensors[1:3]]

        def before():
            for t, copy in zip(tensors[1:3], copies):
                t.copy_(copy)
    else:
        flush = torch.empty(64 << 20, dtype=torch.int32, device="cuda")
        total = torch.empty((), dtype=torch.int64, device="cuda")

        def before():
            torch.sum(flush, dim=0, out=total)

    def run(begin, end):
        before()
        begin()
        kernel(*tensors, out=out, plan=plan)
        end()

    return _event_median(calls, run)


def report_attention(compiled, args, func, kernel, tensors):
    """Print the attention kernel's time in the cascade module beside ``kernel``'s alone
    on torch ``tensors`` of the same shapes, after an L2 flush and after its K/V are
    written."""
    inside = attention_in_module(compiled, args, func)
    alone, written = (standalone_attention(kernel, tensors, written=w) for w in (False, True))
    print(f"  attention: in the module {inside:.4f} ms, standalone {alone:.4f} ms ({inside / alone:.2f}x), "
          f"standalone after its K/V are written {written:.4f} ms ({inside / written:.2f}x)", flush=True)


def report(label, outs, expected, tol, times):
    """Print the check of both outputs against ``expected`` and each other; raise on a
    mismatch."""
    default, cascade = (o.astype(np.float64) for o in outs)
    err_default = float(np.max(np.abs(default - expected)))
    err_cascade = float(np.max(np.abs(cascade - expected)))
    between = float(np.max(np.abs(default - cascade)))
    line = (
        f"{label}: max |default - ref| {err_default:.2e}, |cascade - ref| {err_cascade:.2e}, "
        f"|default - cascade| {between:.2e}"
    )
    if times:
        speedup = times[0] / times[1]
        line += f"; default {times[0]:.4f} ms, cascade {times[1]:.4f} ms, speed-up {speedup:.2f}x"
    print(line, flush=True)
    scale = max(1.0, float(np.max(np.abs(expected))))
    if max(err_default, err_cascade) > tol * scale:
        raise SystemExit(
            f"{label}: outputs differ from the reference by more than {tol} (relative)"
        )
