"""Time choices of tvm-cascade's decode schedule side by side on the GPU.

``python -m benchmarks.sweep_decode decode-gqa-b8-kv4096 --grid '{"pv_keys": [4, 8],
"heads_per_thread": [2, 4]}'`` compiles the heuristic decode schedule of one harness
configuration once per combination of the ``DecodeConfig`` fields in ``--grid`` (the
other fields at their defaults), after the defaults themselves; each is checked against
the float32 reference and timed like a peer of ``python -m benchmarks.attention``, in one
process. Tuned records are not used.
"""
import argparse
import dataclasses
import functools
import itertools
import json
import sys

from .attention import run_config, skip_without_gpu
from .configs import suite


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sweep_decode", description=__doc__.splitlines()[0])
    parser.add_argument("name", help="a decode configuration of the harness, e.g. decode-gqa-b8-kv4096")
    parser.add_argument("--grid", type=json.loads, required=True, help="JSON: DecodeConfig field -> list of values")
    parser.add_argument("--decode-queries", type=int, default=1, metavar="N")
    args = parser.parse_args(argv)
    configs = {cfg.name: cfg for cfg in suite("decode", decode_queries=args.decode_queries)}
    if args.name not in configs:
        parser.error(f"unknown configuration {args.name!r}; known: {sorted(configs)}")
    from tvm_cascade.schedules.decode import DecodeConfig

    fields = {field.name for field in dataclasses.fields(DecodeConfig)}
    if not isinstance(args.grid, dict) or not all(isinstance(v, list) for v in args.grid.values()):
        parser.error("--grid must map DecodeConfig fields to lists of values")
    unknown = sorted(set(args.grid) - fields)
    if unknown:
        parser.error(f"{unknown} are not DecodeConfig fields; fields: {sorted(fields)}")
    if skip_without_gpu("benchmarks.sweep_decode"):
        return 0
    from . import peers
    from .timing import copy_bandwidth_gbps

    cfg = configs[args.name]
    choices = [{}] + [dict(zip(args.grid, values)) for values in itertools.product(*args.grid.values())]
    builders = {
        json.dumps(choice) if choice else "defaults": functools.partial(peers.tvm_cascade, config=DecodeConfig(**choice))
        for choice in choices
    }
    bandwidth = copy_bandwidth_gbps()
    print(f"{cfg.name}: copy bandwidth {bandwidth:.0f} GB/s", flush=True)
    for cell in run_config(cfg, builders):
        if cell.ms is None:
            print(f"  {cell.impl}: {cell.status} {cell.note}", flush=True)
        else:
            percent = 100 * cfg.kv_bytes() / (cell.ms * 1e6) / bandwidth
            print(f"  {cell.impl}: {cell.ms:.4f} ms ({percent:.0f}% of the copy bandwidth)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
