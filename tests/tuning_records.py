"""A MetaSchedule JSON database written the way ``benchmarks/tune_*`` write theirs, for
the tests that check tuned records come back into schedules."""
import tvm
from tvm.s_tir import meta_schedule as ms

from tvm_cascade import trace as cascade_trace


def write_records(work_dir, func, space, target, timings) -> list:
    """Commit one record of ``func`` per ``(seed, seconds)`` in ``timings``, each a sample
    of the design space ``space``; returns their traces in that order. (The run times are
    test data: which record is best is what the tests check.)"""
    database = cascade_trace.JSONDatabase(work_dir=str(work_dir))
    workload = database.commit_workload(tvm.IRModule({"main": func}))
    traces = []
    for seed, secs in timings:
        sch = tvm.s_tir.Schedule(func, seed=seed)
        space(sch)
        traces.append(sch.trace)
        database.commit_tuning_record(
            ms.database.TuningRecord(
                sch.trace, workload, run_secs=[secs], target=target,
                args_info=ms.arg_info.ArgInfo.from_prim_func(func),
            )
        )
    return traces
