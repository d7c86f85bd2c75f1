"""The warp-specialised prefill family: FlashAttention-3's structure on Hopper
(:mod:`tvm_cascade.schedules.warp_specialized`: TMA producer warpgroup, two wgmma
consumer warpgroups) over every layout, lengths at run time.

A block takes :data:`~tvm_cascade.schedules.warp_specialized.ROWS` query rows of one
head of one sequence at a time, one block per SM taking the row tiles in turn (the plan's
``blocks``); the row tiles cover the longest sequence's rows (``max_q``), and those past a
shorter sequence's rows are skipped. Each layout is a set of TMA maps over its tensors as
``(head_dim, a, c)``:

- ``bhsd``: rows of a head (a) of every (sequence, head) (c): a tile's rows past the
  sequence are TMA's zeros;
- ``ragged``: heads (a) of every token (c): a tile is 128 tokens of one head from the
  sequence's first token;
- ``bshd``: as ragged, sequence ``b``'s first token at ``b`` times its length (a tile
  past its end reads the next sequence's rows: masked keys, unstored rows);
- ``paged``: a page's keys (a) of every (page, K or V, head) (c): a tile is
  ``keys / page_size`` pages, looked up in the page table by the producer, a page the
  sequence does not have read as TMA's zeros (a coordinate past the map).

Keys past a sequence's end in its last tile are masked, and their V rows cleared in
shared memory before P·V reads them (a page's unused rows may hold anything). A mask
tensor's row tiles read only the key tiles it shows some of their rows, where the
variant has no term of a key's position (:mod:`.mask_ranges`).

Its schedule of static lengths (:mod:`.static_lengths`) is
:mod:`tvm_cascade.schedules.warp_specialized`'s: ``ops.attention`` fused by the traced
``rolling_update`` over key tiles, the loop annotated for the same kernel (head dim 128).
"""
from __future__ import annotations

from dataclasses import replace

from tvm import tirx

from ..schedules import prefill
from ..schedules import warp_specialized as ws
from . import mask_ranges
from .layouts import views
from .spec import CACHE_LAYOUTS, WINDOW_LAYOUTS, AttentionSpec, head_dim_unsupported, kernel_head_dim
from .split_k import LOG2E

#: The kernel's head dims (Q·Kᵀ of a 64-column panel's multiple, P·V one wgmma wide). A
#: head dim between two, a multiple of 8 (TMA's 16-byte strides), runs the next one's
#: kernel, its columns past the tensors' zeros (:func:`.spec.kernel_head_dim`).
HEAD_DIMS = (64, 128, 256)


