"""GPU schedule for prefill attention on tensor cores (FlashAttention form).

Built from the traced ``rolling_update`` and the tile rewrites of
:mod:`tvm_cascade.primitives.tiles`, then ordinary TVM primitives. One thread block owns
``rows`` query rows of one head and walks the keys in tiles of ``keys``:

* Q is copied to shared memory once, each K and V tile per key tile (128-bit copies
  by all threads);
* ``qk`` (Q·Kᵀ of the tile) runs on tensor cores: ldmatrix from shared memory and
  ``mma.sync`` m16n8k16 with fp32 accumulators, each warp ``rows / warps`` rows; the
  scores go to shared memory (rows padded by one word);
* one thread per row applies the score modification and mask (inlined ``score``),
  keeps the running max and sum and writes the tile's exps as fp16 for the second GEMM,
  all in one loop nest over static shared memory (no barrier inside it);
* ``pv_tile`` (exps · V of the tile) runs on tensor cores like ``qk``;
* the running output lives in shared memory: one thread per row repairs it
  (``O * exp(m_prev - m)``) and adds the tile's P·V once per tile; the epilogue
  normalises it by the sum;
* the reductions' initial values sit before the key loop, and with a causal or window
  mask ``skip_masked_tiles`` bounds the key loop to the tiles the block's rows see and
  ``unmask_inner_tiles`` splits it into the tiles every row sees in full, computed
  without the mask, and the boundary tiles, computed with it.

Query and key lengths must be whole tiles; ``ops.attention(pad_to=(rows, keys))`` pads
others, and the schedule inlines its pad blocks into the copies to shared memory.
"""
from dataclasses import dataclass

import tvm

from ..primitives.tiles import mask_condition
from .padding import inline_padding
from .tensor_cores import cuda_intrinsics


WARP = 32
MMA = 16  # the m16n16k16 tile the TVM mma intrinsics cover
VECTOR = 8  # fp16 elements in a 128-bit copy
SHARED = "shared.dyn"
# The row statistics and the exps live in static shared memory: TVM's barrier planner
# sees all of dynamic shared memory as one buffer, so a thread writing its own row there
# would conflict with every other dynamic buffer read in the same loop and get a barrier
# per iteration.
ROW_SHARED = "shared"
#: An annotation TVM does not know: it keeps a loop of one iteration a loop.
KEEP_LOOP = "tvm_cascade.keep_loop"


@dataclass(frozen=True)
class PrefillConfig:
    """Tunable choices of the prefill schedule."""

    # Query rows per thread block, one thread per row for the softmax. Only 128 (4 warps)
    # builds: at 64, TVM's storage planner puts an fp16 shared buffer in an fp32 one's
    # place and its ldmatrix address lowering rejects the mixed types.
    rows: int = 128
    keys: int = 64  # keys per tile
    pv_split: int = 1  # passes over the head dimension in the P·V GEMM (register pressure)


def check_shape(seq_q, seq_kv, head_dim, config=PrefillConfig()):
    """Raise ``ValueError`` unless the schedule supports this shape."""
    if head_dim % MMA or seq_q % config.rows or seq_kv % config.keys:
        raise ValueError(
            f"the prefill schedule needs head_dim a multiple of {MMA}, query length a multiple "
            f"of {config.rows} and key length a multiple of {config.keys}; got head_dim "
            f"{head_dim}, {seq_q} queries, {seq_kv} keys (ops.attention(pad_to=...) pads "
            "other lengths)"
        )


def schedule_prefill(func, config=PrefillConfig()):
    """Schedule ``ops.attention(..., dtype="float16")`` for CUDA tensor cores; returns the
    schedule."""
    sch = tvm.s_tir.Schedule(func, seed=1)
    _, _, seq_q, seq_kv = _shape(sch)
    check_shape(seq_q, seq_kv, _head_dim(sch), config)
    apply_prefill_schedule(sch, config.rows, config.keys, config.pv_split)
    return sch


#: The design space's choices: keys per tile, passes over the head dimension in P·V.
KEY_TILES = (32, 64)
PV_SPLITS = (1, 2, 4)


def prefill_design_space(rows=PrefillConfig().rows):
    """A MetaSchedule design space (``fn(sch)``) over the prefill schedule: the key tile
    and the P·V passes are ``sample_categorical`` decisions (only the key tiles that
    divide the key length), applied through the traced ``rolling_update`` and tile
    rewrites."""

    def space(sch):
        _, _, seq_q, seq_kv = _shape(sch)
        keys = [k for k in KEY_TILES if seq_kv % k == 0]
        check_shape(seq_q, seq_kv, _head_dim(sch), PrefillConfig(rows, min(KEY_TILES)))
        if not keys:
            raise ValueError(f"no key tile of {KEY_TILES} divides {seq_kv} keys")

        def sample(options):
            return sch.sample_categorical(list(options), [1.0 / len(options)] * len(options))

        apply_prefill_schedule(sch, rows, sample(keys), sample(PV_SPLITS))

    return space


