"""The key tiles a mask tensor lets each row tile see, found before the warp-specialised
prefill reads them.

A mask tensor (:class:`~.spec.MaskTensor`) is read beside the scores, tile by tile; a
key tile whose every entry hides its key for every row of a row tile adds nothing to
those rows, and the prefill need not read it (a causal or padding mask given as a
tensor hides about half of them). Two small kernels run first, in the prefill's
function:

- one clears each row tile's range (``[lo, hi)`` key tiles: empty);
- one scans the mask's rows, a warp each, in one pass: the first and the last key of
  the row not hidden by a larger entry (below); their key tiles widen the row tile's
  range (atomic min and max).

An entry at least :data:`MARGIN` below another of its row hides its key: its weight
beside the other's is at most ``exp(s - s' - MARGIN)`` for the two keys' scaled scores
``s, s'``, zero in float32 unless they differ by more than ``MARGIN - 104``. Each lane
keeps the largest entry it has read (``top``) and the first and last key it has read
not so hidden by ``top``; an entry above ``top + MARGIN`` hides every key the lane read
before it, so the lane starts over. The keys kept are those no larger entry hides (for
a mask of two values, 0 and ``-inf`` or a large negative number, exactly its visible
keys; else perhaps more, which the prefill reads and masks). A boolean mask's hidden
keys are exactly its False ones. A row whose entries all hide (all ``-inf``, or False)
sees no key whatever is read and widens nothing; a row tile no row of which sees a key
reads one tile (its rows' outputs are zeros). The loads come :data:`UNROLL` at a time
into registers before their comparisons, so that a lane has that many in flight.

Ranges serve variants that hide no key and add no bias by position themselves (no
causal mask, window or ALiBi, whose terms the scan does not see); the prefill of other
variants reads the tiles of the variant's own range.
"""
from __future__ import annotations

from typing import Optional

from tvm import tirx
from tvm.script import tirx as T

from ..cuda import ALL_LANES
from ..schedules import warp_specialized as ws
from .spec import AttentionSpec

#: How far below another entry of its row a mask entry hides its key (natural units, as
#: the mask is added to the scaled scores): well below the -1e4 that masks written for
#: float16 use, which bfloat16 rounds to -9984.
MARGIN = 5e3
#: Mask rows a block of the scan takes, a warp each.
WARPS = 4
#: Loads a lane of the scan issues before comparing them.
UNROLL = 8
WARP = 32
_EMPTY = 2**30


def unsupported(spec: AttentionSpec) -> Optional[str]:
    """Why the prefill of ``spec`` reads every key tile its variant sees, or None."""
    if spec.mask is None:
        return "no mask tensor"
    variant = spec.variant
    if variant.is_causal or variant.window is not None or variant.alibi:
        return f"the {variant.name} variant's own terms of a key's position are not in the scan"
    return None


