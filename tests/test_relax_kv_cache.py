"""``KVCacheAttention`` on a module that creates TVM's paged KV cache as models do
(``paged_kv_cache_scenarios``): which of the cache's kernels become tvm-cascade's,
which stay TVM's and why (logged), and that the ``"cascade"`` pipeline does it on GPU
targets. The kernels' numerics through the runtime: ``test_paged_kv_cache.py``."""
import logging

import paged_kv_cache_scenarios as pkv
import pytest
import tvm
import tvm_ffi
from tvm import relax

import tvm_cascade  # noqa: F401  (the "cascade" pipeline)
from tvm_cascade.relax.dispatch import LIBRARY_ATTR
from tvm_cascade.relax.kv_cache import CREATE, KVCacheAttention
from ahead import in_a_process_ahead

CPU = tvm.target.Target("llvm")
HOPPER = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})


def _slots(mod):
    """The functions in the create call's kernel slots 15-19, by slot: (name, family)."""
    calls = []
    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func.body, lambda e: calls.append(e) if isinstance(e, relax.Call)
                                            and isinstance(e.args[0], relax.ExternFunc)
                                            and e.args[0].global_symbol == CREATE else None)
    (call,) = calls
    out = {}
    for slot in range(15, 20):
        gvar = call.args[1 + slot].fields[1]
        func = mod[gvar]
        out[slot] = (gvar.name_hint, func.attrs.get(LIBRARY_ATTR) if func.attrs is not None else None)
    return out


def _module(target, **spec):
    return pkv.build_paged_kv_cache_module(pkv.CacheSpec(**spec), target)


def test_cpu_cache_kernels_become_the_generic_family():
    with CPU:
        mod = KVCacheAttention()(_module(CPU))
    slots = _slots(mod)
    assert slots == {
        15: ("batch_prefill_ragged_kv", "generic"),
        16: ("batch_prefill_paged_kv_cpu", "generic"),
        17: ("batch_decode_paged_kv_cpu", "generic"),
        18: ("batch_prefill_paged_kv_cpu_sliding_window", "generic"),
        19: ("batch_decode_paged_kv_cpu_sliding_window", "generic"),
    }
    # Under TVM's names: the runtime finds them by the same symbols.
    assert all(mod[name].attrs["global_symbol"] == name for name, _ in slots.values())


def test_the_sliding_layers_window_reaches_the_sliding_window_prefill():
    """A cache of sliding layers (``AttnKind.MHA_SLIDING``) gets a sliding-window prefill
    that attends within their window where called with ``causal=1``; without sliding
    layers such a call runs TVM's kernel."""
    def branches(spec):
        with CPU:
            mod = KVCacheAttention()(_module(CPU, **spec))
        func = mod["batch_prefill_paged_kv_cpu_sliding_window"]
        causal = next(p for p in func.params if p.name == "causal")
        served = func.body.then_case  # (the else case: TVM's kernel)
        return isinstance(served, tvm.tirx.IfThenElse) and tvm_ffi.structural_equal(
            served.condition, tvm.tirx.op.tvm_thread_invariant(tvm.tirx.EQ(causal, 0)))

    assert branches({"layer_window": 40})
    assert not branches({})


@pytest.mark.parametrize("head_dim", [64, 128])
@in_a_process_ahead
def test_hopper_cache_kernels_become_the_fast_families(head_dim):
    with HOPPER:
        mod = KVCacheAttention()(_module(HOPPER, num_qo_heads=8, num_kv_heads=2, head_dim=head_dim))
    families = {slot: family for slot, (_, family) in _slots(mod).items()}
    assert families == {15: "warp_specialized_prefill", 16: "warp_specialized_prefill",
                        17: "tensor_core_decode", 18: "warp_specialized_prefill", 19: "tensor_core_decode"}
    assert str(mod["batch_prefill_ragged_kv"].attrs["target"].arch) == "sm_90a"


