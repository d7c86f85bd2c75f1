"""GPU schedule for prefill attention on tensor cores (FlashAttention form).

Built from the traced ``rolling_update`` and the tile rewrites of
:mod:`tvm_cascade.primitives.tiles`, then ordinary TVM primitives. One thread block owns
``rows`` query rows of one head (under grouped-query attention of short key lengths, 32
rows of each of 4 query heads of a group, which share each K and V tile:
:func:`default_heads`), each of its warps 32 of them from the first key tile to the
epilogue, and walks the keys in tiles of ``keys``:

* Q is copied to shared memory once, each K and V tile per key tile (128-bit copies
  by all threads of the block; Q's by ``cp.async`` where the pipelined key loop waits
  for it, see :func:`build`); a key loop of a constant number of tiles (no mask, or the
  inner tiles of padded keys) is software-pipelined FlashAttention-2's way (a
  design-space choice: :func:`default_pipeline`): the next tile's K copied by
  ``cp.async`` once Q·Kᵀ has read this tile's, its V once P·V has, into the same
  shared buffers; so is a causal mask's one loop over a block's inner and boundary
  tiles (:mod:`.merged_tiles`);
* ``qk`` (Q·Kᵀ of the tile) runs on tensor cores: ldmatrix from shared memory and
  ``mma.sync`` m16n8k16 with fp32 accumulators, each warp its rows; the scores stay in
  the accumulators (registers), or, where the score adds a bias from the key's position
  (ALiBi) or a causal mask applies, the scores are computed once into registers in
  their place;
* the per-tile max and sum (``split_tile_accumulation`` of the rolled ``max`` and
  ``sum``) are split again by the lanes that hold a row's keys: each lane reduces its
  own elements of a row in registers to one partial; the row statistics (the tile's
  max and sum, the running ones, the repair factors ``exp(m_prev - m)``) are
  ``replicate``-d in the four lanes that share a row, so each lane folds the quad's
  partials by warp shuffles and keeps its own copy of its rows' statistics in
  registers: no shared memory and no barrier; each lane computes its exps from its
  scores and its copy of the row's max straight into fp16 fragments in the mma operand
  layout, the A operand of the second GEMM (the exps never leave registers), and the
  row sum adds the float32 exps;
* the running output lives in the warp's mma accumulators (registers): per pass over
  ``1 / pv_split`` of the head dimension, each lane repairs its elements of the output
  (``O * factor``) and the tile's exps · V accumulates onto them on tensor cores
  (``accumulate_in_place``: no second set of accumulators); the epilogue normalises
  them by the sum into shared memory, and each warp stores its rows from there in
  128-bit words;
* the reductions' initial values sit before the key loop, and with a causal or window
  mask ``skip_masked_tiles`` bounds the key loop to the tiles the block's rows see and
  ``unmask_inner_tiles`` splits it into the tiles every row sees in full, computed
  without the mask, and the boundary tiles, computed with it.

Query and key lengths must be whole tiles; ``ops.attention(pad_to=(rows, keys))`` pads
others, and the schedule inlines its pad blocks into the copies to shared memory.

With ``PrefillConfig(wgmma=True)`` both GEMMs are Hopper warpgroup MMAs instead
(:mod:`.wgmma`): Q, K and V in shared memory as core matrices (Q's rows in the order the
m64 instructions hand them to the warps), Q·Kᵀ from shared memory, P·V with the exps
from registers, each GEMM one asynchronous batch waited for before its result is read;
everything else as above. Correct, and measured slower than the ``mma.sync`` kernels
(docs/WGMMA.md), so not the default.
"""
from dataclasses import dataclass, replace
from typing import Optional

import tvm
import tvm_ffi
from tvm.ir import expr as ir_expr

from ..analysis.chain import substitute
from ..analysis.scope import buffer_params, uses_var
from ..primitives import ir
from ..primitives.tiles import linear_conjuncts, linear_slope, mask_condition
from ..cuda import merged_tiles, software_pipeline, tensor_cores, wgmma
from ..cuda.async_prologue import async_prologue_copies
from ..trace import sample_uniform
from ..cuda.padding import inline_padding
from ..cuda.tensor_cores import cuda_intrinsics
from . import warp_specialized
from .mma_tiles import MMA, SHARED, VECTOR, WARP, bind_fragment_lanes, copy_in_words, fragment, tile


QUAD = 4  # lanes of an mma fragment that share a row
#: An annotation TVM does not know: it keeps a loop of one iteration a loop.
KEEP_LOOP = "tvm_cascade.keep_loop"
#: The ptxas ``--register-usage-level`` a schedule chose: an annotation of the kernel's
#: thread-block loop, which :func:`build` reads. (Not of the root block: once that is
#: annotated, TVM 0.27's later schedule primitives rewrite the scheduled function in
#: place.)
REGISTER_USAGE_LEVEL = "tvm_cascade.ptxas_register_usage_level"
#: The thread blocks per multiprocessor a schedule asked the compiler to fit (an
#: annotation of the thread-block loop, which :func:`build` reads).
MIN_BLOCKS = "tvm_cascade.min_blocks_per_multiprocessor"
#: :func:`build` as a global function returning the runtime module, for MetaSchedule's
#: builder processes.
BUILD_FUNC = "tvm_cascade.build_prefill"


