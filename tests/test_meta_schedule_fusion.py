"""MetaSchedule finds the fusion itself: ``tvm_cascade.meta_schedule.cascade_space`` on
unfused chains of every kind, its proposals replayed from JSON and run against numpy, a
GPU proposal through CUDA code generation, and tuning runs (``tune_tir``, ``tune_relax``)
whose best record is fused."""

import shutil

import numpy as np
import pytest
import tvm
import tvm_cascade  # noqa: F401
from tvm.s_tir import meta_schedule as ms

from tvm_cascade import ops
from tvm_cascade import trace as cascade_trace
from tvm_cascade.meta_schedule import GPU_LANES, SKIP, cascade_space
from tvm_cascade.ops import cascades, testing
from tvm_cascade.ops import reference as R

from test_meta_schedule import TARGET, build_without_tensor_intrinsics, clear_capture_handlers, tune_briefly
from ahead import in_a_process_ahead

LLVM = tvm.target.Target(TARGET)
FUSIONS = ("RollingUpdate", "SplitKUpdate")


def _case(kind, rng):
    """(unfused PrimFunc, inputs, numpy reference of its outputs)."""
    if kind == "attention":
        q, k, v = testing.random_attention_inputs(1, 2, 1, 3, 40, 8, magnitude=2, seed=1)
        return ops.attention(1, 2, 1, 3, 40, 8, variant="causal"), [q, k, v], [R.attention_ref(q, k, v, variant="causal")]
    if kind in ("logsumexp", "cross_entropy"):
        x = rng.standard_normal((4, 40)).astype("float32") * 4
        if kind == "logsumexp":
            return cascades.logsumexp(4, 40), [x], [R.logsumexp_ref(x)]
        labels = rng.integers(0, 40, 4).astype("int32")
        return cascades.cross_entropy(4, 40), [x, labels], [R.cross_entropy_ref(x, labels)]
    if kind == "absmax_quant_gemm":
        x, w = rng.standard_normal((4, 40)).astype("float32"), rng.standard_normal((40, 8)).astype("float32")
        return cascades.absmax_quant_gemm(4, 8, 40), [x, w], [R.absmax_quant_gemm_ref(x, w)]
    if kind == "rmsnorm_gemm":
        x, gamma = rng.standard_normal((4, 40)).astype("float32"), rng.standard_normal(40).astype("float32")
        w = rng.standard_normal((40, 8)).astype("float32")
        return cascades.rmsnorm_gemm(4, 8, 40), [x, gamma, w], [R.rmsnorm_gemm_ref(x, gamma, w)]
    logits = rng.standard_normal((4, 40)).astype("float32") * 3
    return cascades.moe_routing(4, 40, 2, with_topk=False), [logits], [R.moe_routing_ref(logits, 2)[0]]


def _fusions(sch):
    return [inst.kind.name for inst in sch.trace.insts if inst.kind.name in FUSIONS]


@pytest.mark.parametrize("kind", ["attention", "logsumexp", "cross_entropy", "absmax_quant_gemm", "rmsnorm_gemm", "moe_routing"])
def test_space_proposes_each_fusion_beside_the_unfused_schedule(kind):
    """The space holds unfused schedules (the default rules' own) and a rolling and a
    split-k fusion of the chain; each fused one, replayed from its JSON trace on the
    unfused function and post-processed as the search does, computes what numpy does."""
    func, inputs, expected = _case(kind, np.random.default_rng(0))
    context = ms.TuneContext(mod=tvm.IRModule({"main": func}), target=LLVM, space_generator=cascade_space(), task_name=kind)
    spaces = context.generate_design_space()
    found = {tuple(sorted(set(_fusions(s)))) for s in spaces}
    assert found == {(), ("RollingUpdate",), ("SplitKUpdate",)}
    for space in spaces:
        if not _fusions(space):
            continue
        replayed = tvm.s_tir.Schedule(tvm.IRModule({"main": func}))
        cascade_trace.apply_json_to_schedule(space.trace.as_json(), replayed)
        assert all(postproc.apply(replayed) for postproc in context.space_generator.postprocs)
        outputs = testing.run_prim_func(replayed.mod["main"], inputs)
        for out, ref in zip(outputs if isinstance(outputs, (list, tuple)) else [outputs], expected):
            np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)


