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

Queries are aligned to the end of their keys (query ``i`` of a sequence sits at position
``i + kv_len - q_len``), as in chunked prefill and decode.
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
from .spec import AttentionSpec

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


def views(spec: AttentionSpec, tensor=te.placeholder) -> Views:
    """The tensors of ``spec``'s layout, made by ``tensor(shape, dtype, name)``
    (``te.placeholder`` for TE, ``tvm.tirx.decl_buffer`` for a TIR kernel's parameters),
    and the view of them."""
    return _BUILDERS[spec.layout](spec, tensor)


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


def _ragged_queries(spec, tensor):
    """Ragged queries and their indptr, shared by ``ragged`` and ``paged``: ``(q,
    q_indptr, max_q, max_kv, fields)``, ``fields`` the :class:`Views` fields they set
    (batch, lengths, the queries' reads and the output's stores)."""
    # The indptr's length is the variable: `batch + 1` as a shape would define nothing.
    indptr_len = te.var("indptr_len")
    total_q, max_q, max_kv = te.var("total_q"), te.var("max_q"), te.var("max_kv")
    q = tensor((total_q, spec.heads_q, spec.head_dim), spec.dtype, "q")
    q_indptr = tensor((indptr_len,), INDEX_DTYPE, "q_indptr")
    fields = dict(
        batch=indptr_len - 1, rows=max_q, keys=max_kv,
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
    num_pages, nnz_pages = te.var("num_pages"), te.var("nnz_pages")
    # A constant: a page's keys are found by shifts and masks where it is a power of two.
    page_size = spec.page_size
    pages = tensor((num_pages, 2, spec.heads_kv, page_size, spec.head_dim), spec.dtype, "pages")
    page_indptr = tensor(q_indptr.shape, INDEX_DTYPE, "page_indptr")
    page_ids = tensor((nnz_pages,), INDEX_DTYPE, "page_ids")
    last_page_len = tensor((fields["batch"],), INDEX_DTYPE, "last_page_len")

    def kv_len(b):
        used = page_indptr[b + 1] - page_indptr[b]
        return tirx.Select(used > 0, (used - 1) * page_size + last_page_len[b], 0)

    def kv_row(b, j):
        return page_ids[page_indptr[b] + tirx.floordiv(j, page_size)], tirx.floormod(j, page_size)

    def cache(which):
        return lambda row, h, x: pages[row[0], which, h, row[1], x]

    return Views(
        inputs=[q, pages, q_indptr, page_indptr, page_ids, last_page_len, max_q, max_kv],
        kv_row=kv_row, key_at=cache(0), value_at=cache(1), kv_len=kv_len, **fields,
    )


_BUILDERS = {"bhsd": _bhsd, "bshd": _bshd, "ragged": _ragged, "paged": _paged}


def scatter_output(func: tvm.tirx.PrimFunc, spec: AttentionSpec) -> tvm.tirx.PrimFunc:
    """``func`` with its output ``out[b, h, i, x]`` (the view's rows) stored to the
    layout's ``out`` (the view's ``out_index``), rows past the sequence's queries
    nowhere. bhsd's ``func`` is returned as it is.

    TE cannot index an output by a loaded value, so the view's output is computed and
    this rewrite, after scheduling, changes only where the block that stores it writes.
    """
    if spec.layout == "bhsd":  # the view is the layout
        return func
    params = {p.name: p for p in buffer_params(func)}
    old = params.pop("out")
    # The view over the function's own buffers: the layout says where a row goes.
    view = views(spec, lambda shape, dtype, name: params[name])
    new = tirx.decl_buffer(view.out_shape, spec.dtype, name="out")
    others = list(params.values()) + [new]

    def store(s):
        if not s.buffer.same_as(old):
            return s
        b, h, i, x = s.indices
        stored = tirx.BufferStore(new, s.value, list(view.out_index(b, h, i, x)))
        return stored if view.q_len is None else tirx.IfThenElse(i < view.q_len(b), stored, None)

    def block(blk):
        if not any(w.source.same_as(old) for w in blk.writes):
            return blk
        body = tvm_ffi.structural_map(blk.body, [(tirx.BufferStore, store)])
        return with_regions(copy_block(blk, body=body), others + list(blk.alloc_buffers))

    body = tvm_ffi.structural_map(func.body, [(SBlock, block)])
    return tirx.PrimFunc([new if p.same_as(old) else p for p in func.params], body, attrs=func.attrs)
