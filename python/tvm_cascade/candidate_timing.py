"""How tvm-cascade's tuning times MetaSchedule's candidates: on a GPU each timed run
starts with the L2 cache flushed, as ``benchmarks`` time kernels and as a model's calls
meet them (their inputs written by other kernels since). MetaSchedule's own evaluator
times runs back to back, whose inputs stay in L2 from the run before: on an H200 it
ranks the RMSNorm + GEMM kernel's row-tile groupings opposite to flushed timing (its
pick runs 3% slower than the default in the benchmark). On a CPU the candidates are
timed as MetaSchedule times them."""
from __future__ import annotations

from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.meta_schedule.runner.utils import run_evaluator_common

#: Bytes copied on the device before each timed run: more than twice the L2 of the
#: GPUs tuned for (50 MiB on an H100 or H200, 126 MiB on a B200).
FLUSH_BYTES = 256 << 20
#: Timed runs of a candidate on a GPU, at least (each one launch after a flush)...
GPU_RUNS = 20
#: ... unless they would take longer than this many seconds: a candidate this slow is
#: timed once more after its first run (its rank is plain; an unfused GEMM's twenty
#: flushed runs took ten seconds).
GPU_SECONDS = 0.2
# DLPack's CPU device type; an RPC session's devices add multiples of 128.
_CPU = 1
_RPC_SESSION_MASK = 128


def run_evaluator(rt_mod, device, evaluator_config, repeated_args) -> list:
    """MetaSchedule's ``f_run_evaluator``: the run times (seconds) of ``rt_mod``'s entry on
    ``device`` for each of ``repeated_args``. On a GPU, :func:`flushed_runs`, up to
    ``max(GPU_RUNS, number x repeat)`` of ``evaluator_config`` single runs; on a CPU,
    MetaSchedule's default timing."""
    if int(device.dlpack_device_type()) % _RPC_SESSION_MASK == _CPU:
        return run_evaluator_common(rt_mod, device, evaluator_config, repeated_args)
    return flushed_runs(rt_mod, device, max(GPU_RUNS, evaluator_config.number * evaluator_config.repeat), repeated_args)


def flushed_runs(rt_mod, device, runs: int, repeated_args) -> list:
    """Run times of ``rt_mod``'s entry on ``device`` per argument list of
    ``repeated_args``, each run timed alone after :data:`FLUSH_BYTES` are copied:
    ``runs`` of them, or as many as fit :data:`GPU_SECONDS` after the first (one at
    least)."""
    costs = []
    for args in repeated_args:
        first = _timed(rt_mod, device, 1, args)
        costs += first + _timed(rt_mod, device, max(1, min(runs - 1, int(GPU_SECONDS / max(first[0], 1e-9)))), args)
    return costs


def _timed(rt_mod, device, runs, args) -> list:
    evaluator = rt_mod.time_evaluator(
        rt_mod.entry_name, device, number=1, repeat=runs, min_repeat_ms=0, cache_flush_bytes=FLUSH_BYTES
    )
    device.sync()
    return [float(cost) for cost in evaluator(*args).results]


def local_runner(**options) -> ms.runner.LocalRunner:
    """MetaSchedule's local runner timing candidates by :func:`run_evaluator`
    (``options``: more of ``LocalRunner``'s arguments)."""
    return ms.runner.LocalRunner(f_run_evaluator=run_evaluator, **options)
