"""How a kernel's tensors lie in memory, and the uniform view of them its computation reads.

Every layout is seen as sequences ``b`` of query rows ``i`` and keys ``j``: ``query(b, h,
i, x)``, ``key(b, hk, j, x)`` and ``value(b, hk, j, x)``, read over ``rows`` query rows
and ``keys`` keys per sequence (the longest ones), with each sequence's own lengths
``q_len(b)`` and ``kv_len(b)``: rows past a sequence's queries are computed and not
stored, keys past its keys are masked. Lengths and the batch size are variables of the
PrimFunc (its buffers' shapes, or scalar parameters), so one kernel serves all of them.

``bhsd``
    ``q[b, hq, sq, d]``, ``k/v[b, hkv, skv, d]``, ``out[b, hq, sq, d]``.
``bshd``
    ``q[b, sq, hq, d]``, ``k/v[b, skv, hkv, d]``, ``out[b, sq, hq, d]`` (FlashAttention's
    and Relax's ``R.nn.attention``'s layout).
``ragged``
    sequences packed along tokens (FlashAttention's varlen): ``q[total_q, hq, d]``,
    ``k/v[total_kv, hkv, d]``, ``q_indptr[b + 1]`` and ``kv_indptr[b + 1]`` (int32,
    sequence ``b``'s tokens are ``indptr[b]:indptr[b + 1]``), ``out`` like ``q``.
``paged``
    queries as in ``ragged``; keys and values in a page pool ``pages[num_pages, 2, hkv,
    page_size, d]`` (``page_size`` the spec's; ``[:, 0]`` keys, ``[:, 1]`` values) as TVM's paged KV cache
    (``relax.frontend.nn.llm``) lays it out: sequence ``b`` holds the pages
    ``page_ids[page_indptr[b]:page_indptr[b + 1]]`` in order, all full but the last,
    which holds ``last_page_len[b]`` keys.

The layouts of TVM's paged KV cache's kernels (``relax.frontend.nn.llm``'s
``TIRPagedKVCache``) take its tensors in its order, the scale at run time (a float32
``sm_scale``) and give the rows' base-2 log-sum-exp too (``lse``, float32, by query token
and head): their longest sequence is bounded by the tensors (every query token; every
key token, or every page's keys) as no call passes it.

``kv_ragged``
    ``q[total_q, hq, d], qo_indptr, k/v[total_kv, hkv, d], kv_indptr``, then the RoPE
    positions ``q_rope_position[total_q]`` and ``k_rope_pos_offset[batch]``.
``kv_paged``
    ``q[total_q, hq, d], qo_indptr, pages, page_indptr, page_indices, length_info``
    (the last page's keys, as ``last_page_len``), ``k_rope_pos_offset, q_rope_position``.
``kv_paged_window``
    ``kv_paged`` of a sliding-window cache: ``length_info[3, batch]`` and the keys as
    ``kv_decode_window``'s; its queries follow the cached keys (query ``i`` at position
    ``kv_len + i``: the new tokens, not yet in the pages), where a sliding window of
    ``W`` keys shows query ``i`` the last ``W - 1 - i`` of them.
``kv_decode``
    ``kv_paged`` with one query per sequence, ``q[batch, hq, d]`` and no ``qo_indptr``.
``kv_decode_window``
    ``kv_decode`` of a sliding-window cache: ``length_info[3, batch]`` holds each
    sequence's last page's keys, where its window starts in its pages' positions and
    how many keys before the window it keeps (attention sinks, stored first); a
    sequence's keys are its sink, then its window (``kv_len = (pages - 1) · page_size
    + last - start + sink``; key ``j`` at position ``j`` below the sink, else ``j - sink
    + start``).

Queries are aligned to the end of their keys (query ``i`` of a sequence sits at position
``i + kv_len - q_len``), as in chunked prefill and decode, but where a layout says
otherwise (:attr:`Views.query_start`).

A spec with a mask tensor (:class:`~.spec.MaskTensor`, bhsd and bshd) takes ``mask[b|1,
hq|1, sq|1, skv]`` after the layout's tensors; the view reads it as an additive term of
the scores (``mask(b, h, i, j)``: the float mask, or 0 / ``-inf`` for a boolean one).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import tvm
import tvm_ffi
from tvm import te, tirx
from tvm.s_tir.stmt import SBlock

from ..analysis.scope import buffer_params
from ..primitives.ir import copy_block, with_regions
from .spec import WINDOW_LAYOUTS, AttentionSpec

INDEX_DTYPE = "int32"


@dataclass
class Views:
    """A layout's tensors and the sequence view of them (see the module docstring)."""

    inputs: list  # TE placeholders and scalar variables before ``out``, in parameter order
    batch: object
    rows: object
    keys: object
    query: Callable
    kv_row: Callable  # (b, j) -> the indices that locate key j of sequence b (a tuple)
    key_at: Callable  # (row, h, x) -> element x of head h of the key ``kv_row`` located
    value_at: Callable
    q_len: Optional[Callable]  # None: every row of every sequence is valid
    kv_len: Optional[Callable]  # None: every key of every sequence is valid
    out_shape: tuple  # the shape of ``out`` (a view's shape for bhsd)
    out_index: Callable  # (b, h, i, x) -> the index of ``out`` that row i of sequence b stores
    scale: object = None  # what multiplies Q·Kᵀ: the spec's, or the scalar ``sm_scale``
    lse_index: Optional[Callable] = None  # (b, h, i) -> row i's index of ``lse``; None: no lse
    mask: Optional[Callable] = None  # (b, h, i, j) -> the float32 term the mask tensor adds; None: no mask
    #: (b) -> the position of sequence b's first query row among its keys'; None: aligned
    #: to the end of the keys (``kv_len - q_len``).
    query_start: Optional[Callable] = None
    #: (b, p) -> the key of sequence b stored at position p of its pages (negative where
    #: none is: between a sliding window's sink and its start); None: not paged.
    position_key: Optional[Callable] = None
    #: (b) -> (sink, shift): sequence b's keys below ``sink`` lie at their own positions
    #: of its pages, the others ``shift`` positions on (a sliding-window cache's sinks and
    #: window); None: every key at its own position.
    sunk: Optional[Callable] = None

    def query_length(self, b):
        """Sequence ``b``'s query rows."""
        return self.rows if self.q_len is None else self.q_len(b)

    def key_length(self, b):
        """Sequence ``b``'s keys."""
        return self.keys if self.kv_len is None else self.kv_len(b)

    def key(self, b, h, j, x):
        return self.key_at(self.kv_row(b, j), h, x)

    def value(self, b, h, j, x):
        return self.value_at(self.kv_row(b, j), h, x)

    def lse_buffer(self):
        """A new buffer for the layout's ``lse`` output (float32, a value per row of
        ``out``), or None where the layout has none."""
        return None if self.lse_index is None else tirx.decl_buffer(self.out_shape[:-1], "float32", name="lse")


