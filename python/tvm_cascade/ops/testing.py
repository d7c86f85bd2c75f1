"""Helpers for tests: compile/run a PrimFunc on numpy inputs, random inputs,
block-name inspection."""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np
import tvm


def np_dtype(dtype) -> np.dtype:
    """numpy dtype for a TVM dtype string (``bfloat16`` via ``ml_dtypes``)."""
    name = str(dtype)
    if name == "bfloat16":
        import ml_dtypes  # pylint: disable=import-outside-toplevel

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def compile_prim_func(func: tvm.tirx.PrimFunc, target="llvm"):
    """``tvm.compile`` a single PrimFunc as ``main``; returns the executable."""
    return tvm.compile(tvm.IRModule({"main": func}), target=target)


def run_compiled(exe, func: tvm.tirx.PrimFunc, inputs_np: Sequence, dev=None) -> List[np.ndarray]:
    """Run an executable built from ``func``.  The first ``len(inputs_np)``
    parameters are inputs; the remaining ones are outputs, allocated (zeroed)
    from the function's buffer shapes and dtypes and returned as numpy.

    (In TVM 0.27 ``PrimFunc.params`` are buffer variables carrying ``shape``,
    ``dtype`` and ``name`` directly; there is no ``buffer_map``.)"""
    dev = dev if dev is not None else tvm.cpu()
    params = list(func.params)
    if len(inputs_np) > len(params):
        raise ValueError(f"{len(inputs_np)} inputs given but the function has {len(params)} params")
    args = []
    for buf, arr in zip(params, inputs_np):
        want = np_dtype(buf.dtype)
        arr = np.ascontiguousarray(np.asarray(arr))
        shape = tuple(int(x) for x in buf.shape)
        if arr.shape != shape or arr.dtype != want:
            raise ValueError(
                f"input {buf.name}: expected {shape} {want}, got {arr.shape} {arr.dtype}"
            )
        args.append(tvm.runtime.tensor(arr, dev))
    outputs = []
    for buf in params[len(inputs_np):]:
        shape = tuple(int(x) for x in buf.shape)
        out = tvm.runtime.tensor(np.zeros(shape, dtype=np_dtype(buf.dtype)), dev)
        outputs.append(out)
        args.append(out)
    exe["main"](*args)
    return [o.numpy() for o in outputs]


def run_prim_func(func: tvm.tirx.PrimFunc, inputs_np: Sequence, target="llvm", dev=None) -> List[np.ndarray]:
    """Compile ``func`` for ``target`` and run it; see :func:`run_compiled`."""
    return run_compiled(compile_prim_func(func, target), func, inputs_np, dev)


def block_names(func: tvm.tirx.PrimFunc) -> List[str]:
    """Names of the top-level blocks under the root block, in program order."""
    sch = tvm.s_tir.Schedule(func)
    root = sch.get_sblock("root")
    return [sch.get(b).name_hint for b in sch.get_child_blocks(root)]


def random_attention_inputs(
    batch: int,
    heads_q: int,
    heads_kv: int,
    seq_q: int,
    seq_kv: int,
    head_dim: int,
    dtype: str = "float32",
    seed: int = 0,
    magnitude: float = 1.0,
    rng: Optional[np.random.Generator] = None,
):
    """Standard-normal ``(q, k, v)`` numpy arrays (times ``magnitude`` for q
    and k) in ``dtype``, with the attention layouts
    ``q[b, hq, sq, d]``, ``k, v[b, hkv, skv, d]``."""
    rng = rng if rng is not None else np.random.default_rng(seed)
    dt = np_dtype(dtype)
    q = (rng.standard_normal((batch, heads_q, seq_q, head_dim)) * magnitude).astype(dt)
    k = (rng.standard_normal((batch, heads_kv, seq_kv, head_dim)) * magnitude).astype(dt)
    v = rng.standard_normal((batch, heads_kv, seq_kv, head_dim)).astype(dt)
    return q, k, v


def random_sequences(q_lens, kv_lens, heads_q, heads_kv, head_dim, dtype="float32", rng=None):
    """Per-sequence standard-normal ``(q[sq, hq, d], k[skv, hkv, d], v[skv, hkv, d])``
    numpy arrays in ``dtype``, one triple per pair of lengths."""
    rng = rng if rng is not None else np.random.default_rng(0)
    dt = np_dtype(dtype)
    return [
        tuple(rng.standard_normal((n, h, head_dim)).astype(dt) for n, h in ((sq, heads_q), (skv, heads_kv), (skv, heads_kv)))
        for sq, skv in zip(q_lens, kv_lens)
    ]


def indptr(lengths) -> np.ndarray:
    """int32 offsets ``[0, l0, l0 + l1, ...]`` of consecutive lengths."""
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype("int32")


def pack_ragged(sequences):
    """The ragged layout's ``(q, k, v, q_indptr, kv_indptr)`` of per-sequence arrays."""
    q, k, v = (np.concatenate([s[n] for s in sequences]) for n in range(3))
    return q, k, v, indptr([len(s[0]) for s in sequences]), indptr([len(s[1]) for s in sequences])


def pack_paged(sequences, page_size, spare_pages=3, rng=None):
    """The paged layout's ``(q, pages, q_indptr, page_indptr, page_ids, last_page_len)``
    of per-sequence arrays: each sequence's keys and values in pages of the pool
    ``pages[num_pages, 2, hkv, page_size, d]`` taken in a random order (``spare_pages``
    more than needed, filled with noise), its last page partly filled."""
    rng = rng if rng is not None else np.random.default_rng(0)
    counts = [-(-len(s[1]) // page_size) for s in sequences]
    _, heads_kv, head_dim = sequences[0][1].shape
    dtype = sequences[0][1].dtype
    num_pages = sum(counts) + spare_pages
    pages = rng.standard_normal((num_pages, 2, heads_kv, page_size, head_dim)).astype(dtype)
    order = rng.permutation(num_pages)[: sum(counts)].astype("int32")
    start = 0
    for (_, k, v), count in zip(sequences, counts):
        for p in range(count):
            keys = slice(p * page_size, min((p + 1) * page_size, len(k)))
            n = keys.stop - keys.start
            page = order[start + p]
            pages[page, 0, :, :n] = k[keys].transpose(1, 0, 2)
            pages[page, 1, :, :n] = v[keys].transpose(1, 0, 2)
        start += count
    last = np.array([len(s[1]) - (c - 1) * page_size if c else 0 for s, c in zip(sequences, counts)], "int32")
    q = np.concatenate([s[0] for s in sequences])
    return q, pages, indptr([len(s[0]) for s in sequences]), indptr(counts), order, last
