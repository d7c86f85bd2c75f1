"""``SpacesFirst``: MetaSchedule measures every design space, as its rule chose it, before
the evolutionary search; ``tune_tir`` searches with it."""
import collections
import shutil

import numpy as np
import tvm
import tvm_ffi
from tvm.s_tir import meta_schedule as ms

from tvm_cascade.meta_schedule import build, cascade_space, tune_tir, tuned_database, tuned_schedule
from tvm_cascade.ops import cascades, testing
from tvm_cascade.ops import reference as R
from tvm_cascade.schedules.rows import plan_chain, row_chains
from tvm_cascade.spaces_first import SpacesFirst

from test_meta_schedule import TARGET, build_without_tensor_intrinsics, clear_capture_handlers
from ahead import in_a_process_ahead

FUSIONS = ("RollingUpdate", "SplitKUpdate")


def _fusions(sch):
    return tuple(sorted({inst.kind.name for inst in sch.trace.insts if inst.kind.name in FUSIONS}))


def _replayed(record, mod):
    sch = tvm.s_tir.Schedule(mod)
    record.trace.apply_to_schedule(sch, remove_postproc=True)
    return sch


@in_a_process_ahead
def test_the_first_round_measures_every_design_space_as_its_rule_chose():
    """MoE routing, 16384 tokens x 256 experts, top-8, on an H100: 7 design spaces, of
    which the one-block-per-row one has a few distinct schedules (the evolutionary
    search alone measured none of it in 32 trials). The first round is each space once,
    the row space as the hand plan (``plan_chain``); then the evolutionary search's
    rounds, within the trials asked for."""
    func = cascades.moe_routing(16384, 256, 8, "float16")
    mod = tvm.IRModule({"main": func})
    context = ms.TuneContext(
        mod=mod, target=tvm.target.Target("nvidia/nvidia-h100"), space_generator=cascade_space(),
        search_strategy=SpacesFirst(population_size=32, init_min_unmeasured=16), task_name="moe",
    ).clone()
    spaces = context.generate_design_space()
    strategy = context.search_strategy
    strategy.pre_tuning(12, 4, spaces, ms.database.MemoryDatabase(), ms.cost_model.RandomModel())

    first = strategy.generate_measure_candidates()
    assert len(first) == len(spaces) == 7
    # Post-processed as the search does: what follows the mark is the postprocessors'.
    assert all(any(i.kind.name == "EnterPostproc" for i in c.sch.trace.insts) for c in first)
    assert collections.Counter(_fusions(c.sch) for c in first) == collections.Counter(_fusions(s) for s in spaces)
    (chain,) = row_chains(func)
    plan = plan_chain(func, chain)
    (rows,) = [c.sch.trace for c in first if _fusions(c.sch) == FUSIONS]
    # (256 experts leave the plan's tile and chunk count the only ones: constants)
    (per_block,) = [
        i for i in rows.insts if i.kind.name == "SampleCategorical" and [int(c) for c in i.attrs[0]] == [1, 4, 8, 16]
    ]
    assert int(per_block.attrs[0][int(rows.decisions[per_block])]) == plan["rows_per_block"] == 8
    strategy.notify_runner_results(first, [])

    searched = []
    while (candidates := strategy.generate_measure_candidates()) is not None:
        searched += candidates
        strategy.notify_runner_results(candidates, [ms.runner.RunnerResult([1e-3], None)] * len(candidates))
    assert 0 < len(searched) <= 12 - 7
    assert not any(tvm_ffi.structural_equal(s.sch.mod, f.sch.mod) for s in searched for f in first)
    strategy.post_tuning()


def test_tune_tir_measures_each_space_once_then_searches(tmp_path, monkeypatch):
    """On the CPU: log-sum-exp's 11 design spaces (the default rules' 9 unfused ones, the
    rolled one, the split-k one) are all measured, then the search's round; no module is
    measured twice, and the best record computes what numpy does, read from the tuning directory, from where the
    package's records are (``TVM_CASCADE_TUNED_CASCADES``), and from the user's."""
    func = cascades.logsumexp(4, 40)
    mod = tvm.IRModule({"main": func})
    clear_capture_handlers()
    database = tune_tir(
        mod, TARGET, str(tmp_path), 14, num_trials_per_iter=3,
        space=cascade_space(chunks=(2, 4)),
        strategy=SpacesFirst(population_size=16, init_min_unmeasured=8),
        builder=ms.builder.LocalBuilder(f_build=build_without_tensor_intrinsics(), max_workers=1, timeout_sec=300),
        runner=ms.runner.LocalRunner(timeout_sec=300), num_tuning_cores=1, seed=0,
    )
    records = database.get_all_tuning_records()
    # (a space's module the search proposes again counts among its trials, unmeasured)
    assert 11 < len(records) <= 14
    kinds = collections.Counter(_fusions(_replayed(record, mod)) for record in records)
    assert kinds[("RollingUpdate",)] >= 1 and kinds[("SplitKUpdate",)] >= 1 and kinds[()] >= 9
    measured = [tvm_ffi.structural_hash(_replayed(record, mod).mod) for record in records]
    assert len(set(measured)) == len(measured)
    # Every record replays as the search replays the database's best: its postprocessing
    # left out, then done again.
    postprocs = ms.TuneContext(mod=mod, target=TARGET, space_generator=cascade_space(chunks=(2, 4)),
                               task_name="main").space_generator.postprocs
    for record in records:
        sch = _replayed(record, mod)
        assert all(postproc.apply(sch) for postproc in postprocs)

    x = np.random.default_rng(0).standard_normal((4, 40)).astype("float32") * 4
    expected = R.logsumexp_ref(x)
    best = tuned_schedule(func, TARGET, tuned_database(tmp_path))
    (out,) = testing.run_prim_func(best.mod["main"], [x])
    np.testing.assert_allclose(out, expected, rtol=1e-5)

    # Found where the package's records are, and where the user's are, before those.
    monkeypatch.setenv("TVM_CASCADE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TVM_CASCADE_TUNED_CASCADES", str(tmp_path / "shipped"))
    assert tuned_database() is None and tuned_schedule(func, TARGET) is None
    for where in (tmp_path / "shipped", tmp_path / "cache" / "tuned" / "cascades"):
        where.mkdir(parents=True)
        for name in ("database_workload.json", "database_tuning_record.json"):
            shutil.copy(tmp_path / name, where / name)
        kernel = build(tuned_schedule(func, TARGET).mod, TARGET)
        out = tvm.runtime.tensor(np.zeros(4, "float32"))
        kernel["main"](tvm.runtime.tensor(x), out)
        np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5)
    assert isinstance(tuned_database(), ms.database.OrderedUnionDatabase)
