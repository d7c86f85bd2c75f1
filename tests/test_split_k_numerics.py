"""Numerics of ``Schedule.split_k_update`` (FlashDecoding form; CPU, LLVM target).

Every numerics test splits a cascaded reduction into chunks with ``split_k_update``
and compares the result against

* the float64 numpy reference in :mod:`tvm_cascade.ops.reference`, and
* the *unfused* TVM kernel built from the same PrimFunc (compiled once per
  configuration and cached, see :func:`_unfused`).

Each fused kernel runs twice: as built (``tt.run_prim_func(sch.mod["main"], ...)``)
and *poisoned* -- every buffer the function allocates at its root (``*_partial``,
``exp``, ``max``, ...) is turned into an extra parameter filled with NaN (see
:func:`_run_poisoned`).  A correct kernel never reads an intermediate element it
did not write, so the poisoned run must match too; it makes reads of
uninitialised memory fail deterministically instead of depending on whatever the
allocator returns.

Chunking: ``sch.split(j, [chunks, None])`` gives ``chunk = ceil(n / chunks)``;
the last chunk is short when ``chunks`` does not divide ``n`` and the trailing
chunks are *empty* when ``(chunks - 1) * chunk >= n`` (e.g. n=33, 8 chunks:
chunk 5, chunk 7 would cover keys 35..39).  The grids use non-empty chunkings and
the empty ones are covered by dedicated tests.

Run with ``PYTHONPATH=python python -m pytest tests/test_split_k_numerics.py -q``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import zlib

import numpy as np
import pytest
import tvm
from hypothesis import given, settings
from hypothesis import strategies as st

import tvm_cascade  # noqa: F401  (installs Schedule.split_k_update)
from ahead import in_a_process_ahead
from tvm_cascade import ops
from tvm_cascade import trace as ctrace
from tvm_cascade.ops import reference as R
from tvm_cascade.ops import testing as tt

from numerics import (
    DTYPES,
    EPS32,
    PROPERTY_SETTINGS,
    TOL,
    VARIANT_NAMES,
    WIN0,
    assert_well_formed as _assert_well_formed,
    attention_unfused as _attention_unfused,
    large_logit_tol as _large_logit_tol,
    loop_names as _loop_names,
    mean_v as _mean_v,
    unfused as _unfused,
    check_close as _check_close,
)

# fused / unfused kernel vs the float64 reference
# fused vs unfused TVM kernel: same fp32 accumulation, different summation order
# (fp16 outputs may differ by one fp16 ulp after the final cast)

WIN4 = ops.AttentionVariant("win4", causal=True, window=4)  # only the last 4 keys (decode)

ATTENTION_CHAIN = ("max", "sum", "pv")
PRODUCER = {
    "logsumexp": ("max", "sum"),
    "cross_entropy": ("max", "sum"),
    "absmax_quant_gemm": ("absmax", "gemm"),
    "rmsnorm_gemm": ("sumsq", "gemm"),
}

# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def chunk_size(n: int, chunks: int) -> int:
    return -(-n // chunks)


def has_empty_chunk(n: int, chunks: int) -> bool:
    """``split(j, [chunks, None])`` of a length-``n`` loop leaves trailing chunks empty."""
    return (chunks - 1) * chunk_size(n, chunks) >= n


def _is_under(sch, block, loop_rv) -> bool:
    target = sch.get(loop_rv)
    return any(sch.get(l).same_as(target) for l in sch.get_loops(sch.get_sblock(block)))


def _root_allocs(func):
    return {b.name: b for b in func.body.block.alloc_buffers}


def _assert_split_k_structure(sch, j0, chain, chunks):
    """``<name>_partial`` run under the chunk loop writing ``X_partial[chunks, ...]``;
    ``<name>`` is a global combine after the nest, reducing over a ``chunk`` loop."""
    allocs = _root_allocs(sch.mod["main"])
    for name in chain:
        assert _is_under(sch, f"{name}_partial", j0), (name, _loop_names(sch, f"{name}_partial"))
        assert not _is_under(sch, name, j0), (name, _loop_names(sch, name))
        loops = sch.get_loops(sch.get_sblock(name))
        last = sch.get(loops[-1])
        assert last.loop_var.name == "chunk" and int(last.extent) == chunks, _loop_names(sch, name)
        block = sch.get(sch.get_sblock(f"{name}_partial"))
        partial = block.writes[0].source
        assert partial.name.endswith("_partial") and partial.name in allocs
        assert int(partial.shape[0]) == chunks
    _assert_well_formed(sch.mod)


def split_k(func, chunks, chain, first=None, debug_mask=0):
    """Split the key loop of ``first`` (default ``chain[0]``) into ``[chunks, None]`` and
    split_k_update every block of ``chain`` in order.  Returns (schedule, chunk loop)."""
    sch = tvm.s_tir.Schedule(func, debug_mask=debug_mask)
    j = sch.get_loops(sch.get_sblock(first or chain[0]))[-1]
    j0, _ = sch.split(j, [chunks, None])
    for name in chain:
        sch.split_k_update(sch.get_sblock(name), j0)
    _assert_split_k_structure(sch, j0, chain, chunks)
    return sch, j0


def _expose_allocations(func):
    """``func`` with every buffer allocated by its root block appended to the
    parameters (so the caller chooses its initial contents)."""
    realize = func.body
    root = realize.block
    bufs = list(root.alloc_buffers)
    new_root = tvm.s_tir.stmt.SBlock(
        root.iter_vars, root.reads, root.writes, root.name_hint, root.body, root.init,
        [], root.match_buffers, root.annotations,
    )
    body = tvm.s_tir.stmt.SBlockRealize(realize.iter_values, realize.predicate, new_root)
    return tvm.tirx.PrimFunc(list(func.params) + bufs, body, func.ret_type, func.attrs), bufs


def _run_poisoned(func, inputs_np, fill=np.nan):
    """Run ``func`` with its root allocations pre-filled with ``fill`` (NaN)."""
    exposed, bufs = _expose_allocations(func)
    exe = tt.compile_prim_func(exposed)
    dev = tvm.cpu()
    params = list(func.params)
    args = [tvm.runtime.tensor(np.ascontiguousarray(a), dev) for a in inputs_np]
    outs = []
    for buf in params[len(inputs_np):]:
        shape = tuple(int(x) for x in buf.shape)
        outs.append(tvm.runtime.tensor(np.zeros(shape, dtype=tt.np_dtype(buf.dtype)), dev))
    poison = []
    for buf in bufs:
        dt = tt.np_dtype(buf.dtype)
        value = fill if np.issubdtype(dt, np.floating) else -12345
        poison.append(tvm.runtime.tensor(np.full([int(x) for x in buf.shape], value, dtype=dt), dev))
    exe["main"](*args, *outs, *poison)
    return [o.numpy() for o in outs]


def _run_both(func, inputs):
    """(poisoned outputs, plain outputs) of the fused ``func``; poisoned first so an
    uninitialised read fails deterministically."""
    return _run_poisoned(func, inputs), tt.run_prim_func(func, inputs)


def check_attention(
    shape,
    variant="causal",
    dtype="float32",
    chunks=8,
    nb=False,
    seed=0,
    magnitude=3.0,
    inputs=None,
    tol=None,
    tol_unfused=None,
    schedule_fn=None,
    debug_mask=0,
):
    """split_k_update max, sum, pv; run; compare with the float64 reference and the
    unfused kernel.  Returns (schedule, output, reference)."""
    func, exe = _attention_unfused(shape, variant, dtype, nb)
    sch, j0 = split_k(func, chunks, ATTENTION_CHAIN, debug_mask=debug_mask)
    if nb:
        assert _is_under(sch, "p", j0)
    assert _is_under(sch, "exp", j0)
    if schedule_fn is not None:
        sch = schedule_fn(sch) or sch
    if inputs is None:
        inputs = tt.random_attention_inputs(*shape, dtype=dtype, seed=seed, magnitude=magnitude)
    q, k, v = inputs
    expected = R.attention_ref(q, k, v, variant=variant, normalize_before_pv=nb)
    (out_unfused,) = tt.run_compiled(exe, func, [q, k, v])
    (poisoned,), (out,) = _run_both(sch.mod["main"], [q, k, v])
    assert out.dtype == np.dtype(dtype)
    _check_close(poisoned, expected, out_unfused, dtype, tol, tol_unfused, what="fused (poisoned)")
    _check_close(out, expected, out_unfused, dtype, tol, tol_unfused)
    return sch, out, expected


# ---------------------------------------------------------------------------
# 1. attention: variants x decode/prefill x dtype x shapes
# ---------------------------------------------------------------------------

# (batch, heads_q, heads_kv, seq_q, seq_kv, head_dim), chunks -- none has an empty chunk
DECODE = [
    ((2, 8, 2, 1, 37, 64), 8),  # batch 2, GQA 4, D=64; chunk 5, last chunk 2 keys
    ((1, 8, 1, 1, 40, 128), 8),  # MQA 8, D=128; divides
    ((2, 8, 1, 1, 45, 16), 4),  # batch 2, MQA 8; chunk 12, last chunk 9
    ((1, 16, 2, 1, 64, 64), 5),  # GQA 8; chunk 13, last chunk 12
    ((2, 4, 4, 1, 50, 32), 7),  # batch 2, MHA; chunk 8, last chunk 2
]
PREFILL = [
    ((2, 8, 2, 4, 40, 64), 8),  # batch 2, GQA 4, D=64; divides
    ((1, 8, 1, 4, 57, 128), 8),  # MQA 8, D=128; chunk 8, last chunk 1 key
    ((2, 4, 1, 4, 41, 32), 6),  # batch 2, MQA 4; chunk 7, last chunk 6
    ((1, 16, 2, 4, 64, 16), 7),  # GQA 8; chunk 10, last chunk 4
    ((1, 8, 2, 4, 48, 64), 16),  # GQA 4; chunk 3, divides
]


def _grid():
    """5 variants x {decode, prefill} x {fp32, fp16} = 20 compiled configurations; the
    shape rotates so every shape is used with both dtypes, ``normalize_before_pv`` on a
    third of them."""
    cases = []
    for vi, variant in enumerate(VARIANT_NAMES):
        for pi, (phase, shapes) in enumerate((("decode", DECODE), ("prefill", PREFILL))):
            for di, dtype in enumerate(DTYPES):
                shape, chunks = shapes[(vi + 2 * di) % len(shapes)]
                nb = (vi + pi + di) % 3 == 0
                cases.append(
                    pytest.param(
                        variant, shape, chunks, dtype, nb,
                        id=f"{variant}-{phase}-{dtype}-{'x'.join(map(str, shape))}-c{chunks}{'-nb' if nb else ''}",
                    )
                )
    return cases


@pytest.mark.parametrize("variant,shape,chunks,dtype,nb", _grid())
@in_a_process_ahead
def test_attention_grid(variant, shape, chunks, dtype, nb):
    check_attention(
        shape, variant=variant, dtype=dtype, chunks=chunks, nb=nb,
        seed=zlib.crc32(repr((variant, shape, dtype)).encode()) % 1000,
    )


def test_grid_covers_every_axis():
    cases = [p.values for p in _grid()]
    shapes = {c[1] for c in cases}
    assert shapes == {s for s, _ in DECODE + PREFILL}
    assert {c[0] for c in cases} == set(VARIANT_NAMES)
    assert {(c[3], c[4]) for c in cases} == {(d, nb) for d in DTYPES for nb in (False, True)}
    assert {s[3] for s in shapes} == {1, 4} and all(40 <= s[4] <= 64 for s in shapes if s[3] == 4)
    assert {s[5] for s in shapes} >= {64, 128}
    assert {s[1] // s[2] for s in shapes} >= {4, 8}
    assert any(s[2] == 1 for s in shapes) and any(s[0] == 2 for s in shapes)
    chunkings = [(s[4], c) for s, c in DECODE + PREFILL]
    assert any(n % c == 0 for n, c in chunkings) and any(n % c for n, c in chunkings)
    assert not any(has_empty_chunk(n, c) for n, c in chunkings)  # those are below
    assert len(cases) <= 30


# Empty trailing chunks (see module docstring).  Deterministic failure through the
# poisoned run; the plain run reads whatever the allocator returns.
EMPTY_CASES = [
    # shape, chunks, variant, dtype, nb
    ((2, 8, 2, 1, 33, 64), 8, "causal", "float16", False),  # chunk 5: chunk 7 = keys 35..39
    ((1, 8, 1, 1, 33, 128), 8, "global", "float32", True),
    ((1, 4, 1, 4, 49, 32), 12, "alibi", "float32", False),  # chunk 5: chunks 10, 11 empty
    ((2, 4, 4, 1, 50, 32), 16, "sliding_window", "float16", True),  # chunk 4: chunks 13..15
]


@pytest.mark.parametrize(
    "shape,chunks,variant,dtype,nb", EMPTY_CASES,
    ids=[f"{v}-{d}-{'x'.join(map(str, s))}-c{c}{'-nb' if nb else ''}" for s, c, v, d, nb in EMPTY_CASES],
)
def test_attention_empty_trailing_chunks(shape, chunks, variant, dtype, nb):
    assert has_empty_chunk(shape[4], chunks)
    check_attention(shape, variant=variant, dtype=dtype, chunks=chunks, nb=nb, seed=3)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_rows_merged_by_layout_rewrites_with_one_kv_head(dtype):
    """split_k_update after TVM's own layout rewrites: the chain's blocks and buffers
    indexed (batch, K/V head, row = query * group + head), as the decode schedule packs
    query rows for tensor cores. With one K/V head TVM simplifies that axis's index to
    0 in the spatial blocks' stores, which split_k_update must still see through; the
    result matches the float64 reference."""
    shape, group = (1, 4, 1, 2, 37, 16), 4
    func, exe = _attention_unfused(shape, "causal", dtype, False)
    sch = tvm.s_tir.Schedule(func)

    def merged(b, h, i, *rest):
        return (b, h // group, i * group + h % group, *rest)

    chain = [sch.get_sblock(name) for name in ("qk", "score", "max", "exp", "sum", "pv")]
    for block in chain:
        ndim = len(sch.get(block).iter_vars)
        sch.transform_block_layout(block, tvm.tirx.IndexMap.from_func(merged, ndim=ndim, index_dtype="int32"))
    for block in chain:
        ndim = len(sch.get(block).writes[0].region)
        sch.transform_layout(block, ("write", 0), tvm.tirx.IndexMap.from_func(merged, ndim=ndim, index_dtype="int32"))
    assert "exp[v0, 0, v2, v3]" in sch.mod["main"].script()
    j0, _ = sch.split(sch.get_loops(sch.get_sblock("max"))[-1], [4, None])
    for name in ATTENTION_CHAIN:
        sch.split_k_update(sch.get_sblock(name), j0)
    q, k, v = tt.random_attention_inputs(*shape, dtype=dtype, seed=5, magnitude=3.0)
    expected = R.attention_ref(q, k, v, variant="causal")
    (out_unfused,) = tt.run_compiled(exe, func, [q, k, v])
    (poisoned,), (out,) = _run_both(sch.mod["main"], [q, k, v])
    _check_close(poisoned, expected, out_unfused, dtype, None, None, what="fused (poisoned)")
    _check_close(out, expected, out_unfused, dtype, None, None)


def test_empty_chunk_minimal_reproducer():
    """logsumexp over 5 columns in 4 chunks: chunk 2, chunk 3 covers columns 6..7."""
    func = ops.logsumexp(1, 5)
    sch, _ = split_k(func, 4, ("max", "sum"))
    x = np.random.default_rng(0).standard_normal((1, 5)).astype("float32")
    (out,) = _run_poisoned(sch.mod["main"], [x])
    np.testing.assert_allclose(out, R.logsumexp_ref(x), rtol=1e-5)


def test_empty_chunk_partials_hold_the_identity():
    """An empty chunk folds nothing: its partials hold the reductions' identities (every
    position of a ragged last chunk runs, folding nothing past the axis), the combines
    skip that chunk, and the result is right."""
    func = ops.logsumexp(1, 5)
    sch, _ = split_k(func, 4, ("max", "sum"))
    exposed, bufs = _expose_allocations(sch.mod["main"])
    exe = tt.compile_prim_func(exposed)
    dev = tvm.cpu()
    x = np.random.default_rng(0).standard_normal((1, 5)).astype("float32")
    out = tvm.runtime.tensor(np.zeros(1, "float32"), dev)
    poison = {b.name: tvm.runtime.tensor(np.full([int(s) for s in b.shape], np.nan, "float32"), dev) for b in bufs}
    exe["main"](tvm.runtime.tensor(x, dev), out, *poison.values())
    assert poison["max_partial"].numpy()[3, 0] == np.finfo("float32").min
    assert poison["sum_partial"].numpy()[3, 0] == 0
    np.testing.assert_allclose(out.numpy(), R.logsumexp_ref(x), rtol=1e-5)


# ---------------------------------------------------------------------------
# 2. fully masked chunks and rows
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nb", [False, True], ids=["pv_then_div", "nb"])
def test_sliding_window_decode_masks_whole_chunks(dtype, nb):
    """window=4, SKV=40, 8 chunks of 5: chunks 0..6 are fully masked (their partial max
    is the lowest fp32, the repair factor exp(m_c - m) must drop them)."""
    shape = (2, 4, 1, 1, 40, 16)
    _, out, expected = check_attention(shape, variant=WIN4, dtype=dtype, chunks=8, nb=nb, seed=21)
    q, k, v = tt.random_attention_inputs(*shape, dtype=dtype, seed=21, magnitude=3.0)
    assert not np.allclose(expected, _mean_v(v, shape), atol=1e-2)  # not the all-masked answer


@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_prefill_masks_whole_chunks(dtype):
    """Causal prefill with seq_q=12 > seq_kv=10 (aligned to the end), 5 chunks of 2:
    queries 0, 1 see no key at all (mean of V) and the early queries see none of the
    trailing chunks (fully masked chunks next to visible ones)."""
    shape = (1, 4, 2, 12, 10, 16)
    q, k, v = tt.random_attention_inputs(*shape, dtype=dtype, seed=8, magnitude=3)
    _, out, _ = check_attention(shape, variant="causal", dtype=dtype, chunks=5, inputs=(q, k, v))
    hidden = shape[3] - shape[4]
    np.testing.assert_allclose(out[:, :, :hidden].astype(np.float64), _mean_v(v, shape)[:, :, :hidden], **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape,chunks", [((1, 4, 2, 4, 40, 16), 8), ((2, 4, 1, 1, 37, 16), 8)], ids=["prefill", "decode"]
)
@pytest.mark.parametrize("nb", [False, True], ids=["pv_then_div", "nb"])
@in_a_process_ahead
def test_all_keys_masked_gives_mean_of_v(shape, chunks, dtype, nb):
    """window=0: every key of every row is masked (score = lowest finite fp32); every
    chunk is fully masked; the output is finite and equals the mean of V."""
    q, k, v = tt.random_attention_inputs(*shape, dtype=dtype, seed=5, magnitude=3)
    _, out, expected = check_attention(shape, variant=WIN0, dtype=dtype, chunks=chunks, nb=nb, inputs=(q, k, v))
    np.testing.assert_allclose(expected, _mean_v(v, shape), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(out.astype(np.float64), _mean_v(v, shape), **TOL[dtype])


# ---------------------------------------------------------------------------
# 3. logits around +-1e4
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", ["global", "causal"])
def test_large_random_logits(dtype, variant):
    """magnitude 60 with D=16: |scores| reach beyond 1e4."""
    shape = (1, 2, 1, 4, 40, 16)
    q, k, v = tt.random_attention_inputs(*shape, dtype=dtype, seed=1, magnitude=60.0)
    s = np.einsum("bhid,bhjd->bhij", q.astype(np.float64), np.repeat(k.astype(np.float64), 2, axis=1)) / 4
    assert np.abs(s).max() > 1e4 and s.min() < -1e4
    check_attention(
        shape, variant=variant, dtype=dtype, chunks=6, inputs=(q, k, v),
        tol=_large_logit_tol(np.abs(s).max(), v), tol_unfused=_large_logit_tol(np.abs(s).max(), v),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pattern", ["plus", "minus", "minus_then_plus", "plus_then_minus", "alternate"])
def test_logits_offset_1e4(dtype, pattern):
    """Scores = +-1e4 + O(1) noise (q[..., 0] = 200, k[..., 0] = +-200, scale 1/4):
    a naive exp overflows (+1e4) or underflows to 0/0 (-1e4).  ``minus_then_plus``
    gives chunks whose partial max is 2e4 below the global one (factor exp(-2e4) == 0)."""
    shape = (1, 2, 1, 1, 37, 16)
    skv = shape[4]
    q, k, v = tt.random_attention_inputs(*shape, dtype=dtype, seed=2, magnitude=1.0)
    j = np.arange(skv)
    sign = {
        "plus": np.ones(skv),
        "minus": -np.ones(skv),
        "minus_then_plus": np.where(j < 30, -1.0, 1.0),
        "plus_then_minus": np.where(j < 7, 1.0, -1.0),
        "alternate": np.where(j % 2 == 0, -1.0, 1.0),
    }[pattern]
    q[..., 0] = 200
    k[..., 0] = (200 * sign)[None, None, :]
    tol = _large_logit_tol(1e4 + 100, v)
    _, out, expected = check_attention(
        shape, variant="causal", dtype=dtype, chunks=8, inputs=(q, k, v), tol=tol, tol_unfused=tol
    )
    assert np.abs(expected).max() > 0.05  # not trivially zero


# ---------------------------------------------------------------------------
# 4. non-attention cascades
# ---------------------------------------------------------------------------


def _reference(builder, inputs):
    if builder == "logsumexp":
        return R.logsumexp_ref(inputs[0])
    if builder == "cross_entropy":
        return R.cross_entropy_ref(inputs[0], inputs[1])
    if builder == "absmax_quant_gemm":
        return R.absmax_quant_gemm_ref(*inputs)
    if builder == "rmsnorm_gemm":
        return R.rmsnorm_gemm_ref(*inputs)
    raise ValueError(builder)  # pragma: no cover


def _run_cascade(builder, args, kwargs, chunks, inputs):
    """(poisoned fused output, fused output, unfused output, reference)."""
    func, exe = _unfused(builder, tuple(args), tuple(kwargs))
    sch, j0 = split_k(func, chunks, PRODUCER[builder])
    (out_unfused,) = tt.run_compiled(exe, func, inputs)
    (poisoned,), (out,) = _run_both(sch.mod["main"], inputs)
    return poisoned, out, out_unfused, _reference(builder, inputs)


def _cascade_inputs(builder, dims, dtype, rng, magnitude=3.0):
    if builder in ("logsumexp", "cross_entropy"):
        rows, n = dims
        x = (rng.standard_normal((rows, n)) * magnitude).astype(dtype)
        return [x] if builder == "logsumexp" else [x, rng.integers(0, n, rows).astype("int32")]
    M, N, K = dims
    x = rng.standard_normal((M, K)).astype(dtype)
    w = rng.standard_normal((K, N)).astype(dtype)
    if builder == "absmax_quant_gemm":
        return [x, w]
    return [x, rng.standard_normal((K,)).astype(dtype), w]


CASCADE_CASES = [
    # builder, (rows, n) or (M, N, K), chunks
    ("logsumexp", (5, 37), 8),  # chunk 5, last 2
    ("logsumexp", (4, 64), 8),  # divides
    ("cross_entropy", (5, 37), 6),  # chunk 7, last 2
    ("cross_entropy", (3, 48), 4),  # divides
    ("absmax_quant_gemm", (5, 6, 37), 8),
    ("absmax_quant_gemm", (4, 8, 32), 4),
    ("rmsnorm_gemm", (5, 6, 37), 5),  # chunk 8, last 5
    ("rmsnorm_gemm", (4, 8, 33), 3),  # divides
]


def _cascade_params():
    return [
        pytest.param(
            b, d, c, id=f"{b}-{'x'.join(map(str, d))}-c{c}",
        )
        for b, d, c in CASCADE_CASES
    ]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("builder,dims,chunks", _cascade_params())
def test_cascades(builder, dims, chunks, dtype):
    assert not has_empty_chunk(dims[-1] if len(dims) == 2 else dims[2], chunks)
    rng = np.random.default_rng(sum(dims) + chunks)
    inputs = _cascade_inputs(builder, dims, dtype, rng)
    poisoned, out, out_unfused, expected = _run_cascade(builder, dims, (("dtype", dtype),), chunks, inputs)
    # outputs of the GEMMs are O(sqrt(K)) and cast to dtype
    gemm = builder in ("absmax_quant_gemm", "rmsnorm_gemm")
    tol = dict(rtol=1e-2, atol=3e-2) if gemm and dtype == "float16" else TOL[dtype]
    _check_close(poisoned, expected, out_unfused, dtype, tol=tol, tol_unfused=tol, what="fused (poisoned)")
    _check_close(out, expected, out_unfused, dtype, tol=tol, tol_unfused=tol)


def test_cascade_structure_spatial_block_between():
    """absmax_quant_gemm's per-row ``scale`` sits between absmax and gemm: it moves under
    the chunk loop and a ``scale_complete`` copy stays outside for ``out``."""
    func = ops.absmax_quant_gemm(4, 8, 32)
    sch, j0 = split_k(func, 4, ("absmax", "gemm"))
    assert _is_under(sch, "scale", j0)
    assert not _is_under(sch, "scale_complete", j0)
    assert {r.source.name for r in sch.get(sch.get_sblock("scale_complete")).reads} == {"absmax"}


@pytest.mark.parametrize("builder,block,producer", [("absmax_quant_gemm", "scale", "absmax"), ("rmsnorm_gemm", "rstd", "sumsq")])
def test_moved_per_row_block_reads_chunk_partial(builder, block, producer):
    """The per-row block moved under the chunk loop must read its chunk's partial
    (``<producer>_partial[c, i]``), never the global buffer written after the nest."""
    func = getattr(ops, builder)(4, 8, 32)
    sch, j0 = split_k(func, 4, PRODUCER[builder])
    assert _is_under(sch, block, j0)
    reads = {r.source.name for r in sch.get(sch.get_sblock(block)).reads}
    assert f"{producer}_partial" in reads and producer not in reads, reads


@pytest.mark.parametrize("builder", ["absmax_quant_gemm", "rmsnorm_gemm"])
def test_gemm_cascades_zero_chunks_and_zero_row(builder):
    """The first two chunks of X are zero (chunk absmax 0 -> scale fp8_max/eps, chunk
    rstd 1/sqrt(eps)) and one row is all zero."""
    M, N, K, chunks = 5, 6, 37, 8
    rng = np.random.default_rng(12)
    inputs = _cascade_inputs(builder, (M, N, K), "float32", rng)
    inputs[0][:, :10] = 0
    inputs[0][-1, :] = 0
    poisoned, out, out_unfused, expected = _run_cascade(builder, (M, N, K), (), chunks, inputs)
    _check_close(poisoned, expected, out_unfused, "float32", what="fused (poisoned)")
    _check_close(out, expected, out_unfused, "float32")
    assert np.all(out[-1] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pattern", ["plus", "minus", "mixed"])
@pytest.mark.parametrize("builder", ["logsumexp", "cross_entropy"])
def test_logsumexp_large_logits(builder, dtype, pattern):
    rows, n, chunks = 6, 45, 8  # chunk 6, last chunk 3
    rng = np.random.default_rng(3)
    x = rng.standard_normal((rows, n)) * 3
    if pattern == "plus":
        x += 1e4
    elif pattern == "minus":
        x -= 1e4
    else:  # the first chunks at -1e4, the last chunk at +1e4
        x += np.where(np.arange(n) < 42, -1e4, 1e4)[None, :]
    x = x.astype(dtype)
    inputs = [x]
    if builder == "cross_entropy":
        inputs.append(rng.integers(0, n, rows).astype("int32"))
    poisoned, out, out_unfused, expected = _run_cascade(builder, (rows, n), (("dtype", dtype),), chunks, inputs)
    # relative: |out| ~ 1e4 and fp32 carries ~1e-7 relative precision
    tol = dict(rtol=1e-6, atol=2e-3) if builder == "logsumexp" else dict(rtol=0, atol=8 * EPS32 * 1e4)
    for result in (poisoned, out):
        assert np.all(np.isfinite(result))
        np.testing.assert_allclose(result, expected, **tol)
        np.testing.assert_allclose(result, out_unfused, **tol)


@pytest.mark.parametrize(
    "builder,dims,chunks",
    [("logsumexp", (3, 33), 8), ("cross_entropy", (3, 9), 4), ("absmax_quant_gemm", (3, 4, 33), 8),
     ("rmsnorm_gemm", (3, 4, 10), 8)],
    ids=["logsumexp", "cross_entropy", "absmax_quant_gemm", "rmsnorm_gemm"],
)
def test_cascades_empty_trailing_chunks(builder, dims, chunks):
    assert has_empty_chunk(dims[-1] if len(dims) == 2 else dims[2], chunks)
    inputs = _cascade_inputs(builder, dims, "float32", np.random.default_rng(4))
    poisoned, _, out_unfused, expected = _run_cascade(builder, dims, (), chunks, inputs)
    _check_close(poisoned, expected, out_unfused, "float32", what="fused (poisoned)")


# ---------------------------------------------------------------------------
# 5. property-based tests
# ---------------------------------------------------------------------------


@st.composite
def _chunking(draw, n):
    """A chunk count for a length-``n`` loop without empty chunks (2..n+? capped)."""
    ok = [c for c in range(1, min(n, 16) + 1) if not has_empty_chunk(n, c)]
    return draw(st.sampled_from(ok))


@st.composite
def _lse_case(draw):
    n = draw(st.integers(1, 70))
    rows = draw(st.integers(1, 6))
    chunks = draw(_chunking(n))
    dtype = draw(st.sampled_from(DTYPES))
    builder = draw(st.sampled_from(["logsumexp", "cross_entropy"]))
    magnitude = draw(st.sampled_from([0.1, 3.0, 100.0]))
    seed = draw(st.integers(0, 2**16))
    return builder, rows, n, chunks, dtype, magnitude, seed


@settings(max_examples=12, **PROPERTY_SETTINGS)
@given(_lse_case())
def test_property_logsumexp(case):
    builder, rows, n, chunks, dtype, magnitude, seed = case
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, n)) * magnitude).astype(dtype)
    inputs = [x] if builder == "logsumexp" else [x, rng.integers(0, n, rows).astype("int32")]
    poisoned, out, out_unfused, expected = _run_cascade(builder, (rows, n), (("dtype", dtype),), chunks, inputs)
    tol = dict(rtol=1e-5, atol=1e-5 * max(1.0, magnitude))
    _check_close(poisoned, expected, out_unfused, "float32", tol=tol, tol_unfused=tol, what="fused (poisoned)")
    _check_close(out, expected, out_unfused, "float32", tol=tol, tol_unfused=tol)


ATT_VARIANTS = VARIANT_NAMES + ["win0", "win4"]


@st.composite
def _decode_case(draw):
    heads_kv = draw(st.integers(1, 2))
    group = draw(st.sampled_from([1, 4, 8]))
    batch = draw(st.integers(1, 2))
    seq_kv = draw(st.integers(1, 48))
    head_dim = draw(st.sampled_from([8, 16, 64]))
    chunks = draw(_chunking(seq_kv))
    variant = draw(st.sampled_from(ATT_VARIANTS))
    nb = draw(st.booleans())
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**16))
    return (batch, heads_kv * group, heads_kv, 1, seq_kv, head_dim), chunks, variant, nb, dtype, seed


def _variant(name):
    return {"win0": WIN0, "win4": WIN4}.get(name, name)


@settings(max_examples=12, **PROPERTY_SETTINGS)
@given(_decode_case())
def test_property_attention_decode(case):
    shape, chunks, variant, nb, dtype, seed = case
    check_attention(shape, variant=_variant(variant), dtype=dtype, chunks=chunks, nb=nb, seed=seed)


# Empty chunks over many (n, chunks) pairs: deterministic list rather than a failing
# hypothesis test (a failing property test writes patch files into .hypothesis/).
EMPTY_LSE = [(n, c) for n in (2, 5, 9, 13, 21, 33, 50) for c in range(2, n + 4) if has_empty_chunk(n, c)][::10]


@pytest.mark.parametrize("n,chunks", EMPTY_LSE, ids=[f"n{n}-c{c}" for n, c in EMPTY_LSE])
def test_logsumexp_empty_chunks_sweep(n, chunks):
    x = np.random.default_rng(n * 100 + chunks).standard_normal((2, n)).astype("float32")
    poisoned, _, out_unfused, expected = _run_cascade("logsumexp", (2, n), (), chunks, [x])
    _check_close(poisoned, expected, out_unfused, "float32", what="fused (poisoned)")


# ---------------------------------------------------------------------------
# 6. the chunk loop carries no dependency; the combines schedule on their own
# ---------------------------------------------------------------------------

SCHED_SHAPE = (2, 8, 2, 1, 40, 64)  # decode, GQA 4; 8 chunks of 5 (divides)


def _chunk_loop(sch):
    loops = sch.get_loops(sch.get_sblock("max_partial"))
    return [l for l in loops if sch.get(l).loop_var.name == "rj_0"][0], loops


def test_parallel_chunk_loop():
    """The chunk loop alone, on the schedule split_k_update returned (TVM verifies the
    state after every native primitive with debug_mask='all')."""

    def fn(sch):
        j0, _ = _chunk_loop(sch)
        sch.parallel(j0)
        assert sch.get(j0).kind == tvm.tirx.ForKind.PARALLEL

    check_attention(SCHED_SHAPE, chunks=8, schedule_fn=fn, debug_mask="all")


def test_rolls_within_chunks_that_do_not_divide_the_row():
    """Split-k first, over chunks that do not divide the row (77 positions in 4 chunks
    of 20), then the sum rolled within each chunk: the last chunk's positions past the
    row fold the reducer's identity, so its update stays a sum of its accumulator and one
    term; the chunk loop stays parallelisable (a fresh schedule's analysis) and the
    result is numpy's."""
    from tvm_cascade.algebra.reducers import SUM, match_reducer
    from tvm_cascade.analysis.scope import accumulator_store

    func = ops.logsumexp(3, 77)
    sch = tvm.s_tir.Schedule(func, debug_mask="all")
    sch.compute_inline(sch.get_sblock("exp"))
    chunk = sch.split(sch.get_loops(sch.get_sblock("max"))[-1], [4, None])[0]
    for name in ("max", "sum"):
        sch.split_k_update(sch.get_sblock(name), chunk)
    reducer, _ = match_reducer(accumulator_store(sch.get(sch.get_sblock("sum_partial"))))
    assert reducer is SUM
    tile = sch.split(sch.get_loops(sch.get_sblock("max_partial"))[-1], [None, 8])[0]
    sch.rolling_update(sch.get_sblock("sum_partial"), tile)
    fresh = tvm.s_tir.Schedule(sch.mod)
    fresh.parallel(fresh.get_loops(fresh.get_sblock("max_partial"))[1])
    x = np.random.default_rng(3).standard_normal((3, 77)).astype("float32") * 4
    np.testing.assert_allclose(tt.run_prim_func(fresh.mod["main"], [x])[0], R.logsumexp_ref(x), rtol=1e-5)


def test_debug_mask_verification_after_split_k_update():
    """split_k_update leaves TVM's cached block info (affine binding, region cover, stage
    pipeline) consistent: the next native primitive verifies the whole state."""
    func, _ = _attention_unfused(SCHED_SHAPE, "causal", "float32", False)
    sch = tvm.s_tir.Schedule(func, debug_mask="all")
    j0, _ = sch.split(sch.get_loops(sch.get_sblock("max"))[-1], [8, None])
    for name in ATTENTION_CHAIN:
        sch.split_k_update(sch.get_sblock(name), j0)
        sch.annotate(sch.get_loops(sch.get_sblock("out"))[0], "note", 1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_parallel_fused_rows_and_chunks(dtype):
    """b, h, i and the chunk loop fused into one parallel loop: every (row, chunk) pair
    is an independent task; numerics still match."""

    def fn(sch):
        _, loops = _chunk_loop(sch)
        assert [sch.get(l).loop_var.name for l in loops[:4]] == ["b", "h", "i", "rj_0"]
        sch.parallel(sch.fuse(*loops[:4]))
        assert sch.get(sch.get_loops(sch.get_sblock("pv_partial"))[0]).kind == tvm.tirx.ForKind.PARALLEL

    check_attention(SCHED_SHAPE, dtype=dtype, chunks=8, schedule_fn=fn, debug_mask="all")


def test_parallel_chunk_loop_non_dividing():
    shape = (2, 8, 2, 1, 37, 64)  # 37 keys in 8 chunks of 5

    def fn(sch):
        j0, _ = _chunk_loop(sch)
        sch.parallel(j0)

    check_attention(shape, chunks=8, schedule_fn=fn)


@pytest.mark.parametrize(
    "skv", [40, 37], ids=["divides", "non_dividing"]
)
def test_partial_blocks_have_affine_bindings(skv):
    """TVM's own analysis of the result (fresh schedule): every *_partial block has an
    affine binding -- the precondition of parallel / bind on the chunk loop -- also where
    the chunks do not divide the keys (the last chunk's positions past them run, reads
    clamped, folding nothing)."""
    func, _ = _attention_unfused((1, 2, 1, 1, skv, 16), "causal", "float32", False)
    sch, _ = split_k(func, 8, ATTENTION_CHAIN)
    fresh = tvm.s_tir.Schedule(sch.mod)
    for name in ("max_partial", "exp", "sum_partial", "pv_partial"):
        flags = fresh.state._get_cached_flags(fresh.get_sref(fresh.get_sblock(name)))
        assert flags.affine_binding and flags.region_cover and flags.stage_pipeline, (name, flags)


def test_parallel_chunk_loop_non_dividing_fresh_schedule():
    """Not a stale-state artefact: a fresh Schedule of the result takes it too."""
    func, _ = _attention_unfused((2, 8, 2, 1, 37, 64), "causal", "float32", False)
    sch, _ = split_k(func, 8, ATTENTION_CHAIN)
    fresh = tvm.s_tir.Schedule(sch.mod)
    fresh.parallel(_chunk_loop(fresh)[0])


def _schedule_combines(sch):
    """Fuse the spatial loops of every global combine, split by 4 and parallelise the
    outer part (the reduction over ``chunk`` stays innermost)."""
    for name in ATTENTION_CHAIN:
        loops = sch.get_loops(sch.get_sblock(name))
        assert sch.get(loops[-1]).loop_var.name == "chunk"
        fused = sch.fuse(*loops[:-1])
        outer, _ = sch.split(fused, [None, 4])
        sch.parallel(outer)
    return sch


@pytest.mark.parametrize("nb", [False, True], ids=["pv_then_div", "nb"])
def test_combines_schedule_on_their_own(nb):
    sch, _, _ = check_attention(
        (2, 4, 1, 4, 41, 16), variant="alibi", chunks=6, nb=nb, schedule_fn=_schedule_combines, debug_mask="all"
    )
    for name in ATTENTION_CHAIN:
        assert sch.get(sch.get_loops(sch.get_sblock(name))[0]).kind == tvm.tirx.ForKind.PARALLEL


def test_combine_decompose_reduction_and_reorder():
    def fn(sch):
        loops = sch.get_loops(sch.get_sblock("pv"))
        sch.reorder(loops[-1], loops[-2])  # chunk outside d
        sch.decompose_reduction(sch.get_sblock("pv"), sch.get_loops(sch.get_sblock("pv"))[0])
        sch.unroll(sch.get_loops(sch.get_sblock("pv_update"))[-2])  # the chunk loop
        sch.parallel(sch.get_loops(sch.get_sblock("max"))[1])

    check_attention((1, 4, 2, 1, 37, 16), chunks=8, schedule_fn=fn, debug_mask="all")


def _bind_all_for_cuda(sch, threads=32):
    """blockIdx.x = fused (rows x chunk) loops of the chunk nest; every other root nest
    gets its spatial loops fused and bound to blockIdx.x / threadIdx.x."""
    _, loops = _chunk_loop(sch)
    sch.bind(sch.fuse(*loops[:4]), "blockIdx.x")
    spatial = {"qk": 4, "score": 4, "out": 4, "max": 3, "sum": 3, "pv": 4}
    for name, n in spatial.items():
        fused = sch.fuse(*sch.get_loops(sch.get_sblock(name))[:n])
        bx, tx = sch.split(fused, [None, threads])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
    return sch


def _cuda_source(shape, chunks, dtype="float16"):
    func, _ = _attention_unfused(shape, "causal", dtype, False)
    sch, _ = split_k(func, chunks, ATTENTION_CHAIN)
    sch = _bind_all_for_cuda(sch)
    exe = tvm.compile(sch.mod, target={"kind": "cuda", "arch": "sm_90a"})
    device_mods = [m for m in exe.mod.imports_ if m.kind == "cuda"]
    assert device_mods, [m.kind for m in exe.mod.imports_]
    return device_mods[0].inspect_source("")


def test_bind_chunk_loop_to_blockidx_compiles_for_cuda():
    src = _cuda_source(SCHED_SHAPE, 8)
    kernels = [l for l in src.splitlines() if "__global__" in l and l.rstrip().endswith("{")]
    # qk, score, chunk nest, 3 combines, out
    assert len(kernels) == 7, kernels
    chunk_kernel = [k for k in kernels if "pv_partial" in k and "V_ptr" in k]
    assert len(chunk_kernel) == 1, kernels
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not installed: TVM codegen checked only")
    with tempfile.TemporaryDirectory() as tmp:
        cu = os.path.join(tmp, "k.cu")
        with open(cu, "w") as f:
            f.write(src)
        res = subprocess.run(
            ["nvcc", "-arch=sm_90a", "-cubin", "-o", os.path.join(tmp, "k.cubin"), cu],
            capture_output=True, text=True, timeout=300,
        )
        assert res.returncode == 0, res.stderr[-3000:]


def test_bind_chunk_loop_to_blockidx_non_dividing():
    _cuda_source((2, 8, 2, 1, 37, 64), 8)


# ---------------------------------------------------------------------------
# 7. trace: printing, replay, JSON
# ---------------------------------------------------------------------------


def _traced_schedule(nb=False):
    func, _ = _attention_unfused((1, 4, 1, 4, 41, 16), "causal", "float32", nb)
    sch, _ = split_k(func, 6, ATTENTION_CHAIN)
    return func, sch


@pytest.mark.parametrize("nb", [False, True], ids=["pv_then_div", "nb"])
def test_trace_replay_gives_same_module(nb):
    func, sch = _traced_schedule(nb)
    text = str(sch.trace)
    calls = [l.strip() for l in text.splitlines() if "split_k_update" in l]
    assert len(calls) == 3, text
    assert all(l.startswith("sch.split_k_update(block=") and ", loop=" in l for l in calls), calls
    replay = tvm.s_tir.Schedule(func)
    sch.trace.apply_to_schedule(replay, remove_postproc=False)
    tvm.ir.assert_structural_equal(sch.mod, replay.mod)
    assert "split_k_update" in str(replay.trace)


def test_trace_json_roundtrip():
    func, sch = _traced_schedule()
    js = sch.trace.as_json()
    kinds = [str(inst[0]) for inst in js[0]]
    assert kinds.count("SplitKUpdate") == 3, kinds
    fresh = tvm.s_tir.Schedule(func)
    ctrace.apply_json_to_schedule(js, fresh)
    tvm.ir.assert_structural_equal(sch.mod, fresh.mod)
    # through text JSON too
    plain = json.loads(json.dumps(ctrace.to_plain_json(js)))
    fresh2 = tvm.s_tir.Schedule(func)
    ctrace.apply_json_to_schedule(plain, fresh2)
    tvm.ir.assert_structural_equal(sch.mod, fresh2.mod)
    # and the replayed module computes the same thing
    q, k, v = tt.random_attention_inputs(1, 4, 1, 4, 41, 16, seed=30, magnitude=3)
    (a,) = tt.run_prim_func(sch.mod["main"], [q, k, v])
    (b,) = tt.run_prim_func(fresh2.mod["main"], [q, k, v])
    np.testing.assert_array_equal(a, b)
