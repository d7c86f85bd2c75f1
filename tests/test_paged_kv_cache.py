"""TVM's paged KV cache, created by a compiled Relax module and driven through the
runtime builtins, against the numpy reference of ``paged_kv_cache_scenarios`` (CPU):
with TVM's own TIR kernels, and with tvm-cascade's in their place
(:class:`~tvm_cascade.relax.kv_cache.KVCacheAttention` before the default pipeline)."""
import dataclasses
import functools
import hashlib
import importlib
import inspect
import sys

import numpy as np
import paged_kv_cache_scenarios as pkv
import pytest
import tvm
from tvm import relax

from runs_ahead import call_run, called, runs

TARGET = "llvm"

LIBRARY = "kv_cache_attention"
"""The pipeline with tvm-cascade's kernels in the cache: ``KVCacheAttention``, then the
default pipeline (the ``"cascade"`` pipeline runs the pass on GPUs only)."""
PIPELINES = [LIBRARY]
"""Relax pipelines the variations (RoPE, GQA, dtypes, scale, window support) are compiled
with: :data:`LIBRARY`, or names of TVM's (a name not registered in TVM is looked up after
importing ``tvm_cascade``, which registers ``"cascade"``)."""

HEAD_DIMS = (64, 128)

BASIC_SCENARIOS = [name for name in pkv.SCENARIOS if name not in pkv.SLIDING_WINDOW_SCENARIOS]

ROPE = {"rope_mode": pkv.RopeMode.NORMAL, "rope_theta": 5e5, "rope_scale": 0.5}
"""RoPE before attention, at a base and scale other than the defaults."""


def _ensure_pipeline(pipeline):
    if isinstance(pipeline, str) and pipeline not in relax.pipeline.PIPELINE_MAP:
        importlib.import_module("tvm_cascade")


def _pipeline(name):
    _ensure_pipeline(name)
    if name == LIBRARY:
        from tvm_cascade.relax.kv_cache import KVCacheAttention  # pylint: disable=import-outside-toplevel

        return tvm.transform.Sequential([KVCacheAttention(), relax.get_pipeline("default")])
    return name


@functools.lru_cache(maxsize=None)
def _compiled(pipeline, config, exported=None):
    """The cache module of ``pipeline`` and ``config`` (sorted items of
    ``compile_paged_kv_cache``'s options), loaded from the library ``exported`` where
    given, else compiled here; once for every test."""
    executable = None if exported is None else tvm.runtime.load_module(exported)
    return pkv.compile_paged_kv_cache(TARGET, _pipeline(pipeline), executable=executable, **dict(config))


def _export(pipeline, config, path):
    """A run ahead: the cache module compiled and exported to ``path``."""
    pkv.compile_paged_kv_cache(TARGET, _pipeline(pipeline), **config).executable.export_library(path)


def _built_ahead(module_of, ahead=lambda pipeline: True):
    """Marks a test whose cache module, ``module_of(**the test's parameters)`` (a
    pipeline and ``compile_paged_kv_cache``'s options), a run ahead compiles and exports, once
    for every test of that module (``runs_ahead.py``), where ``ahead(pipeline)``: the
    test gets it loaded from there as its argument ``model`` (else compiled here)."""

    def key(params):
        pipeline, config = module_of(**params)
        return pipeline, tuple(sorted(config.items()))

    def path(tmp_path_factory, module):
        folder = tmp_path_factory.getbasetemp() / "kv_cache_modules"
        folder.mkdir(exist_ok=True)
        return folder / f"{hashlib.sha256(repr(module).encode()).hexdigest()[:16]}.so"

    def make(tmp_path_factory, **params):
        module = key(params)
        if not ahead(module[0]):
            return None
        exported = path(tmp_path_factory, module)
        run = call_run(exported.parent, __file__, _export,
                       {"pipeline": module[0], "config": dict(module[1]), "path": str(exported)})
        return {**run, "shared": module}

    def mark(test):
        takes = [name for name in inspect.signature(test).parameters if name != "model"]

        @functools.wraps(test)
        def checked(runs_ahead, request, tmp_path_factory, **arguments):
            module = key(request.node.callspec.params if hasattr(request.node, "callspec") else {})
            exported = None
            if ahead(module[0]):
                run = runs_ahead.result(request.node)
                assert run.returncode == 0, run.stdout + run.stderr
                exported = str(path(tmp_path_factory, module))
            test(model=_compiled(*module, exported), **arguments)

        checked.__signature__ = inspect.Signature([
            inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD)
            for name in takes + ["runs_ahead", "request", "tmp_path_factory"]])
        return runs(make)(checked)

    return mark