class WarpSpecializedPrefill:
    """Prefill on sm_90a: any number of query rows per sequence, head dims from 64 to 256
    (multiples of 8; 64, 128 and 256 without padding), fp16 and bf16, every variant."""

    name = "warp_specialized_prefill"
    queries = None
    # Its schedule of static lengths (:mod:`.static_lengths`).
    kind = "prefill"
    space = "warp-specialized"
    config_type = ws.WarpSpecializedConfig
    needs_variant = True
    # Its shared memory is dynamic and larger than the static 48 KB VerifyGPUCode allows.
    verifies_gpu_code = False
    build_func = prefill.BUILD_FUNC

    def supports(self, spec: AttentionSpec):
        if not ws.serves_target(spec.target):
            return f"needs sm_90a (wgmma, TMA, setmaxnreg); target is {spec.target}"
        if spec.dtype not in ("float16", "bfloat16"):
            return f"{spec.dtype}: fp16 and bf16 only"
        reason = head_dim_unsupported(spec.head_dim, HEAD_DIMS)
        if reason is not None:
            return reason
        keys = ws.key_tile(kernel_head_dim(spec.head_dim, HEAD_DIMS))
        if spec.page_size is not None and (keys % spec.page_size or spec.page_size % 8):
            return f"pages of {spec.page_size} keys: a multiple of 8 dividing {keys} (a key tile)"
        return None

    def build(self, spec: AttentionSpec) -> tirx.PrimFunc:
        # As many K/V stages as shared memory holds.
        stages = max(s for s in ws.STAGE_CHOICES if ws.shared_bytes(kernel_head_dim(spec.head_dim, HEAD_DIMS), s) <= ws.SHARED_BYTES)
        config = ws.WarpSpecializedConfig(stages=stages)
        laid = persistent(tiles(spec))
        # A cache layout's kernel takes the scale at run time.
        scale = next((p for p in laid.params if isinstance(p, tirx.Var) and p.name == "sm_scale"), spec.scale)
        func = ws.kernel(laid, spec.variant, config, scale=scale)
        return func.with_attr("global_symbol", self.name)

    def plan(self, spec, batch, max_q, max_kv, device) -> list:
        """``[blocks]``: one block per SM, or per row tile where there are fewer."""
        return [ws.persistent_blocks(batch, spec.heads_q, max_q, device)]

    def compile_target(self, target):
        return ws.sm90a(target)

    def schedule_supports(self, spec: AttentionSpec, seq_q, seq_kv):
        return ws.unsupported(spec.heads_q, spec.heads_kv, seq_q, seq_kv, spec.head_dim, spec.variant, spec.dtype,
                              spec.target)

    def padding(self, group, seq_q, head_dim, config=None):
        # The tensor-core schedule's: the two share a tuning database, whose records are
        # of one padded function.
        return prefill.PADDING

    def schedule(self, func, spec: AttentionSpec, config=None):
        return ws.schedule(func, spec.variant, config or ws.WarpSpecializedConfig())

    def design_space(self, spec: AttentionSpec):
        return ws.design_space(spec.variant)

    def scheduled(self, mod):
        return ws.lowers(mod)

    def prefers(self, spec: AttentionSpec):
        return ws.preferred(spec.variant)

    def compile(self, mod, target):
        return ws.build(mod, target)

    def register_intrinsics(self):
        """(none: its instructions are written in the kernel)"""


def persistent(tiles: ws.Tiles) -> ws.Tiles:
    """``tiles`` with the grid's blocks a scalar parameter before ``out``: each block
    takes row tiles in turn (the next one's loads overlap the last one's stores, and
    no row tile waits for a second wave's start), under a causal mask every head's
    longest first: no causal span (:attr:`~tvm_cascade.schedules.warp_specialized.Tiles.span`),
    which serves the static kernel only (docs/DESIGN.md says what it cost this one)."""
    blocks = tirx.Var("blocks", "int32")
    at = tiles.params.index(tiles.out)
    return replace(tiles, params=tiles.params[:at] + [blocks] + tiles.params[at:], blocks=blocks)