def row_tiles(sch, rows, keys):
    """The FlashAttention form of ``ops.attention`` with ``keys`` keys per tile, P·V split
    into a per-tile GEMM and its repair, and a tile of ``rows`` query rows moved below the
    key loop; returns the loops (batch, head, row tile, key tile, row in tile)."""
    b, h, i, j = sch.get_loops(sch.get_sblock("max"))
    j0, _ = sch.split(j, [None, keys])
    sch.rolling_update(sch.get_sblock("sum"), j0)
    sch.rolling_update(sch.get_sblock("pv"), j0)
    sch.compute_at(sch.get_sblock("score"), j0)
    sch.compute_at(sch.get_sblock("qk"), j0)
    sch.split_tile_accumulation(sch.get_sblock("pv"), j0)
    i0, i1 = sch.split(i, [None, rows])
    sch.reorder(j0, i1)
    return b, h, i0, j0, i1


def apply_prefill_schedule(sch, rows, keys, pv_split):
    """The prefill schedule on a fresh schedule of ``ops.attention``; ``keys`` and
    ``pv_split`` are ints or sampled ``ExprRV``s."""
    warps = rows // WARP
    # FlashAttention form, then a tile of rows below the key loop, one loop nest per stage.
    b, h, i0, j0, i1 = row_tiles(sch, rows, keys)
    # Stages qk, score, then max, exp and sum in one row loop (each thread reads only the
    # statistics it wrote: no barrier between them), then pv_tile, pv.
    sch.distribute(i1, [1, 1, 3, 1, 1])
    sch.compute_inline(sch.get_sblock("score"))
    max_block, exp, sum_block = (sch.get_sblock(name) for name in ("max", "exp", "sum"))
    stats_row = sch.get_loops(max_block)[-2]
    bx = sch.fuse(b, h, i0)
    sch.bind(bx, "blockIdx.x")
    out = sch.get_sblock("out")
    sch.reverse_compute_at(out, bx)

    _gemm(sch, sch.get_sblock("qk"), bx, j0, warps, 1, transposed_b=True)

    # One thread per row for the row statistics and the exps.
    ty, tx = sch.split(stats_row, [warps, WARP])
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    sch.set_scope(max_block, 0, ROW_SHARED)
    sch.set_scope(max_block, 1, ROW_SHARED)
    sch.set_scope(sum_block, 0, ROW_SHARED)
    sch.set_scope(exp, 0, ROW_SHARED)
    # Padded rows: ldmatrix's eight row addresses hit distinct banks.
    sch.storage_align(exp, 0, axis=-2, factor=MMA, offset=VECTOR)
    sch.unsafe_set_dtype(exp, 0, "float16")
    _gemm(sch, sch.get_sblock("pv_tile"), None, j0, warps, pv_split, transposed_b=False)
    # Lengths padded to whole tiles (``ops.attention(pad_to=...)``): the shared-memory
    # copies read the inputs, with zeros past their ends.
    inline_padding(sch)

    # The running output stays in shared memory (registers would need one thread mapping
    # for the tile loop's stages and the epilogue, which TVM's buffer compaction cannot
    # see across loop nests). One thread per row repairs (O * exp(m_prev - m), one exp
    # per row and tile) and advances its row; rows padded like the tile's P·V, so that
    # both are read at one index (no barrier) and without bank conflicts.
    pv = sch.get_sblock("pv")
    row, _ = sch.get_loops(pv)[-2:]
    ty, tx = sch.split(row, [warps, WARP])
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    sch.set_scope(pv, 0, SHARED)
    sch.storage_align(pv, 0, axis=-2, factor=WARP, offset=1)
    # The epilogue normalises with lanes along the head dimension (coalesced stores).
    _, ty, tx = sch.split(sch.fuse(*sch.get_loops(out)[-2:]), [None, warps, WARP])
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    # The key loops stay loops even over one tile (64 keys or fewer, or the last tile of
    # padded keys that unmask_inner_tiles splits off): without its loop, TVM's storage
    # planner puts that tile's fp16 buffers in the place of fp32 ones, which the ldmatrix
    # address lowering rejects.
    sch.annotate(j0, KEEP_LOOP, 1)
    # Initial values once before the key loop, not as a branch in every tile.
    for name in ("max", "sum", "pv"):
        sch.decompose_reduction(sch.get_sblock(name), j0)
    # Causal and window masks: each thread block walks only the key tiles its rows see,
    # and only the tiles its rows see in part compute the mask.
    if mask_condition(sch.get(max_block)) is not None:
        sch.skip_masked_tiles(max_block, j0)
        sch.unmask_inner_tiles(sch.get_loops(sch.get_sblock("max_update"))[1])


