"""What the split-k decode families share: the scores of a chunk's keys, the keys a
sequence's rows can see, the kernel that combines a row's chunks, and the chunk plan.

A chunk kernel writes, for each query row and chunk of keys, the chunk's partial state:
the max of its scores (log2 units), the sum of their exponentials and the output they
weigh, all taken against that max. :func:`combine_kernel` repairs each chunk's state to
the row's common max and divides: the repair is the factor the algebra derives and
proves for ``ops.attention``'s sum and output
(:func:`~tvm_cascade.schedules.warp_specialized.repair_factor`).

Chunks start at the first key the first query row of a sequence can see (a sliding
window's first; key 0 otherwise), so a window's decode reads the window, not the keys
before it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from tvm import tirx
from tvm.script import tirx as T

from ..cuda import sm_count
from ..ops.flex_attention import NO_KEYS_LSE, variant_te_mods
from ..primitives.ir import maximum, minimum
from ..schedules.warp_specialized import repair_factor
from .spec import CACHE_LAYOUTS

#: Query rows a sequence may have for the split-k decode families to serve it.
QUERIES = 8
LOG2E = math.log2(math.e)
ACC = "float32"
NEG_INF = T.float32("-inf")


def unsupported(spec):
    """Why neither split-k decode family serves ``spec`` (not CUDA, not fp16/bf16), or None."""
    if spec.target_kind != "cuda":
        return "CUDA only"
    if spec.dtype not in ("float16", "bfloat16"):
        return f"{spec.dtype}: fp16 and bf16 only"
    return None


def partial_shape(view, num_chunks, heads_q):
    """The shape of a row's partial max and sum, by (sequence, query row, head, chunk)."""
    return (view.batch, view.rows, heads_q, num_chunks)


def first_key(spec, view, b):
    """The first key any query row of sequence ``b`` sees."""
    window = spec.variant.window
    if window is None:
        return 0
    return T.max(view.key_length(b) - view.query_length(b) - window + 1, 0)


@dataclass(frozen=True)
class Chunking:
    """How a decode kernel splits a sequence's keys: ``param``, the scalar parameter it
    takes (``chunk_keys``, the keys of every chunk; for a cache layout, whose calls pass
    no longest length, ``chunks``, the chunks of every sequence); ``count``, the chunks
    its grid has per sequence; ``keys(b)``, the keys of a chunk of sequence ``b``."""

    param: tirx.Var
    count: object
    keys: Callable