@pytest.mark.parametrize("target, decode", [(CPU, "batch_decode_paged_kv_cpu"), (HOPPER, "batch_decode_paged_kv")])
@in_a_process_ahead
def test_inline_rope_gets_kernels_built_to_rotate(target, decode):
    """A cache of the runtime's RoPE inside attention (``RopeMode.INLINE``) gets the
    library's kernels, built for ``rotary_mode`` 1 (TVM's for the other)."""
    mod = _with_rope_mode(_module(target), 2)
    with target:
        out = KVCacheAttention()(mod)
    assert all(family is not None for _, family in _slots(out).values())
    func = out[decode]
    rotary = next(p for p in func.params if p.name == "rotary_mode")
    tvm.ir.assert_structural_equal(func.body.condition, tvm.tirx.op.tvm_thread_invariant(tvm.tirx.EQ(rotary, 1)))


def test_rope_where_the_runtime_decides_sliding_window_support():
    """RoPE before attention in a cache whose sliding-window support is an argument (as
    ``relax.frontend.nn.llm`` models take it): where the runtime turns it on, RoPE moves
    inside attention, the calls going to the sliding-window kernels (built to rotate) and
    the ragged prefill (built for both modes); the paged prefill and decode are called
    only where it is off (built for RoPE before attention). A cache with sliding layers
    never moves it."""
    def conditions(spec):
        with CPU:
            mod = KVCacheAttention()(_with_rope_mode(_module(CPU, **spec), 1))
        found = {}
        for slot, (name, family) in _slots(mod).items():
            assert family == "generic"
            func = mod[name]
            rotary = tvm.tirx.EQ(next(p for p in func.params if p.name == "rotary_mode"), 1)
            found[slot] = [_requires(branch.condition, rotary) for branch in (func.body, func.body.else_case)
                           if isinstance(branch, tvm.tirx.IfThenElse)]
        return found

    # (ragged: rotated, else its own unrotated kernel (with TVM's as its fallback))
    assert conditions({}) == {15: [True, False], 16: [False], 17: [False], 18: [True], 19: [True]}
    assert conditions({"layer_window": 40}) == {15: [False], 16: [False], 17: [False], 18: [False], 19: [False]}


def test_inline_rope_without_a_rotation_pass_leaves_tvms_kernels_and_says_why(caplog, monkeypatch):
    from tvm_cascade.library import kv_cache  # pylint: disable=import-outside-toplevel

    monkeypatch.setattr(kv_cache, "ROTATES_ON", ("llvm",))
    mod = _with_rope_mode(_module(HOPPER), 2)
    with HOPPER, caplog.at_level(logging.INFO, logger="tvm_cascade.relax"):
        out = KVCacheAttention()(mod)
    tvm.ir.assert_structural_equal(out, mod)
    assert caplog.text.count("RoPE inside attention: no rotation pass for cuda targets") == 5


def _requires(condition, term):
    """Whether ``condition`` (a host branch's) holds ``term`` among its conjuncts."""
    found = []
    tvm_ffi.structural_walk(condition, lambda n: found.append(n) if tvm_ffi.structural_equal(n, term) else None)
    return bool(found)


def _with_rope_mode(mod, mode):
    """``mod`` with the create call's RoPE mode argument set to ``mode``."""
    @relax.expr_functor.mutator
    class _Rope(relax.PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            if isinstance(call.args[0], relax.ExternFunc) and call.args[0].global_symbol == CREATE:
                args = list(call.args)
                args[1 + 8] = relax.prim_value(mode)
                return relax.Call(call.op, args, call.attrs, call.ty_args)
            return call

    rewriter = _Rope(mod)
    for gvar, func in mod.functions.items():
        if isinstance(func, relax.Function):
            rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
    return rewriter.builder_.get()


@in_a_process_ahead
def test_the_cascade_pipeline_puts_them_in_on_gpus_only():
    with HOPPER:
        gpu = relax.get_pipeline("cascade")(_module(HOPPER))
    with CPU:
        cpu = relax.get_pipeline("cascade")(_module(CPU))
    def library(mod):
        return {gv.name_hint for gv, f in mod.functions.items() if f.attrs is not None and LIBRARY_ATTR in f.attrs}

    assert {"batch_prefill_ragged_kv", "batch_prefill_paged_kv", "batch_decode_paged_kv"} <= library(gpu)
    assert not library(cpu)
