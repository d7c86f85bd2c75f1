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
    """Median µs of each TVM kernel ``call`` launches, and of a call's span, over
    ``calls`` calls each after an L2 flush."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from .timing import l2_flush

    flush = l2_flush()
    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            flush()
            torch.cuda.synchronize()
            call()
            torch.cuda.synchronize()
    # TVM names the kernels of the PrimFunc ``main`` main_kernel, main_kernel_1, ...
    kernels = sorted(
        (e for e in prof.events() if e.device_type.name == "CUDA" and e.name.startswith("main_kernel")),
        key=lambda e: e.time_range.start,
    )
    per_call = len(kernels) // calls
    durations = collections.defaultdict(list)
    spans = []
    for first in range(0, per_call * calls, per_call):
        launched = kernels[first : first + per_call]
        spans.append(launched[-1].time_range.end - launched[0].time_range.start)
        for event in launched:
            durations[event.name].append(event.time_range.elapsed_us())
    return {kernel: statistics.median(us) for kernel, us in durations.items()}, statistics.median(spans)


if __name__ == "__main__":
    sys.exit(main())