def tiles(spec: AttentionSpec) -> ws.Tiles:
    """The kernel's :class:`~tvm_cascade.schedules.warp_specialized.Tiles` of ``spec``'s
    layout, over the buffers of its view (:func:`~tvm_cascade.library.layouts.views`)."""
    view = views(spec, tirx.decl_buffer)
    d, hq, hkv = spec.head_dim, spec.heads_q, spec.heads_kv
    padded = kernel_head_dim(d, HEAD_DIMS)
    dim = None if padded == d else d
    if spec.layout == "bhsd":
        laid = ws.bhsd_tiles(view.batch, hq, hkv, view.rows, view.keys, padded, spec.dtype, dim=dim)
        if view.mask is None:
            return laid
        # The mask tensor follows q, k and v.
        return replace(laid, params=laid.params[:3] + view.inputs[3:] + laid.params[3:], mask=_masked(spec, view),
                       key_ranges=_key_ranges(spec, view, padded))
    keys = ws.key_tile(padded)
    buffers = {t.name: t for t in view.inputs if isinstance(t, tirx.Buffer)}
    q = buffers["q"]
    lse = view.lse_buffer()
    out = [tirx.decl_buffer(view.out_shape, spec.dtype, "out")] + ([] if lse is None else [lse])
    row = d * 2
    first_q, first_kv, tokens_of = _packed(spec, view, buffers)

    def tokens(buf, heads, box):
        # (d, heads, tokens): a box is `box` tokens of one head.
        return ws.TensorMap(buf, (heads, tokens_of(buf)), (row, heads * row), (1, box))

    common = dict(
        params=list(view.inputs) + out, heads_q=hq, heads_kv=hkv, head_dim=padded, dim=dim, dtype=spec.dtype,
        lse_index=view.lse_index,
        batch=view.batch, rows=view.rows, q_len=view.query_length, kv_len=view.key_length,
        q_map=tokens(q, hq, ws.ROWS), q_at=lambda b, h, r0: (h, first_q(b) + r0), out_index=view.out_index,
        mask=_masked(spec, view), key_ranges=_key_ranges(spec, view, padded),
    )
    if spec.layout in ("ragged", "bshd", "kv_ragged"):
        k, v = buffers["k"], buffers["v"]
        return ws.Tiles(
            k_map=tokens(k, hkv, keys), v_map=tokens(v, hkv, keys),
            kv_at=lambda b, hk, t, s, which: (hk, first_kv(b) + t * keys), **common,
        )
    pages, page_indptr = buffers["pages"], buffers["page_indptr"]
    page_ids = buffers["page_indices" if spec.layout in CACHE_LAYOUTS else "page_ids"]
    size = spec.page_size
    # (d, a page's keys, every (page, K or V, head)); one past the last is no page.
    planes = pages.shape[0] * 2 * hkv
    pool = ws.TensorMap(pages, (size, planes), (row, size * row), (size, 1))

    def kv_at(b, hk, t, s, which):
        page = t * (keys // size) + s
        used = page_indptr[b + 1] - page_indptr[b]
        plane = (page_ids[page_indptr[b] + page] * 2 + which) * hkv + hk
        return 0, tirx.if_then_else(page < used, plane, planes)

    if spec.layout in WINDOW_LAYOUTS:
        common.update(_stored_positions(buffers["length_info"], page_indptr, size))
    return ws.Tiles(k_map=pool, v_map=pool, kv_at=kv_at, **common)


def _stored_positions(length_info, page_indptr, size):
    """A sliding-window cache's keys as the positions of its pages, whole pages a TMA
    box each: a sequence's positions up to its last page's end, those between its sink
    and its window's start (evicted) hidden, its queries after the last (the
    :class:`~tvm_cascade.schedules.warp_specialized.Tiles` fields ``kv_len``,
    ``q_start`` and ``mask``). (A window counted over these positions is the cache's
    over its kept keys where it keeps no sink, as the calls with a window do.)"""
    def stored(b):
        used = page_indptr[b + 1] - page_indptr[b]
        return tirx.Select(used > 0, (used - 1) * size + length_info[0, b], 0)

    hidden = tirx.const(ws.MASKED_SCORE, "float32")

    def mask(s, b, h, i, j):
        return tirx.Select(tirx.And(length_info[2, b] <= j, j < length_info[1, b]), hidden, s)

    return dict(kv_len=stored, q_start=stored, mask=mask)


def _masked(spec, view):
    """The kernel's :attr:`~tvm_cascade.schedules.warp_specialized.Tiles.mask` of the
    view's mask tensor, or None: a hidden key's score is the kernel's masked one (finite,
    so that a tile whose keys are all hidden leaves no NaN)."""
    if spec.mask is None:
        return None
    hidden, log2e = tirx.const(ws.MASKED_SCORE, "float32"), tirx.const(LOG2E, "float32")
    return lambda s, b, h, i, j: tirx.max(s + view.mask(b, h, i, j) * log2e, hidden)


def _key_ranges(spec, view, head_dim):
    """The :attr:`~tvm_cascade.schedules.warp_specialized.Tiles.key_ranges` of the view's
    mask tensor (:mod:`.mask_ranges`), or None where its tiles are the variant's."""
    if mask_ranges.unsupported(spec) is not None:
        return None
    return mask_ranges.MaskRanges(spec, view, ws.key_tile(head_dim))


def _packed(spec, view, buffers):
    """The layout's tokens as rows of one tensor: (sequence b's first query token, its
    first key token, the tokens tensor ``buf`` holds)."""
    if spec.layout == "bshd":
        return (lambda b: b * view.rows), (lambda b: b * view.keys), (lambda buf: view.batch * buf.shape[1])
    q_indptr = buffers["qo_indptr" if spec.layout in CACHE_LAYOUTS else "q_indptr"]
    return (lambda b: q_indptr[b]), (lambda b: buffers["kv_indptr"][b]), (lambda buf: buf.shape[0])
