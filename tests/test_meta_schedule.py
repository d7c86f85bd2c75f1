"""MetaSchedule tunes through rolling_update and its records reload from JSON."""
import json
import logging
import os

import numpy as np
import pytest
import tvm
import tvm_cascade  # noqa: F401
from tvm.s_tir import meta_schedule as ms

from tvm_cascade import ops
from tvm_cascade import trace as cascade_trace
from tvm_cascade.ops import reference, testing
from ahead import in_a_process_ahead

TARGET = {"kind": "llvm", "num-cores": 2}
SHAPE = (1, 2, 2, 16, 64, 16)


def attention_space(sch):
    """Design space: a sampled key tile, then the fusion and the usual compute_at."""
    j = sch.get_loops(sch.get_sblock("max"))[-1]
    j0, _ = sch.split(j, sch.sample_perfect_tile(j, n=2))
    sch.rolling_update(sch.get_sblock("sum"), j0)
    sch.rolling_update(sch.get_sblock("pv"), j0)
    sch.compute_at(sch.get_sblock("score"), j0)
    sch.compute_at(sch.get_sblock("qk"), j0)


def clear_capture_handlers():
    """Each tuning run's logging config lists MetaSchedule's logger's handlers by name:
    pytest's capture handlers, left there by an earlier run in this process, have none."""
    ms_logger = logging.getLogger("tvm.s_tir.meta_schedule")
    for handler in [h for h in ms_logger.handlers if h.get_name() is None]:
        ms_logger.removeHandler(handler)


def build_without_tensor_intrinsics():
    """MetaSchedule's default build less its import of TVM's tensor intrinsics, half a
    minute in each builder process (which the builder starts anew each round); llvm
    candidates use none. A closure, so that it reaches the builder's processes by
    value."""

    def build(mod, target, _params):
        from tvm.driver import build as tvm_build
        from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

        return tvm_build(RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod), target=target)

    return build


def tune_briefly(func, work_dir, space, population=16):
    """One round of 4 measurements with the xgboost model, on 2 cores (~10 s: each round
    starts builder and runner processes). The population is small: sampling
    MetaSchedule's default 512 takes minutes on 2 cores."""
    clear_capture_handlers()
    ms.tune_tir(
        func,
        target=TARGET,
        work_dir=work_dir,
        max_trials_global=4,
        num_trials_per_iter=4,
        space=space,
        strategy=ms.search_strategy.EvolutionarySearch(population_size=population, init_min_unmeasured=population // 2),
        cost_model="xgb",
        num_tuning_cores=1,
        builder=ms.builder.LocalBuilder(f_build=build_without_tensor_intrinsics(), max_workers=1, timeout_sec=300),
        runner=ms.runner.LocalRunner(timeout_sec=300),
        seed=0,
    )


@in_a_process_ahead
def test_tune_tir_with_xgboost_and_reload(tmp_path):
    func = ops.attention(*SHAPE, variant="causal")
    work_dir = str(tmp_path)
    # The design space has 7 points (key tiles of 64).
    space = ms.space_generator.ScheduleFn(attention_space, sch_rules=[], postprocs=[], mutator_probs={})
    tune_briefly(func, work_dir, space)
    records_path = os.path.join(work_dir, "database_tuning_record.json")
    with open(records_path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    assert len(records) >= 2
    tiles = set()
    for _, (trace_json, run_secs, _, _) in records:
        names = [inst[0] for inst in trace_json[0]]
        assert names.count("RollingUpdate") == 2
        assert run_secs and all(s < 1e9 for s in run_secs)
        tiles.add(json.dumps(trace_json[1]))
    assert len(tiles) >= 2, "the search measured only one tile"

    with pytest.raises(Exception, match="RollingUpdate"):
        ms.database.JSONDatabase(work_dir=work_dir).get_all_tuning_records()

    database = cascade_trace.JSONDatabase(work_dir=work_dir)
    sch = database.query_schedule(
        tvm.IRModule({"main": func}), target=tvm.target.Target(TARGET), workload_name="main"
    )
    assert str(sch.trace).count("sch.rolling_update(") == 2
    q, k, v = testing.random_attention_inputs(*SHAPE, magnitude=2)
    (out,) = testing.run_prim_func(sch.mod["main"], [q, k, v])
    np.testing.assert_allclose(out, reference.attention_ref(q, k, v, variant="causal"), atol=1e-5)
