"""The tensor-core split-k decode family: a few query rows per sequence over many keys
(FlashDecoding) on ``mma.sync.m16n8k16``, lengths and chunk size at run time, for CUDA
GPUs from sm_80, head dims from 64 to 128 (multiples of 8; between the two, the head
dim 128 kernel with Q's, K's and V's columns past the tensors' read as zeros).

A block takes one chunk of a sequence's keys for up to 16 query rows of one K/V head
(the rows (query, head) of the group's heads, as the M dimension of the products; more
rows take further blocks); its :data:`WARPS` warps take the chunk's steps of
:data:`STEPS` keys (16 or 32: the same K and V bytes at either head dim) in turn, each
loading its next step's keys into registers while it computes this one's
(in a paged layout, with the page-table entries of those keys read a step before
them, so that a load never waits on the read that locates it: one entry a 16-key group
where the group lies in one page, else one a key), with no reduction
across lanes but the row max and sum over the four lanes of a quad:

* scores ``S[row, key] = Q[row, :] · K[key, :]``: 16 x 8 tiles of keys. Lane ``(g,
  q)`` (``g = lane / 4``, ``q = lane % 4``) loads key ``g`` of each tile, a quarter of
  its dims with 128-bit loads, and holds the B fragments of every k-step as they come:
  the sum over the head dim is taken in an order of the dims in which each lane's
  quarter is contiguous, and Q's A fragments, loaded once, follow the same order;
* ``O[row, dim] += P[row, key] · V[key, dim]``: the scores' accumulator fragments are
  the A fragment of ``P`` as they stand (FlashAttention-2's observation), a k-step per
  16 keys; lane ``(g, q)`` loads the four keys of each its B fragments need, an eighth
  of each row's dims
  (128-bit loads), and output column ``g`` of tile ``t`` is the dim those loads hold
  at ``t``.

The warps' running states are merged through shared memory into the chunk's partial
(max, sum, output) and the second kernel combines a row's chunks (:mod:`.split_k`); the
running max and the repair of sum and output are those of :mod:`.split_k`, scores in
log2 units.
"""
from __future__ import annotations

import functools

import tvm
from tvm import tirx
from tvm.script import tirx as T

from ..cuda import ALL_LANES
from ..schedules.warp_specialized import repair_factor
from .layouts import views
from .spec import CACHE_LAYOUTS, PAGED_LAYOUTS, WINDOW_LAYOUTS, AttentionSpec, head_dim_unsupported, kernel_head_dim
from .static_lengths import RuntimeLengthsOnly
from .split_k import (
    ACC, NEG_INF, QUERIES, chunking, combine_kernel, finite, first_key, partial_shape, partials_store,
    maximum, plan_chunk_keys, score_of, unsupported,
)

WARP = 32
#: Warps per block: they share a chunk, a step each in turn.
WARPS = 4
#: Query rows (query, head) of a K/V head a warp serves: the M of m16n8k16.
ROWS = 16
#: Keys a warp takes per step, by the kernel's head dim: 8-key tiles of scores, a k-step
#: of P·V per 16. A head dim 64 step of 16 keys would hold half the bytes of a 128 one
#: for the same exchanges of the row max and sum.
STEPS = {64: 32, 128: 16}
#: Blocks per SM the chunk size is planned for (two fit at once), and the fewest keys a
#: chunk takes (a chunk's set-up and merge repay only a few steps of every warp). Swept
#: on an H200 over chunk sizes at Llama-3-8B/70B and MHA decode shapes.
BLOCKS_PER_SM = 2
LEAST_CHUNK = 256
#: The fewest keys a chunk of a KV-cache layout takes (its chunks a sequence are planned,
#: their keys follow the sequence's): one step of each warp (the step's multiple, so a
#: head dim 64 chunk takes at least 128). Measured on an H200 with TVM's cache decode
#: (32/8 heads, d128), ms with 256 / 64: 1 x 512 keys 0.0194 / 0.0165, 1 x 1024 0.0203 /
#: 0.0177, 4 x 1024 0.0169 / 0.0158, 1 x 4096 0.0217 / 0.0207; 1 x 16000 and batches of
#: 16 and 32 unchanged. bhsd keeps :data:`LEAST_CHUNK`: its 1 x 4096 took 0.0174 in
#: 128-key chunks against 0.0151 in 256-key ones.
CACHE_LEAST_CHUNK = 64
#: The kernel's head dims (its lanes' K and V loads tile 32 and 64 dims); one between
#: runs the next one's kernel (:func:`.spec.kernel_head_dim`).
HEAD_DIMS = (64, 128)
#: Key rows a lane loads per 16 keys of a step: two of K, four of V.
LANE_KEYS = 6
_PTX_TYPE = {"float16": "fp16", "bfloat16": "bf16"}


