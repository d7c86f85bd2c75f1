"""The tuning's candidate timing: on a GPU single runs after an L2 flush, on a CPU
MetaSchedule's own timing."""
import numpy as np
import tvm
from tvm.s_tir import meta_schedule as ms

from tvm_cascade import candidate_timing
from tvm_cascade.ops import cascades


def _module_and_args():
    lib = tvm.compile(cascades.logsumexp(4, 64), target="llvm")
    dev = tvm.cpu()
    x = np.random.default_rng(0).standard_normal((4, 64)).astype("float32")
    return lib.mod, dev, [tvm.runtime.tensor(x, dev), tvm.runtime.tensor(np.zeros(4, "float32"), dev)]


def test_flushed_runs_times_each_run_alone_per_argument_list():
    rt_mod, dev, args = _module_and_args()
    costs = candidate_timing.flushed_runs(rt_mod, dev, 5, [args, args])
    assert len(costs) == 10 and all(0 < c < 1 for c in costs)


def test_a_slow_candidate_is_timed_fewer_times(monkeypatch):
    """After the first run, as many runs as fit :data:`GPU_SECONDS` (the runs asked for
    at most, one at least)."""
    seconds = {}
    monkeypatch.setattr(candidate_timing, "_timed", lambda mod, dev, runs, args: [seconds[args]] * runs)
    budget = candidate_timing.GPU_SECONDS
    seconds.update(fast=budget / 1000, quarter=budget / 4, slow=budget * 3)
    assert len(candidate_timing.flushed_runs(None, None, 20, ["fast"])) == 20
    assert len(candidate_timing.flushed_runs(None, None, 20, ["quarter"])) == 5
    assert len(candidate_timing.flushed_runs(None, None, 20, ["slow", "fast"])) == 2 + 20


def test_a_cpu_candidate_is_timed_as_metaschedule_times_it():
    rt_mod, dev, args = _module_and_args()
    config = ms.runner.EvaluatorConfig(number=2, repeat=3, min_repeat_ms=0)
    assert len(candidate_timing.run_evaluator(rt_mod, dev, config, [args])) == 3


class _Device:
    def __init__(self, dlpack_type):
        self.dlpack_type = dlpack_type

    def dlpack_device_type(self):
        return self.dlpack_type


def test_a_gpu_candidate_local_or_remote_is_timed_in_flushed_single_runs(monkeypatch):
    calls = []
    monkeypatch.setattr(candidate_timing, "flushed_runs", lambda mod, dev, runs, args: calls.append((dev, runs)) or [])
    config = ms.runner.EvaluatorConfig(number=3, repeat=1)
    for dlpack_type in (2, 2 + 128, 10):  # CUDA, CUDA through an RPC session, ROCm
        candidate_timing.run_evaluator(None, _Device(dlpack_type), config, [])
    assert [runs for _, runs in calls] == [candidate_timing.GPU_RUNS] * 3
    candidate_timing.run_evaluator(None, _Device(2), ms.runner.EvaluatorConfig(number=10, repeat=4), [])
    assert calls[-1][1] == 40


def test_the_local_runner_times_by_the_flushed_evaluator():
    assert candidate_timing.local_runner().f_run_evaluator is candidate_timing.run_evaluator