def _head_dim(sch):
    return int(sch.get(sch.get_loops(sch.get_sblock("out"))[-1]).extent)


def _shape(sch):
    """(batch, query heads, query length, key length) of an unscheduled ``ops.attention``."""
    return [int(sch.get(l).extent) for l in sch.get_loops(sch.get_sblock("max"))]


def _gemm(sch, block, a_at, j0, warps, col_passes, transposed_b):
    """Tensor-core GEMM of ``block`` (loops rows x cols x depth under ``j0``): A copied
    to dynamic shared memory at ``a_at`` (None: A already is in static shared memory, as
    the exps are), B at ``j0``, both through
    ldmatrix into warp fragments, fp32 accumulators, the result stored to shared
    memory with rows padded by one word (its readers take one row per thread)."""
    intrin = cuda_intrinsics()
    i, n, k = sch.get_loops(block)[-3:]
    ty, mi, i16 = sch.split(i, [warps, None, MMA])
    no, nj, n16 = sch.split(n, [col_passes, None, MMA])
    ko, k16 = sch.split(k, [None, MMA])
    sch.reorder(ty, no, ko, mi, nj, i16, n16, k16)
    sch.bind(ty, "threadIdx.y")

    # Operands: A (rows of this block) and B (this key tile) in shared memory.
    a_index, b_index = 0, 1
    if a_at is not None:
        _operand_to_shared(sch, block, a_index, a_at, warps)
    _operand_to_shared(sch, block, b_index, j0, warps)
    a_warp = sch.cache_read(block, a_index, "warp", consumer_blocks=[block])
    b_warp = sch.cache_read(block, b_index, "warp", consumer_blocks=[block])
    sch.compute_at(a_warp, ko)
    sch.compute_at(b_warp, ko)
    c_warp = sch.cache_write(block, 0, "warp")
    sch.reverse_compute_at(c_warp, no)
    sch.set_scope(c_warp, 0, SHARED)
    store_name = sch.get(c_warp).name_hint
    init = sch.decompose_reduction(block, ko)

    def layout(*index):
        *outer, r, c = index
        return (*outer, r // MMA, c // MMA, *intrin.shared_16x16_to_ldmatrix_32x8_layout(r % MMA, c % MMA))

    sch.transform_layout(a_warp, ("write", 0), layout)
    sch.transform_layout(b_warp, ("write", 0), layout)
    sch.transform_layout(c_warp, ("read", 0), layout)

    b_load = intrin.LDMATRIX_f16_B_TRANS_DYN_INTRIN if transposed_b else intrin.LDMATRIX_f16_B_DYN_INTRIN
    a_load = intrin.LDMATRIX_f16_A_DYN_INTRIN if a_at is not None else intrin.LDMATRIX_f16_A_INTRIN
    for cache, name in ((a_warp, a_load), (b_warp, b_load)):
        r, c = sch.get_loops(cache)[-2:]
        ro, ri = sch.split(r, [None, MMA])
        co, ci = sch.split(c, [None, MMA])
        sch.reorder(ro, co, ri, ci)
        sch.tensorize(ri, name)
    sch.tensorize(
        i16, intrin.MMA_f16f16f32_TRANS_B_INTRIN if transposed_b else intrin.MMA_f16f16f32_INTRIN
    )
    sch.tensorize(sch.get_loops(init)[-2], intrin.MMA_fill_16x16_f32_INTRIN)
    r, c = sch.get_loops(c_warp)[-2:]
    ro, ri = sch.split(r, [None, MMA])
    co, ci = sch.split(c, [None, MMA])
    sch.reorder(ro, co, ri, ci)
    sch.tensorize(ri, intrin.MMA_store_16x16_f32_shared_dyn_INTRIN)
    # On the tensorized block: tensorize drops the annotations of the block it replaces.
    sch.storage_align(sch.get_sblock(f"{store_name}_o"), 0, axis=-2, factor=WARP, offset=1)


def _operand_to_shared(sch, block, index, at, warps):
    """Copy operand ``index`` of ``block`` to shared memory at loop ``at`` with 128-bit
    copies by all threads."""
    cache = sch.cache_read(block, index, SHARED)
    # First in the loop body: the copy is issued before the tile's other work, and its
    # buffer lives beside the fp32 ones, never in place of one (the storage planner would
    # otherwise alias them across types, which the ldmatrix address lowering rejects).
    sch.compute_at(cache, at, index=0)
    fused = sch.fuse(*sch.get_loops(cache)[-2:])
    _, ty, tx, vec = sch.split(fused, [None, warps, WARP, VECTOR])
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(vec)
    # Rows padded by one 128-bit word: ldmatrix's eight row addresses hit distinct banks.
    sch.storage_align(cache, 0, axis=-2, factor=MMA, offset=VECTOR)