class TensorCoreDecode(RuntimeLengthsOnly):
    """Split-k decode on tensor cores for up to :data:`QUERIES` query rows per sequence
    (its static-length counterpart is :class:`~.split_k_decode.SplitKDecode`'s schedule)."""

    name = "tensor_core_decode"
    queries = QUERIES

    def supports(self, spec: AttentionSpec):
        reason = unsupported(spec)
        if reason is not None:
            return reason
        arch = str(tvm.target.Target(spec.target).attrs.get("arch", ""))
        if not arch.startswith("sm_") or int(arch[3:].rstrip("a")) < 80:
            return f"mma.sync.m16n8k16 needs sm_80 or later; target arch is {arch or 'unknown'}"
        reason = head_dim_unsupported(spec.head_dim, HEAD_DIMS)
        if reason is not None:
            return reason
        return None

    def rotates_keys(self, spec: AttentionSpec, rotation) -> bool:
        """Whether the kernel for ``spec`` can rotate its keys as ``rotation``
        (:class:`.rope_inside.Rotation`) does: at the kernel's own head dim, rotating
        element ``x`` reads elements a multiple of 32 from it only (in the lane's quarter
        of the row: :func:`_k_dim`)."""
        if kernel_head_dim(spec.head_dim, HEAD_DIMS) != spec.head_dim:
            return False
        reads = [rotation.reads(x) for x in range(spec.head_dim)]
        return all(r is not None and all(0 <= i < spec.head_dim and (i - x) % 32 == 0 for i in r)
                   for x, r in enumerate(reads))

    def build(self, spec: AttentionSpec, rotate_keys=None) -> tvm.tirx.PrimFunc:
        return decode_kernel(spec, rotate_keys)

    def plan(self, spec: AttentionSpec, batch, max_q, max_kv, device) -> list:
        """``[chunk_keys]``: keys per chunk (a cache layout's ``[chunks]``, chunks per
        sequence: :func:`.split_k.plan_chunk_keys`), so that at most about
        :data:`BLOCKS_PER_SM` blocks run per SM (one wave), none shorter than
        :data:`LEAST_CHUNK`."""
        blocks = batch * spec.heads_kv * -(-spec.group * maximum(max_q, 1) // ROWS)
        step = STEPS[kernel_head_dim(spec.head_dim, HEAD_DIMS)]
        return [plan_chunk_keys(spec, blocks, max_q, max_kv, device, BLOCKS_PER_SM, WARPS * step, LEAST_CHUNK,
                                whole_waves=True)]

    def compile_target(self, target):
        return target


def _k_dim(quad, e):
    """The dim of element ``e`` of the quarter of a key row lane ``quad`` of a quad holds
    (16-byte pieces, the quad's four lanes side by side)."""
    return (e // 8) * 32 + quad * 8 + e % 8


def _v_dim(g, e):
    """The dim of element ``e`` of the eighth of a value row lane group ``g`` holds."""
    return (e // 8) * 64 + g * 8 + e % 8


def decode_kernel(spec: AttentionSpec, rotate_keys=None) -> tvm.tirx.PrimFunc:
    """The family's PrimFunc for ``spec``: the layout's tensors, its scalars, then
    the scalar of its chunking (:func:`.split_k.chunking`), then ``out`` (and ``lse``
    where the layout has one).

    ``rotate_keys`` (a :class:`~.rope_inside.KeyRotation`), where given, rotates element
    ``x`` of key ``j`` of sequence ``b`` (RoPE inside attention) from the row's elements
    around it: the keys are rotated in registers as they enter the products, the
    rotation's part per element (TVM's frequencies) taken from a table in shared memory
    that the block fills first. A lane holds a quarter
    of each row it loads, in pieces of 8 dims 32 apart, so a rotation that pairs dims a
    multiple of 32 apart (``x`` and ``x ± d / 2``: TVM's) finds both of a pair in the
    lane's registers (:meth:`TensorCoreDecode.rotates_keys`)."""
    view = views(spec, tirx.decl_buffer)
    # d: the kernel's head dim; the tensors', the partials' and the output's is stored.
    stored, group, heads_q, dtype = spec.head_dim, spec.group, spec.heads_q, spec.dtype
    d = kernel_head_dim(stored, HEAD_DIMS)
    ptx = _PTX_TYPE[dtype]
    k_steps, k_elems, v_elems = d // 16, d // 4, d // 8
    out = tirx.decl_buffer(view.out_shape, dtype, "out")
    step = STEPS[d]
    # 16-key groups of a step: a k-step of P·V each
    groups = step // 16
    chunks = chunking(spec, view, WARPS * step, CACHE_LEAST_CHUNK if spec.layout in CACHE_LAYOUTS else LEAST_CHUNK)
    num_chunks, chunk_keys = chunks.count, chunks.keys
    lse = view.lse_buffer()
    passes = (group * view.rows + ROWS - 1) // ROWS
    score = score_of(spec, view)
    combine = combine_kernel(spec, view, chunks, out, lse)
    store = partials_store(spec, ROWS, WARPS, WARP * WARPS)
    shape = partial_shape(view, num_chunks, heads_q)
    row_parts = len(view.kv_row(0, 0))
    # A page table is read a step before the keys it locates: where pages hold a multiple
    # of 16 keys stored in order, a few entries per 16-key group (:func:`locate_group`),
    # else every key's place.
    paged = spec.layout in PAGED_LAYOUTS
    sinks = spec.layout in WINDOW_LAYOUTS
    # (a window variant's chunks start anywhere: in a cache with sinks, per key)
    by_page = paged and spec.page_size % 16 == 0 and not (sinks and spec.variant.window is not None)
    spans = 4 if sinks else 1 if spec.variant.window is None else 2
    entries = groups * spans if by_page else (LANE_KEYS * groups if paged else 1) * row_parts
    table_dtype = None if rotate_keys is None else rotate_keys.table_dtype
    tabled = table_dtype is not None

    @T.macro
    def locate(rows, n, b, j):
        """Where key ``j`` lies (the layout's ``kv_row``), to entry ``n`` of ``rows``."""
        parts = T.meta_var(view.kv_row(b, j))
        rows[n * row_parts] = parts[0]
        if row_parts > 1:
            rows[n * row_parts + 1] = parts[1]

    def located_by(rows, n, b, j, j0):
        """The indices that locate key ``j`` (as the layout's ``kv_row``) from entry ``n``
        of ``rows``: where ``by_page``, the page of 16-key group ``n`` of the step at
        ``j0`` that holds it (:func:`locate_group`) and its place in it; else the key's
        own."""
        if not by_page:
            return (rows[n * row_parts], rows[n * row_parts + 1]) if row_parts > 1 else (rows[n * row_parts],)
        page = rows[n * spans]
        if sinks:
            # key j = f + k of the group at f: a sink on f's page, else at position
            # f + shift + k, on the page of f + shift or the one after
            sink, _ = view.sunk(b)
            after = rows[n * spans + 3] + (j - (j0 + 16 * n))
            beyond = after >= spec.page_size
            page = T.if_then_else(j < sink, page, T.if_then_else(beyond, rows[n * spans + 2], rows[n * spans + 1]))
            place = T.if_then_else(j < sink, T.floormod(j, spec.page_size),
                                   after - T.if_then_else(beyond, spec.page_size, 0))
            return page, place
        if spans > 1:
            first = j0 + 16 * n
            page = T.if_then_else(j // spec.page_size == first // spec.page_size, page, rows[n * spans + 1])
        return page, view.kv_row(b, j)[1]

    def last_key(j0, n, end):
        """The last key group ``n`` of the step at ``j0`` loads (``end``: the chunk's)."""
        return T.min(j0 + 16 * n + 15, end - 1)

    @T.macro
    def locate_group(rows, n, b, j0, end):
        """The pages of 16-key group ``n`` of the step at ``j0`` to ``rows``: its first
        key's (its only one where chunks start at a sequence's first key, in whole
        steps); with a window variant, whose first key may lie anywhere in a page, also
        its last key's; in a cache with sinks (keys up to the sink stored as they come,
        the window's from anywhere in a page on), its first key's (the sinks' where it
        is one), its first window key's and its last key's pages, and the place its
        first key would have as a window key (:func:`located_by`)."""
        rows[n * spans] = view.kv_row(b, j0 + 16 * n)[0]
        if sinks:
            rows[n * spans + 1] = view.kv_row(b, T.max(j0 + 16 * n, T.min(view.sunk(b)[0], last_key(j0, n, end))))[0]
            rows[n * spans + 2] = view.kv_row(b, last_key(j0, n, end))[0]
            rows[n * spans + 3] = T.floormod(j0 + 16 * n + view.sunk(b)[1], spec.page_size)
        elif spans > 1:
            rows[n * spans + 1] = view.kv_row(b, last_key(j0, n, end))[0]

    @T.macro
    def load_row(dst, offset, rows, n, b, hk, j, j0, end, at, pieces, dim, lane):
        """Key ``j`` (of the step at ``j0``)'s elements ``e < 8 pieces`` of ``lane``, dims
        ``dim(lane, e)`` (:func:`_k_dim`, :func:`_v_dim`), to ``dst[offset:]`` by ``at``,
        zeros past ``end``; located by entry ``n`` of ``rows`` where paged
        (:func:`locate_step`), else here."""
        if j < end:
            if not paged:
                locate(rows, n, b, j)
            located = T.meta_var(located_by(rows, n, b, j, j0))
            for i in T.unroll(pieces):
                # (a piece's 8 dims are all the tensors' or all past them: zeros)
                if stored == d or dim(lane, i * 8) < stored:
                    for x in T.vectorized(8):
                        dst[offset + i * 8 + x] = at(located, hk, dim(lane, i * 8 + x))
                else:
                    for x in T.vectorized(8):
                        dst[offset + i * 8 + x] = T.Cast(dtype, 0)
        else:
            for i in T.unroll(pieces):
                for x in T.vectorized(8):
                    dst[offset + i * 8 + x] = T.Cast(dtype, 0)

    def mma(a, a_at, b, b_at, c, c_at):
        return T.ptx_legacy.mma(
            "m16n8k16", "row", "col", ptx, ptx, "fp32", a.data, a_at, b.data, b_at, c.data, c_at, False,
            dtype="float32",
        )

    def k_key(j0, n, g):
        """Key ``n`` of the two a lane loads a quarter of the dims of at the step at ``j0``."""
        return j0 + n * 8 + g

    def v_key(j0, kk, quad):
        """Key ``kk`` of the four per 16 keys a lane loads an eighth of the values of at
        the step at ``j0``."""
        return j0 + 16 * (kk // 4) + 2 * quad + kk % 2 + 8 * (kk % 4 // 2)

    @T.macro
    def locate_step(rows, b, j0, end, g, quad):
        """Where the keys of the step at ``j0`` a lane loads lie, to ``rows``: each 16-key
        group's pages where ``by_page`` (:func:`locate_group`), else each key's place
        (those of K, then those of V)."""
        if by_page:
            for n in T.unroll(groups):
                if j0 + 16 * n < end:
                    locate_group(rows, n, b, j0, end)
        else:
            for n in T.unroll(2 * groups):
                if k_key(j0, n, g) < end:
                    locate(rows, n, b, k_key(j0, n, g))
            for kk in T.unroll(4 * groups):
                if v_key(j0, kk, quad) < end:
                    locate(rows, 2 * groups + kk, b, v_key(j0, kk, quad))

    @T.macro
    def load_step(k_buf, v_buf, rows, b, hk, j0, end, g, quad):
        """The keys of the step at ``j0`` a lane needs: keys ``8 n + g`` (a quarter of their
        dims each) and keys ``16 n + 2 quad + {0, 1, 8, 9}`` (an eighth of their values)."""
        # (entries of rows: by_page, the 16-key group's; paged, the key's; else one)
        for n in T.unroll(2 * groups):
            entry = T.meta_var(n // 2 if by_page else (n if paged else 0))
            load_row(k_buf, n * k_elems, rows, entry, b, hk, k_key(j0, n, g), j0, end, view.key_at,
                     k_elems // 8, _k_dim, quad)
        for kk in T.unroll(4 * groups):
            entry = T.meta_var(kk // 4 if by_page else (2 * groups + kk if paged else 0))
            load_row(v_buf, kk * v_elems, rows, entry, b, hk, v_key(j0, kk, quad), j0, end,
                     view.value_at, v_elems // 8, _v_dim, g)

    def rotated_key(k_reg, n, at, b, j0, g, tx, table):
        """Element ``at`` of a lane's quarter of its key ``n`` of the step at ``j0``,
        rotated (``rotate_keys``, its part per element read from ``table``)."""
        # (the quad as ``tx % 4``, whose bounds let a rotation's conditions on the dim fold)
        return rotate_keys(view, lambda delta: k_reg[n * k_elems + at + delta // 32 * 8], b, k_key(j0, n, g),
                           _k_dim(tx % 4, at), table)

    def row_max(s, half):
        """The largest of a lane's scores of row ``g + 8 half``."""
        pairs = [T.max(s[n * 4 + half * 2], s[n * 4 + half * 2 + 1]) for n in range(2 * groups)]
        return functools.reduce(T.max, pairs)

    @T.prim_func(private=True, check_well_formed=False)
    def body():
        part_o = T.alloc_buffer(shape + (stored,), ACC)
        part_m = T.alloc_buffer(shape, ACC)
        part_l = T.alloc_buffer(shape, ACC)
        with T.launch_thread("blockIdx.x", num_chunks) as c:
            by = T.launch_thread("blockIdx.y", view.batch * spec.heads_kv)
            bz = T.launch_thread("blockIdx.z", passes)
            tx = T.launch_thread("threadIdx.x", WARP)
            ty = T.launch_thread("threadIdx.y", WARPS)
            staged = T.alloc_local((2 * k_elems,), dtype)
            q_frag = T.alloc_local((k_steps * 8,), dtype)
            k_reg = T.alloc_local((2 * groups * k_elems,), dtype)
            v_reg = T.alloc_local((4 * groups * v_elems,), dtype)
            k_next = T.alloc_local((2 * groups * k_elems,), dtype)
            v_next = T.alloc_local((4 * groups * v_elems,), dtype)
            k_frag = T.alloc_local((4,), dtype)
            v_frag = T.alloc_local((4,), dtype)
            s = T.alloc_local((8 * groups,), ACC)
            p = T.alloc_local((8 * groups,), dtype)
            o = T.alloc_local((v_elems * 4,), ACC)
            m = T.alloc_local((2,), ACC)
            l = T.alloc_local((2,), ACC)
            m_new = T.alloc_local((1,), ACC)
            repair = T.alloc_local((1,), ACC)
            rows = T.alloc_local((entries,), "int32")
            merged_m = T.alloc_shared((WARPS, ROWS), ACC)
            merged_l = T.alloc_shared((WARPS, ROWS), ACC)
            merged_o = T.alloc_shared((WARPS, ROWS, d), ACC)
            # The rotation's part per element (a pow of the element's index) computed
            # once: in the loop it takes registers the rotating kernels spill for.
            if tabled:
                per_element = T.alloc_shared((rotate_keys.period,), table_dtype)
            b = by // spec.heads_kv
            hk = by % spec.heads_kv
            g = tx // 4
            quad = tx % 4
            n_rows = group * view.query_length(b)
            start = first_key(spec, view, b) + c * chunk_keys(b)
            end = T.min(start + chunk_keys(b), view.key_length(b))
            # Q's A fragments: rows g and g + 8, element f of k-step t at the quad's dims.
            for half in T.unroll(2):
                rr = bz * ROWS + g + 8 * half
                for i in T.unroll(k_elems // 8):
                    for x in T.vectorized(8):
                        staged[half * k_elems + i * 8 + x] = T.Cast(dtype, 0)
                if rr < n_rows:
                    for i in T.unroll(k_elems // 8):
                        if stored == d or _k_dim(quad, i * 8) < stored:
                            for x in T.vectorized(8):
                                staged[half * k_elems + i * 8 + x] = view.query(
                                    b, hk * group + rr % group, rr // group, _k_dim(quad, i * 8 + x)
                                )
            for t in T.unroll(k_steps):
                for f in T.unroll(8):
                    q_frag[t * 8 + f] = staged[(f // 2) % 2 * k_elems + t * 4 + 2 * (f // 4) + f % 2]
            if tabled:
                for i in T.serial((rotate_keys.period + WARP * WARPS - 1) // (WARP * WARPS)):
                    entry = T.meta_var(i * WARP * WARPS + ty * WARP + tx)
                    if entry < rotate_keys.period:
                        per_element[entry] = rotate_keys.per_element(entry)
                T.tvm_storage_sync("shared")
            for half in T.unroll(2):
                m[half] = NEG_INF
                l[half] = T.float32(0)
            for i in T.unroll(v_elems * 4):
                o[i] = T.float32(0)
            # The warps take the chunk's steps in turn, each loading its next step's keys
            # while it computes with this one's (and, paged, locating the step after).
            if paged:
                locate_step(rows, b, start + ty * step, end, g, quad)
            load_step(k_next, v_next, rows, b, hk, start + ty * step, end, g, quad)
            if paged:
                locate_step(rows, b, start + (WARPS + ty) * step, end, g, quad)
            for it in T.serial((T.max(end - start, 0) + WARPS * step - 1) // (WARPS * step)):
                j0 = start + (it * WARPS + ty) * step
                if rotate_keys is None:
                    for i in T.unroll(2 * groups * k_elems):
                        k_reg[i] = k_next[i]
                else:
                    # Rotated as they leave the loads' registers, the elements 8 apart
                    # taken together: a rotation's pairs (32 dims apart) share an angle.
                    for n in T.unroll(2 * groups):
                        for r in T.unroll(8):
                            for piece in T.unroll(k_elems // 8):
                                k_reg[n * k_elems + piece * 8 + r] = rotated_key(k_next, n, piece * 8 + r, b, j0, g,
                                                                                 tx, per_element if tabled else None)
                for i in T.unroll(4 * groups * v_elems):
                    v_reg[i] = v_next[i]
                load_step(k_next, v_next, rows, b, hk, j0 + WARPS * step, end, g, quad)
                if paged:
                    locate_step(rows, b, j0 + 2 * WARPS * step, end, g, quad)
                for n in T.unroll(2 * groups):
                    for e in T.unroll(4):
                        s[n * 4 + e] = T.float32(0)
                    for t in T.unroll(k_steps):
                        for e in T.unroll(4):
                            k_frag[e] = k_reg[n * k_elems + t * 4 + e]
                        T.evaluate(mma(q_frag, t * 8, k_frag, 0, s, n * 4))
                # s[4n + e]: row g + 8 (e // 2), key 8n + 2 quad + e % 2 of the step.
                for e in T.unroll(8 * groups):
                    rr = bz * ROWS + g + 8 * (e % 4 // 2)
                    j = j0 + e // 4 * 8 + 2 * quad + e % 2
                    s[e] = T.if_then_else(j < end, score(s[e], b, hk * group + rr % group, rr // group, j), NEG_INF)
                for half in T.unroll(2):
                    m_new[0] = row_max(s, half)
                    for k in T.unroll(2):
                        m_new[0] = T.max(m_new[0], T.cuda.__shfl_xor_sync(T.uint32(ALL_LANES), m_new[0], 1 << k, 32))
                    m_new[0] = T.max(m_new[0], m[half])
                    repair[0] = repair_factor(spec.variant, m[half], finite(m_new[0]))
                    l[half] = l[half] * repair[0]
                    for i in T.unroll(v_elems):
                        for e in T.unroll(2):
                            o[i * 4 + half * 2 + e] = o[i * 4 + half * 2 + e] * repair[0]
                    m[half] = m_new[0]
                for e in T.unroll(8 * groups):
                    s[e] = T.exp2(s[e] - finite(m[e % 4 // 2]))
                    l[e % 4 // 2] = l[e % 4 // 2] + s[e]
                    p[e] = T.Cast(dtype, s[e])
                for n in T.unroll(groups):
                    for i in T.unroll(v_elems):
                        for kk in T.unroll(4):
                            v_frag[kk] = v_reg[(n * 4 + kk) * v_elems + i]
                        T.evaluate(mma(p, n * 8, v_frag, 0, o, i * 4))
            # The warps' states merged: each repaired to the rows' common max.
            for half in T.unroll(2):
                for k in T.unroll(2):
                    l[half] = l[half] + T.cuda.__shfl_xor_sync(T.uint32(ALL_LANES), l[half], 1 << k, 32)
                if quad == 0:
                    merged_m[ty, g + 8 * half] = m[half]
            T.tvm_storage_sync("shared")
            for half in T.unroll(2):
                m_new[0] = merged_m[0, g + 8 * half]
                for w in T.unroll(1, WARPS):
                    m_new[0] = T.max(m_new[0], merged_m[w, g + 8 * half])
                repair[0] = repair_factor(spec.variant, m[half], finite(m_new[0]))
                if quad == 0:
                    merged_l[ty, g + 8 * half] = l[half] * repair[0]
                for i in T.unroll(v_elems):
                    for e in T.unroll(2):
                        merged_o[ty, g + 8 * half, _v_dim(2 * quad + e, i)] = o[i * 4 + half * 2 + e] * repair[0]
            T.tvm_storage_sync("shared")
            store(merged_m, merged_l, merged_o, part_o, part_m, part_l, ty * WARP + tx, b, hk, c, bz * ROWS, n_rows,
                  repair, m_new)
        combine(part_o, part_m, part_l)

    params = list(view.inputs) + [chunks.param, out] + ([] if lse is None else [lse])
    return tirx.PrimFunc(params, body.body).with_attr("global_symbol", TensorCoreDecode.name)