def views(spec: AttentionSpec, tensor=te.placeholder) -> Views:
    """The tensors of ``spec``'s layout, made by ``tensor(shape, dtype, name)``
    (``te.placeholder`` for TE, ``tvm.tirx.decl_buffer`` for a TIR kernel's parameters),
    and the view of them."""
    view = _BUILDERS[spec.layout](spec, tensor)
    if view.scale is None:
        view.scale = tirx.const(spec.scale, "float32")
    if spec.mask is not None:
        _add_mask(view, spec, tensor)
    return view


def _add_mask(view: Views, spec: AttentionSpec, tensor) -> None:
    """The mask tensor as the view's last input, and its term of the scores."""
    m = spec.mask
    one = tirx.IntImm("int32", 1)
    shape = (view.batch if m.batch else one, spec.heads_q if m.heads else one, view.rows if m.queries else one,
             view.keys)
    mask = tensor(shape, m.dtype, "mask")
    view.inputs.append(mask)
    zero = tirx.IntImm("int32", 0)

    def term(b, h, i, j):
        value = mask[b if m.batch else zero, h if m.heads else zero, i if m.queries else zero, j]
        if m.dtype == "bool":
            return tirx.Select(value, tirx.const(0, "float32"), tirx.const(float("-inf"), "float32"))
        return value.astype("float32")

    view.mask = term


