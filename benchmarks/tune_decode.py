"""Tune the decode schedule with MetaSchedule on the GPU and keep the records.

    python -m benchmarks.tune_decode [--only SUBSTR ...] [--trials N] [--work-dir DIR]
                                     [--rpc-tracker HOST:PORT --rpc-key KEY [--rpc-workers N]]

For each decode configuration of the suite: evolutionary search with the xgboost cost
model over :func:`tvm_cascade.schedules.decode.decode_design_space` (its choices are
``sample_categorical`` decisions, its fusion the traced ``split_k_update``). Records go
to a JSON database (``database_workload.json``, ``database_tuning_record.json``) in
``--work-dir`` (default ``python/tvm_cascade/tuned/decode``, the records shipped with the package), which
:func:`tvm_cascade.kernels.compile_attention` reads back; MetaSchedule's logs (build and
run errors included) go to ``<work-dir>/logs/<workload>`` (git-ignored). With
``--rpc-tracker HOST:PORT --rpc-key KEY`` the candidates are measured on the GPU servers
registered under KEY with TVM's RPC tracker, in parallel (:mod:`benchmarks.tuning`).
"""
import sys
from pathlib import Path

from .tuning import parse_args, tune_suite

DEFAULT_WORK_DIR = Path(__file__).resolve().parents[1] / "python" / "tvm_cascade" / "tuned" / "decode"


def main(argv=None) -> int:
    args = parse_args("python -m benchmarks.tune_decode", __doc__, 32, DEFAULT_WORK_DIR, argv)
    return tune_suite("decode", args)


if __name__ == "__main__":
    sys.exit(main())
