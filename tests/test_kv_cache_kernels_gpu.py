"""The kernels with TVM's paged KV cache's calling convention
(:mod:`tvm_cascade.library.kv_cache`) on a CUDA GPU (skipped without one): the fast
families' outputs and log-sum-exps against numpy's, over ragged batches longer than a
tile, pages in any order and index arrays at element offsets."""
import numpy as np
import pytest
import tvm

from kv_cache_cases import OUTPUT_AT, arguments, both_modes_runs, expected, rope_inside_runs, tvm_kernel
from tvm_cascade.library.kv_cache import cache_kernel

pytestmark = pytest.mark.skipif(not tvm.cuda(0).exist, reason="needs a CUDA GPU")

#: (kind, query lengths, key lengths).
CASES = [
    ("ragged", [300, 1, 77, 129], [300, 1, 77, 129]),
    ("ragged", [1000], [1000]),
    ("prefill", [200, 3, 64], [500, 17, 0]),
    ("prefill", [130], [1030]),
    ("decode", [1] * 5, [1, 300, 1000, 4097, 77]),
    ("decode", [1] * 40, list(range(10, 4010, 100))),
    ("decode_window", [1] * 6, [1, 30, 300, 1000, 4097, 77]),
]
#: The family each kind runs on an sm_90 GPU.
FAMILIES = {"ragged": "warp_specialized_prefill", "prefill": "warp_specialized_prefill"}