def _bhsd(spec, tensor):
    batch, seq_q, seq_kv = te.var("batch"), te.var("seq_q"), te.var("seq_kv")
    d = spec.head_dim
    q = tensor((batch, spec.heads_q, seq_q, d), spec.dtype, "q")
    k = tensor((batch, spec.heads_kv, seq_kv, d), spec.dtype, "k")
    v = tensor((batch, spec.heads_kv, seq_kv, d), spec.dtype, "v")
    return Views(
        inputs=[q, k, v], batch=batch, rows=seq_q, keys=seq_kv,
        query=lambda b, h, i, x: q[b, h, i, x],
        kv_row=lambda b, j: (b, j),
        key_at=lambda row, h, x: k[row[0], h, row[1], x],
        value_at=lambda row, h, x: v[row[0], h, row[1], x],
        q_len=None, kv_len=None, out_shape=(batch, spec.heads_q, seq_q, d),
        out_index=lambda b, h, i, x: (b, h, i, x),
    )


def _bshd(spec, tensor):
    batch, seq_q, seq_kv = te.var("batch"), te.var("seq_q"), te.var("seq_kv")
    d = spec.head_dim
    q = tensor((batch, seq_q, spec.heads_q, d), spec.dtype, "q")
    k = tensor((batch, seq_kv, spec.heads_kv, d), spec.dtype, "k")
    v = tensor((batch, seq_kv, spec.heads_kv, d), spec.dtype, "v")
    return Views(
        inputs=[q, k, v], batch=batch, rows=seq_q, keys=seq_kv,
        query=lambda b, h, i, x: q[b, i, h, x],
        kv_row=lambda b, j: (b, j),
        key_at=lambda row, h, x: k[row[0], row[1], h, x],
        value_at=lambda row, h, x: v[row[0], row[1], h, x],
        q_len=None, kv_len=None, out_shape=q.shape,
        out_index=lambda b, h, i, x: (b, i, h, x),
    )


def _ragged_queries(spec, tensor, indptr="q_indptr"):
    """Ragged queries and their indptr (named ``indptr``), shared by the ragged and
    paged layouts: ``(q, q_indptr, max_q, max_kv, fields)``, ``fields`` the
    :class:`Views` fields they set (batch, lengths, the queries' reads and the output's
    stores)."""
    # The indptr's length is the variable: `batch + 1` as a shape would define nothing.
    indptr_len = te.var("indptr_len")
    total_q, max_q, max_kv = te.var("total_q"), te.var("max_q"), te.var("max_kv")
    q = tensor((total_q, spec.heads_q, spec.head_dim), spec.dtype, "q")
    q_indptr = tensor((indptr_len,), INDEX_DTYPE, indptr)
    fields = dict(
        batch=q_indptr.shape[0] - 1, rows=max_q, keys=max_kv,
        query=lambda b, h, i, x: q[q_indptr[b] + i, h, x],
        q_len=lambda b: q_indptr[b + 1] - q_indptr[b],
        out_shape=q.shape, out_index=lambda b, h, i, x: (q_indptr[b] + i, h, x),
    )
    return q, q_indptr, max_q, max_kv, fields


def _ragged(spec, tensor):
    q, q_indptr, max_q, max_kv, fields = _ragged_queries(spec, tensor)
    total_kv = te.var("total_kv")
    k = tensor((total_kv, spec.heads_kv, spec.head_dim), spec.dtype, "k")
    v = tensor((total_kv, spec.heads_kv, spec.head_dim), spec.dtype, "v")
    kv_indptr = tensor(q_indptr.shape, INDEX_DTYPE, "kv_indptr")

    def kv_len(b):
        return kv_indptr[b + 1] - kv_indptr[b]

    return Views(
        inputs=[q, k, v, q_indptr, kv_indptr, max_q, max_kv],
        kv_row=lambda b, j: (kv_indptr[b] + j,),
        key_at=lambda row, h, x: k[row[0], h, x],
        value_at=lambda row, h, x: v[row[0], h, x],
        kv_len=kv_len, **fields,
    )


def _paged(spec, tensor):
    q, q_indptr, max_q, max_kv, fields = _ragged_queries(spec, tensor)
    pages, page_indptr, page_ids, last_page_len, paged = _page_pool(spec, tensor, q_indptr.shape, fields["batch"])
    return Views(inputs=[q, pages, q_indptr, page_indptr, page_ids, last_page_len, max_q, max_kv], **paged, **fields)


