"""Run tvm-cascade's kernel of some suite configurations a few times, for a profiler.

``ncu --clock-control none -k regex:main python -m benchmarks.profile decode-gqa-b8-kv4096``
profiles the kernels of one configuration: each selected configuration is built once,
checked against the float32 reference (a wrong kernel is not worth profiling) and
called ``--calls`` times. Names are those of ``python -m benchmarks.attention``.
"""
import argparse
import sys

from .attention import close_to, random_inputs, skip_without_gpu
from .configs import suite


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.profile", description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="+", help="configuration names (exact)")
    parser.add_argument("--calls", type=int, default=3)
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
        for _ in range(args.calls):
            fn(q, k, v)
        torch.cuda.synchronize()
        print(f"{name}: {args.calls} calls", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