@pytest.mark.parametrize("kind, q_lens, kv_lens", CASES)
@pytest.mark.parametrize("heads", [(32, 8), (16, 16), (12, 4)], ids=["gqa4", "mha", "gqa3"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fast_families_match_numpy(kind, q_lens, kv_lens, heads, head_dim):
    target = tvm.target.Target.from_device(tvm.cuda(0))
    kernel, why = cache_kernel(kind, *heads, head_dim, "float16", target)
    assert kernel is not None, why
    if kind in FAMILIES and int(str(target.arch)[3:5]) == 90:
        assert kernel.family.name == FAMILIES[kind]
    if kind.startswith("decode"):
        assert kernel.family.name in ("tensor_core_decode", "split_k_decode")
    func = tvm.compile(tvm.IRModule({"main": kernel.func}), target=kernel.func.attrs["target"])["main"]
    args, reference, causal = arguments(kind, q_lens, kv_lens, *heads, head_dim, tvm.cuda(0), seed=3)
    func(*args)
    out, lse = expected(q_lens, reference, causal, args[-1])
    at = OUTPUT_AT[kind]
    np.testing.assert_allclose(args[at].numpy().astype("float64"), out, atol=5e-3, rtol=5e-3)
    np.testing.assert_allclose(args[at + 1].numpy(), lse, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("kind", ["ragged", "prefill", "decode"])
def test_rope_inside_attention_runs_tvms_kernel(kind):
    """With TVM's kernel as the fallback (as the cascade pipeline builds them), a call
    with RoPE inside attention runs TVM's kernel: its outputs bit for bit."""
    target = tvm.target.Target.from_device(tvm.cuda(0))
    heads_q, heads_kv, head_dim = 32, 8, 128
    theirs = tvm_kernel(kind, heads_q, heads_kv, head_dim, target)
    kernel, why = cache_kernel(kind, heads_q, heads_kv, head_dim, "float16", target, fallback=theirs)
    assert kernel is not None, why
    ours = tvm.compile(tvm.IRModule({"main": kernel.func}), target=kernel.func.attrs["target"])["main"]
    tvm_func = tvm.compile(tvm.IRModule({"main": theirs}), target=target)["main"]
    q_lens, kv_lens = {"ragged": ([300, 7], [300, 7]), "prefill": ([70, 5], [300, 40]),
                       "decode": ([1, 1, 1], [5, 400, 1000])}[kind]
    at = OUTPUT_AT[kind]
    runs = []
    for func in (ours, tvm_func):
        args, reference, causal = arguments(kind, q_lens, kv_lens, heads_q, heads_kv, head_dim, tvm.cuda(0), seed=5)
        rotary = at + 2 if kind == "decode" else at + 3
        args[rotary] = 1
        positions = [a for a in args[:at] if isinstance(a, tvm.runtime.Tensor) and a.dtype == "int32"]
        for p in positions[-2:]:  # the RoPE positions: not 0, where rotation changes the scores
            p.copyfrom(np.arange(3, 3 + p.shape[0], dtype="int32"))
        func(*args)
        runs.append((args[at].numpy(), args[at + 1].numpy()))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    np.testing.assert_array_equal(runs[0][1], runs[1][1])
    assert np.abs(runs[0][0] - expected(q_lens, reference, causal, args[-1])[0]).max() > 1e-2


@pytest.mark.parametrize("kind, q_lens, kv_lens", [
    ("ragged", [300, 7], [300, 7]), ("prefill", [70, 5], [300, 40]), ("prefill_window", [70, 5], [300, 40]),
    ("decode", [1] * 3, [5, 400, 1000]), ("decode_window", [1] * 3, [5, 400, 1000])])
def test_rope_inside_attention_rotates_on_the_gpu(kind, q_lens, kv_lens):
    """Built for RoPE inside attention with TVM's kernel's rotation, the fast families'
    kernels rotate query ``t`` by ``q_rope_position[t]`` and key ``j`` of sequence ``b``
    by ``k_rope_pos_offset[b] + j``: numpy's attention over numpy's rotated Q and K, and
    TVM's kernel where a row sees keys."""
    target = tvm.target.Target.from_device(tvm.cuda(0))
    heads_q, heads_kv, head_dim = 32, 8, 128
    theirs = tvm_kernel(kind, heads_q, heads_kv, head_dim, target)
    kernel, why = cache_kernel(kind, heads_q, heads_kv, head_dim, "float16", target, fallback=theirs,
                               rotate_inside=True)
    assert kernel is not None, why
    funcs = [tvm.compile(tvm.IRModule({"main": f}), target=t)["main"]
             for f, t in ((kernel.func, kernel.func.attrs["target"]), (theirs, target))]
    outputs, (out, lse) = rope_inside_runs(kind, funcs, q_lens, kv_lens, heads_q, heads_kv, head_dim, tvm.cuda(0),
                                           seed=5)
    np.testing.assert_allclose(outputs[0][0], out, atol=5e-3, rtol=5e-3)
    np.testing.assert_allclose(outputs[0][1], lse, atol=2e-3, rtol=1e-3)
    seen = lse > -5e4
    np.testing.assert_allclose(outputs[0][0][seen], outputs[1][0][seen], atol=5e-3, rtol=5e-3)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_ragged_kernel_for_both_rotary_modes(head_dim, monkeypatch):
    """The ragged prefill built for both ``rotary_mode`` values (a cache whose
    sliding-window support the runtime decides) rotates where 1 and not where 0, each
    by the library's kernel (TVM's, the fallback, here computes nothing)."""
    from tvm_cascade.library import kv_cache, rope_inside  # pylint: disable=import-outside-toplevel

    target = tvm.target.Target.from_device(tvm.cuda(0))
    theirs = tvm_kernel("ragged", 32, 8, head_dim, target)
    monkeypatch.setattr(kv_cache, "rotation_of", lambda fallback: rope_inside.rotation_of(theirs))
    kernel, why = cache_kernel("ragged", 32, 8, head_dim, "float16", target, rotate_inside=True, unrotated_too=True,
                               fallback=theirs.with_body(tvm.tirx.Evaluate(0)))
    assert kernel is not None, why
    func = tvm.compile(tvm.IRModule({"main": kernel.func}), target=kernel.func.attrs["target"])["main"]
    for (out, lse), (want, want_lse) in both_modes_runs("ragged", func, [300, 7], [300, 7], 32, 8, head_dim,
                                                        tvm.cuda(0), seed=6):
        np.testing.assert_allclose(out, want, atol=5e-3, rtol=5e-3)
        np.testing.assert_allclose(lse, want_lse, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("heads", [(32, 8), (16, 16)], ids=["gqa4", "mha"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_sliding_window_prefill_matches_numpy(heads, head_dim):
    """The warp-specialised sliding-window paged prefill over a window starting inside
    a page: with ``causal=0`` every kept key (sinks too), with ``causal=1`` the last
    ``W - 1 - i`` of a sliding layer's for new token ``i`` (rows past them: zeros, lse
    -5e4)."""
    target = tvm.target.Target.from_device(tvm.cuda(0))
    window = 300
    kernel, why = cache_kernel("prefill_window", *heads, head_dim, "float16", target, window=window)
    assert kernel is not None, why
    if int(str(target.arch)[3:5]) == 90:
        assert kernel.family.name == "warp_specialized_prefill"
    func = tvm.compile(tvm.IRModule({"main": kernel.func}), target=kernel.func.attrs["target"])["main"]
    at = OUTPUT_AT["prefill_window"]
    q_lens, kv_lens = [200, 3, 64, 400, 1], [299, 17, 0, 300, 1000]
    for causal in (0, 1):
        args, reference, _ = arguments("prefill_window", q_lens, kv_lens, *heads, head_dim, tvm.cuda(0), seed=7,
                                       sinks=not causal)
        args[at + 2] = causal
        func(*args)
        out, lse = expected(q_lens, reference, False, args[-1], window=window * causal)
        np.testing.assert_allclose(args[at].numpy().astype("float64"), out, atol=5e-3, rtol=5e-3)
        np.testing.assert_allclose(args[at + 1].numpy(), lse, atol=2e-3, rtol=1e-3)
