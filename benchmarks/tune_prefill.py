"""Tune the prefill schedule with MetaSchedule on the GPU and keep the records.

    python -m benchmarks.tune_prefill [--only SUBSTR ...] [--trials N] [--work-dir DIR]

For each prefill configuration of the suite: evolutionary search with the xgboost cost
model over :func:`tvm_cascade.schedules.prefill.prefill_design_space` (its choices are
``sample_categorical`` decisions; its fusion the traced ``rolling_update``,
``distribute``, ``split_tile_accumulation`` and, for causal and window masks,
``skip_masked_tiles``), through :func:`tvm_cascade.kernels.tune`. Candidates are built
with :func:`tvm_cascade.schedules.tensor_cores.build` (every warp fragment lowered to
registers). Records go to a JSON database in ``--work-dir`` (default
``benchmarks/tuned/prefill``), which :func:`tvm_cascade.kernels.compile_attention` reads
back; MetaSchedule's logs go to ``<work-dir>/logs/<workload>`` (git-ignored). On an
H100/H200 the records serve only the configurations the warp-specialised kernel does not
(:mod:`tvm_cascade.schedules.warp_specialized`: its few choices are a config measured
side by side, not a design space).
"""
import sys
from pathlib import Path

from .tuning import parse_args, tune_suite

DEFAULT_WORK_DIR = Path(__file__).resolve().parent / "tuned" / "prefill"


def main(argv=None) -> int:
    args = parse_args("python -m benchmarks.tune_prefill", __doc__, 16, DEFAULT_WORK_DIR, argv)
    return tune_suite("prefill", args)


if __name__ == "__main__":
    sys.exit(main())