def test_top_k_rounds_do_not_multiply_the_space():
    """MoE routing with 8 top-k rounds: each round, a reduction outside the chain, takes
    one alternative of each default rule, so the space is a handful of schedules (it
    was 72171 on LLVM) with both fusions; a fused one routes as numpy does."""
    logits = np.random.default_rng(1).standard_normal((4, 40)).astype("float32") * 3
    func = cascades.moe_routing(4, 40, 8)
    context = ms.TuneContext(mod=tvm.IRModule({"main": func}), target=LLVM, space_generator=cascade_space(), task_name="moe")
    spaces = context.generate_design_space()
    assert len(spaces) <= 16
    fused = [s for s in spaces if _fusions(s)]
    assert {tuple(sorted(set(_fusions(s)))) for s in fused} == {("RollingUpdate",), ("SplitKUpdate",)}
    replayed = tvm.s_tir.Schedule(tvm.IRModule({"main": func}))
    cascade_trace.apply_json_to_schedule(fused[0].trace.as_json(), replayed)
    assert all(postproc.apply(replayed) for postproc in context.space_generator.postprocs)
    for out, ref in zip(testing.run_prim_func(replayed.mod["main"], [logits]), R.moe_routing_ref(logits, 8)):
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_fused_nest_is_left_to_the_fusion():
    """The blocks of a fused nest carry ``schedule_rule = "None"``: the default rules
    that follow leave them alone (no multi-level tiling of P·V inside the key loop)."""
    func = ops.attention(1, 2, 1, 3, 40, 8, variant="causal")
    context = ms.TuneContext(mod=tvm.IRModule({"main": func}), target=LLVM, space_generator=cascade_space(), task_name="a")
    rolled = next(s for s in context.generate_design_space() if "RollingUpdate" in _fusions(s))
    for name in ("max", "sum", "pv"):
        assert rolled.get(rolled.get_sblock(name)).annotations[SKIP[0]] == SKIP[1]


def test_gpu_proposals_are_bound_and_compile_for_cuda():
    """On a CUDA target the fused proposals are bound to blocks and threads (a row's
    threads sampled) and pass the GPU postprocessors (VerifyGPUCode among them); TVM's
    CUDA code generation and nvcc build them, with every sampled thread count; their
    simplified traces (MetaSchedule's records) replay."""
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    target = tvm.target.Target("nvidia/nvidia-h100")
    func = ops.attention(1, 4, 1, 1, 256, 64, variant="causal")
    context = ms.TuneContext(mod=tvm.IRModule({"main": func}), target=target, space_generator=cascade_space(), task_name="d")
    fused = [s for s in context.generate_design_space() if _fusions(s)]
    assert {_fusions(s)[0] for s in fused} == set(FUSIONS)
    for space in fused:
        # As MetaSchedule logs and stores it: simplified, it still names and replays.
        simplified = space.trace.simplified(remove_postproc=True)
        simplified.as_python(remove_postproc=False)
        simplified.apply_to_schedule(tvm.s_tir.Schedule(tvm.IRModule({"main": func})), remove_postproc=True)
        (lanes,) = [
            inst for inst in space.trace.insts
            if inst.kind.name == "SampleCategorical" and tuple(int(c) for c in inst.attrs[0]) == GPU_LANES
        ]
        for decision in range(len(GPU_LANES)):
            sch = tvm.s_tir.Schedule(tvm.IRModule({"main": func}))
            space.trace.with_decision(lanes, decision, remove_postproc=True).apply_to_schedule(sch, remove_postproc=True)
            assert all(postproc.apply(sch) for postproc in context.space_generator.postprocs)
            source = tvm.compile(sch.mod, target=target).mod.imports[0].inspect_source()
            assert f"__launch_bounds__({4 * GPU_LANES[decision]})" in source


