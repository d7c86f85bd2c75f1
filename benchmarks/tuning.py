"""The tuning loop ``tune_decode`` and ``tune_prefill`` share: parse the command line,
then tune each configuration of a suite with :func:`tvm_cascade.kernels.tune`
(MetaSchedule's evolutionary search with the xgboost cost model over the schedule's
design space) into one JSON database."""
import argparse
from pathlib import Path

from .configs import suite


def parse_args(prog: str, doc: str, default_trials: int, default_work_dir: Path, argv=None, spaces=None):
    """The command line; with ``spaces`` (names of design spaces), a ``--spaces`` option
    that picks some of them (default: all)."""
    parser = argparse.ArgumentParser(prog=prog, description=doc)
    parser.add_argument("--only", nargs="*", default=[], help="config name substrings")
    parser.add_argument("--trials", type=int, default=default_trials, help="trials per configuration")
    parser.add_argument("--work-dir", type=Path, default=default_work_dir)
    if spaces is not None:
        parser.add_argument("--spaces", nargs="+", choices=spaces, default=list(spaces), help="design spaces searched")
    return parser.parse_args(argv)


def tune_suite(kind: str, args) -> int:
    """Tune every ``kind`` configuration selected by ``args`` into ``args.work_dir``."""
    import tvm

    from tvm_cascade import kernels, ops
    from tvm_cascade.bench import VARIANTS

    if not tvm.cuda(0).exist:
        print("no CUDA GPU: nothing to tune; skipping.")
        return 0
    target = tvm.target.Target.from_device(tvm.cuda(0))
    spaces = {"spaces": tuple(args.spaces)} if "spaces" in args else {}
    for cfg in suite(kind, only=args.only):
        op = cfg.op
        func = ops.attention(
            cfg.batch, op.heads_q, op.heads_kv, cfg.seq_q, cfg.seq_kv, cfg.head_dim,
            dtype=cfg.dtype, variant=VARIANTS[op.variant],
        )
        print(f"tuning {cfg.name}: {args.trials} trials", flush=True)
        best = kernels.tune(func, target, args.work_dir, args.trials, VARIANTS[op.variant], **spaces)
        if best is not None:
            print(f"  best {1e3 * best:.4f} ms", flush=True)
        else:
            print(f"  no valid record: see {args.work_dir / 'logs'}", flush=True)
    return 0
