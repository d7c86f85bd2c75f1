"""Tune the prefill schedule with MetaSchedule on the GPU and keep the records.

    python -m benchmarks.tune_prefill [--only SUBSTR ...] [--trials N] [--work-dir DIR]

For each prefill configuration of the suite: evolutionary search with the xgboost cost
model over :func:`tvm_cascade.schedules.prefill.prefill_design_space` (its choices are
``sample_categorical`` decisions; its fusion the traced ``rolling_update``, ``distribute``,
``split_tile_accumulation`` and, for causal and window masks, ``skip_masked_tiles``). Candidates are built with
:func:`tvm_cascade.schedules.prefill.build` (every warp fragment lowered to registers).
Records go to a JSON database in ``--work-dir`` (default ``benchmarks/tuned/prefill``);
MetaSchedule's logs go to ``<work-dir>/logs/<config>`` (git-ignored).
"""
import sys
from pathlib import Path

from .tuning import parse_args, tune_suite

DEFAULT_WORK_DIR = Path(__file__).resolve().parent / "tuned" / "prefill"


def register_build() -> None:
    """Builder-process initializer: registers the prefill build function there, and TVM's
    CUDA tensor intrinsics (half a minute, once per process, not per build)."""
    from tvm_cascade.schedules.prefill import cuda_intrinsics

    cuda_intrinsics()


def main(argv=None) -> int:
    args = parse_args("python -m benchmarks.tune_prefill", __doc__, 16, DEFAULT_WORK_DIR, argv)
    from tvm.s_tir import meta_schedule as ms

    from tvm_cascade.schedules.prefill import BUILD_FUNC, prefill_design_space

    def space(_cfg):
        # No VerifyGPUCode: it holds shared memory to the static 48 KB, and the
        # kernel's dynamic shared memory is larger by design.
        return ms.space_generator.ScheduleFn(
            prefill_design_space(), sch_rules=[], postprocs=[], mutator_probs={}
        )

    builder = ms.builder.LocalBuilder(f_build=BUILD_FUNC, initializer=register_build, timeout_sec=120)
    return tune_suite("prefill", args, space, trials_per_iter=8, builder=builder)


if __name__ == "__main__":
    sys.exit(main())