def chunking(spec, view, step: int, least: int) -> Chunking:
    """The chunks of ``spec``'s kernel over ``view`` (see :class:`Chunking`); a cache
    layout's chunks of a sequence hold a multiple of ``step`` keys, at least ``least``."""
    if spec.layout not in CACHE_LAYOUTS:
        chunk_keys = tirx.Var("chunk_keys", "int32")
        return Chunking(chunk_keys, chunk_count(spec, view, chunk_keys), lambda b: chunk_keys)
    chunks = tirx.Var("chunks", "int32")

    def keys(b):
        seen = view.key_length(b)
        if spec.variant.window is not None:
            seen = T.min(seen, spec.variant.window + view.query_length(b) - 1)
        return T.max(least, (seen + chunks * step - 1) // (chunks * step) * step)

    return Chunking(chunks, chunks, keys)


def chunk_count(spec, view, chunk_keys):
    """The chunks of ``chunk_keys`` keys that cover the keys any sequence's rows see."""
    keys = view.keys
    if spec.variant.window is not None:
        keys = T.min(keys, spec.variant.window + view.rows - 1)
    return (keys + chunk_keys - 1) // chunk_keys


def visible_keys(spec, max_q, max_kv):
    """The most keys the rows of a sequence of ``max_q`` queries and ``max_kv`` keys see."""
    window = spec.variant.window
    return max_kv if window is None else minimum(max_kv, window + max_q - 1)


def score_of(spec, view):
    """``score(dot, b, h, qi, j)``: query row ``qi``'s score of key ``j`` (head ``h`` of
    sequence ``b``) from the dot product, scaled, modified by the variant, plus the mask
    tensor's term where the spec has one, and in log2 units, -inf where the key is
    masked or past the sequence's keys."""
    score_mod, mask_mod = variant_te_mods(spec.variant, spec.heads_q, view.query_length, view.key_length, ACC,
                                          query_start=view.query_start)

    def score(dot, b, h, qi, j):
        s = dot * view.scale
        if score_mod is not None:
            s = score_mod(s, b, h, qi, j).astype(ACC)
        if view.mask is not None:
            # (a block's rows past the sequence's queries are computed, not stored: they
            # read the last row's mask rather than past the tensor)
            s = s + view.mask(b, h, T.min(qi, view.query_length(b) - 1), j)
        s = s * T.float32(LOG2E)
        seen = j < view.key_length(b)
        if mask_mod is not None:
            seen = tirx.And(seen, mask_mod(b, h, qi, j))
        return tirx.Select(seen, s, NEG_INF)

    return score


def finite(m):
    """The max the exponentials are taken against: 0 while no key was seen."""
    return tirx.Select(m == NEG_INF, T.float32(0), m)


def partials_store(spec, rows: int, parts: int, threads: int):
    """A macro that stores a chunk's partials from ``parts`` running states of ``rows``
    rows a block merged in shared memory (``merged_m[part, row]``, and ``merged_l`` and
    ``merged_o[part, row, dim]`` already repaired to the rows' common max): row ``r`` is
    the block's row ``first_row + r`` of sequence ``b``'s K/V head ``hk``, stored if it is
    one of the sequence's ``n_rows`` rows (query, head); ``tid`` is the thread of
    ``threads``, ``total`` and ``top`` a local float each."""
    d, group = spec.head_dim, spec.group

    @T.macro
    def store(merged_m, merged_l, merged_o, part_o, part_m, part_l, tid, b, hk, c, first_row, n_rows, total, top):
        for e in T.serial((rows * d + threads - 1) // threads):
            r = (e * threads + tid) // d
            x = (e * threads + tid) % d
            rr = first_row + r
            if r < rows and rr < n_rows:
                total[0] = T.float32(0)
                for w in T.serial(parts):
                    total[0] = total[0] + merged_o[w, r, x]
                part_o[b, rr // group, hk * group + rr % group, c, x] = total[0]
        if tid < rows:
            rr = first_row + tid
            if rr < n_rows:
                top[0] = merged_m[0, tid]
                total[0] = merged_l[0, tid]
                for w in T.serial(1, parts):
                    top[0] = T.max(top[0], merged_m[w, tid])
                    total[0] = total[0] + merged_l[w, tid]
                part_m[b, rr // group, hk * group + rr % group, c] = top[0]
                part_l[b, rr // group, hk * group + rr % group, c] = total[0]

    return store


def combine_kernel(spec, view, chunks: Chunking, out, lse=None, threads=128):
    """A macro ``combine(part_o, part_m, part_l)``: the kernel that combines each row's
    chunks into ``out`` (and its base-2 log-sum-exp into ``lse``, if given, at the
    view's ``lse_index``), one block of ``threads`` per row (sequence, query row,
    head), a thread per output dimension."""
    d, heads_q = spec.head_dim, spec.heads_q
    num_chunks = chunks.count

    @T.macro
    def combine(part_o, part_m, part_l):
        with T.launch_thread("blockIdx.x", view.batch * view.rows * heads_q) as row:
            tx = T.launch_thread("threadIdx.x", threads)
            total_m = T.alloc_local((1,), ACC)
            total_l = T.alloc_local((1,), ACC)
            weight = T.alloc_local((1,), ACC)
            value = T.alloc_local((1,), ACC)
            b = row // (view.rows * heads_q)
            qi = row % (view.rows * heads_q) // heads_q
            h = row % heads_q
            lo = first_key(spec, view, b)
            if qi < view.query_length(b):
                total_m[0] = NEG_INF
                for c in T.serial(num_chunks):
                    total_m[0] = T.max(total_m[0], part_m[b, qi, h, c])
                for e in T.serial((d + threads - 1) // threads):
                    x = e * threads + tx
                    if x < d:
                        total_l[0] = T.float32(0)
                        value[0] = T.float32(0)
                        for c in T.serial(num_chunks):
                            weight[0] = T.if_then_else(
                                lo + c * chunks.keys(b) < view.key_length(b),
                                repair_factor(spec.variant, part_m[b, qi, h, c], finite(total_m[0])),
                                T.float32(0),
                            )
                            total_l[0] = total_l[0] + part_l[b, qi, h, c] * weight[0]
                            value[0] = value[0] + part_o[b, qi, h, c, x] * weight[0]
                        out[view.out_index(b, h, qi, x)] = T.Cast(
                            spec.dtype, T.if_then_else(total_l[0] > T.float32(0), value[0] / total_l[0], T.float32(0))
                        )
                        if lse is not None and x == 0:
                            lse[view.lse_index(b, h, qi)] = T.if_then_else(
                                total_l[0] > T.float32(0), total_m[0] + T.log2(total_l[0]), T.float32(NO_KEYS_LSE)
                            )

    return combine


def plan_chunk_keys(spec, blocks, max_q, max_kv, device, per_sm: int, step: int, least: int, whole_waves: bool):
    """The scalar of :func:`chunking`: keys per chunk (a multiple of ``step``, at least
    ``least``), or a cache layout's chunks per sequence, so that the chunk kernel
    launches about ``per_sm`` of its ``blocks``-per-chunk blocks per SM: at most that
    many if ``whole_waves`` (a family whose ``per_sm`` blocks fit an SM at once: one wave
    rather than one and a fraction), else at least. Never more chunks than needed to
    cover the keys a sequence's rows see. Lengths are ints, or PrimExprs for a plan
    over symbolic shapes (:func:`~tvm_cascade.primitives.ir.maximum`)."""
    sms = sm_count(device)
    blocks = maximum(blocks, 1)
    chunks = maximum(1, per_sm * sms // blocks if whole_waves else -(-per_sm * sms // blocks))
    if spec.layout in CACHE_LAYOUTS:
        return chunks
    keys = maximum(visible_keys(spec, max_q, max_kv), 1)
    return maximum(least, -(-keys // chunks // step) * step)