@_built_ahead(lambda: ("default", {"head_dim": 64}))
def test_module_creates_cache_through_relax_function(model):
    """The exported module creates the cache in a Relax function from TIR kernels of the
    module, and the compiled function returns an empty runtime cache."""
    spec = pkv.CacheSpec(head_dim=64)
    mod = pkv.build_paged_kv_cache_module(spec, TARGET)
    script = mod[pkv.CREATE_FUNCTION].script()
    assert "vm.builtin.paged_attention_kv_cache_create" in script
    kernels = {gv.name_hint for gv, func in mod.functions.items() if not isinstance(func, relax.Function)}
    assert {"batch_prefill_paged_kv_cpu", "batch_decode_paged_kv_cpu", "batch_prefill_ragged_kv"} <= kernels

    cache = model.create(max_batch_size=4, max_total_seq_len=256)
    checker = pkv.KVCacheChecker(model, cache)
    checker.assert_empty()


#: The pipelines and head dims of every scenario: TVM's kernels at one head dim (they
#: check the harness), tvm-cascade's at both.
SCENARIO_RUNS = [("default", 64)] + [(LIBRARY, d) for d in HEAD_DIMS]


@pytest.mark.parametrize("scenario", list(pkv.SCENARIOS))
@pytest.mark.parametrize("pipeline, head_dim", SCENARIO_RUNS)
@_built_ahead(lambda pipeline, head_dim, scenario: (pipeline, {"head_dim": head_dim}))
def test_scenario(pipeline, head_dim, scenario, model):
    """Every scenario, heads 4/2, two layers, float16, no RoPE."""
    report = pkv.SCENARIOS[scenario](model)
    assert report.steps > 0 and report.kv_checks > 0


@pytest.mark.parametrize("scenario", BASIC_SCENARIOS)
@pytest.mark.parametrize("pipeline", PIPELINES)
@_built_ahead(lambda pipeline, scenario: (pipeline, {"head_dim": 64}))
def test_scenario_with_sliding_window_support(pipeline, scenario, model):
    """The scenarios without windows in a cache created with sliding window support,
    which attends with the runtime's sliding-window kernels."""
    pkv.SCENARIOS[scenario](model, cache_options={"support_sliding_window": True})