@dataclass(frozen=True)
class PrefillConfig:
    """Tunable choices of the prefill schedule."""

    # Query rows per thread block, one warp per 32 rows. Only 128 (4 warps) builds: at
    # 64, TVM's storage planner puts an fp16 shared buffer in an fp32 one's place and
    # its ldmatrix address lowering rejects the mixed types.
    rows: int = 128
    keys: int = 64  # keys per tile (64 measured faster than 32 for every variant)
    pv_split: int = 4  # passes over the head dimension in the P·V GEMM (register pressure)
    # ptxas's --register-usage-level (0-10); None: :func:`default_register_usage_level`
    register_usage_level: Optional[int] = None
    # Whether a key loop of a constant number of tiles is software-pipelined (in single
    # buffers under mma.sync; a causal mask's merged tile loop always is); None:
    # :func:`default_pipeline`
    pipeline: Optional[bool] = None
    # Query heads per thread block, of one grouped-query group (they share each K and V
    # tile), rows / heads rows of each; None: :func:`default_heads`
    heads: Optional[int] = None
    # Both GEMMs as Hopper warpgroup MMAs (wgmma, sm_90a) instead of mma.sync
    # (:mod:`.wgmma`); one head per block, a multiple of 128 rows
    wgmma: bool = False
    # Query rows per warp: 32 (under wgmma, 16 of each 64-row half of its warpgroup), or
    # under wgmma 16 (a warpgroup per 64 rows)
    warp_rows: int = WARP
    # Thread blocks per multiprocessor the compiler must fit (registers capped to match:
    # ``__launch_bounds__``'s second argument); None: as many as its registers allow.
    # Measured side by side on an H200 (ms, wgmma with 16-row warps, 256 threads a
    # block, None against 2): global b8 s1024 0.641/0.580, s4096 10.83/8.94, causal b8
    # s1024 0.421/0.359, s4096 5.05/4.27
    min_blocks: Optional[int] = None
    # Under wgmma, with P·V in one pass: FlashAttention-3's intra-warpgroup overlap on a
    # key loop of a constant number of tiles (tile j+1's Q·Kᵀ and tile j's P·V issued
    # together, tile j+1's softmax while P·V runs; copies two tiles ahead:
    # :func:`.software_pipeline.overlap_annotations`). Measured side by side on an H200
    # (ms, 16-row warps, one block a multiprocessor; global b8 s1024 / b8 s4096 / b1
    # s16384, softcap b8 s1024): without 0.653 / 11.35 / 22.42 / 0.695, with 0.616 /
    # 9.03 / 18.12 / 0.660; the mma.sync default 0.460 / 6.86 / 13.73 / 0.495.
    overlap: bool = False


def default_pipeline(func, keys, wgmma=False):
    """Whether the prefill schedule of ``ops.attention`` function ``func`` with ``keys``
    keys per tile software-pipelines a key loop of a constant number of tiles (no mask, or
    only padded keys'). With ``mma.sync`` always, in single buffers
    (:func:`.software_pipeline.interleaved_annotations`); measured side by side on an
    H200 (ms, global unless named, 64-key tiles; interleaved against the double-buffered
    pipeline of up to :data:`PIPELINED_TILES` tiles and synchronous copies beyond): b8
    s1024 0.446/0.459, b8 s4096 6.82/7.03, b1 s16384 13.65/13.84, softcap b8 s4096
    7.36/7.45. Under wgmma (double-buffered) up to :data:`PIPELINED_TILES` tiles: longer
    loops ran faster synchronously there, overlapped only by the other thread block on
    the multiprocessor (mma.sync, double-buffered against synchronous: b8 s1024
    0.460/0.475, b8 s2048 1.851/1.773, b8 s4096 7.31/7.00, b1 s16384 14.47/13.97)."""
    return not wgmma or _shape(tvm.s_tir.Schedule(func))[3] // keys <= PIPELINED_TILES


def default_heads(func, rows=128):
    """Query heads per thread block of ``rows`` rows (one warp per 32) for ``ops.attention``
    function ``func``: under grouped-query attention whose groups are a multiple of the
    block's warps and up to :data:`SHARED_KV_KEYS` keys, one head per warp, the heads
    sharing each K and V tile and each head's rows cut 32 at a time (a causal mask's
    diagonal wastes less), where the lengths are whole blocks and tiles (as measured on
    the GPU; :func:`schedule_prefill` takes any key length and a query length that is a
    multiple of 32); else 1. Longer key loops lose by it: a causal mask's tiles are
    pipelined in one loop (:mod:`.merged_tiles`) where a block has two or more
    diagonal tiles, 128 rows of one head. Measured side by side on an H200 (ms, 1
    against 4 heads per block, 32 query / 8 kv heads, 64-key tiles; before the merged
    loop): causal b8 s1024 0.298/0.282, b8 s4096 3.679/3.752, b1
    s16384 7.178/7.334; no mask b8 s1024 0.471/0.466, b8 s4096 6.930/6.953."""
    q, k = buffer_params(func)[:2]
    warps = rows // WARP
    group = int(q.shape[1]) // int(k.shape[1])
    whole = int(q.shape[2]) % rows == 0 and int(k.shape[2]) % max(KEY_TILES) == 0
    if group % warps or int(k.shape[2]) > SHARED_KV_KEYS or not whole:
        return 1
    return warps