HOPPER_CASES = {
    "rows": lambda: cascades.logsumexp(8, 2048, "float16"),
    "moe_routing": lambda: cascades.moe_routing(32, 256, 2, "float16"),
    "rmsnorm_gemm": lambda: cascades.rmsnorm_gemm(256, 512, 1024, dtype="float16"),
    "fp8_tiles_and_skinny": lambda: cascades.fp8_quant_gemm(32, 512, 1024),
    "fp8_two_pass": lambda: cascades.fp8_quant_gemm(2048, 512, 1024, tile=1024),
    "fp8_by_tokens": lambda: cascades.fp8_quant_gemm(tvm.tirx.Var("m", "int64"), 512, 1024),
}


@pytest.mark.parametrize("case", HOPPER_CASES)
def test_simplified_traces_of_gpu_proposals_replay_to_their_schedules(case):
    """MetaSchedule stores a candidate's trace simplified (instructions whose outputs no
    later instruction takes are dropped): every fused proposal on an H100 target, its
    sampled kernel choices included, replays from it to the module the space held. (A
    value sampled into a list inside one annotation would be dropped: the trace then
    fails to replay.)"""
    func = HOPPER_CASES[case]()
    target = tvm.target.Target("nvidia/nvidia-h100")
    context = ms.TuneContext(mod=tvm.IRModule({"main": func}), target=target, space_generator=cascade_space(), task_name=case)
    proposals = [
        s for s in context.generate_design_space()
        if any(i.kind.name == "Annotate" and [str(i.attrs[0]), str(i.inputs[1])] == list(SKIP) for i in s.trace.insts)
    ]
    assert any(i.kind.name == "SampleCategorical" for s in proposals for i in s.trace.insts)
    for space in proposals:
        simplified = space.trace.simplified(remove_postproc=True)
        replayed = tvm.s_tir.Schedule(tvm.IRModule({"main": func}))
        simplified.apply_to_schedule(replayed, remove_postproc=True)
        tvm.ir.assert_structural_equal(replayed.mod, space.mod)


def test_every_mutator_applies_to_a_gpu_row_space_with_one_chunk_count():
    """MoE routing over 256 experts on CUDA leaves one chunk count to its row fusion. The
    space takes that count as a constant: as a one-option categorical decision,
    MetaSchedule's thread-binding mutator (which re-samples among the *other* options)
    stopped the whole search with ``Check failed: (!weights.empty())``."""
    target = tvm.target.Target("nvidia/nvidia-h100")
    func = cascades.moe_routing(32, 256, 2, "float16")
    context = ms.TuneContext(mod=tvm.IRModule({"main": func}), target=target, space_generator=cascade_space(), task_name="moe")
    spaces = context.generate_design_space()
    assert any("SplitKUpdate" in _fusions(s) for s in spaces)
    mutators = list(context.space_generator.mutator_probs)
    for mutator in mutators:
        mutator._initialize_with_tune_context(context)
    for space in spaces:
        samples = [i for i in space.trace.insts if i.kind.name == "SampleCategorical"]
        assert all(len(inst.attrs[0]) > 1 for inst in samples)
        for mutator in mutators:
            mutator.apply(space.trace)


def test_tune_tir_finds_a_fused_kernel_and_reloads_it(tmp_path):
    """``ms.tune_tir`` on the unfused attention with the fused proposals only: the best
    record is a fusion, it reloads from the JSON database and computes what numpy does."""
    func = ops.attention(1, 2, 2, 4, 64, 16, variant="causal")
    tune_briefly(func, str(tmp_path), cascade_space(unfused=False), population=8)
    database = cascade_trace.JSONDatabase(work_dir=str(tmp_path))
    sch = database.query_schedule(tvm.IRModule({"main": func}), target=LLVM, workload_name="main")
    assert any(name in str(sch.trace) for name in ("sch.rolling_update(", "sch.split_k_update("))
    q, k, v = testing.random_attention_inputs(1, 2, 2, 4, 64, 16, magnitude=2)
    (out,) = testing.run_prim_func(sch.mod["main"], [q, k, v])
    np.testing.assert_allclose(out, R.attention_ref(q, k, v, variant="causal"), atol=1e-5)