def _page_pool(spec, tensor, indptr_shape, batch, names=("page_ids", "last_page_len"), window=False):
    """The page pool, its indptr, page ids and last pages' lengths (``names`` the last
    two's): ``(pages, page_indptr, page_ids, last_page_len, fields)``, ``fields`` the
    :class:`Views` fields of the keys. With ``window``, the lengths are a sliding-window
    cache's ``[3, batch]`` (see :data:`WINDOW_LAYOUTS`)."""
    num_pages, nnz_pages = te.var("num_pages"), te.var("nnz_pages")
    # A constant: a page's keys are found by shifts and masks where it is a power of two.
    page_size = spec.page_size
    pages = tensor((num_pages, 2, spec.heads_kv, page_size, spec.head_dim), spec.dtype, "pages")
    page_indptr = tensor(indptr_shape, INDEX_DTYPE, "page_indptr")
    page_ids = tensor((nnz_pages,), INDEX_DTYPE, names[0])
    last_page_len = tensor((3, batch) if window else (batch,), INDEX_DTYPE, names[1])

    def sunk(b):
        sink = last_page_len[2, b]
        return sink, last_page_len[1, b] - sink

    def stored(b, j):
        """Where key ``j`` of sequence ``b`` lies in its pages' positions."""
        if not window:
            return j
        sink, shift = sunk(b)
        return tirx.Select(j < sink, j, j + shift)

    def kv_len(b):
        used = page_indptr[b + 1] - page_indptr[b]
        if not window:
            return tirx.Select(used > 0, (used - 1) * page_size + last_page_len[b], 0)
        kept = (used - 1) * page_size + last_page_len[0, b] - last_page_len[1, b] + last_page_len[2, b]
        return tirx.Select(used > 0, kept, 0)

    def kv_row(b, j):
        at = stored(b, j)
        return page_ids[page_indptr[b] + tirx.floordiv(at, page_size)], tirx.floormod(at, page_size)

    def cache(which):
        return lambda row, h, x: pages[row[0], which, h, row[1], x]

    def position_key(b, p):
        if not window:
            return p
        sink, offset = last_page_len[2, b], last_page_len[1, b]
        return tirx.Select(p < sink, p, tirx.Select(p >= offset, p - offset + sink, -1))

    fields = dict(kv_row=kv_row, key_at=cache(0), value_at=cache(1), kv_len=kv_len, position_key=position_key)
    if window:
        fields.update(sunk=sunk)
    return pages, page_indptr, page_ids, last_page_len, fields