def position_bias(func):
    """Whether the score of ``ops.attention`` function ``func`` adds a bias computed from
    the key's position (ALiBi)."""
    block, mask = _score(func)
    score = block.body.value if mask is None else block.body.value.true_value
    # The key's position, not the product it indexes.
    positions = tvm_ffi.structural_map(score, (ir_expr.TensorLoad, lambda load: tvm.tirx.const(0, load.source.dtype)))
    return uses_var(positions, block.iter_vars[-1].var)


def default_register_usage_level(func):
    """ptxas's ``--register-usage-level`` for ``ops.attention`` function ``func``: its own
    default 5 rather than the 10 TVM passes, except under a window mask (a lower bound on
    the key that rises with the query row). Measured side by side on an H200 (ms, level
    10 against 5, 64-key tiles): causal b8 s4096 4.45/4.01, ALiBi b8 s1024 0.475/0.455,
    global b8 s1024 0.553/0.546, but window b8 s1024 0.265/0.276, b8 s4096
    1.053/1.101."""
    return 10 if sliding_window(func) else 5


def sliding_window(func):
    """Whether the mask of ``ops.attention`` function ``func`` bounds the key from below
    by a bound that rises with the query row (a sliding window)."""
    return "below" in _rising_key_bounds(func)


def causal_mask(func):
    """Whether the mask of ``ops.attention`` function ``func`` bounds the key from above
    by a bound that rises with the query row, and not from below (a causal mask: the
    thread blocks see different numbers of key tiles)."""
    return _rising_key_bounds(func) == {"above"}


def _rising_key_bounds(func):
    """The sides (``"below"``, ``"above"``) from which a conjunct of the mask of
    ``ops.attention`` function ``func`` bounds the key by a bound that rises with the
    query row."""
    block, mask = _score(func)
    row, key = (iv.var for iv in block.iter_vars[-2:])
    analyzer = tvm.sym.Analyzer()
    sides = set()
    # (A conjunct holds iff its difference is <= 0: a lower bound on the key has the key
    # with a negative slope, the row with a positive one.)
    for difference, _ in linear_conjuncts(mask) if mask is not None else ():
        (along_key, _), (along_row, _) = (linear_slope(analyzer, difference, v) for v in (key, row))
        if along_key is not None and along_row is not None and along_key * along_row < 0:
            sides.add("below" if along_key < 0 else "above")
    return sides


def _score(func):
    """(the ``score`` block of ``ops.attention`` function ``func``, its mask or None)."""
    sch = tvm.s_tir.Schedule(func)
    block = sch.get(sch.get_sblock("score"))
    return block, mask_condition(block)


def build(mod, target):
    """Compile a scheduled prefill module for ``target`` (:func:`tensor_cores.build`) at
    the ptxas register usage level its schedule chose (:data:`REGISTER_USAGE_LEVEL`) and
    for the thread blocks per multiprocessor it asked for (:data:`MIN_BLOCKS`), the key
    loops it chose to pipeline pipelined
    (:func:`~.software_pipeline.apply_chosen_pipelines`), and the Q tile's copy issued
    asynchronously where the pipeline covers it
    (:func:`~.async_prologue.async_prologue_copies`). A module whose key-tile loop asks for
    the warp-specialised kernel (:func:`.warp_specialized.lowers`, a sample of its design
    space) is compiled to that kernel (:func:`.warp_specialized.build`)."""
    if warp_specialized.lowers(mod):
        return warp_specialized.build(mod, target)
    level = _chosen(mod, REGISTER_USAGE_LEVEL, "ptxas register usage levels")
    min_blocks = _chosen(mod, MIN_BLOCKS, "thread blocks per multiprocessor")
    mod = async_prologue_copies(software_pipeline.apply_chosen_pipelines(merged_tiles.merge_tile_loops(mod)))
    return tensor_cores.build(mod, target, register_usage_level=level, min_blocks=min_blocks)


def chooses_registers(mod):
    """Whether ``mod`` is a schedule of this module's: its block loop carries the ptxas
    register usage level every schedule and sample of the design space chooses."""
    return _chosen(mod, REGISTER_USAGE_LEVEL, "ptxas register usage levels") is not None


def _chosen(mod, annotation, what):
    """The value of loop ``annotation`` in ``mod``'s functions (None if no loop has it)."""
    values = set()

    def visit(node):
        if isinstance(node, tvm.tirx.For) and annotation in node.annotations:
            values.add(int(node.annotations[annotation]))

    for func in mod.functions.values():
        if isinstance(func, tvm.tirx.PrimFunc):
            tvm_ffi.structural_walk(func.body, visit)
    if len(values) > 1:
        raise ValueError(f"the module's functions ask for different {what} {sorted(values)}")
    return values.pop() if values else None


tvm_ffi.register_global_func(BUILD_FUNC, lambda mod, target, _params: build(mod, target).mod, override=True)


