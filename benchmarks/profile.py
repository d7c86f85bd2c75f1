"""Run tvm-cascade's kernel of some suite configurations a few times, for a profiler.

``ncu --clock-control none -k regex:main python -m benchmarks.profile decode-gqa-b8-kv4096``
profiles the kernels of one configuration: each selected configuration is built once,
checked against the float32 reference (a wrong kernel is not worth profiling) and
called ``--calls`` times. Names are those of ``python -m benchmarks.attention``.

``--kernel-times`` times the kernels itself instead (torch's profiler, the L2 cache
flushed before each call as in the harness): the median duration of each kernel and of
a call's span from its first kernel's start to its last kernel's end, in µs. Unlike ncu,
this replays nothing, so no kernel reads what a replay left in the L2 cache.
"""
import argparse
import collections
import statistics
import sys

from .attention import close_to, random_inputs, skip_without_gpu
from .configs import suite


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile", description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="+", help="configuration names (exact)")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--kernel-times", action="store_true", help="print each kernel's median duration (µs)")
    args = parser.parse_args(argv)
    configs = {cfg.name: cfg for cfg in suite("all")}
    unknown = [n for n in args.names if n not in configs]
    if unknown:
        parser.error(f"unknown configurations {unknown}; known: {sorted(configs)}")
    if skip_without_gpu("benchmarks.profile"):
        return 0
    import torch

    from .peers import tvm_cascade
    from .reference import attention_reference

    for name in args.names:
        cfg = configs[name]
        q, k, v = random_inputs(cfg)
        fn, _ = tvm_cascade(cfg, q, k, v)
        if not close_to(fn(q, k, v), attention_reference(cfg, q, k, v)):
            raise SystemExit(f"{name}: tvm-cascade's output is wrong; not profiling it")
        if args.kernel_times:
            durations, span = kernel_times(lambda: fn(q, k, v), args.calls)
            listed = ", ".join(f"{kernel} {us:.1f}" for kernel, us in durations.items())
            print(f"{name}: {listed}; first start to last end {span:.1f} (medians of {args.calls} calls)", flush=True)
            continue
        for _ in range(args.calls):
            fn(q, k, v)
        torch.cuda.synchronize()
        print(f"{name}: {args.calls} calls", flush=True)
    return 0


def kernel_times(call, calls):
    """Median µs of each kernel ``call`` launches, and of a call's span (its first
    kernel's start to its last kernel's end), over ``calls`` calls each after an L2 flush.
    A call's kernels are those between two flushes (the flush's own kernels are told
    apart by their names)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from .timing import l2_flush

    flush = l2_flush()
    call()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        flush()
        torch.cuda.synchronize()
    flush_kernels = {e.name for e in _kernels(prof)}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            # No wait between the flush and the call, as in the harness: the host launches
            # the call's kernels while the flush runs, so no host time lies inside a span.
            flush()
            call()
            torch.cuda.synchronize()
    per_call, launched = [], None
    for event in _kernels(prof):
        if event.name in flush_kernels:
            launched = None
            continue
        if launched is None:
            launched = []
            per_call.append(launched)
        launched.append(event)
    if len(per_call) != calls:
        raise RuntimeError(f"found the kernels of {len(per_call)} calls in the profile, not {calls}")
    durations = collections.defaultdict(list)
    for launched in per_call:
        for event in launched:
            durations[event.name].append(event.time_range.elapsed_us())
    spans = [launched[-1].time_range.end - launched[0].time_range.start for launched in per_call]
    return {kernel: statistics.median(us) for kernel, us in durations.items()}, statistics.median(spans)


def _kernels(prof):
    """The CUDA kernels (and memsets, copies) of a torch profile, by start time."""
    return sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)


if __name__ == "__main__":
    sys.exit(main())
