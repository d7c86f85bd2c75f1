"""Warp-specialised prefill attention for Hopper (sm_90a): FlashAttention-3's structure as a
TVMScript kernel template, compiled by TVM's own CUDA codegen.

A thread block of three warpgroups owns :data:`ROWS` query rows of one head:

* warpgroup 0, the producer (registers cut to ``producer_registers`` by ``setmaxnreg``):
  one thread issues TMA copies (``cp.async.bulk.tensor``, tensor maps encoded on the
  host) of the Q tile once and of each K and V tile of :data:`KEYS` keys into a ring of
  ``stages`` shared-memory stages; ``full[s]`` mbarriers count the bytes in
  (``expect_tx``), ``empty[s]`` mbarriers tell it a stage may be overwritten;
* warpgroups 1 and 2, the consumers (registers raised to ``consumer_registers``), 64 rows
  each: Q·Kᵀ as ``wgmma`` m64n128k16 from shared memory (Q and K 128-byte swizzled, as
  TMA writes them), the scores in registers in the wgmma accumulator layout, the online
  softmax there (row max and sum by quad shuffles), the exps converted to fp16 in place:
  they are already the register A operand of P·V (``wgmma`` with V from shared memory,
  laid out as K is and read MN-major), accumulated onto the output in registers; the
  epilogue multiplies by the inverted row sums and stores four columns a thread at a time.

The rolling update is the one :meth:`~tvm.s_tir.Schedule.rolling_update` derives and
proves for the function's softmax cascade (``m = max s``, ``l = Σ exp(s - m)``,
``o = Σ exp(s - m)·v``; :func:`derived_repairs`): per tile the running ``l`` and ``o``
are repaired by its factor, ``exp(m_old - m_new)``, emitted from the derivation
(:func:`repair_factor`; in base 2 here: the scores are scaled by log2(e) once). With ``overlap`` the consumers issue tile j+1's Q·Kᵀ
and tile j's P·V together and wait only for Q·Kᵀ before the softmax (P·V runs under it);
with ``pingpong`` the two consumer warpgroups take turns issuing their GEMMs (named
barriers), so that one's softmax runs under the other's GEMMs.

Masks: the key tiles a block's rows cannot see (causal, sliding window) are not visited;
tiles entirely visible are computed without mask arithmetic; only tiles that straddle
the mask's edge (a uniform branch per tile) mask their scores, with the masked score of
:mod:`tvm_cascade.ops` (:data:`MASKED_SCORE`). ALiBi's bias and the softcap are applied
to every score. Grouped-query heads read their group's K and V (each head its own
copy: the heads of a group do not share a tile in one block).

Where Q, K and V lie is a :class:`Tiles`: TMA maps over the tensors and each sequence's
lengths, static (:func:`attention`, ``ops.attention``'s bhsd tensors) or read at run time
(the ragged and paged layouts of :mod:`tvm_cascade.library`). Lengths need not be whole
tiles: a part tile's TMA boxes read zeros past a head's rows (or another sequence's
rows), its rows past the sequence's queries are not stored, its keys past the
sequence's keys are masked on the edge tile and their V rows cleared in shared memory
(whatever they hold, NaN included, meets a zero exp). Supported: fp16 and bf16, head dim
128; :func:`unsupported` names what is not.

With ``cluster=2`` two blocks form a cluster that shares each K/V
tile: two query heads of a group on one row tile (or, without a mask, two row tiles of
one head); rank 0 fetches K and rank 1 V, each by TMA multicast into both blocks, and
every consumer thread releases a stage in both blocks (``mapa`` and a remote mbarrier
arrival), the blocks meeting at cluster barriers after initialisation and before exit.

Tuning: the kernel's choices are a MetaSchedule design space (:func:`design_space`).
Its samples, like :func:`schedule`'s, are schedules of ``ops.attention``: the traced
``rolling_update`` fuses the chain over 128-key tiles and annotations on that loop carry
the choices; :func:`build` lowers the annotated loop to this kernel.
"""
import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import sympy
import tvm
import tvm_ffi
from tvm.s_tir.stmt import SBlock
from tvm.script import tirx as T

from .. import ops
from ..algebra.convert import to_tir
from ..analysis.scope import buffer_params
from ..errors import FusionError
from ..primitives import ir
from ..primitives.fusion import derive
from ..primitives.rolling_update import chain_of
from ..cuda import ALL_LANES, sm_count
from ..cuda.accumulator_stores import first_column, trade_halves
from ..cuda.wgmma import descriptor
from ..cuda.wgmma_batches import fence_operand, register_fence
from ..trace import sample_uniform

#: Query rows per thread block (two consumer warpgroups of 64).
ROWS = 128
#: Keys per tile.
KEYS = 128
HEAD_DIM = 128
#: Threads per block: the producer warpgroup and two consumer warpgroups.
THREADS = 384
#: Dynamic shared memory an sm_90 thread block may have (227 KB).
SHARED_BYTES = 227 * 1024
#: Bytes of K and V that a causal kernel's running blocks read at once (a third of an
#: H100's or H200's 50 MB L2): its row tiles go a span of heads at a time
#: (:func:`causal_span`), so that a head's K and V, read by each of its row tiles, are
#: read from memory about once. Every head's last row tile at once would read as many
#: heads' K and V as there are blocks (132 at 2 MB for 4096 keys of head dim 128).
L2_SHARE = 16 << 20
#: The score of a masked key, as in :mod:`tvm_cascade.ops` (finite: while a row has seen
#: only masked keys their exps are exp2(0) = 1, and the repair at its first visible key,
#: exp2(MASKED_SCORE - m), zeroes them; never NaN).
MASKED_SCORE = float(np.finfo(np.float32).min)
_LOG2E = math.log2(math.e)
#: A TMA copy of a tile of the given rank into shared memory, completing on an mbarrier.
TMA_COPY = "cp.async.bulk.tensor.{}d.shared::cluster.global.mbarrier::complete_tx::bytes"
#: wgmma's names of the 16-bit input types.
PTX_TYPE = {"float16": "f16", "bfloat16": "bf16"}
#: The design space's choices (:func:`design_space`): K/V stages, and the consumers'
#: form, ``(overlap, pingpong)``.
STAGE_CHOICES = (2, 3)
FORMS = ((False, False), (True, False), (True, True))
#: Cluster sizes sampled where the configuration allows them (:func:`cluster_unsupported`).
CLUSTER_CHOICES = (1, 2)
#: Annotations of the key-tile loop that :func:`build` lowers to this kernel: the
#: variant (:func:`variant_text`), the stages, the index of the form in :data:`FORMS`, the
#: registers ``[producer, consumer]``.
VARIANT = "tvm_cascade.warp_specialized"
STAGES = "tvm_cascade.warp_specialized_stages"
FORM = "tvm_cascade.warp_specialized_form"
REGISTERS = "tvm_cascade.warp_specialized_registers"
#: The cluster size, annotated where it is not 1 (:attr:`WarpSpecializedConfig.cluster`).
CLUSTER = "tvm_cascade.warp_specialized_cluster"
# The named barriers of the consumer warpgroups' ping-pong: consumer w waits on
# _PINGPONG + w for its turn (barrier 0 is __syncthreads').
_PINGPONG = 3
# Consumer warpgroup w waits on _CLEARED + w for its threads to have cleared a V tail.
_CLEARED = 1


@dataclass(frozen=True)
class WarpSpecializedConfig:
    """Choices of the warp-specialised kernel. Measured side by side on an H200 (ms,
    global b8 s4096 / b1 s16384; stages 3): without overlap or ping-pong 4.82 / 9.91,
    overlap 4.87 / 9.21, overlap and ping-pong 4.58 / 8.57."""

    stages: int = 3  # K/V stages in shared memory (3 is the most 227 KB hold)
    overlap: bool = True
    pingpong: bool = True
    producer_registers: int = 40
    consumer_registers: int = 232
    # Blocks that share each K/V tile (TMA multicast; 2: see :func:`attention`). H200, ms,
    # cluster 1 / 2: GQA b8 s4096 2.548 / 2.583, b1 s16384 4.471 / 4.334; global b8 s1024
    # 0.363 / 0.383, b1 s16384 8.699 / 8.505.
    cluster: int = 1