@in_a_process_ahead
def test_tune_relax_finds_the_fused_attention_of_a_model(tmp_path):
    """``tune_relax`` on a Relax attention (``R.nn.attention``, causal, legalised to one
    PrimFunc whose V transpose sits between the softmax and P·V): the best record of the
    attention task is a fusion; reloaded from the JSON database and applied to the
    module (``MetaScheduleApplyDatabase``), the model computes what numpy does."""
    from tvm import relax

    from test_relax_fuse_attention import _causal_attention_op

    mod = tvm.transform.Sequential(
        [relax.transform.LegalizeOps(), relax.transform.FuseOps(), relax.transform.FuseTIR()]
    )(_causal_attention_op())
    clear_capture_handlers()
    ms.relax_integration.tune_relax(
        mod, params={}, target=LLVM, work_dir=str(tmp_path), max_trials_global=4, num_trials_per_iter=4,
        space=cascade_space(unfused=False),
        strategy=ms.search_strategy.EvolutionarySearch(population_size=8, init_min_unmeasured=4),
        builder=ms.builder.LocalBuilder(f_build=build_without_tensor_intrinsics(), max_workers=1, timeout_sec=300),
        runner=ms.runner.LocalRunner(timeout_sec=300), seed=0,
    )
    database = cascade_trace.JSONDatabase(work_dir=str(tmp_path))
    (task,) = ms.relax_integration.extract_tasks(mod, LLVM)
    best = database.query_schedule(task.dispatched[0], target=LLVM, workload_name=task.task_name)
    assert any(name in str(best.trace) for name in ("sch.rolling_update(", "sch.split_k_update("))
    with LLVM, database, tvm.transform.PassContext(opt_level=3):
        applied = relax.transform.MetaScheduleApplyDatabase()(mod)
    vm = relax.VirtualMachine(tvm.compile(applied, target=LLVM), tvm.cpu())
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal(shape).astype("float32") for shape in ((1, 8, 2, 8), (1, 80, 2, 8), (1, 80, 2, 8)))
    out = vm["main"](*(tvm.runtime.tensor(x) for x in (q, k, v))).numpy()
    expected = R.sequence_attention_ref(q[0], k[0], v[0], variant="causal")
    np.testing.assert_allclose(out[0], expected, rtol=1e-4, atol=1e-5)


def test_split_k_samples_chunk_counts_that_do_not_divide_the_keys():
    """37 keys (no sampled chunk count divides them): the split-k proposal samples the
    counts that leave no chunk empty (2, 4, 8; 16 chunks of 3 would leave 3 empty), and
    each decision computes what numpy does."""
    x = np.random.default_rng(3).standard_normal((4, 37)).astype("float32") * 4
    func = cascades.logsumexp(4, 37)
    context = ms.TuneContext(mod=tvm.IRModule({"main": func}), target=LLVM, space_generator=cascade_space(), task_name="l")
    (split,) = [s for s in context.generate_design_space() if "SplitKUpdate" in _fusions(s)]
    (chunks,) = [inst for inst in split.trace.insts if inst.kind.name == "SampleCategorical"
                 and tuple(int(c) for c in inst.attrs[0]) == (2, 4, 8)]
    for decision in range(3):
        sch = tvm.s_tir.Schedule(tvm.IRModule({"main": func}))
        split.trace.with_decision(chunks, decision, remove_postproc=True).apply_to_schedule(sch, remove_postproc=True)
        assert all(postproc.apply(sch) for postproc in context.space_generator.postprocs)
        (out,) = testing.run_prim_func(sch.mod["main"], [x])
        np.testing.assert_allclose(out, R.logsumexp_ref(x), rtol=1e-5)
