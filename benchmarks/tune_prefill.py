"""Tune the prefill kernels with MetaSchedule on the GPU and keep the records.

    python -m benchmarks.tune_prefill [--only SUBSTR ...] [--trials N] [--work-dir DIR]
                                      [--spaces mma warp-specialized]
                                      [--rpc-tracker HOST:PORT --rpc-key KEY [--rpc-workers N]]

For each prefill configuration of the suite: evolutionary search with the xgboost cost
model, through :func:`tvm_cascade.kernels.tune`, over the union of two design spaces
(``--spaces`` picks): the tensor-core schedule's,
:func:`tvm_cascade.schedules.prefill.prefill_design_space` (its choices are
``sample_categorical`` decisions; its fusion the traced ``rolling_update``,
``distribute``, ``split_tile_accumulation`` and, for causal and window masks,
``skip_masked_tiles``; candidates built by
:func:`tvm_cascade.schedules.prefill.build`), and on an H100/H200 the warp-specialised
kernel's, :func:`tvm_cascade.schedules.warp_specialized.design_space` (the traced
``rolling_update`` over 128-key tiles, the K/V stages and the consumers' form sampled,
the annotated loop lowered to the kernel by
:func:`tvm_cascade.schedules.warp_specialized.build`). Records go to a JSON database in
``--work-dir`` (default ``python/tvm_cascade/tuned/prefill``, the records shipped with the package), which
:func:`tvm_cascade.kernels.compile_attention` reads back (the best record that serves
the GPU); MetaSchedule's logs go to ``<work-dir>/logs/<workload>`` (git-ignored). With
``--rpc-tracker HOST:PORT --rpc-key KEY`` the candidates are measured on the GPU servers
registered under KEY with TVM's RPC tracker, in parallel (:mod:`benchmarks.tuning`).
"""
import sys
from pathlib import Path

from tvm_cascade.kernels import PREFILL_SPACES

from .tuning import parse_args, tune_suite

DEFAULT_WORK_DIR = Path(__file__).resolve().parents[1] / "python" / "tvm_cascade" / "tuned" / "prefill"


def main(argv=None) -> int:
    args = parse_args("python -m benchmarks.tune_prefill", __doc__, 16, DEFAULT_WORK_DIR, argv, PREFILL_SPACES)
    return tune_suite("prefill", args)


if __name__ == "__main__":
    sys.exit(main())