def stage_release(cluster):
    """The macro ``release(empty, st, rank)``: a consumer thread is done with stage
    ``st`` (in a cluster of two, in both blocks: the peer's producer fills this block's
    stage too, so the thread also arrives on the peer's ``empty``, located by ``mapa``
    from block ``rank``)."""

    @T.macro
    def release(empty, st, rank):
        T.ptx.mbarrier.arrive.shared.b64(empty.ptr_to([st]), T.uint32(1))
        if cluster > 1:
            remote = T.alloc_local((1,), "uint32")
            T.evaluate(
                T.ptx.mapa.shared__cluster.u32(
                    remote[0], T.cuda.cvta_generic_to_shared(empty.ptr_to([st])), T.uint32(1) - T.Cast("uint32", rank)
                )
            )
            T.ptx.mbarrier.arrive.shared__cluster.b64(remote[0])

    return release


def serves_target(target):
    """Whether ``target`` is a GPU this kernel runs on (sm_90, sm_90a)."""
    target = tvm.target.Target(target)
    return target.kind.name == "cuda" and str(target.attrs.get("arch", "")) in ("sm_90", "sm_90a")


def unsupported(heads_q, heads_kv, seq_q, seq_kv, head_dim, variant, dtype, target):
    """Why the kernel cannot serve this configuration on ``target``, or None."""
    if not serves_target(target):
        return f"the warp-specialised kernel needs sm_90a (wgmma, TMA, setmaxnreg); target is {target}"
    if dtype not in PTX_TYPE:
        return f"the warp-specialised kernel computes in float16 or bfloat16, not {dtype}"
    if head_dim != HEAD_DIM:
        return f"the warp-specialised kernel of ops.attention takes head dim {HEAD_DIM}, not {head_dim}"
    if heads_q % heads_kv:
        return f"{heads_q} query heads do not form groups of {heads_kv} key/value heads"
    if variant.is_causal and seq_kv < seq_q:
        return f"a causal mask with more queries ({seq_q}) than keys ({seq_kv}) leaves rows without keys"
    return None


def shapes(func):
    """``(batch, heads_q, heads_kv, seq_q, seq_kv, head_dim, dtype)`` of ``ops.attention``
    function ``func`` (its real lengths: padding is internal)."""
    q, k = buffer_params(func)[:2]
    (batch, heads_q, seq_q, head_dim), (_, heads_kv, seq_kv, _) = ([int(x) for x in p.shape] for p in (q, k))
    return batch, heads_q, heads_kv, seq_q, seq_kv, head_dim, str(q.dtype)


def function_unsupported(func, variant, target):
    """:func:`unsupported` for ``ops.attention`` function ``func`` of ``variant``."""
    _, heads_q, heads_kv, seq_q, seq_kv, head_dim, dtype = shapes(func)
    return unsupported(heads_q, heads_kv, seq_q, seq_kv, head_dim, variant, dtype, target)


def cluster_unsupported(cluster, heads_q, heads_kv, seq_q, variant):
    """Why clusters of ``cluster`` blocks cannot share K/V tiles in this configuration, or
    None."""
    if cluster not in (1, 2):
        return f"the warp-specialised kernel shares K/V tiles in clusters of 1 or 2 blocks, not {cluster}"
    group, q_tiles = heads_q // heads_kv, -(-seq_q // ROWS)
    if cluster > 1 and group % 2 and (variant.is_causal or q_tiles % 2):
        return (
            "a cluster of two blocks needs two query heads of a group (grouped-query attention) or, without a "
            f"mask, an even number of row tiles; this has groups of {group} heads and {q_tiles} row tiles"
        )
    return None


def preferred(variant):
    """Whether ``compile_attention`` takes this kernel by default where it is supported:
    not under a sliding window, whose blocks see too few key tiles to repay the kernel's
    set-up (H200, window 256, ms at b8 s1024 / b8 s4096 / b1 s16384: this kernel 0.217 /
    0.857 / 0.446 against Flex 0.195 / 0.791 / 0.418 in one run; the mma.sync schedule
    0.193 / 0.773 / 0.400 against Flex 0.192 / 0.780 / 0.412 in another)."""
    return variant.window is None


def sm90a(target):
    """``target`` with the arch-specific features of sm_90 (wgmma, setmaxnreg) named:
    ``Target.from_device`` reports an H100/H200 as sm_90."""
    config = dict(tvm.target.Target(target).export())
    config["arch"] = "sm_90a"
    return tvm.target.Target(config)


def _whole(length, size):
    """Whether ``length`` is known to be whole tiles of ``size`` (an int multiple of it)."""
    return isinstance(length, int) and length % size == 0


def _offset(seq_q, seq_kv, offset):
    """The position of the first query row among the keys': ``offset``, or aligned to
    the end of the keys."""
    return seq_kv - seq_q if offset is None else offset


