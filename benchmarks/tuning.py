"""The tuning loop ``tune_decode`` and ``tune_prefill`` share: parse the command line,
then for each configuration of a suite run MetaSchedule's evolutionary search with the
xgboost cost model over a design space and keep the records in a JSON database."""
import argparse
from pathlib import Path

from .configs import suite


def parse_args(prog: str, doc: str, default_trials: int, default_work_dir: Path, argv=None):
    parser = argparse.ArgumentParser(prog=prog, description=doc)
    parser.add_argument("--only", nargs="*", default=[], help="config name substrings")
    parser.add_argument("--trials", type=int, default=default_trials, help="trials per configuration")
    parser.add_argument("--work-dir", type=Path, default=default_work_dir)
    return parser.parse_args(argv)


def tune_suite(kind: str, args, space_generator, trials_per_iter: int, builder=None) -> int:
    """Tune every ``kind`` configuration selected by ``args``; ``space_generator(cfg)``
    gives the MetaSchedule space generator of one configuration."""
    import tvm
    from tvm.s_tir import meta_schedule as ms

    import tvm_cascade  # noqa: F401  (adds the primitives)
    from tvm_cascade import ops
    from tvm_cascade import trace as cascade_trace
    from tvm_cascade.bench import VARIANTS

    if not tvm.cuda(0).exist:
        print("no CUDA GPU: nothing to tune")
        return 0
    target = tvm.target.Target.from_device(tvm.cuda(0))
    args.work_dir.mkdir(parents=True, exist_ok=True)
    database = cascade_trace.JSONDatabase(work_dir=str(args.work_dir))
    for cfg in suite(kind, only=args.only):
        op = cfg.op
        func = ops.attention(
            cfg.batch, op.heads_q, op.heads_kv, cfg.seq_q, cfg.seq_kv, cfg.head_dim,
            dtype=cfg.dtype, variant=VARIANTS[op.variant],
        )
        print(f"tuning {cfg.name}: {args.trials} trials", flush=True)
        ms.tune_tir(
            func,
            target=target,
            work_dir=str(args.work_dir / "logs" / cfg.name),
            max_trials_global=args.trials,
            num_trials_per_iter=min(trials_per_iter, args.trials),
            space=space_generator(cfg),
            builder=builder if builder is not None else "local",
            strategy="evolutionary",
            cost_model="xgb",
            database=database,
        )
        best = database.query_tuning_record(tvm.IRModule({"main": func}), target, "main")
        secs = [float(s) for s in best.run_secs] if best is not None else []
        if secs and min(secs) < 1e9:
            print(f"  best {1e3 * min(secs):.4f} ms", flush=True)
        else:
            print(f"  no valid record: see {args.work_dir / 'logs' / cfg.name}", flush=True)
    return 0