class MaskRanges:
    """The ranges of key tiles of ``keys`` keys the row tiles of ``spec``'s mask tensor
    see (:func:`unsupported` is None), over the view ``view``'s mask: ``buffer`` ``[b|1,
    h|1, row tiles|1, 2]``, ``key_range(b, h, r0)`` the prefill's narrowing of row tile
    ``r0``'s tiles, ``prepend(func)`` the prefill's function with the kernels that find
    them run first."""

    def __init__(self, spec: AttentionSpec, view, keys: int):
        self.spec, self.view, self.keys = spec, view, keys
        mask = view.inputs[-1]
        batch, heads, rows, self.seq_kv = mask.shape
        tiles = (rows + ws.ROWS - 1) // ws.ROWS
        self.buffer = tirx.decl_buffer((batch, heads, tiles, 2), "int32", "mask_key_tiles")
        self.dims = (batch, heads, rows)

    def key_range(self, b, h, r0):
        m = self.spec.mask
        zero = tirx.IntImm("int32", 0)
        at = (b if m.batch else zero, h if m.heads else zero, r0 // ws.ROWS if m.queries else zero)
        lo, hi = self.buffer[at + (0,)], self.buffer[at + (1,)]
        seen = hi > lo
        return tirx.if_then_else(seen, lo, 0), tirx.if_then_else(seen, hi, 1)

    def prepend(self, func: tirx.PrimFunc) -> tirx.PrimFunc:
        body = tirx.SeqStmt([tirx.AllocBuffer(self.buffer), self._kernels().body, func.body])
        return func.with_body(body)

    def _kernels(self) -> tirx.PrimFunc:
        ranges, keys, seq_kv, value = self.buffer, self.keys, self.seq_kv, self.view.mask
        batch, heads, rows = self.dims
        entries = batch * heads * ((rows + ws.ROWS - 1) // ws.ROWS)
        n_rows = batch * heads * rows
        neg_inf = tirx.const(float("-inf"), "float32")

        def widen(op, at, tile):
            return T.call_extern("int32", op, T.address_of(ranges[at]), tile)

        @T.prim_func(private=True, check_well_formed=False)
        def kernels():
            flat = T.decl_buffer((entries * 2,), "int32", data=ranges.data)
            with T.launch_thread("blockIdx.x", (entries + WARP * WARPS - 1) // (WARP * WARPS)) as bx:
                tx = T.launch_thread("threadIdx.x", WARP * WARPS)
                if bx * WARP * WARPS + tx < entries:
                    flat[(bx * WARP * WARPS + tx) * 2] = _EMPTY
                    flat[(bx * WARP * WARPS + tx) * 2 + 1] = 0
            with T.launch_thread("blockIdx.x", (n_rows + WARPS - 1) // WARPS) as bx:
                tx = T.launch_thread("threadIdx.x", WARP * WARPS)
                top = T.alloc_local((1,), "float32")
                row_top = T.alloc_local((1,), "float32")
                read = T.alloc_local((UNROLL,), "float32")
                first = T.alloc_local((1,), "int32")
                last = T.alloc_local((1,), "int32")
                r = bx * WARPS + tx // WARP
                lane = tx % WARP
                if r < n_rows:
                    b = r // (heads * rows)
                    h = r // rows % heads
                    i = r % rows
                    top[0] = neg_inf
                    first[0] = seq_kv
                    last[0] = -1
                    for k in T.serial((seq_kv + WARP * UNROLL - 1) // (WARP * UNROLL)):
                        for u in T.unroll(UNROLL):
                            j = (k * UNROLL + u) * WARP + lane
                            # A clamped index, not a condition: the loads issue together.
                            read[u] = value(b, h, i, T.min(j, seq_kv - 1))
                        for u in T.unroll(UNROLL):
                            j = (k * UNROLL + u) * WARP + lane
                            read[u] = T.if_then_else(j < seq_kv, read[u], neg_inf)
                            if read[u] > top[0] + T.float32(MARGIN):
                                top[0] = read[u]
                                first[0] = j
                                last[0] = j
                            elif read[u] > top[0] - T.float32(MARGIN):
                                top[0] = T.max(top[0], read[u])
                                first[0] = T.min(first[0], j)
                                last[0] = j
                    # A lane whose largest entry the row's hides read no key the row sees.
                    row_top[0] = top[0]
                    for s in T.unroll(5):
                        row_top[0] = T.max(row_top[0], T.cuda.__shfl_xor_sync(T.uint32(ALL_LANES), row_top[0], 1 << s, WARP))
                    if top[0] <= row_top[0] - T.float32(MARGIN):
                        first[0] = seq_kv
                        last[0] = -1
                    for s in T.unroll(5):
                        first[0] = T.min(first[0], T.cuda.__shfl_xor_sync(T.uint32(ALL_LANES), first[0], 1 << s, WARP))
                        last[0] = T.max(last[0], T.cuda.__shfl_xor_sync(T.uint32(ALL_LANES), last[0], 1 << s, WARP))
                    if lane == 0 and last[0] >= 0:
                        T.evaluate(widen("atomicMin", (b, h, i // ws.ROWS, 0), first[0] // keys))
                        T.evaluate(widen("atomicMax", (b, h, i // ws.ROWS, 1), last[0] // keys + 1))

        return kernels
