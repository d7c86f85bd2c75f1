"""TVM's paged KV cache compiled with ``relax_pipeline="cascade"`` on a CUDA GPU
(skipped without one): its ragged prefill, paged prefill and decode kernels and the
latter two's sliding-window forms are tvm-cascade's, and the cache's scenarios
(``paged_kv_cache_scenarios``) give numpy's attention through the runtime, fp16, head dims
64 and 128."""
import functools

import paged_kv_cache_scenarios as pkv
import pytest
import tvm

import tvm_cascade  # noqa: F401  (the "cascade" pipeline)
from tvm_cascade.relax.dispatch import LIBRARY_ATTR
from tvm_cascade.relax.kv_cache import KVCacheAttention

pytestmark = pytest.mark.skipif(not tvm.cuda(0).exist, reason="needs a CUDA GPU")

SCENARIOS = list(pkv.SCENARIOS)


def _target():
    return tvm.target.Target.from_device(tvm.cuda(0))


@functools.lru_cache(maxsize=None)
def _compiled(head_dim, heads, **options):
    return pkv.compile_paged_kv_cache(_target(), "cascade", num_qo_heads=heads[0], num_kv_heads=heads[1],
                                      head_dim=head_dim, **options)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_caches_kernels_are_the_librarys(head_dim):
    spec = pkv.CacheSpec(num_qo_heads=8, num_kv_heads=2, head_dim=head_dim)
    with _target():
        mod = KVCacheAttention()(pkv.build_paged_kv_cache_module(spec, _target()))
    families = {gv.name_hint: func.attrs[LIBRARY_ATTR] for gv, func in mod.functions.items()
                if func.attrs is not None and LIBRARY_ATTR in func.attrs}
    assert set(families) == {"batch_prefill_ragged_kv", "batch_prefill_paged_kv", "batch_prefill_paged_kv_sliding_window",
                             "batch_decode_paged_kv", "batch_decode_paged_kv_sliding_window"}, families


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa4", "mha"])
def test_scenarios_on_the_library_kernels(scenario, head_dim, heads):
    report = pkv.SCENARIOS[scenario](_compiled(head_dim, heads))
    assert report.steps > 0 and report.kv_checks > 0


@pytest.mark.parametrize("head_dim", [64, 128])
def test_layers_of_sliding_windows_on_the_library_kernels(head_dim):
    """Gemma-2's alternation: a layer within a window of 40 keys, one over every key,
    RoPE before attention."""
    report = pkv.scenario_layer_sliding_window(
        _compiled(head_dim, (8, 2), layer_window=40, rope_mode=pkv.RopeMode.NORMAL))
    assert report.steps > 0 and report.tokens > 0


@pytest.mark.parametrize("scenario", ["prefill_decode", "fork_sequence", "popn"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rope_inside_attention_on_the_library_kernels(scenario, head_dim):
    """A cache of ``RopeMode.INLINE``: the keys kept as appended, the library's kernels
    rotating copies of Q and K first."""
    report = pkv.SCENARIOS[scenario](_compiled(head_dim, (8, 2), rope_mode=pkv.RopeMode.INLINE, rope_theta=5e5,
                                               rope_scale=0.5))
    assert report.steps > 0 and report.kv_checks > 0