def _paged_keys(page_indices, page_size):
    """The most keys a sequence of pages ``page_indices`` lists has: every page's, within
    int32 key positions (a bound the compiler's int32 range analysis can hold)."""
    return tirx.min(page_indices.shape[0], (2**31 - 1) // page_size) * page_size


def _cache_fields(out_index):
    """The fields every layout of TVM's KV cache adds: the runtime scale (an input) and
    the lse output at the rows of ``out``."""
    sm_scale = te.var("sm_scale", "float32")
    return sm_scale, dict(scale=sm_scale, lse_index=lambda b, h, i: out_index(b, h, i, 0)[:-1])


def _kv_ragged(spec, tensor):
    q, qo_indptr, _, _, fields = _ragged_queries(spec, tensor, "qo_indptr")
    total_kv = te.var("total_kv")
    k = tensor((total_kv, spec.heads_kv, spec.head_dim), spec.dtype, "k")
    v = tensor((total_kv, spec.heads_kv, spec.head_dim), spec.dtype, "v")
    kv_indptr = tensor(qo_indptr.shape, INDEX_DTYPE, "kv_indptr")
    q_rope_position = tensor(q.shape[:1], INDEX_DTYPE, "q_rope_position")
    k_rope_pos_offset = tensor((fields["batch"],), INDEX_DTYPE, "k_rope_pos_offset")
    sm_scale, cache = _cache_fields(fields["out_index"])
    # k's own extent: ``tensor`` may give buffers of their own shape variables.
    fields.update(rows=q.shape[0], keys=k.shape[0])
    return Views(
        inputs=[q, qo_indptr, k, v, kv_indptr, q_rope_position, k_rope_pos_offset, sm_scale],
        kv_row=lambda b, j: (kv_indptr[b] + j,),
        key_at=lambda row, h, x: k[row[0], h, x],
        value_at=lambda row, h, x: v[row[0], h, x],
        kv_len=lambda b: kv_indptr[b + 1] - kv_indptr[b], **cache, **fields,
    )


def _kv_paged(spec, tensor):
    q, qo_indptr, _, _, fields = _ragged_queries(spec, tensor, "qo_indptr")
    pages, page_indptr, page_indices, length_info, paged = _page_pool(
        spec, tensor, qo_indptr.shape, fields["batch"], ("page_indices", "length_info"),
        window=spec.layout in WINDOW_LAYOUTS)
    k_rope_pos_offset = tensor((fields["batch"],), INDEX_DTYPE, "k_rope_pos_offset")
    q_rope_position = tensor(q.shape[:1], INDEX_DTYPE, "q_rope_position")
    sm_scale, cache = _cache_fields(fields["out_index"])
    fields.update(rows=q.shape[0], keys=_paged_keys(page_indices, spec.page_size))
    if spec.layout in WINDOW_LAYOUTS:
        fields.update(query_start=paged["kv_len"])
    return Views(
        inputs=[q, qo_indptr, pages, page_indptr, page_indices, length_info, k_rope_pos_offset, q_rope_position,
                sm_scale],
        **paged, **cache, **fields,
    )


def _kv_decode(spec, tensor):
    q = tensor((te.var("batch"), spec.heads_q, spec.head_dim), spec.dtype, "q")
    # q's shape defines the batch; the indptr's follows it.
    batch = q.shape[0]
    pages, page_indptr, page_indices, length_info, paged = _page_pool(
        spec, tensor, (batch + 1,), batch, ("page_indices", "length_info"), window=spec.layout in WINDOW_LAYOUTS)
    k_rope_pos_offset = tensor((batch,), INDEX_DTYPE, "k_rope_pos_offset")
    q_rope_position = tensor((batch,), INDEX_DTYPE, "q_rope_position")

    def out_index(b, h, i, x):
        return (b + i, h, x)

    sm_scale, cache = _cache_fields(out_index)
    return Views(
        inputs=[q, pages, page_indptr, page_indices, length_info, k_rope_pos_offset, q_rope_position, sm_scale],
        batch=batch, rows=1, keys=_paged_keys(page_indices, spec.page_size),
        query=lambda b, h, i, x: q[b + i, h, x], q_len=None, out_shape=q.shape, out_index=out_index,
        **paged, **cache,
    )


_BUILDERS = {"bhsd": _bhsd, "bshd": _bshd, "ragged": _ragged, "paged": _paged,
             "kv_ragged": _kv_ragged, "kv_paged": _kv_paged, "kv_paged_window": _kv_paged, "kv_decode": _kv_decode,
             "kv_decode_window": _kv_decode}


def scatter_output(func: tvm.tirx.PrimFunc, spec: AttentionSpec) -> tvm.tirx.PrimFunc:
    """``func`` with its output ``out[b, h, i, x]`` (the view's rows) stored to the
    layout's ``out`` (the view's ``out_index``), and its ``lse[b, h, i]``, if any, to the
    layout's ``lse`` (``lse_index``), rows past the sequence's queries nowhere. bhsd's
    ``func`` is returned as it is.

    TE cannot index an output by a loaded value, so the view's output is computed and
    this rewrite, after scheduling, changes only where the blocks that store it write.
    """
    if spec.layout == "bhsd":  # the view is the layout
        return func
    params = {p.name: p for p in buffer_params(func)}
    # The view over the function's own buffers: the layout says where a row goes.
    view = views(spec, lambda shape, dtype, name: params[name])
    moved = {params.pop("out"): (tirx.decl_buffer(view.out_shape, spec.dtype, name="out"), view.out_index)}
    if view.lse_index is not None:
        moved[params.pop("lse")] = (view.lse_buffer(), view.lse_index)
    others = list(params.values()) + [new for new, _ in moved.values()]

    def store(s):
        target = next((moved[old] for old in moved if s.buffer.same_as(old)), None)
        if target is None:
            return s
        new, index = target
        b, h, i = s.indices[:3]
        stored = tirx.BufferStore(new, s.value, list(index(*s.indices)))
        return stored if view.q_len is None else tirx.IfThenElse(i < view.q_len(b), stored, None)

    def block(blk):
        if not any(w.source.same_as(old) for w in blk.writes for old in moved):
            return blk
        body = tvm_ffi.structural_map(blk.body, [(tirx.BufferStore, store)])
        return with_regions(copy_block(blk, body=body), others + list(blk.alloc_buffers))

    body = tvm_ffi.structural_map(func.body, [(SBlock, block)])
    new_params = [next((new for old, (new, _) in moved.items() if p.same_as(old)), p) for p in func.params]
    return tirx.PrimFunc(new_params, body, attrs=func.attrs)
