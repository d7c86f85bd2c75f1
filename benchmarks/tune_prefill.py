"""Tune the prefill schedule with MetaSchedule on the GPU and keep the records.

    python -m benchmarks.tune_prefill [--only SUBSTR ...] [--trials N] [--work-dir DIR]

For each prefill configuration of the suite: evolutionary search with the xgboost cost
model over :func:`tvm_cascade.schedules.prefill.prefill_design_space` (its choices are
``sample_categorical`` decisions; its fusion the traced ``rolling_update``, ``distribute``
and ``split_tile_accumulation``). Candidates are built with
:func:`tvm_cascade.schedules.prefill.build` (every warp fragment lowered to registers).
Records go to a JSON database in ``--work-dir`` (default ``benchmarks/tuned/prefill``);
MetaSchedule's logs go to ``<work-dir>/logs/<config>`` (git-ignored).
"""
import argparse
import sys
from pathlib import Path

from .configs import suite

DEFAULT_WORK_DIR = Path(__file__).resolve().parent / "tuned" / "prefill"


def register_build() -> None:
    """Builder-process initializer: registers the prefill build function there."""
    import tvm_cascade.schedules.prefill  # noqa: F401


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tune_prefill", description=__doc__)
    parser.add_argument("--only", nargs="*", default=[], help="config name substrings")
    parser.add_argument("--trials", type=int, default=16, help="trials per configuration")
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR)
    args = parser.parse_args(argv)

    import tvm
    from tvm.s_tir import meta_schedule as ms

    import tvm_cascade  # noqa: F401  (adds the primitives)
    from tvm_cascade import ops
    from tvm_cascade import trace as cascade_trace
    from tvm_cascade.bench import VARIANTS
    from tvm_cascade.schedules.prefill import BUILD_FUNC, prefill_design_space

    if not tvm.cuda(0).exist:
        print("no CUDA GPU: nothing to tune")
        return 0
    target = tvm.target.Target.from_device(tvm.cuda(0))
    args.work_dir.mkdir(parents=True, exist_ok=True)
    database = cascade_trace.JSONDatabase(work_dir=str(args.work_dir))
    for cfg in suite("prefill", only=args.only):
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
            num_trials_per_iter=min(8, args.trials),
            # No VerifyGPUCode: it holds shared memory to the static 48 KB, and the
            # kernel's dynamic shared memory is larger by design.
            space=ms.space_generator.ScheduleFn(
                prefill_design_space(), sch_rules=[], postprocs=[], mutator_probs={}
            ),
            builder=ms.builder.LocalBuilder(f_build=BUILD_FUNC, initializer=register_build),
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


if __name__ == "__main__":
    sys.exit(main())