@pytest.mark.parametrize("scenario", BASIC_SCENARIOS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("pipeline", PIPELINES)
@_built_ahead(lambda pipeline, head_dim, scenario: (pipeline, {"head_dim": head_dim, **ROPE}))
def test_scenario_with_rope(pipeline, head_dim, scenario, model):
    """RoPE applied to q/k before attention (``RopeMode.NORMAL``): forks and popn must
    keep every token's position."""
    pkv.SCENARIOS[scenario](model)


@pytest.mark.parametrize("scenario", ["prefill_decode", "fork_sequence", "popn"])
@pytest.mark.parametrize("pipeline", ["default"] + PIPELINES)
@_built_ahead(lambda pipeline, scenario: (pipeline, {"head_dim": 64, **ROPE, "rope_mode": pkv.RopeMode.INLINE}))
def test_scenario_with_rope_inside_attention(pipeline, scenario, model):
    """RoPE inside attention (``RopeMode.INLINE``): the cache keeps keys unrotated, the
    kernels rotate q and every key at its position (TVM's kernels check the reference,
    tvm-cascade's take their place)."""
    pkv.SCENARIOS[scenario](model)


@pytest.fixture(scope="module")
def library_only_rope_cache():
    """The cache module of :data:`LIBRARY` with RoPE before attention (head dim 64) whose
    TVM kernels, the library's fallbacks, compute nothing; built once for the module."""
    from tvm_cascade.library import kv_cache as library  # pylint: disable=import-outside-toplevel
    from tvm_cascade.library import rope_inside  # pylint: disable=import-outside-toplevel
    from tvm_cascade.relax import kv_cache as relax_kv  # pylint: disable=import-outside-toplevel

    build = relax_kv.cache_kernel
    with pytest.MonkeyPatch.context() as patch:
        def without_tvms(kind, *args, fallback, **options):
            patch.setattr(library, "rotation_of", lambda _: rope_inside.rotation_of(fallback))
            return build(kind, *args, fallback=fallback.with_body(tvm.tirx.Evaluate(0)), **options)

        patch.setattr(relax_kv, "cache_kernel", without_tvms)
        return pkv.compile_paged_kv_cache(TARGET, _pipeline(LIBRARY), head_dim=64, **ROPE)


@pytest.mark.parametrize("scenario", ["prefill_decode", "sliding_window"])
@_built_ahead(lambda scenario: ("default", {"head_dim": 64, **ROPE}))
def test_rope_that_the_runtime_moves_inside_attention(scenario, library_only_rope_cache, model):
    """RoPE before attention (``RopeMode.NORMAL``) in a cache created with sliding window
    support: the runtime rotates inside attention, at the positions it keeps for a
    window (which the reference does not model), through the sliding-window kernels and
    the ragged prefill. Those of the library serve every such call: with TVM's kernels,
    their fallbacks, made to compute nothing, the outputs equal the default pipeline's
    (TVM's kernels) step by step."""
    library_only = library_only_rope_cache
    runs = [pkv.SCENARIOS[scenario](each, cache_options={"support_sliding_window": True}, reference=False)
            for each in (library_only, model)]
    assert len(runs[0].outputs) == len(runs[1].outputs) > 0
    for ours, theirs in zip(runs[0].outputs, runs[1].outputs):
        for layer, (a, b) in enumerate(zip(ours, theirs)):
            np.testing.assert_allclose(a, b, atol=2e-3, rtol=2e-3, err_msg=f"layer {layer}")


@pytest.mark.parametrize("scenario", ["prefill_decode", "fork_sequence", "sliding_window"])
@pytest.mark.parametrize("pipeline", PIPELINES)
@_built_ahead(lambda pipeline, scenario: (pipeline, {"num_qo_heads": 8, "num_kv_heads": 2, "head_dim": 64}))
def test_scenario_gqa_group_of_four(pipeline, scenario, model):
    """Eight query heads over two KV heads."""
    pkv.SCENARIOS[scenario](model)


@pytest.mark.parametrize("pipeline", ["default"] + PIPELINES)
# (TVM's kernels of this cache, exported and loaded, give NaN outputs from some builds and
# not others, where compiled in the process they never have: compiled here)
@_built_ahead(lambda pipeline: (pipeline, {"head_dim": 64, "layer_window": 40, "rope_mode": pkv.RopeMode.NORMAL}),
              ahead=lambda pipeline: pipeline != "default")
def test_layers_of_sliding_windows(pipeline, model):
    """A cache whose first layer attends within a window of 40 keys
    (``AttnKind.MHA_SLIDING``) and whose second sees every key, with RoPE before
    attention: TVM's kernels check the reference, tvm-cascade's take their place."""
    report = pkv.scenario_layer_sliding_window(model)
    assert report.steps > 0 and report.tokens > 0


# (test_layers_of_sliding_windows[default]'s module, compiled here once for both)
@_built_ahead(lambda: ("default", {"head_dim": 64, "layer_window": 40, "rope_mode": pkv.RopeMode.NORMAL}),
              ahead=lambda pipeline: False)
def test_a_window_shows_in_the_layers_outputs(model):
    """The sliding layer's reference is not the full layer's: a checker that takes the
    window away fails where the sequence has outgrown it."""
    checker = pkv.KVCacheChecker(model, model.create(), name="windowless")
    checker.add(0)
    checker.step([(0, 39)])
    checker.spec = dataclasses.replace(checker.spec, layer_window=0)
    with pytest.raises(AssertionError, match="layer 0"):
        checker.step([(0, 10)])


FLOAT32_MHA = {"num_layers": 1, "num_qo_heads": 4, "num_kv_heads": 4, "head_dim": 64, "dtype": "float32"}
"""One layer of plain multi-head attention in float32, where outputs are checked to 1e-5."""


@pytest.mark.parametrize("scenario", ["prefill_decode", "fork_sequence", "popn", "sliding_window"])
@pytest.mark.parametrize("pipeline", PIPELINES)
@_built_ahead(lambda pipeline, scenario: (pipeline, FLOAT32_MHA))
def test_scenario_float32_mha(pipeline, scenario, model):
    """Float32 multi-head attention (as many KV heads as query heads)."""
    report = pkv.SCENARIOS[scenario](model)
    assert report.max_abs_error < 1e-5


@pytest.mark.parametrize("scenario", ["prefill_decode", "fork_sequence"])
@pytest.mark.parametrize("pipeline", PIPELINES)
@_built_ahead(lambda pipeline, scenario: (pipeline, FLOAT32_MHA))
def test_sm_scale_is_honoured(pipeline, scenario, model):
    """A scale other than ``head_dim ** -0.5`` reaches the kernels."""
    pkv.SCENARIOS[scenario](model, sm_scale=0.3)


@pytest.mark.parametrize("pipeline", PIPELINES)
@_built_ahead(lambda pipeline: (pipeline, {"head_dim": 64, "dtype": "bfloat16"}))
def test_scenario_bfloat16(pipeline, model):
    """A bfloat16 cache."""
    pkv.scenario_prefill_decode(model)
    pkv.scenario_sliding_window(model)


@_built_ahead(lambda: ("default", {"head_dim": 64}))
def test_checker_catches_wrong_outputs_and_contents(model):
    """The comparisons are live: a reference that disagrees with the cache fails."""
    checker = pkv.KVCacheChecker(model, model.create(), name="corrupted")
    checker.add(0)
    checker.step([(0, 20)])
    checker.keys[0] = checker.keys[0].copy()
    checker.keys[0][:, 3] += np.asarray(0.5, checker.keys[0].dtype)
    with pytest.raises(AssertionError, match="attention output of sequence 0"):
        checker.step([(0, 1)])

    checker = pkv.KVCacheChecker(model, model.create(), name="corrupted")
    checker.add(0)
    checker.step([(0, 20)])
    checker.values[0] = checker.values[0].copy()
    checker.values[0][1, 19, 0, 0] += np.asarray(0.25, checker.values[0].dtype)
    with pytest.raises(AssertionError, match="cached values of sequence 0"):
        checker.verify()


@_built_ahead(lambda: ("default", {"head_dim": 64, **ROPE}))
def test_unsupported_configurations_are_rejected(model):
    """RoPE inside attention with sliding layers, and RoPE in a cache of sliding window
    support (in-window positions), are outside what the reference models."""
    with pytest.raises(ValueError, match="rope_mode"):
        pkv.CacheSpec(rope_mode=pkv.RopeMode.INLINE, layer_window=40)
    with pytest.raises(ValueError, match="sliding window"):
        pkv.scenario_sliding_window(model)


if __name__ == "__main__":
    function, arguments, _ = called(sys.argv[1:])
    function(**arguments)