def check_shape(seq_q, seq_kv, head_dim, config):
    """Raise ``ValueError`` unless the schedule supports this shape (``config.keys``
    resolved)."""
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
    if config.register_usage_level is None:
        config = replace(config, register_usage_level=default_register_usage_level(func))
    if config.pipeline is None:
        config = replace(config, pipeline=default_pipeline(func, config.keys, config.wgmma))
    if config.heads is None:
        config = replace(config, heads=1 if config.wgmma else default_heads(func, config.rows))
    sch = tvm.s_tir.Schedule(func, seed=1)
    _, heads_q, seq_q, seq_kv = _shape(sch)
    check_shape(seq_q, seq_kv, _head_dim(sch), config)
    q, k = buffer_params(func)[:2]
    group = heads_q // int(k.shape[1])
    if (config.rows // WARP) % config.heads or group % config.heads:
        # (Heads of different groups would need a K and V tile each.)
        raise ValueError(
            f"{config.heads} query heads per thread block must divide its {config.rows // WARP} "
            f"warps and the query heads that share a K and V head ({group})"
        )
    queries = int(q.shape[2])
    if config.heads > 1 and queries % (config.rows // config.heads):
        # (The output's row bound then cuts a head's slice of the block, and TVM's
        # compute-at primitives no longer see the block's stages as a pipeline.)
        raise ValueError(
            f"with {config.heads} query heads per thread block the query length must be a "
            f"multiple of {config.rows // config.heads} rows per head; got {queries}"
        )
    if config.warp_rows not in ((wgmma.ROWS, WARP) if config.wgmma else (WARP,)):
        raise ValueError(
            f"{config.warp_rows} rows per warp; the schedule takes {WARP}, or {wgmma.ROWS} with wgmma"
        )
    if config.wgmma and (config.heads != 1 or config.rows % wgmma.BLOCK_ROWS or _head_dim(sch) % 64):
        raise ValueError(
            f"the wgmma prefill schedule takes one query head and a multiple of {wgmma.BLOCK_ROWS} rows per thread block "
            f"and a head dimension that is a multiple of 64; got {config.heads} heads, "
            f"{config.rows} rows, head dimension {_head_dim(sch)}"
        )
    if config.wgmma and config.keys != 64 and sliding_window(func):
        # (The window's tile range leaves offsets of the accumulators in a form that TVM's
        # LowerWarpMemory cannot split into lane and element.)
        raise ValueError(f"the wgmma prefill schedule takes 64-key tiles under a sliding window; got {config.keys}")
    if config.overlap and not (config.wgmma and config.pv_split == 1):
        raise ValueError(
            f"the overlapped key loop takes wgmma and P·V in one pass; got wgmma={config.wgmma}, "
            f"pv_split={config.pv_split}"
        )
    loop = apply_prefill_schedule(
        sch, config.rows, config.keys, config.pv_split, config.register_usage_level, config.heads,
        config.warp_rows if config.wgmma else None, config.min_blocks, config.overlap,
    )
    if config.overlap and loop is None:
        raise ValueError(
            "the overlapped key loop needs a key loop of a constant number of tiles (no causal or window mask)"
        )
    if loop is not None:
        choice = (
            software_pipeline.OVERLAPPED if config.overlap
            else software_pipeline.INTERLEAVED if config.pipeline and not config.wgmma
            else int(config.pipeline)
        )
        sch.annotate(loop, software_pipeline.CHOSEN, choice)
    return sch


#: The design space's choices: keys per tile, passes over the head dimension in P·V,
#: ptxas's register usage level, whether a key loop of a constant number of tiles is
#: software-pipelined.
KEY_TILES = (32, 64)
PV_SPLITS = (1, 2, 4)
REGISTER_USAGE_LEVELS = (5, 10)
PIPELINES = (software_pipeline.INTERLEAVED, 0)
#: Key tiles up to which :func:`default_pipeline` pipelines.
PIPELINED_TILES = 16
#: Keys up to which :func:`default_heads` has a thread block take several query heads
#: of a group.
SHARED_KV_KEYS = 1024
#: The multiples of (query rows, keys) ``ops.attention(pad_to=...)`` pads to for the
#: schedule: whole tiles of every choice of :func:`prefill_design_space`.
PADDING = (PrefillConfig().rows, max(KEY_TILES))


def prefill_design_space(rows=PrefillConfig().rows):
    """A MetaSchedule design space (``fn(sch)``) over the prefill schedule: the key tile,
    the P·V passes, ptxas's register usage level and, where the key loop has a constant
    number of tiles, its software pipeline are ``sample_categorical`` decisions (only the
    key tiles that divide the key length), applied through the traced ``rolling_update``
    and tile rewrites; the query heads per block are :func:`default_heads`'s."""

    def space(sch):
        _, _, seq_q, seq_kv = _shape(sch)
        keys = [k for k in KEY_TILES if seq_kv % k == 0]
        check_shape(seq_q, seq_kv, _head_dim(sch), PrefillConfig(rows, min(KEY_TILES)))
        if not keys:
            raise ValueError(f"no key tile of {KEY_TILES} divides {seq_kv} keys")

        def sample(options):
            return sample_uniform(sch, options)

        heads = default_heads(sch.mod["main"], rows)
        loop = apply_prefill_schedule(
            sch, rows, sample(keys), sample(PV_SPLITS), sample(REGISTER_USAGE_LEVELS), heads
        )
        if loop is not None:
            sch.annotate(loop, software_pipeline.CHOSEN, sample(PIPELINES))

    return space


def row_tiles(sch, rows, keys, warps=1, per_tile=("pv",), heads=1):
    """The FlashAttention form of ``ops.attention`` with ``keys`` keys per tile, the
    reductions ``per_tile`` split into a per-tile reduction and the update that folds it
    into the running value, and a tile of ``rows`` query rows in ``warps`` slices, each
    slice's rows moved below the key loop; returns the loops (batch, head, row tile,
    slice, key tile, row in slice). With ``heads`` > 1 the tile takes ``rows / heads``
    rows of each of ``heads`` consecutive query heads (which share their K and V under
    grouped-query attention), a head's rows in ``warps / heads`` slices: the head loop
    returned is over groups of ``heads`` heads, the slice loop fuses head and slice."""
    b, h, i, j = sch.get_loops(sch.get_sblock("max"))
    j0, _ = sch.split(j, [None, keys])
    sch.rolling_update(sch.get_sblock("sum"), j0)
    sch.rolling_update(sch.get_sblock("pv"), j0)
    sch.compute_at(sch.get_sblock("score"), j0)
    sch.compute_at(sch.get_sblock("qk"), j0)
    for name in per_tile:
        sch.split_tile_accumulation(sch.get_sblock(name), j0)
    # One head per tile without a unit split of the head loop: the trace the checked-in
    # tuning records (one head per block) replay.
    if heads == 1:
        i0, iw, i1 = sch.split(i, [None, warps, rows // warps])
        sch.reorder(j0, i1)
        return b, h, i0, iw, j0, i1
    h, hw = sch.split(h, [None, heads])
    i0, iw, i1 = sch.split(i, [None, warps // heads, rows // warps])
    sch.reorder(i0, hw, iw, j0, i1)
    return b, h, i0, sch.fuse(hw, iw), j0, i1


def apply_prefill_schedule(
    sch, rows, keys, pv_split, register_usage_level, heads=1, wgmma_warp_rows=None, min_blocks=None, overlap=False
):
    """The prefill schedule on a fresh schedule of ``ops.attention``; ``keys``,
    ``pv_split`` and ``register_usage_level`` (ptxas's, for :func:`build`) are ints or
    sampled ``ExprRV``s; ``heads`` query heads per block (:func:`row_tiles`);
    ``wgmma_warp_rows``: both GEMMs on warpgroup MMAs (:mod:`.wgmma`), this many rows per
    warp (None: ``mma.sync``, 32); ``min_blocks``: thread blocks per multiprocessor for
    :func:`build` (None: the compiler's choice); ``overlap``: the P·V statements left
    apart for :func:`.software_pipeline.overlap_annotations` (one pass). Returns the key
    loop whose software pipeline is the caller's choice
    (:data:`~.software_pipeline.CHOSEN`): the key loop without a mask, the inner tiles'
    loop under a mask of padded keys only; else None (a causal mask's tiles are
    pipelined in one loop, :func:`_pipeline_inner_tiles`, a window's not)."""
    use_wgmma = wgmma_warp_rows is not None
    warps = rows // (wgmma_warp_rows or WARP)
    # A causal mask's inner and boundary tiles run in one loop whose statements that
    # the mask changes branch on the tile's kind (:mod:`.merged_tiles`): with the scores
    # kept that is one statement (the masked copy of the scores), inlined it would be
    # three (the max, the sum, the exps), and ptxas spills (296 B at b8 s4096).
    causal = causal_mask(sch.mod["main"])
    scores_kept = position_bias(sch.mod["main"]) or causal
    # FlashAttention form, each warp's rows below the key loop, one loop nest per stage:
    # qk, score, max_tile, max, exp, sum_scale, sum_tile, sum, pv_scale, pv_tile, pv.
    b, h, i0, ty, j0, i1 = row_tiles(sch, rows, keys, warps, per_tile=("pv", "max", "sum"), heads=heads)
    gemm = _wgmma_gemm if use_wgmma else _gemm
    sch.distribute(i1)
    score = sch.get_sblock("score")
    if scores_kept:
        # A bias from the key's position costs index arithmetic per score: computed once
        # into registers in place of the Q·Kᵀ accumulators rather than inlined into both
        # the max and the exps (H200, ALiBi b8 s1024 / s4096 / b1 s16384, ms: inlined
        # 0.357 / 4.28 / 8.14, kept 0.328 / 3.94 / 7.56; without a bias keeping the
        # scores is 0-2% slower: softcap b8 s1024 0.494 / 0.505, global 0.469 / 0.475).
        sch.set_scope(score, 0, "warp")
        sch.transform_layout(score, ("write", 0), fragment)
        bind_fragment_lanes(sch, score)
    else:
        sch.compute_inline(score)
    bx = sch.fuse(b, h, i0)
    sch.bind(bx, "blockIdx.x")
    sch.annotate(bx, REGISTER_USAGE_LEVEL, register_usage_level)
    if min_blocks is not None:
        sch.annotate(bx, MIN_BLOCKS, min_blocks)
    # Each warp owns its rows from the first key tile to the epilogue: their scores,
    # exps and running output stay in its registers.
    sch.bind(ty, "threadIdx.y")
    out = sch.get_sblock("out")
    sch.reverse_compute_at(out, ty)
    # The output leaves through shared memory (here: while the scope still is a stage
    # pipeline, which the in-place P·V below ends).
    out_copy = sch.cache_write(out, 0, SHARED)
    sch.reverse_compute_at(out_copy, ty)

    # The scores stay in the accumulators of Q·Kᵀ; each lane reduces its own elements
    # of a row (the keys of one column class of the fragment layout) to a partial max
    # and sum, and the row statistics are replicated in the four lanes that share the
    # row: each folds the quad's partials (shuffles) and keeps its own copy of the row's
    # max, sum and repair factors in registers.
    _lane_partials(sch, "max_tile")
    _lane_partials(sch, "sum_tile")
    row_statistics = ("max_tile", "max", "sum_scale", "sum_tile", "sum", "pv_scale")
    for name in row_statistics:
        sch.replicate(sch.get_sblock(name), QUAD, 2)
    for name in row_statistics:
        _quad_rows(sch, name, j0)
    _exps(sch)
    # (After the stages above: a GEMM's initial values make a second writer of its
    # accumulator, and compute-at primitives want one writer per buffer.)
    gemm(sch, sch.get_sblock("qk"), bx, j0, warps, transposed_b=True)

    # The running output in the mma accumulator layout, in registers: per pass over a
    # slice of the head dimension, each lane repairs its elements (O * factor) and the
    # tile's P·V (the exps straight from registers as the A operand) accumulates onto
    # them.
    pv = sch.get_sblock("pv")
    row, dim = sch.get_loops(pv)[-2:]
    passes, dim = sch.split(dim, [pv_split, None])
    sch.reorder(passes, row)
    sch.annotate(passes, tensor_cores.UNROLL, 1)
    if not overlap:
        # (Overlapped, the tile's P·V and its fold into the output stay statements of
        # their own, which the pipeline orders apart: :func:`.software_pipeline.overlap_annotations`.)
        sch.compute_at(sch.get_sblock("pv_tile"), passes)
    sch.set_scope(pv, 0, "warp")
    sch.transform_layout(pv, ("write", 0), wgmma.accumulator if use_wgmma else fragment)
    bind_fragment_lanes(sch, pv)
    # FlashAttention's order: the tile's P·V accumulates onto the repaired output (no
    # second set of accumulators, no zero fill), and the fold is a copy.
    sch.decompose_reduction(pv, j0)

    def seed(init):
        # Once every block is placed and every copy to shared memory exists: the seeded
        # tile reads the output the fold then writes, a write-after-read that TVM's
        # compute-at and compute-inline refuse. First, lengths padded to whole tiles
        # (``ops.attention(pad_to=...)``): the copies read the inputs, with zeros past
        # their ends.
        inline_padding(sch)
        sch.accumulate_in_place(pv, init)

    gemm(sch, sch.get_sblock("pv_tile"), None, j0, warps, transposed_b=False, seed=seed)
    # The epilogue normalises each lane's elements of the output into shared memory, a
    # column pair at a time, and the warp copies its rows out in 128-bit stores: stored
    # straight from the fragments, the 16-bit stores of eight rows at a time took
    # 10-17% of a 1024-key kernel (H200, b8 s1024: global 0.530 -> 0.473 ms, causal
    # 0.359 -> 0.304, window 0.251 -> 0.193).
    bind_fragment_lanes(sch, out, column_pairs=True)
    copy_in_words(sch, out_copy, out)
    # The key loops stay loops even over one tile (64 keys or fewer, or the last tile of
    # padded keys that unmask_inner_tiles splits off): without its loop, TVM's storage
    # planner puts that tile's fp16 buffers in the place of fp32 ones, which the ldmatrix
    # address lowering rejects.
    sch.annotate(j0, KEEP_LOOP, 1)
    # Initial values once before the key loop, not as a branch in every tile.
    for name in ("max", "sum"):
        sch.decompose_reduction(sch.get_sblock(name), j0)
    # Causal and window masks: each thread block walks only the key tiles its rows see,
    # and only the tiles its rows see in part compute the mask.
    masked = sch.get_sblock("score" if scores_kept else "max_tile_tile")
    if mask_condition(sch.get(masked)) is not None:
        if sch.get(j0).extent.value == 1:
            # (One key tile: none to skip or to unmask.)
            return None
        sch.skip_masked_tiles(masked, j0)
        sch.unmask_inner_tiles(sch.get_loops(sch.get_sblock("max_update"))[2])
        return _pipeline_inner_tiles(sch, use_wgmma, merge=causal)
    return j0


def _exps(sch):
    """The tile's exps as P·V's A operand: fp16 in the mma operand layout, in registers;
    the row sum adds the float32 exps, as FlashAttention does (the exps are inlined into
    the sum and into the fp16 copy, and the CUDA compiler computes each once). Measured
    side by side on an H200 (ms, the sum reading the fp16 operand back against float32
    exps): global b8 s1024 0.537/0.525, s4096 7.570/7.448, causal b8 s1024 0.374/0.359,
    GQA 0.367/0.354, softcap 0.585/0.571, window 0.262/0.250; ALiBi b8 s4096 with its
    scores kept in registers 4.236/3.935."""
    pv_tile = sch.get_sblock("pv_tile")
    operand = sch.cache_read(pv_tile, 0, "warp", consumer_blocks=[pv_tile])
    sch.compute_inline(sch.get_sblock("exp"))
    sch.unsafe_set_dtype(operand, 0, "float16")
    sch.transform_layout(operand, ("write", 0), fragment)
    bind_fragment_lanes(sch, operand)


def _lane_partials(sch, name):
    """Split the per-tile row reduction ``name`` (loops rows x keys over a fragment) by
    the lanes that hold its keys: ``<name>_tile`` reduces each lane's keys of a row
    (lane ``4 * (row % 8) + (key % 8) // 2``) in registers into warp memory, and
    ``name`` the row's four partials."""
    block = sch.get_sblock(name)
    rows, keys = sch.get_loops(block)[-2:]
    # The 16-key tile and the half of it as loops of their own (not one column loop
    # split by division): under a mask's condition TVM's simplifier would fold the
    # division's quotient into the element offset (where the mask bounds the column,
    # e.g. to 0 in the last tile of 200 keys), and LowerWarpMemory could no longer
    # separate the lane from the element.
    tile, half, lane, pair = sch.split(keys, [None, 2, QUAD, 2])
    sch.reorder(lane, tile, half)
    sch.split_tile_accumulation(block, lane)
    sch.distribute(lane)
    sch.distribute(rows)
    partial = sch.get_sblock(f"{name}_tile")
    sch.set_scope(partial, 0, "warp")
    sch.transform_layout(partial, ("write", 0), lambda lane, *index: (*index[:-1], *_quad(index[-1], lane)))
    rows, lane = sch.get_loops(partial)[-5:-3]
    row_half, row = sch.split(rows, [None, 8])
    sch.reorder(row, lane, row_half)
    lanes = sch.fuse(row, lane)
    sch.bind(lanes, "threadIdx.x")
    for loop in sch.get_loops(partial)[-4:]:
        sch.annotate(loop, tensor_cores.UNROLL, 1)
    # Each lane reduces in registers and stores each partial once (placed per row half:
    # at the lane loop, TVM would relax the four rows' stores to one 25-element range).
    store = sch.cache_write(partial, 0, "local")
    sch.reverse_compute_at(store, sch.get_loops(partial)[-4])


def _quad_rows(sch, name, j0):
    """Bind the row block ``name``, replicated ``QUAD`` times (loops below ``j0``: rows,
    the lanes it reduces if it folds partials, replicas), to the four lanes of a quad:
    replica ``c`` of row ``r`` lives in lane ``4 * (r % 8) + c`` (warp memory, registers),
    the lane that holds the row's keys and output columns ``(col % 8) // 2`` in the mma
    layout."""
    block = sch.get_sblock(name)
    loops = sch.get_loops(block)
    below = loops[[sch.get(l).same_as(sch.get(j0)) for l in loops].index(True) + 1:]
    rows, replica = below[0], below[-1]
    row_half, row = sch.split(rows, [None, 8])
    sch.reorder(*below[1:-1], row, replica)
    sch.bind(sch.fuse(row, replica), "threadIdx.x")
    for loop in sch.get_loops(block)[len(loops) - len(below):-1]:
        sch.annotate(loop, tensor_cores.UNROLL, 1)
    for index in range(len(sch.get(block).writes)):
        sch.set_scope(block, index, "warp")
        sch.transform_layout(block, ("write", index), lambda *index: (*index[:-2], *_quad(*index[-2:])))


def _quad(row, replica):
    """(row // 8, lane) of replica ``replica`` of ``row`` in warp memory."""
    return row // 8, QUAD * (row % 8) + replica


def _pipeline_inner_tiles(sch, use_wgmma, merge):
    """A mask's inner tiles: where their number is a constant of two or more (a mask of
    padded keys only), returns their loop, whose pipeline is a choice. Where it depends
    on the block (a causal mask's inner tiles end at the block's first row: none for the
    first block), TVM cannot pipeline their loop (its prologue would run under a
    condition, where its barrier planner places no barrier); with ``merge`` (a causal
    mask, its scores kept) the loop is annotated to merge with the boundary tiles' at
    build time (:mod:`.merged_tiles`), a loop of two or more tiles for every block,
    pipelined as a loop of a constant number of tiles is by default (interleaved;
    double-buffered under wgmma). (A window's inner tiles stay unpipelined: merged as
    they are, with the scores inlined into the max, the sum and the exps, TVM's barrier
    planner refused the loop, "Cannot insert syncs inside condition".) Measured side by
    side on an H200 (ms, pipelined runs of two inner tiles against the merged loop):
    causal b8 s1024 0.306 / 0.281, b8 s4096 3.787 / 3.704, b1 s16384 7.282 / 7.317; GQA
    b8 s4096 3.718 / 3.624, b1 s16384 7.254 / 7.223; ALiBi b8 s4096 3.912 / 3.921, b1
    s16384 7.562 / 7.568."""
    if not any(b.name_hint == "max_update_inner" for b in ir.blocks_in(sch.mod["main"].body.block)):
        return None
    loops = sch.get_loops(sch.get_sblock("max_update_inner"))
    extent = sch.get(loops[2]).extent
    if isinstance(extent, tvm.tirx.IntImm):
        # (One tile has nothing to overlap.)
        return loops[2] if extent.value > 1 else None
    analyzer = tvm.sym.Analyzer()
    for above in loops[:2]:
        node = sch.get(above)
        analyzer.bind(node.loop_var, tvm.ir.Range.from_min_extent(node.min, node.extent))
    # (The boundary tiles' extent names the inner tiles' count, bound before their loop.)
    bound = {}

    def visit(node):
        if isinstance(node, tvm.tirx.Bind):
            bound[node.var] = node.value

    tvm_ffi.structural_walk(sch.mod["main"].body, visit)
    boundary = sch.get(sch.get_loops(sch.get_sblock("max_update"))[2]).extent
    if merge and analyzer.can_prove(substitute(extent + boundary, bound) >= 2):
        sch.annotate(loops[2], merged_tiles.MERGE, 1 if use_wgmma else software_pipeline.INTERLEAVED)
    return None


def _head_dim(sch):
    return int(sch.get(sch.get_loops(sch.get_sblock("out"))[-1]).extent)


def _shape(sch):
    """(batch, query heads, query length, key length) of an unscheduled ``ops.attention``."""
    return [int(sch.get(l).extent) for l in sch.get_loops(sch.get_sblock("max"))]


def _gemm(sch, block, a_at, j0, warps, transposed_b, seed=None):
    """Tensor-core GEMM of one warp's ``block`` (loops rows x cols x depth last): A
    copied to dynamic shared memory at ``a_at`` (None: A already is a warp fragment in
    the mma operand layout, as the exps are), B at ``j0``, both by all ``warps`` warps and through
    ldmatrix into warp fragments, fp32 accumulators that stay in registers (the block's
    buffer takes the fragment layout) and start from zero, or from what ``seed(init)``
    makes the initial-value block ``init`` store, element by element."""
    intrin = cuda_intrinsics()
    i, n, k = sch.get_loops(block)[-3:]
    mi, i16 = sch.split(i, [None, MMA])
    nj, n16 = sch.split(n, [None, MMA])
    ko, k16 = sch.split(k, [None, MMA])
    sch.reorder(ko, mi, nj, i16, n16, k16)

    # Operands: A (rows of this block) and B (this key tile) in shared memory.
    a_index, b_index = 0, 1
    if a_at is not None:
        _operand_to_shared(sch, block, a_index, a_at, warps)
    _operand_to_shared(sch, block, b_index, j0, warps)
    b_warp = sch.cache_read(block, b_index, "warp", consumer_blocks=[block])
    sch.compute_at(b_warp, ko)
    caches = [(b_warp, intrin.LDMATRIX_f16_B_TRANS_DYN_INTRIN if transposed_b else intrin.LDMATRIX_f16_B_DYN_INTRIN)]
    if a_at is not None:
        a_warp = sch.cache_read(block, a_index, "warp", consumer_blocks=[block])
        sch.compute_at(a_warp, ko)
        caches.append((a_warp, intrin.LDMATRIX_f16_A_DYN_INTRIN))
    init = sch.decompose_reduction(block, ko)
    if seed is not None:
        seed(init)
    sch.set_scope(block, 0, "warp")
    sch.transform_layout(block, ("write", 0), fragment)
    for cache, load in caches:
        sch.transform_layout(cache, ("write", 0), fragment)
        sch.tensorize(tile(sch, cache), load)
    sch.tensorize(
        i16, intrin.MMA_f16f16f32_TRANS_B_INTRIN if transposed_b else intrin.MMA_f16f16f32_INTRIN
    )
    if seed is not None:
        bind_fragment_lanes(sch, init)
        for loop in sch.get_loops(init)[-9:-7]:
            sch.annotate(loop, tensor_cores.UNROLL, 1)
    else:
        sch.tensorize(sch.get_loops(init)[-2], intrin.MMA_fill_16x16_f32_INTRIN)


def _wgmma_gemm(sch, block, a_at, j0, warps, transposed_b, seed=None):
    """:func:`_gemm` on warpgroup MMAs: the operands in shared memory as core matrices
    (A from its warp fragment if ``a_at`` is None: the rs form), the warp's 16-row
    slices of the 64-row halves, the accumulators in :func:`.wgmma.accumulator`'s
    layout, the key-depth steps one batch of asynchronous instructions."""
    i, n, k = sch.get_loops(block)[-3:]
    warp_rows = int(sch.get(i).extent)
    half, i16 = sch.split(i, [None, wgmma.ROWS])
    ko, k16 = sch.split(k, [None, wgmma.DEPTH])
    sch.reorder(ko, half, i16, n, k16)
    a_index, b_index = 0, 1
    if a_at is not None:
        _operand_to_core_matrices(sch, block, a_index, a_at, warps, wgmma.row_slices(warp_rows))
    _operand_to_core_matrices(sch, block, b_index, j0, warps, wgmma.core_matrices)
    init = sch.decompose_reduction(block, ko)
    if seed is not None:
        seed(init)
    sch.set_scope(block, 0, "warp")
    sch.transform_layout(block, ("write", 0), wgmma.accumulator)
    columns = int(sch.get(n).extent)
    sch.tensorize(i16, wgmma.scores_intrin(columns) if transposed_b else wgmma.output_intrin(columns))
    sch.annotate(ko, wgmma.BATCH, 1)
    bind_fragment_lanes(sch, init)


def _operand_to_core_matrices(sch, block, index, at, warps, layout):
    """Copy operand ``index`` of ``block`` to shared memory at loop ``at`` in ``layout``
    (of core matrices), 128-bit copies by all threads, consecutive lanes down a core
    matrix's rows (its 128 contiguous bytes: no bank conflicts)."""
    cache = sch.cache_read(block, index, SHARED)
    sch.compute_at(cache, at, index=0)
    sch.transform_layout(cache, ("write", 0), layout)
    rows, cols = sch.get_loops(cache)[-2:]
    row_group, row = sch.split(rows, [None, wgmma.CORE])
    col_group, col = sch.split(cols, [None, VECTOR])
    sch.reorder(row_group, col_group, row, col)
    _, ty, tx = sch.split(sch.fuse(row_group, col_group, row), [None, warps, WARP])
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(col)


def _operand_to_shared(sch, block, index, at, warps):
    """Copy operand ``index`` of ``block`` to shared memory at loop ``at`` with 128-bit
    copies by all threads."""
    cache = sch.cache_read(block, index, SHARED)
    # First in the loop body: the copy is issued before the tile's other work, and its
    # buffer lives beside the fp32 ones, never in place of one (the storage planner would
    # otherwise alias them across types, which the ldmatrix address lowering rejects).
    sch.compute_at(cache, at, index=0)
    copy_in_words(sch, cache, cache, warps)