def key_tiles(r0, seq_q, seq_kv, variant, keys=KEYS, offset=None):
    """``(lo, hi)``: the tiles of ``keys`` keys ``[lo, hi)`` that some of query rows ``r0``
    to ``r0 + ROWS - 1`` (those below ``seq_q``) see (ints or expressions, as ``r0`` and
    the lengths are; ``hi <= lo`` where the rows see no key). ``offset``: the first row's
    position among the keys' (None: the rows end where the keys do)."""
    offset = _offset(seq_q, seq_kv, offset)
    hi = (seq_kv + keys - 1) // keys
    if variant.is_causal:
        hi = T.min(hi, (_last_row(r0, seq_q) + offset) // keys + 1)
    lo = 0
    if variant.window is not None:
        lo = T.max(0, r0 + offset - variant.window + 1) // keys
    return lo, hi


def straddles(r0, t, seq_q, seq_kv, variant, keys=KEYS, offset=None):
    """Whether key tile ``t`` holds a key that one of rows ``r0``.. (below ``seq_q``)
    cannot see: a masked key or a key past ``seq_kv`` (a part tile's). ``offset`` as
    :func:`key_tiles`'."""
    offset = _offset(seq_q, seq_kv, offset)
    edges = []
    if variant.is_causal:
        edges.append(t * keys + keys - 1 > r0 + offset)
    if variant.window is not None:
        edges.append(_last_row(r0, seq_q) + offset - t * keys >= variant.window)
    if not _whole(seq_kv, keys):
        edges.append(t * keys + keys > seq_kv)
    return functools.reduce(T.Or, edges, T.bool(False))


def visible(row, key, seq_q, seq_kv, variant, keys=KEYS, offset=None):
    """Whether query ``row`` sees ``key`` (as :class:`~tvm_cascade.ops.variants.AttentionVariant`
    defines; keys past ``seq_kv``, which a part tile holds, are not seen). ``offset`` as
    :func:`key_tiles`'."""
    offset = _offset(seq_q, seq_kv, offset)
    seen = []
    if variant.is_causal:
        seen.append(key <= row + offset)
    if variant.window is not None:
        seen.append(row + offset - key < variant.window)
    if not _whole(seq_kv, keys):
        seen.append(key < seq_kv)
    return functools.reduce(T.And, seen, T.bool(True))


def _last_row(r0, seq_q):
    """The last row below ``seq_q`` of the tile from ``r0``."""
    return r0 + ROWS - 1 if _whole(seq_q, ROWS) else T.min(r0 + ROWS - 1, seq_q - 1)


@functools.lru_cache(maxsize=None)
def derived_repairs(variant):
    """The repairs :meth:`~tvm.s_tir.Schedule.rolling_update` derives and proves for
    ``ops.attention``'s running sum and output (its ``sum`` and ``pv`` blocks over key
    tiles) when the running max moves: their
    :class:`~tvm_cascade.primitives.fusion.Fusion`. The algebra does not depend on the
    shapes, so a small instance of ``variant`` serves."""
    sch = tvm.s_tir.Schedule(ops.attention(1, 1, 1, KEYS, KEYS, 16, dtype="float16", variant=variant))
    key_tiles = _key_tiles_loop(sch)
    return tuple(derive(chain_of(sch, sch.get_sblock(name), key_tiles)[2]) for name in ("sum", "pv"))


_OLD, _NEW = sympy.symbols("m_old m_new", real=True)


@functools.lru_cache(maxsize=None)
def _repair_factor(variant):
    factors = []
    for fusion in derived_repairs(variant):
        factor, old, new = fusion.single_factor(
            "the warp-specialised kernel repairs the running sum and output by one factor of the running max"
        )
        # The kernel keeps maxima in log2 units (m = m2 ln 2).
        log2 = {old: _OLD * sympy.log(2), new: _NEW * sympy.log(2)}
        factors.append(sympy.simplify(factor.subs(log2, simultaneous=True)))
    if any(sympy.simplify(f - factors[0]) != 0 for f in factors[1:]):
        raise FusionError(f"the running sum and output take different repairs: {factors}")
    return factors[0]


def repair_factor(variant, m_old, m_new):
    """The factor that repairs the running sum and output when the running max (in log2
    units) moves from ``m_old`` to ``m_new``, as TIR: :func:`derived_repairs`' repair,
    which must be one factor shared by both (for softmax attention ``exp2(m_old -
    m_new)``); FusionError otherwise."""
    return to_tir(_repair_factor(variant), {_OLD: m_old, _NEW: m_new}, "float32")


@dataclass(frozen=True)
class TensorMap:
    """A TMA map over ``buffer`` as a 3-d tensor ``(head_dim, a, c)``: ``extents`` (a, c),
    the byte ``strides`` of a step along a and along c, and the ``box`` (a, c) one copy
    moves (64 columns wide: one 128-byte swizzled panel)."""

    buffer: object
    extents: tuple
    strides: tuple
    box: tuple

    def encode(self, handle, head_dim, dtype):
        (a, c), (box_a, box_c) = self.extents, self.box
        return T.tensormap_encode_tiled(
            handle, self.buffer.data, head_dim, a, c, *self.strides, 64, box_a, box_c, 1, 1, 1,
            descriptor_dtype=dtype, rank=3, swizzle=3,
        )

    @property
    def rows(self):
        """The rows (of ``head_dim`` elements) one copy moves."""
        return self.box[0] * self.box[1]


@dataclass(frozen=True)
class Tiles:
    """Where the kernel's tiles lie in memory and what its sequences are: the PrimFunc's
    ``params`` (``out`` last), ``batch`` sequences of at most ``rows`` query rows, each with
    ``q_len(b)`` rows and ``kv_len(b)`` keys (queries aligned to the end of the keys); the
    TMA maps of Q, K and V (V's may be K's); ``q_at(b, h, r0)``, the map coordinates
    ``(a, c)`` of a box of :data:`ROWS` rows of head ``h`` from row ``r0``; ``kv_at(b, hk,
    t, s, which)`` those of box ``s`` of key tile ``t`` of K (``which`` 0) or V (1), a
    tile being :func:`key_tile` keys in boxes of the map's rows (coordinates past the map
    where the sequence has no such keys: TMA fills zeros); ``out_index(b, h, row, x)``,
    where row ``row`` of sequence ``b`` stores element ``x``."""

    params: list
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: str
    batch: object
    rows: object
    q_len: Callable
    kv_len: Callable
    q_map: TensorMap
    k_map: TensorMap
    v_map: TensorMap
    q_at: Callable
    kv_at: Callable
    out_index: Callable
    #: The grid's blocks (persistent, each taking row tiles in turn: a scalar parameter, or an int), or
    #: None: a block per row tile.
    blocks: object = None
    #: Under a causal mask, the heads (of every sequence; an int)
    #: whose row tiles the blocks take before the next heads' (:func:`causal_span`);
    #: None: every head's longest first, then every head's next.
    span: object = None
    #: ``lse_index(b, h, row)``: where row ``row`` of sequence ``b`` stores its base-2
    #: log-sum-exp in ``lse``, the parameter after ``out``; None: no such output.
    lse_index: Optional[Callable] = None
    #: ``mask(score, b, h, row, key)``: the score (log2 units) under a mask tensor (a
    #: parameter), or keys of the layout that no row sees, no lower than
    #: :data:`MASKED_SCORE`; None: none.
    mask: Optional[Callable] = None
    #: ``q_start(b)``: the position of sequence ``b``'s first query row among its keys';
    #: None: its rows end where its keys do.
    q_start: Optional[Callable] = None
    #: Key tiles beyond which a row tile's rows see no key, found by kernels the
    #: function runs first (a mask tensor's: :class:`~tvm_cascade.library.mask_ranges.MaskRanges`):
    #: ``key_range(b, h, r0)``, ``(lo, hi)`` narrowing the variant's own tiles
    #: (:func:`key_tiles`) for the row tile from ``r0``, and ``prepend(func)``, ``func``
    #: with those kernels first; None: the variant's tiles.
    key_ranges: Optional[object] = None
    #: The tensors' head dim where it is less than ``head_dim``, the kernel's (a multiple
    #: of 64): TMA fills Q's, K's and V's columns past it with zeros (adding nothing to
    #: Q·Kᵀ, making zero output columns), and only its columns are stored; None: the
    #: tensors' is ``head_dim``.
    dim: Optional[int] = None

    @property
    def stored_dim(self):
        """The head dim of the tensors."""
        return self.head_dim if self.dim is None else self.dim

    @property
    def out(self):
        """The output's buffer."""
        return self.params[-1] if self.lse_index is None else self.params[-2]


def causal_span(heads_q, heads_kv, head_dim, keys):
    """The heads whose row tiles a causal kernel takes before the next heads' (the
    longest first among them): those of as many K/V heads as :data:`L2_SHARE`
    holds ``keys`` keys of (K and V, 2-byte elements), at least a group's."""
    group = heads_q // heads_kv
    return max(1, L2_SHARE // (4 * head_dim) // max(keys, 1)) * group


def causal_order(n, heads, q_tiles, span):
    """``(head, unit)``: the ``n``-th of ``heads`` heads' ``q_tiles`` units (row tiles, or
    folds of two) in a causal kernel's order, ``unit`` counted from the last (the
    longest). Heads go ``span`` at a time (None: all at once), the last unit of each of
    them first, then their ones before. Ints, or PrimExprs."""
    if span is None:
        return n % heads, n // heads
    first = n // (span * q_tiles) * span
    width = ir.minimum(span, heads - first)
    within = n - first * q_tiles
    return first + within % width, within // width


def causal_fold(unit, n, heads, q_tiles, span):
    """``(real, head, tile)``: what fold ``unit`` of ``heads`` heads' ``q_tiles`` row tiles
    gives in round ``n``: in an even round its head's ``u``-th row tile from the last,
    in an odd one its ``u``-th from the first (``tile`` counted from the last); ``real``
    is false where the two are one (the middle of an odd count). The folds go in
    :func:`causal_order`, ``(q_tiles + 1) // 2`` a head. PrimExprs of ``n``."""
    head, u = causal_order(unit, heads, (q_tiles + 1) // 2, span)
    even = n % 2 == 0
    return T.Or(even, u * 2 + 1 < q_tiles), head, T.if_then_else(even, u, q_tiles - 1 - u)


def key_tile(head_dim):
    """Keys per tile for ``head_dim``: :data:`KEYS`, or half as many past 128 (Q and two
    K/V stages of head dim 256 fill shared memory)."""
    return KEYS if head_dim <= 128 else KEYS // 2


def shared_bytes(head_dim, stages):
    """The dynamic shared memory of the kernel at ``head_dim`` with ``stages`` K/V
    stages: Q's tile and each stage's K and V tiles (2-byte elements)."""
    return 2 * (ROWS + 2 * stages * key_tile(head_dim)) * head_dim


def bhsd_tiles(batch, heads_q, heads_kv, seq_q, seq_kv, head_dim, dtype="float16", dim=None):
    """:class:`Tiles` of ``q[b, hq, sq, d], k/v[b, hkv, skv, d] -> out[b, hq, sq, d]``
    (ints, or variables for lengths known at run time); ``d`` is ``dim`` where given,
    less than ``head_dim``, the kernel's (:attr:`Tiles.dim`)."""
    d = head_dim if dim is None else dim
    q = tvm.tirx.decl_buffer((batch, heads_q, seq_q, d), dtype, "Q")
    k = tvm.tirx.decl_buffer((batch, heads_kv, seq_kv, d), dtype, "K")
    v = tvm.tirx.decl_buffer((batch, heads_kv, seq_kv, d), dtype, "V")
    out = tvm.tirx.decl_buffer((batch, heads_q, seq_q, d), dtype, "out")
    row_bytes = d * 2
    keys = key_tile(head_dim)

    def sequences(buf, length, heads, box):
        # (d, rows of a head, heads of all sequences): rows past a head's end read zeros.
        return TensorMap(buf, (length, batch * heads), (row_bytes, length * row_bytes), (box, 1))

    return Tiles(
        params=[q, k, v, out], heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim, dtype=dtype,
        batch=batch, rows=seq_q, q_len=lambda b: seq_q, kv_len=lambda b: seq_kv,
        q_map=sequences(q, seq_q, heads_q, ROWS), k_map=sequences(k, seq_kv, heads_kv, keys),
        v_map=sequences(v, seq_kv, heads_kv, keys),
        q_at=lambda b, h, r0: (r0, b * heads_q + h),
        kv_at=lambda b, hk, t, s, which: (t * keys, b * heads_kv + hk),
        out_index=lambda b, h, row, x: (b, h, row, x), dim=dim,
    )


def attention(batch, heads_q, heads_kv, seq_q, seq_kv, head_dim, variant, config=WarpSpecializedConfig(), dtype="float16"):
    """The kernel's PrimFunc for ``q[b, hq, sq, d], k/v[b, hkv, skv, d] -> out`` (like
    ``ops.attention``'s ``main``); :func:`unsupported` must hold None for it. Without a
    cluster its blocks are persistent, one per SM (or per row tile where there are
    fewer) as the runtime-length kernel's (:mod:`tvm_cascade.library.warp_specialized_prefill`):
    a block's next row tile's loads overlap its last one's epilogue."""
    refusal = cluster_unsupported(config.cluster, heads_q, heads_kv, seq_q, variant)
    if refusal:
        raise ValueError(refusal)
    tiles = bhsd_tiles(batch, heads_q, heads_kv, seq_q, seq_kv, head_dim, dtype)
    if config.cluster == 1:
        tiles = dataclasses.replace(tiles, blocks=persistent_blocks(batch, heads_q, seq_q, tvm.cuda(0)))
    if variant.is_causal:
        tiles = dataclasses.replace(tiles, span=causal_span(heads_q, heads_kv, head_dim, seq_kv))
    return kernel(tiles, variant, config)


def _uniform(tiles) -> bool:
    """Whether every sequence of ``tiles`` has ``tiles.rows`` query rows."""
    length = tiles.q_len(tvm.tirx.Var("b", "int32"))
    return isinstance(length, int) or tvm_ffi.structural_equal(length, tiles.rows)


def persistent_blocks(batch, heads_q, rows, device):
    """The persistent blocks of a kernel over ``batch`` sequences of at most ``rows``
    query rows: one per SM of ``device``, or one per row tile where there are fewer (at
    least one). Ints, or PrimExprs of a plan over a call's lengths."""
    return ir.maximum(1, ir.minimum(batch * heads_q * -(-rows // ROWS), sm_count(device)))


def kernel(tiles, variant, config=WarpSpecializedConfig(), scale=None):
    """The kernel's PrimFunc over ``tiles`` (:class:`Tiles`) for ``variant``, Q·Kᵀ scaled
    by ``scale`` (default ``1/sqrt(head_dim)``)."""
    stages, overlap, pingpong, cluster = config.stages, config.overlap, config.pingpong, config.cluster
    causal = variant.is_causal
    heads_q, heads_kv, head_dim, dtype = tiles.heads_q, tiles.heads_kv, tiles.head_dim, tiles.dtype
    group = heads_q // heads_kv
    q_tiles = (tiles.rows + ROWS - 1) // ROWS
    pair_heads = cluster > 1 and group % 2 == 0
    heads = tiles.batch * heads_q  # (sequence, head) pairs
    multicast, mask = (".multicast::cluster", (T.uint16(0b11),)) if cluster > 1 else ("", ())
    # Rows past a sequence's queries, and keys past its keys: some tile may hold them.
    part_rows = not (_whole(tiles.rows, ROWS) and isinstance(tiles.q_len(0), int))
    keys = key_tile(head_dim)
    tile = keys * head_dim  # elements of a K or V stage
    part_keys = not _whole(tiles.kv_len(0), keys)
    masked_tiles = causal or part_keys
    # Rows may see no key: a sequence without keys, or more queries than keys under a mask.
    keyless_rows = not isinstance(tiles.kv_len(0), int) or not isinstance(tiles.q_len(0), int)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale

    def offset_of(b, seq_q, seq_kv):
        """Where sequence ``b``'s first query row sits among its keys' positions."""
        return _offset(seq_q, seq_kv, None if tiles.q_start is None else tiles.q_start(b))

    def placed(row, b, seq_q, seq_kv):
        """Query ``row``'s position among sequence ``b``'s keys'."""
        return row + seq_kv - seq_q if tiles.q_start is None else row + tiles.q_start(b)

    def instruction(columns):
        shape = getattr(T.ptx.wgmma.mma_async.sync.aligned, f"m64n{columns}k16").f32
        return getattr(getattr(shape, PTX_TYPE[dtype]), PTX_TYPE[dtype])

    # Per thread: a row pair's scores of a tile, and of the output.
    scores_mma, output_mma = instruction(keys), instruction(head_dim)
    n_scores, n_output = keys // 2, head_dim // 2
    k_base = ROWS * head_dim
    v_base = k_base + stages * tile
    shared = v_base + stages * tile
    if stages < 1 or shared_bytes(head_dim, stages) > SHARED_BYTES:
        raise ValueError(
            f"{stages} K/V stages need {shared_bytes(head_dim, stages)} bytes of shared memory; "
            f"an sm_90 block has {SHARED_BYTES}"
        )
    kv_boxes = keys // tiles.k_map.rows

    # Scores go to log2 units in one multiply-add: with a softcap, the inner term
    # s·scale/cap + bias/cap, times cap·log2(e) after the tanh.
    inner = 1.0 / variant.softcap if variant.softcap is not None else _LOG2E
    multiplier = scale * inner

    def score(s, bias):
        """The score (log2 units) from the dot product ``s`` and ``bias``, the ALiBi bias
        times ``inner``."""
        s = s * T.float32(multiplier) + bias if variant.alibi else s * T.float32(multiplier)
        if variant.softcap is not None:
            s = T.float32(variant.softcap * _LOG2E) * T.tanh(s)
        return s

    def q_operand(smem, ks, cw):
        # Q: two 64-column panels of ROWS rows, 128-byte swizzled; depth step ks is 32 B
        # into the swizzled row of panel ks // 4.
        return descriptor(smem.ptr_to([ks // 4 * (ROWS * 64) + cw * 64 * 64 + ks % 4 * 16]), 16, 1024, swizzle=True)

    def k_operand(smem, st, ks):
        return descriptor(smem.ptr_to([k_base + st * tile + ks // 4 * (keys * 64) + ks % 4 * 16]), 16, 1024, swizzle=True)

    def v_operand(smem, st, ks):
        # V: as K, [key, d] in 64-column 128-byte swizzled panels, read MN-major: the
        # leading byte offset steps to the next panel along d, the stride to the next 8
        # keys; step ks starts 16 keys on.
        return descriptor(smem.ptr_to([v_base + st * tile + ks * 16 * 64]), keys * 64 * 2, 1024, swizzle=True)

    @T.macro
    def wait(bar, t):
        T.cuda.mbarrier_wait(bar.ptr_to([t % stages]), (t // stages) & 1)

    @T.macro
    def clear_tail(smem, st, t, seq_kv, cw, tx):
        """Zero stage ``st``'s V rows past the sequence's keys (tile ``t``): their exps are
        zero, but the rows may hold anything (a page's unused keys), NaN among it."""
        if t * keys + keys > seq_kv:
            first = T.max(seq_kv - t * keys, 0)
            chunks = T.meta_var((keys - first) * (head_dim // 8))
            for e in T.serial((chunks + 127) // 128):
                c = e * 128 + tx % 128
                if c < chunks:
                    row = first + c // (head_dim // 8)
                    column = c % (head_dim // 8) * 8
                    for x in T.vectorized(8):
                        smem[v_base + st * tile + column // 64 * (keys * 64) + row * 64 + column % 64 + x] = T.Cast(dtype, 0)
            T.ptx.fence.proxy.async_.shared__cta()
            T.ptx.bar.sync(T.uint32(_CLEARED) + T.Cast("uint32", cw), T.uint32(128))

    fence_scores, fence_accumulators = register_fence(n_scores), register_fence(n_output)

    @T.macro
    def fence_output(O_acc, P):
        fence_accumulators(O_acc, 0)
        for i in T.unroll(n_scores // 2):
            T.evaluate(fence_operand(P.vload([2 * i], f"{dtype}x2")))

    @T.macro
    def issue_scores(S, smem, st, cw):
        for ks in T.unroll(head_dim // 16):
            T.evaluate(scores_mma(*[S[i] for i in range(n_scores)], q_operand(smem, ks, cw), k_operand(smem, st, ks), ks > 0, 1, 1, 0, 0))
        T.ptx.wgmma.commit_group.sync.aligned()

    @T.macro
    def issue_output(O_acc, P, smem, st):
        for ks in T.unroll(keys // 16):
            T.evaluate(
                output_mma(
                    *[O_acc[i] for i in range(n_output)],
                    *[T.reinterpret("uint32", P.vload([8 * ks + 2 * q], f"{dtype}x2")) for q in range(4)],
                    v_operand(smem, st, ks), True, 1, 1, 1,
                )
            )
        T.ptx.wgmma.commit_group.sync.aligned()

    @T.macro
    def scores(S, bias, slope, t, r0, b, h, seq_q, seq_kv, cw, w, lane, masked):
        for n in T.unroll(keys // 8):
            for g in T.unroll(2):
                for e in T.unroll(2):
                    S[4 * n + 2 * g + e] = score(S[4 * n + 2 * g + e], bias[g] + slope[0] * T.float32(8 * n + e))
                    if tiles.mask is not None:
                        # (rows and keys past the sequence's, computed and not used, read
                        # its last)
                        at_row = T.min(r0 + 64 * cw + 16 * w + lane // 4 + 8 * g, seq_q - 1)
                        at_key = T.min(t * keys + 8 * n + 2 * (lane % 4) + e, seq_kv - 1)
                        S[4 * n + 2 * g + e] = tiles.mask(S[4 * n + 2 * g + e], b, h, at_row, at_key)
                    if masked:
                        row = r0 + 64 * cw + 16 * w + lane // 4 + 8 * g
                        key = t * keys + 8 * n + 2 * (lane % 4) + e
                        if not visible(row, key, seq_q, seq_kv, variant, keys, offset_of(b, seq_q, seq_kv)):
                            S[4 * n + 2 * g + e] = T.float32(MASKED_SCORE)

    @T.macro
    def softmax(S, m, l, m_new, repair, slope, bias, t, r0, b, h, seq_q, seq_kv, cw, w, lane):
        # Accumulator element 4 n + 2 g + e of lane `lane` in warp w: row 16 w + lane / 4 + 8 g
        # of the warpgroup's 64, key 8 n + 2 (lane % 4) + e of the tile.
        if variant.alibi:
            for g in T.unroll(2):
                # the bias of the row's key 2 (lane % 4) of the tile; key 8 n + e adds (8 n + e) slopes
                bias[g] = slope[0] * T.Cast(
                    "float32", t * keys + 2 * (lane % 4) - placed(r0 + 64 * cw + 16 * w + lane // 4 + 8 * g, b, seq_q, seq_kv)
                )
        if masked_tiles:
            # Only a tile on the mask's edge computes it (a uniform branch; as one
            # predicate per score, nvcc would select on every tile).
            if straddles(r0, t, seq_q, seq_kv, variant, keys, offset_of(b, seq_q, seq_kv)):
                scores(S, bias, slope, t, r0, b, h, seq_q, seq_kv, cw, w, lane, True)
            else:
                scores(S, bias, slope, t, r0, b, h, seq_q, seq_kv, cw, w, lane, False)
        else:
            scores(S, bias, slope, t, r0, b, h, seq_q, seq_kv, cw, w, lane, False)
        for g in T.unroll(2):
            m_new[g] = m[g]
        for n in T.unroll(keys // 8):
            for g in T.unroll(2):
                for e in T.unroll(2):
                    m_new[g] = T.max(m_new[g], S[4 * n + 2 * g + e])
        for g in T.unroll(2):
            m_new[g] = T.max(m_new[g], T.cuda.__shfl_xor_sync(T.uint32(ALL_LANES), m_new[g], 1, 32))
            m_new[g] = T.max(m_new[g], T.cuda.__shfl_xor_sync(T.uint32(ALL_LANES), m_new[g], 2, 32))
            repair[g] = repair_factor(variant, m[g], m_new[g])
            m[g] = m_new[g]
            l[g] = l[g] * repair[g]
        for n in T.unroll(keys // 8):
            for g in T.unroll(2):
                for e in T.unroll(2):
                    S[4 * n + 2 * g + e] = T.exp2(S[4 * n + 2 * g + e] - m[g])
                    l[g] = l[g] + S[4 * n + 2 * g + e]

    @T.macro
    def repair_output(S, P, O_acc, repair):
        for i in T.unroll(n_scores):
            P[i] = T.Cast(dtype, S[i])
        for i in T.unroll(n_output):
            O_acc[i] = O_acc[i] * repair[i % 4 // 2]

    def sees_keys(row, b, seq_q, seq_kv, n_tiles, m_row):
        """Whether ``row`` (its running max ``m_row``) sees some key (else its output is
        zero)."""
        seen = T.bool(True)
        if keyless_rows:
            seen = n_tiles > 0
            if causal:
                seen = T.And(seen, placed(row, b, seq_q, seq_kv) >= 0)
        # (rows placed among the keys may see none of a tile's keys that others see)
        if tiles.mask is not None or tiles.q_start is not None:
            seen = T.And(seen, m_row > T.float32(MASKED_SCORE))
        return seen

    def row_of(r0, cw, w, lane, g):
        """The query row of accumulator row ``g`` of consumer ``cw``'s warp ``w``'s lane."""
        return r0 + 64 * cw + 16 * w + lane // 4 + 8 * g

    def final(outputs, n, e):
        """The output in column ``8 n + 2 (lane % 4) + e`` of the row of ``outputs``
        (:func:`finish`'s): zero where the row sees no key."""
        O_acc, inverse_l, m_row, row, b, seq_q, seq_kv, n_tiles, g = outputs
        return T.if_then_else(sees_keys(row, b, seq_q, seq_kv, n_tiles, m_row), O_acc[4 * n + 2 * g + e] * inverse_l, T.float32(0))

    @T.macro
    def store(out, b, h, row, column, value, seq_q):
        # The rows of a part tile past the sequence's queries (another's, or TMA's zeros)
        # are not stored.
        if part_rows:
            if row < seq_q:
                out[tiles.out_index(b, h, row, column)] = T.Cast(dtype, value)
        else:
            out[tiles.out_index(b, h, row, column)] = T.Cast(dtype, value)

    release = stage_release(cluster)

    @T.macro
    def locate(located, b, hk, t):
        """The map coordinates of every box of key tile ``t``'s K and V, into ``located``:
        their loads (a page table's) issue together, not one between each two copies."""
        for which in T.unroll(2):
            for s in T.unroll(kv_boxes):
                a, c = T.meta_var(tiles.kv_at(b, hk, t, s, which))
                located[(which * kv_boxes + s) * 2] = a
                located[(which * kv_boxes + s) * 2 + 1] = c

    @T.macro
    def fetch(smem, tensor_map, base, st, located, which, bar):
        """The K (``which`` 0) or V (1) rows ``located`` into stage ``st``, box by box."""
        for s in T.unroll(kv_boxes):
            for p in T.unroll(head_dim // 64):
                T.ptx[TMA_COPY.format(3) + multicast](
                    smem.ptr_to([base + st * tile + p * keys * 64 + s * tiles.k_map.rows * 64]),
                    T.address_of(tensor_map), T.int32(p * 64), located[(which * kv_boxes + s) * 2],
                    located[(which * kv_boxes + s) * 2 + 1], bar, *mask,
                )

    @T.macro
    def release_q(q_empty, last):
        # Only the score wgmmas read Q: once the row tile's last has completed, the
        # producer may load the next row tile's Q, and then its K/V tiles, while this
        # tile's last P·V and its epilogue run.
        if last:
            T.ptx.mbarrier.arrive.shared.b64(q_empty.ptr_to([0]), T.uint32(1))

    @T.macro
    def consume(smem, full, empty, q_full, q_empty, S, O_acc, P, m, l, m_new, repair, slope, bias, lo, n_tiles, r0, b, h, seq_q, seq_kv, cw, w, lane, tx, rank, base, q_phase):
        # `base`: the K/V tiles this block consumed before (stages and phases run on
        # across its row tiles); `q_phase`: the parity of its Q loads before.
        T.cuda.mbarrier_wait(q_full.ptr_to([0]), q_phase)
        if overlap:
            wait(full, base)
            clear_tail(smem, base % stages, lo, seq_kv, cw, tx)
            fence_scores(S, 0)
            T.ptx.wgmma.fence.sync.aligned()
            issue_scores(S, smem, base % stages, cw)
            T.ptx.wgmma.wait_group.sync.aligned(0)
            release_q(q_empty, n_tiles == 1)
            fence_scores(S, 0)
            softmax(S, m, l, m_new, repair, slope, bias, lo, r0, b, h, seq_q, seq_kv, cw, w, lane)
            repair_output(S, P, O_acc, repair)
            if pingpong:
                # The first warpgroup issues first.
                if cw == 1 and n_tiles > 1:
                    T.ptx.bar.arrive(T.uint32(_PINGPONG), T.uint32(256))
            for i in range(1, n_tiles):
                wait(full, base + i)
                clear_tail(smem, (base + i) % stages, lo + i, seq_kv, cw, tx)
                if pingpong:
                    T.ptx.bar.sync(T.uint32(_PINGPONG) + T.Cast("uint32", cw), T.uint32(256))
                fence_scores(S, 0)
                fence_output(O_acc, P)
                T.ptx.wgmma.fence.sync.aligned()
                issue_scores(S, smem, (base + i) % stages, cw)
                issue_output(O_acc, P, smem, (base + i - 1) % stages)
                if pingpong:
                    # (The second warpgroup's last turn has no one to hand over to.)
                    if cw == 0 or i < n_tiles - 1:
                        T.ptx.bar.arrive(T.uint32(_PINGPONG + 1) - T.Cast("uint32", cw), T.uint32(256))
                T.ptx.wgmma.wait_group.sync.aligned(1)
                release_q(q_empty, i == n_tiles - 1)
                fence_scores(S, 0)
                softmax(S, m, l, m_new, repair, slope, bias, lo + i, r0, b, h, seq_q, seq_kv, cw, w, lane)
                T.ptx.wgmma.wait_group.sync.aligned(0)
                fence_output(O_acc, P)
                release(empty, (base + i - 1) % stages, rank)
                repair_output(S, P, O_acc, repair)
            fence_output(O_acc, P)
            T.ptx.wgmma.fence.sync.aligned()
            issue_output(O_acc, P, smem, (base + n_tiles - 1) % stages)
            T.ptx.wgmma.wait_group.sync.aligned(0)
            fence_output(O_acc, P)
            release(empty, (base + n_tiles - 1) % stages, rank)
        else:
            for i in range(n_tiles):
                wait(full, base + i)
                clear_tail(smem, (base + i) % stages, lo + i, seq_kv, cw, tx)
                fence_scores(S, 0)
                T.ptx.wgmma.fence.sync.aligned()
                issue_scores(S, smem, (base + i) % stages, cw)
                T.ptx.wgmma.wait_group.sync.aligned(0)
                release_q(q_empty, i == n_tiles - 1)
                fence_scores(S, 0)
                softmax(S, m, l, m_new, repair, slope, bias, lo + i, r0, b, h, seq_q, seq_kv, cw, w, lane)
                repair_output(S, P, O_acc, repair)
                fence_output(O_acc, P)
                T.ptx.wgmma.fence.sync.aligned()
                issue_output(O_acc, P, smem, (base + i) % stages)
                T.ptx.wgmma.wait_group.sync.aligned(0)
                fence_output(O_acc, P)
                release(empty, (base + i) % stages, rank)

    # The grid: `tiles.blocks` blocks (persistent, each taking row tiles in turn), or one
    # block per row tile. A cluster takes a pair of row tiles (two heads of a group on one
    # row tile, or two row tiles of one head) at a time.
    grid = tiles.blocks if tiles.blocks is not None else heads * q_tiles
    clusters = grid // cluster
    per = heads // cluster
    span = None if tiles.span is None else ir.maximum(1, tiles.span // cluster)
    # Under a causal mask persistent blocks take a span's row tiles in folds, in two
    # rounds: a head's u-th row tile from the last, then its u-th from the first. The two
    # see a row tile's keys and one more tile's whatever u, so the blocks' shares even
    # out in any order of the folds; row tiles taken longest first even out only over
    # the whole order (a span's restart of it leaves some blocks the longest tiles of
    # every span), but a fold's last round is whole folds where theirs is short tiles:
    # they are kept where the span holds every head.
    folded = causal and tiles.blocks is not None and (cluster == 1 or pair_heads) and span is not None and span < per
    pairs = heads * q_tiles // cluster
    folds = per * ((q_tiles + 1) // 2)
    units = folds if folded else pairs
    rounds = (folds + clusters - 1) // clusters * 2 if folded else (pairs + clusters - 1) // clusters
    # Under a causal mask a row tile sees more keys the later it is, and the latest are
    # taken first; rows placed after the keys (`q_start`) see fewer, under a window, the
    # later they are, and go in their order. Sequences of fewer query rows than
    # `tiles.rows` have row tiles past their rows: each sequence's row tiles are counted
    # from its own last, so that the longest of every sequence come first and those past
    # its rows last.
    latest_first = causal and tiles.q_start is None
    own_last = latest_first and not folded and cluster == 1 and tiles.blocks is not None and not _uniform(tiles)

    def last_tile(seq_q):
        """The row tile counted first under a causal mask: a sequence's own last where
        ``own_last``."""
        return (seq_q + ROWS - 1) // ROWS - 1 if own_last else q_tiles - 1

    def holds_rows(r0, seq_q):
        """Whether the row tile from ``r0`` holds rows of its sequence."""
        return T.And(0 <= r0, r0 < seq_q) if own_last else r0 < seq_q

    def unit_at(c, n):
        """The unit (a fold, else a pair of row tiles) cluster ``c`` takes in its round
        ``n``: a fold over two rounds; pairs in rounds of alternate direction (longest
        first under a causal mask), so the clusters' shares even out."""
        if folded:
            return n // 2 * clusters + c
        return n * clusters + T.if_then_else(n % 2 == 0, c, clusters - 1 - c)

    def row_tile_of(unit, n, rank):
        """(whether block ``rank`` of ``unit`` takes a row tile in round ``n``, its
        (sequence, head) index, the row tile: counted from the last under a causal
        mask). A span of heads' (:attr:`Tiles.span`) units come before the next span's."""
        takes = unit < units
        if cluster > 1 and not pair_heads:
            return takes, unit // (q_tiles // 2), unit % (q_tiles // 2) * 2 + rank
        if not causal:
            index, tile = unit // q_tiles, unit % q_tiles
        elif folded:
            real, index, tile = causal_fold(unit, n, per, q_tiles, span)
            takes = T.And(takes, real)
        else:
            index, tile = causal_order(unit, per, q_tiles, span)
        return takes, (index * 2 + rank if pair_heads else index), tile

    def has_keys(n_tiles):
        """Whether the row tile reads keys (a Q load and K/V tiles); else its rows are zeros."""
        return n_tiles > 0 if keyless_rows else T.bool(True)

    @T.macro
    def produce(state, smem, full, empty, q_full, q_empty, b, h, r0, lo, n_tiles, seq_q, seq_kv, rank, base, q_phase):
        q_map, k_map, v_map, located = T.meta_var(state)
        hk = T.meta_var(h // group)
        # Q waits for the consumers' last score wgmmas of the block's previous row tile.
        T.cuda.mbarrier_wait(q_empty.ptr_to([0]), q_phase ^ 1)
        T.ptx.mbarrier.arrive.expect_tx.shared.b64(q_full.ptr_to([0]), T.uint32(ROWS * head_dim * 2))
        qa, qc = T.meta_var(tiles.q_at(b, h, r0))
        for p in T.unroll(head_dim // 64):
            T.ptx[TMA_COPY.format(3)](
                smem.ptr_to([p * ROWS * 64]), T.address_of(q_map), T.int32(p * 64), T.int32(qa), T.int32(qc),
                q_full.ptr_to([0]),
            )
        for i in range(n_tiles):
            st = (base + i) % stages
            # The tile's coordinates are loaded while the stage is still being read.
            locate(located, b, hk, lo + i)
            T.cuda.mbarrier_wait(empty.ptr_to([st]), (((base + i) // stages) & 1) ^ 1)
            T.ptx.mbarrier.arrive.expect_tx.shared.b64(full.ptr_to([st]), T.uint32(2 * tile * 2))
            # In a cluster rank 0 fetches K and rank 1 V, each into both blocks
            # (the bytes complete on each block's full[st]).
            if cluster == 1 or rank == 0:
                fetch(smem, k_map, k_base, st, located, 0, full.ptr_to([st]))
            if cluster == 1 or rank == 1:
                fetch(smem, v_map, v_base, st, located, 1, full.ptr_to([st]))

    @T.macro
    def finish(state, smem, full, empty, q_full, q_empty, b, h, r0, lo, n_tiles, seq_q, seq_kv, rank, base, q_phase):
        S, O_acc, P, m, l, m_new, repair, slope, bias, four, tx, cw = T.meta_var(state)
        w = T.meta_var((tx // 32) % 4)
        lane = T.meta_var(tx % 32)
        if variant.alibi:
            slope[0] = T.pow(T.float32(2.0), T.Cast("float32", -8 * (h + 1)) / T.float32(heads_q)) * T.float32(inner)
        for g in T.unroll(2):
            m[g] = T.float32("-inf")
            l[g] = T.float32(0)
        for i in T.unroll(n_output):
            O_acc[i] = T.float32(0)
        if has_keys(n_tiles):
            consume(smem, full, empty, q_full, q_empty, S, O_acc, P, m, l, m_new, repair, slope, bias, lo, n_tiles, r0, b, h, seq_q, seq_kv, cw, w, lane, tx, rank, base, q_phase)
        for g in T.unroll(2):
            l[g] = l[g] + T.cuda.__shfl_xor_sync(T.uint32(ALL_LANES), l[g], 1, 32)
            l[g] = l[g] + T.cuda.__shfl_xor_sync(T.uint32(ALL_LANES), l[g], 2, 32)
        if tiles.lse_index is not None:
            if lane % 4 == 0:
                for g in T.unroll(2):
                    row = T.meta_var(row_of(r0, cw, w, lane, g))
                    if row < seq_q:
                        tiles.params[-1][tiles.lse_index(b, h, row)] = T.if_then_else(
                            sees_keys(row, b, seq_q, seq_kv, n_tiles, m[g]), m[g] + T.log2(l[g]), T.float32(ops.flex_attention.NO_KEYS_LSE),
                        )
        # Four columns stored at a time (:mod:`~tvm_cascade.cuda.accumulator_stores`):
        # two-column stores use a quarter of each sector, and stalls on them made most
        # of a short row tile's time. The four have registers of their own: in the
        # scores' registers, ptxas serialises every wgmma of the kernel (C7511). Each
        # row's sum is inverted once: a division is a branch to a slow path, a product
        # one instruction.
        for g in T.unroll(2):
            l[g] = T.float32(1) / l[g]
        for g in T.unroll(2):
            row = T.meta_var(row_of(r0, cw, w, lane, g))
            outputs = T.meta_var((O_acc, l[g], m[g], row, b, seq_q, seq_kv, n_tiles, g))
            for p in T.unroll(tiles.stored_dim // 16):
                trade_halves(four, lane, lambda e: final(outputs, 2 * p, e), lambda e: final(outputs, 2 * p + 1, e))
                for e in T.vectorized(4):
                    store(tiles.out, b, h, row, 16 * p + first_column(lane) + e, four[e], seq_q)
            if tiles.stored_dim % 16 != 0:
                n = T.meta_var(tiles.stored_dim // 8 - 1)
                for e in T.vectorized(2):
                    store(tiles.out, b, h, row, 8 * n + 2 * (lane % 4) + e, final(outputs, n, e), seq_q)

    def tile_range(b, h, r0, seq_q, seq_kv):
        """The key tiles ``[lo, hi)`` the row tile from ``r0`` reads."""
        lo, hi = key_tiles(r0, seq_q, seq_kv, variant, keys, offset_of(b, seq_q, seq_kv))
        if tiles.key_ranges is None:
            return lo, hi
        least, most = tiles.key_ranges.key_range(b, h, r0)
        return T.max(lo, least), T.min(hi, most)

    @T.macro
    def rows_of(role, state, bx, rank, smem, full, empty, q_full, q_empty, counts):
        """Run ``role`` (:func:`produce` or :func:`finish`) on each row tile the block
        takes, counting the K/V tiles and the Q loads gone by."""
        counts[0] = 0
        counts[1] = 0
        for n in range(rounds):
            unit = unit_at(bx // cluster, n)
            takes, bh, row_tile = T.meta_var(row_tile_of(unit, n, rank))
            if takes:
                b = bh // heads_q
                h = bh % heads_q
                seq_q = tiles.q_len(b)
                seq_kv = tiles.kv_len(b)
                r0 = T.if_then_else(latest_first, last_tile(seq_q) - row_tile, row_tile) * ROWS
                lo, hi = T.meta_var(tile_range(b, h, r0, seq_q, seq_kv))
                n_tiles = hi - lo
                # (a row tile past a shorter sequence's rows has no work)
                if holds_rows(r0, seq_q):
                    role(state, smem, full, empty, q_full, q_empty, b, h, r0, lo, n_tiles, seq_q, seq_kv, rank, counts[0], counts[1] & 1)
                    if has_keys(n_tiles):
                        counts[0] = counts[0] + n_tiles
                        counts[1] = counts[1] + 1

    @T.macro
    def block(q_map, k_map, v_map, bx, rank, tx):
        # __launch_bounds__(384, 1): ptxas must know the registers at entry to honour setmaxnreg
        T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", 1)
        smem = T.alloc_buffer((shared,), dtype, scope="shared.dyn", align=1024)
        full = T.alloc_shared((stages,), "uint64")
        empty = T.alloc_shared((stages,), "uint64")
        q_full = T.alloc_shared((1,), "uint64")
        q_empty = T.alloc_shared((1,), "uint64")
        S = T.alloc_local((n_scores,), "float32")
        O_acc = T.alloc_local((n_output,), "float32")
        P = T.alloc_local((n_scores,), dtype)
        m = T.alloc_local((2,), "float32")
        l = T.alloc_local((2,), "float32")
        m_new = T.alloc_local((2,), "float32")
        repair = T.alloc_local((2,), "float32")
        slope = T.alloc_local((1,), "float32")
        bias = T.alloc_local((2,), "float32")
        four = T.alloc_local((4,), "float32")
        counts = T.alloc_local((2,), "int32")
        warpgroup = T.cuda.__shfl_sync(T.uint32(ALL_LANES), tx // 128, 0, 32)
        if tx == 0:
            for s in T.unroll(stages):
                T.ptx.mbarrier.init.shared.b64(full.ptr_to([s]), T.uint32(1))
                # every consumer thread of the cluster releases every stage
                T.ptx.mbarrier.init.shared.b64(empty.ptr_to([s]), T.uint32(256 * cluster))
            T.ptx.mbarrier.init.shared.b64(q_full.ptr_to([0]), T.uint32(1))
            T.ptx.mbarrier.init.shared.b64(q_empty.ptr_to([0]), T.uint32(256))
            T.ptx.fence.mbarrier_init.release.cluster()
        if cluster > 1:
            # The peer's multicasts and arrivals need this block's barriers initialised.
            T.ptx.barrier.cluster.arrive()
            T.ptx.barrier.cluster.wait()
        else:
            T.cuda.cta_sync()
        if warpgroup == 0:
            T.ptx.setmaxnreg.dec.sync.aligned.u32(config.producer_registers)
            if tx == 0:
                located = T.alloc_local((4 * kv_boxes,), "int32")
                rows_of(produce, (q_map, k_map, v_map, located), bx, rank, smem, full, empty, q_full, q_empty, counts)
        else:
            T.ptx.setmaxnreg.inc.sync.aligned.u32(config.consumer_registers)
            rows_of(finish, (S, O_acc, P, m, l, m_new, repair, slope, bias, four, tx, warpgroup - 1), bx, rank, smem, full, empty, q_full, q_empty, counts)
        if cluster > 1:
            # No block leaves while its peer may still arrive on its barriers.
            T.ptx.barrier.cluster.arrive()
            T.ptx.barrier.cluster.wait()

    @T.prim_func(private=True, check_well_formed=False)
    def main():
        q_map = T.tvm_stack_alloca("tensormap", 1)
        k_map = T.tvm_stack_alloca("tensormap", 1)
        v_map = T.tvm_stack_alloca("tensormap", 1)
        # Q, K and V as rows of d in 64-column boxes, 128-byte swizzled.
        T.evaluate(tiles.q_map.encode(q_map, tiles.stored_dim, dtype))
        T.evaluate(tiles.k_map.encode(k_map, tiles.stored_dim, dtype))
        T.evaluate(tiles.v_map.encode(v_map, tiles.stored_dim, dtype))
        bx = T.launch_thread("blockIdx.x", grid)
        if cluster > 1:
            rank = T.launch_thread("clusterCtaIdx.x", cluster)
            tx = T.launch_thread("threadIdx.x", THREADS)
            block(q_map, k_map, v_map, bx, rank, tx)
        else:
            tx = T.launch_thread("threadIdx.x", THREADS)
            block(q_map, k_map, v_map, bx, 0, tx)

    func = tvm.tirx.PrimFunc(tiles.params, main.body)
    if tiles.key_ranges is not None:
        func = tiles.key_ranges.prepend(func)
    return func.with_attr("global_symbol", "main")


def design_space(variant):
    """A MetaSchedule design space (``fn(sch)``) of this kernel over ``ops.attention``
    function of ``variant``: the traced ``rolling_update`` fuses the running sum and
    output into max's loop over key tiles (:func:`fuse_key_tiles`), whose annotations ask
    :func:`build` for the kernel; the stages (:data:`STAGE_CHOICES`), the consumers'
    form (:data:`FORMS`) and, where the function allows clusters
    (:func:`cluster_unsupported`), the cluster size (:data:`CLUSTER_CHOICES`) are
    ``sample_categorical`` decisions."""

    def space(sch):
        clusters = _cluster_choices(sch.mod["main"], variant)
        stages, form = sample_uniform(sch, STAGE_CHOICES), sample_uniform(sch, range(len(FORMS)))
        cluster = sample_uniform(sch, clusters) if len(clusters) > 1 else None
        _annotate(sch, fuse_key_tiles(sch), variant, stages, form, cluster=cluster)

    return space


def schedule(func, variant, config=WarpSpecializedConfig()):
    """The schedule of ``ops.attention`` function ``func`` (of ``variant``) that
    :func:`build` lowers to this kernel with ``config``'s choices."""
    sch = tvm.s_tir.Schedule(func)
    form = FORMS.index((config.overlap, config.overlap and config.pingpong))
    registers = (config.producer_registers, config.consumer_registers)
    # (annotated as the design space's samples are: where the function allows clusters)
    cluster = config.cluster if config.cluster != 1 or len(_cluster_choices(func, variant)) > 1 else None
    _annotate(sch, fuse_key_tiles(sch), variant, config.stages, form, registers, cluster)
    return sch


def _cluster_choices(func, variant):
    _, heads_q, heads_kv, seq_q, *_ = shapes(func)
    return [c for c in CLUSTER_CHOICES if not cluster_unsupported(c, heads_q, heads_kv, seq_q, variant)]


def fuse_key_tiles(sch):
    """Split ``max``'s key loop into tiles of :data:`KEYS` and fuse ``sum`` and ``pv``
    into it by ``rolling_update`` (which derives and proves their repair); returns the
    loop over key tiles."""
    key_tiles = _key_tiles_loop(sch)
    for name in ("sum", "pv"):
        sch.rolling_update(sch.get_sblock(name), key_tiles)
    return key_tiles


def _key_tiles_loop(sch):
    """Split ``max``'s key loop into tiles of :data:`KEYS`; the loop over tiles."""
    key_tiles, _ = sch.split(sch.get_loops(sch.get_sblock("max"))[-1], [None, KEYS])
    return key_tiles


def _annotate(
    sch, loop, variant, stages, form,
    registers=(WarpSpecializedConfig.producer_registers, WarpSpecializedConfig.consumer_registers),
    cluster=None,
):
    sch.annotate(loop, VARIANT, variant_text(variant))
    sch.annotate(loop, STAGES, stages)
    sch.annotate(loop, FORM, form)
    sch.annotate(loop, REGISTERS, list(registers))
    if cluster is not None:  # (None: no cluster annotation, as in the records before clusters)
        sch.annotate(loop, CLUSTER, cluster)


def variant_text(variant):
    """``variant`` as the text of an annotation, ``field=value`` pairs (no quotes: a
    printed trace stays Python)."""
    values = ((f.name, getattr(variant, f.name)) for f in dataclasses.fields(variant))
    return ",".join(f"{name}={'' if value is None else value}" for name, value in values)


_FIELDS = {"name": str, "causal": "True".__eq__, "window": int, "alibi": "True".__eq__, "softcap": float}


def variant_of(text):
    """The :class:`~tvm_cascade.ops.variants.AttentionVariant` of :func:`variant_text`."""
    values = dict(pair.split("=", 1) for pair in text.split(","))
    if set(values) != set(_FIELDS):
        raise ValueError(f"'{text}' does not give the fields of an attention variant, {sorted(_FIELDS)}")
    return ops.AttentionVariant(**{k: _FIELDS[k](v) if v else None for k, v in values.items()})


def lowers(mod):
    """Whether a loop of ``mod`` asks for this kernel (:func:`build`)."""
    return bool(_annotated_loops(mod))


def _annotated_loops(mod):
    return [
        (func, loop)
        for func in mod.functions.values()
        if isinstance(func, tvm.tirx.PrimFunc)
        for loop in ir.nodes(func.body, tvm.tirx.For)
        if VARIANT in loop.annotations
    ]


def build(mod, target):
    """Compile ``mod``, a schedule of ``ops.attention`` whose key-tile loop
    :func:`design_space` or :func:`schedule` annotated, to this kernel for ``target``:
    the annotated loop, into which ``rolling_update`` fused the chain, is lowered to the
    kernel of its variant and choices (as TVM lowers a loop's software-pipeline
    annotations). ValueError if the loop is not that loop or the kernel does not
    support the function."""
    loops = _annotated_loops(mod)
    if len(loops) != 1:
        raise ValueError(f"the warp-specialised kernel lowers one annotated key-tile loop; the module has {len(loops)}")
    (func, loop), = loops
    annotations = loop.annotations
    variant = variant_of(str(annotations[VARIANT]))
    overlap, pingpong = FORMS[int(annotations[FORM])]
    producer, consumer = (int(r) for r in annotations[REGISTERS])
    cluster = int(annotations[CLUSTER]) if CLUSTER in annotations else 1
    config = WarpSpecializedConfig(int(annotations[STAGES]), overlap, pingpong, producer, consumer, cluster)
    batch, heads_q, heads_kv, seq_q, seq_kv, head_dim, dtype = shapes(func)
    fused = {block.name_hint for block in ir.nodes(loop.body, SBlock)}
    if int(loop.extent) != -(-seq_kv // KEYS) or not {"max", "sum", "pv"} <= fused:
        raise ValueError(
            f"the loop annotated for the warp-specialised kernel must be max's loop over {KEYS}-key tiles "
            f"with sum and pv fused into it by rolling_update; it has {loop.extent} iterations and "
            f"the blocks {sorted(fused)}"
        )
    reason = function_unsupported(func, variant, target)
    if reason is not None:
        raise ValueError(reason)
    func = attention(batch, heads_q, heads_kv, seq_q, seq_kv, head_dim, variant, config, dtype)
    target = sm90a(target)
    with target:  # TVM's CUDA compile callback takes the arch from the current target
        return tvm.compile(tvm.IRModule({"main": func}), target=target)
