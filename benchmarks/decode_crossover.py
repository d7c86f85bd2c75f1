"""Where ``kernels.RUNTIME_DECODE_KEYS`` belongs: the two decode kernels of a static configuration.

``python -m benchmarks.decode_crossover [--keys 4096 8192 16384 32768]`` times, in one
process, the decode suite's four operators (batch 8, one query row, head dim 128) at each
key count with

* ``static``: the split-k schedule of static shapes (``schedules/decode.py``) as
  ``compile_attention`` builds it with records (records keep it from the other kernel);
* ``runtime``: the runtime-length tensor-core decode family's function fixed to the
  configuration (``library/specialise.py``), what ``compile_attention`` gives untuned
  decode from ``RUNTIME_DECODE_KEYS`` keys.

Both are checked against the float32 reference before they are timed; each row gives
their median ms (:func:`.timing.bench`) and the runtime kernel's time over the static's.
"""
import argparse
import dataclasses
import sys

from .attention import close_to, random_inputs, skip_without_gpu
from .configs import suite
from .reference import attention_reference
from .timing import bench

KEYS = (4096, 8192, 16384, 32768)


def kernels_of(cfg):
    """``{"static": fn, "runtime": fn}``, each ``fn(q, k, v) -> out`` on torch tensors."""
    import tvm

    from tvm_cascade import kernels
    from tvm_cascade.bench import VARIANTS, on_torch
    from tvm_cascade.library.spec import AttentionSpec
    from tvm_cascade.library.specialise import compile_specialised

    o = cfg.op
    target = tvm.target.Target.from_device(tvm.cuda(0))
    static = kernels.compile_attention(cfg.batch, o.heads_q, o.heads_kv, cfg.seq_q, cfg.seq_kv, cfg.head_dim,
                                       variant=VARIANTS[o.variant], dtype=cfg.dtype,
                                       records=kernels.default_records("decode"))
    spec = AttentionSpec.make(o.heads_q, o.heads_kv, cfg.head_dim, variant=VARIANTS[o.variant], dtype=cfg.dtype,
                              layout="bhsd", target=target)
    fixed = compile_specialised(spec, cfg.batch, cfg.seq_q, cfg.seq_kv, target)
    return {"static": on_torch(static), "runtime": on_torch(fixed)}


def main(argv=None):
    p = argparse.ArgumentParser(prog="benchmarks.decode_crossover", description=__doc__.splitlines()[0])
    p.add_argument("--keys", type=int, nargs="+", default=KEYS, help=f"key counts (default {' '.join(map(str, KEYS))})")
    args = p.parse_args(argv)
    if skip_without_gpu("benchmarks.decode_crossover"):
        return 0
    print("| configuration | static | runtime | runtime / static |\n|---|---|---|---|")
    for base in suite("decode", quick=True):
        for keys in args.keys:
            cfg = dataclasses.replace(base, seq_kv=keys)
            q, k, v = random_inputs(cfg)
            ref = attention_reference(cfg, q, k, v)
            times = {}
            for label, fn in kernels_of(cfg).items():
                if not close_to(fn(q, k, v), ref):
                    raise SystemExit(f"{cfg.name}: the {label} kernel's output differs from the reference")
                times[label] = bench(lambda: fn(q, k, v))
            print(f"| {cfg.name} | {times['static']:.4f} | {times['runtime']:.4f} | "
                  f"{times['runtime'] / times['static']:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
