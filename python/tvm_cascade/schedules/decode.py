"""GPU schedule for decode attention (a few query rows, many keys): split-k (FlashDecoding).

Built from the traced ``split_k_update``, then ordinary TVM primitives, in one of four
forms (:func:`qk_form`). With GQA groups of 8 query heads or multiples (from
``mma_from_group``), or speculative decoding whose rows (query, head) of a K/V head fill
tiles of 8 (MHA with 8 queries, groups of 2 with 4 or 8, ...), on tensor cores, two
kernels:

* the chunks: a block of warps per chunk of keys. It stages the group's query rows once
  and the chunk's keys a tile at a time in shared memory with 128-bit copies; each warp
  computes the scores of 16 keys with 8 query rows (heads of a query row, or packed rows
  (query, head)) at a time by ``mma.sync.m16n8k16`` (:mod:`.mma16x8`, operands by
  ldmatrix) and stores them to shared memory; the warps then split the rows for max, exp
  (fp16, in shared memory) and sum, their lanes the keys, and the head dimension for
  P·V, again by m16n8k16 (16 dims x 8 rows x 16 keys,
  V staged a tile at a time and transposed by ldmatrix); the partial outputs go from the
  accumulators to global memory. Such schedules build with :func:`.tensor_cores.build`;
* the combine, as below.

Otherwise kernels 1 and 2 below, or, where a chunk serves at most ``fuse_rows`` query
rows (one or two, as in MHA and small GQA groups), both as one (``"fused"``): the
threads of each chunk first compute its scores as kernel 1's lanes do, a few K rows in
flight at a time, into shared memory, which saves a launch and the scores' round trip
through global memory; then the combine:

* kernel 1, ``qk``:

  - lanes (small GQA groups): thread rows (``threadIdx.y``) take a few keys each, 16
    lanes (``threadIdx.x``) split the head dimension with 128-bit loads of K and reduce
    with shuffles; each lane keeps its slice of the group's query rows in registers;
  - tiled (groups of ``tile_from_group`` query heads or more, where the lanes' shuffles
    for every head would dominate): a block stages a tile of keys, a slice of the head
    dimension at a time, and its group's query rows in shared memory with coalesced
    128-bit loads; each thread then computes whole dot products of a few consecutive keys
    with every query row of the group, with no reduction across threads;

  either way each K row is loaded once for all query heads of its group;
* kernel 2, the chunks: a chunk of keys belongs to a row of head_dim / 8 lanes (``threadIdx.x``),
  one row per chunk (``threadIdx.y``) and per slice of the group's query heads
  (``threadIdx.z``; the head loop is moved below the chunk loop before ``split_k_update``
  so that every block placed under it gets its own head loop). The lanes reduce each
  head's max and sum with shuffles, write the exps to shared memory, and fold V rows
  into registers with 128-bit loads, 8 dims per lane; the head slices of a chunk read the
  same V rows, which the first of them brings into L1. Several query rows of one head
  per K/V head are served like the heads of a group (:func:`packs_queries`); otherwise
  each query row has blocks of its own;
* kernel 3, the combine: a block per query row, a thread per output dim and slice of the
  chunks, which combines the chunks' maxima, sums and partial outputs and writes the
  output.

The chunk count is chosen from the shape and the number of SMs: enough threads to keep
the GPU's memory busy, chunks long enough that the partial outputs they write
(``group x head_dim`` floats each) stay small next to the K and V rows they read, and
short enough that a block's exps (or scores) fit its share of shared memory. Key counts the chunks
do not split are padded by ``ops.attention(pad_to=(1, PAD_KEYS))``; the schedule inlines
the pad blocks into its K and V loads.
"""
import dataclasses
import math
from dataclasses import dataclass

import tvm

from ..analysis.scope import buffer_params
from ..cuda import mma16x8
from ..cuda.padding import inline_padding, padded_inputs
from ..trace import sample_uniform

VECTOR = 8  # fp16/bf16 elements in a 128-bit load
#: Key lengths the schedule takes: multiples of this (``ops.attention(pad_to=(1, PAD_KEYS))``
#: pads others, its blocks ``K_pad`` and ``V_pad`` are inlined into the loads).
PAD_KEYS = 128


@dataclass(frozen=True)
class DecodeConfig:
    """Tunable choices of the decode schedule."""

    qk_rows: int = 8  # kernel 1 (lanes): thread rows per block
    keys_per_row: int = 4  # kernel 1 (lanes): keys each thread row reduces
    fuse_rows: int = 2  # lanes: kernel 2 computes the scores itself for chunks of at most this many query rows ...
    fused_keys: int = 8  # ... K rows each of its thread rows loads at once ...
    fused_block_chunks: int = 2  # ... and chunks per block (threadIdx.y)
    tile_from_group: int = 4  # kernel 1 is tiled for GQA groups of this many heads or more ...
    mma_from_group: int = 8  # ... and on tensor cores (with kernel 2) for multiples of 8 from this
    mma_warps: int = 8  # tensor cores: warps per chunk (at most head_dim / 16)
    mma_pv_keys: int = 128  # tensor cores: V rows staged in shared memory at once (at least v_tiles' first)
    mma_score_bytes: int = 16384  # tensor cores: shared memory for a chunk's scores (float32) at most
    # Tensor cores: threads to aim for per SM and the combine's slices (as threads_per_sm
    # and combine_slices). Swept on an H200 (benchmarks.sweep_decode, against 2048 and 2):
    # GQA kv4096 0.0490 -> 0.0467 ms, kv32768 0.2807 -> 0.2733, 8 queries: causal
    # kv32768 1.062 -> 1.042, GQA kv32768 0.887 -> 0.825; the single slice makes the
    # difference except at GQA kv4096, where 1024 threads do too (0.0467; 2048: 0.0484).
    mma_threads_per_sm: int = 1024
    mma_combine_slices: int = 1
    tile_threads: int = 64  # kernel 1 (tiled): threads per block
    tile_keys: int = 4  # kernel 1 (tiled): consecutive keys per thread
    tile_stages: int = 2  # kernel 1 (tiled): slices of the head dimension staged in turn
    rows: int = 4  # kernel 2: chunks per block (threadIdx.y)
    heads_per_thread: int = 4  # kernel 2: query heads of the group each thread serves
    pv_keys: int = 8  # kernel 2: V rows each lane loads before folding them in
    packed_rows: int = 8  # kernel 2: query rows a chunk serves at most (one head per K/V head)
    combine_slices: int = 2  # kernel 3: threads (threadIdx.y) that split a row's chunks
    threads_per_sm: int = 2048  # kernel 2: threads to aim for per SM
    min_chunk: int = 128  # kernel 2: keys per chunk at least, if the shape allows ...
    keys_per_head: int = 16  # ... and at least this many per query head of the group
    exp_bytes: int = 32768  # kernel 2: shared memory for a block's exps (float32) at most


def qk_form(group, config, rows=1):
    """The schedule's form for GQA groups of ``group`` query heads whose chunks serve
    ``rows`` query rows (:func:`rows_per_chunk`): ``"mma"`` (tensor cores, scores and
    chunks in one kernel), ``"fused"`` (lanes, scores and chunks in one kernel, for at
    most ``fuse_rows`` rows: more rows multiply the lanes' shuffles, which then outweigh
    the saved launch), ``"tiled"`` or ``"lanes"`` (kernel 1's form). Tensor cores serve
    groups of 8 heads or multiples (from ``mma_from_group``), and packed rows (query,
    head) of a K/V head that fill tiles of 8 (:func:`packs_queries`)."""
    if group >= config.mma_from_group and group % mma16x8.COLS == 0:
        return "mma"
    if rows > group and rows >= config.mma_from_group and rows % mma16x8.COLS == 0:
        return "mma"  # packed query rows (packs_queries)
    if group >= config.tile_from_group:
        return "tiled"
    return "fused" if rows <= config.fuse_rows else "lanes"


def score_bytes(rows, config):
    """Shared memory for the scores of a chunk of ``rows`` query rows on tensor cores:
    ``mma_score_bytes``, or enough for ``PAD_KEYS`` keys (the shortest chunk)."""
    return max(config.mma_score_bytes, 4 * rows * PAD_KEYS)


def v_tiles(head_dim, scores):
    """The V tiles (rows) the tensor-core form may stage: more bytes than a chunk's
    ``scores``, so that TVM's storage planner never puts the fp16 tile, which ldmatrix
    reads, in the place of the dead fp32 scores (the ldmatrix address lowering rejects
    that)."""
    return [keys for keys in (16, 32, 64, 128) if keys * (head_dim + VECTOR) * 2 > scores]


def z_threads(group, heads_per_thread):
    """Kernel 2's threads over the query heads of a group (``threadIdx.z``)."""
    per_thread = min(heads_per_thread, group)
    if group % per_thread:
        raise ValueError(f"{per_thread} heads per thread do not divide a group of {group}")
    return group // per_thread


def longest_chunk(group, rows, config):
    """Keys per chunk at most: the exps of ``rows`` chunks of the whole group fit
    ``config.exp_bytes`` of shared memory."""
    return config.exp_bytes // (4 * rows * group)


def lanes_for(head_dim):
    """Lanes (``threadIdx.x``) over the head dimension: one 128-bit load each."""
    lanes = head_dim // VECTOR
    if head_dim % VECTOR or lanes & (lanes - 1) or not 1 < lanes <= 32:
        raise ValueError(
            f"the decode schedule needs head_dim {VECTOR} times a power of two between 2 "
            f"and 32 (64 and 128 among them), got {head_dim}"
        )
    return lanes


def choose_chunks(batch, heads_kv, group, seq_kv, config, multiprocessors, lanes=16, granularity=None):
    """The chunk count: a multiple of ``config.rows`` dividing ``seq_kv / granularity``
    (chunks split the keys evenly, in whole groups of ``granularity`` keys, default
    ``lanes``) with at most :func:`longest_chunk` keys; among those with at least
    ``max(min_chunk, keys_per_head * group)`` keys (all, if none has), the one closest to
    ``threads_per_sm`` threads per SM (``lanes`` threads per slice of a chunk's heads)."""
    granularity = granularity or lanes
    threads_per_chunk = lanes * z_threads(group, config.heads_per_thread)
    wanted = config.threads_per_sm * multiprocessors / (batch * heads_kv * threads_per_chunk)
    groups = seq_kv // granularity
    longest = longest_chunk(group, config.rows, config)
    fits = [
        c
        for c in range(config.rows, groups + 1, config.rows)
        if groups % c == 0 and seq_kv // c <= longest
    ]
    if seq_kv % granularity or not fits:
        raise ValueError(
            f"the decode schedule needs a key count divisible by {granularity} into chunks of at "
            f"most {longest} keys, got {seq_kv} (ops.attention(pad_to=(1, {PAD_KEYS})) pads "
            "other counts)"
        )
    # Each chunk writes group x head_dim float partials: long chunks keep them small.
    least = max(config.min_chunk, config.keys_per_head * group)
    long_enough = [c for c in fits if seq_kv // c >= least] or fits
    return min(long_enough, key=lambda c: (abs(c - wanted) / c, c))


def schedule_decode(func, heads_q, heads_kv, head_dim, multiprocessors=132, config=DecodeConfig()):
    """Schedule ``ops.attention(..., seq_q=1..8, ...)`` for CUDA with the choices of
    ``config`` (the chunk count from the shape and the SM count); returns the schedule.
    Build its module with :func:`.tensor_cores.build` (the tensor-core form's warp
    fragments need it; ``tvm.compile`` fails on them)."""
    group, lanes = heads_q // heads_kv, lanes_for(head_dim)
    sch = tvm.s_tir.Schedule(func)
    batch, _, seq_q, seq_kv = _shape(sch)
    packed = packs_queries(group, seq_q, head_dim, config)
    rows = rows_per_chunk(group, seq_q, head_dim, config)
    form = qk_form(group, config, rows)
    warps = min(config.mma_warps, head_dim // mma16x8.ROWS)
    (chunk_rows, chunk_config), chunk_keys, granularity = _chunk_config(form, config), lanes, None
    pv_keys = config.pv_keys
    if form == "mma":
        tiles = v_tiles(head_dim, score_bytes(rows, config))
        if not tiles:
            raise ValueError(
                f"mma_score_bytes={config.mma_score_bytes}: no V tile of head_dim {head_dim} outgrows "
                "the chunk's scores (see v_tiles)"
            )
        pv_keys = max(config.mma_pv_keys, tiles[0])
        if pv_keys not in tiles:
            raise ValueError(
                f"mma_pv_keys={config.mma_pv_keys} with head_dim {head_dim}: the tensor-core form "
                f"stages V tiles of {tiles} rows"
            )
        # A block of warps (over the group's heads) per chunk, whose keys are whole tiles
        # of every choice, and whose scores fit their share of shared memory.
        chunk_rows, chunk_keys, granularity = 1, mma16x8.WARP, PAD_KEYS
        chunk_config = dataclasses.replace(
            config, rows=1, heads_per_thread=rows // warps, exp_bytes=score_bytes(rows, config),
            threads_per_sm=config.mma_threads_per_sm,
        )
    # Query rows that are not packed are rows of thread blocks of their own.
    chunks = choose_chunks(
        batch * (1 if packed else seq_q), heads_kv, rows, seq_kv, chunk_config, multiprocessors, chunk_keys,
        granularity,
    )
    qk = {
        "mma": (warps,),
        "fused": (config.fused_keys,),
        "tiled": (config.tile_threads, config.tile_keys, config.tile_stages),
        "lanes": (config.qk_rows, config.keys_per_row),
    }[form]
    apply_decode_schedule(
        sch,
        heads_kv,
        group,
        chunks,
        qk,
        chunk_rows,
        z_threads(rows, chunk_config.heads_per_thread),
        form=form,
        lanes=lanes,
        pv_keys=pv_keys,
        packed=packed,
        combine_slices=config.mma_combine_slices if form == "mma" else config.combine_slices,
    )
    return sch


def _chunk_config(form, config):
    """Kernel 2's chunks per block, and ``config`` with them as ``rows`` and, with the
    scores in shared memory next to the exps (``"fused"``), half ``exp_bytes`` for each."""
    if form != "fused":
        return config.rows, config
    rows = config.fused_block_chunks
    return rows, dataclasses.replace(config, rows=rows, exp_bytes=config.exp_bytes // 2)


def packs_queries(group, seq_q, head_dim, config):
    """Whether a chunk's query rows (speculative decoding) are served by the threads (or
    tensor-core products) that serve its heads, which then load each V row once for all
    of them, rather than by blocks of their own, which read the chunk again from L2. On
    tensor cores whenever the rows (query, head) of a K/V head fill tiles of 8 (the
    columns of the products, :func:`qk_form`) and the largest V tile outgrows the
    shortest chunk's scores (:func:`v_tiles`); otherwise with one query head per K/V
    head. Not in kernel 2's lanes with a GQA group: region analysis does not see that a
    thread's fused (query, head) rows read one V head, and gives every thread a copy of
    many V rows."""
    if not 1 < seq_q <= config.packed_rows:
        return False
    rows = group * seq_q
    if qk_form(group, config, rows) == "mma":
        return bool(v_tiles(head_dim, score_bytes(rows, config))) or group == 1
    return group == 1


def query_rows(group, seq_q, head_dim, config):
    """The query length to compute over for ``seq_q`` queries: ``seq_q``, or, where
    speculative decoding would not run on tensor cores, the next length (at most
    ``packed_rows``) whose rows (query, head) of a K/V head fill tiles of 8 there
    (4096 keys, H200: MHA with 3-4 queries 0.161-0.175 -> 0.145 ms, softcap with 2-4
    0.103-0.149 -> 0.081-0.082 ms; H100: MHA with 2 queries 0.207 -> 0.198 ms). ``ops.attention(pad_to=(that,
    ...))`` adds the rows, whose outputs are dropped: they cost tensor-core work, which
    is free next to the stream of K and V, and no memory traffic."""
    if seq_q == 1:
        return 1
    if qk_form(group, config, rows_per_chunk(group, seq_q, head_dim, config)) == "mma":
        return seq_q
    step = mma16x8.COLS // math.gcd(group, mma16x8.COLS)
    padded = -(-seq_q // step) * step
    rows = rows_per_chunk(group, padded, head_dim, config)
    if padded <= config.packed_rows and rows > group and qk_form(group, config, rows) == "mma":
        return padded
    return seq_q


def rows_per_chunk(group, seq_q, head_dim, config):
    """The query rows (heads x queries) a chunk of kernel 2 serves."""
    return group * seq_q if packs_queries(group, seq_q, head_dim, config) else group


def decode_design_space(heads_q, heads_kv, head_dim, config=DecodeConfig()):
    """A MetaSchedule design space (``fn(sch)``) over the decode schedule: the chunk
    count, the chunks per thread block, the threads over the chunk's rows, the V rows
    loaded at once, the combine's slices of the chunks and the scores' choices of the
    :func:`qk_form` (warps on tensor cores; K rows loaded at once, fused; rows and keys
    per row with lanes; threads, keys per thread and stages tiled) are
    ``sample_categorical`` decisions, applied through the traced ``split_k_update``."""
    group, lanes = heads_q // heads_kv, lanes_for(head_dim)
    block_chunks = [1, 2, 4, 8]
    qk_choices = {
        # Warps per chunk; each takes 16 dims of a multiple of 16 (P·V).
        "mma": ([w for w in (2, 4, 8) if head_dim // mma16x8.ROWS % w == 0],),
        "fused": ([4, 8, 16],),
        "tiled": ([64, 128], [2, 4], [2, 4]),
        "lanes": ([4, 8, 16], [1, 2, 4, 8]),
    }

    def space(sch):
        _, _, seq_q, seq_kv = _shape(sch)
        rows = rows_per_chunk(group, seq_q, head_dim, config)
        form = qk_form(group, config, rows)
        mma = form == "mma"
        # With tensor cores a chunk is a block whose keys are whole tiles of every choice.
        # Counts from 2: the combine splits its chunk loop.
        granularity, first, step = (PAD_KEYS, 2, 1) if mma else (lanes, max(block_chunks), max(block_chunks))
        # Bounded for the heuristic's chunks per block: VerifyGPUCode drops samples whose
        # exps outgrow the GPU's shared memory.
        if mma:
            longest = longest_chunk(rows, 1, dataclasses.replace(config, exp_bytes=score_bytes(rows, config)))
        else:
            longest = longest_chunk(rows, *_chunk_config(form, config))
        counts = [
            c
            for c in range(first, seq_kv // granularity + 1, step)
            if (seq_kv // granularity) % c == 0 and seq_kv // c <= longest
        ]
        if not counts:
            raise ValueError(f"no chunk count splits {seq_kv} keys for this design space")

        def sample(options):
            return sample_uniform(sch, options)

        apply_decode_schedule(
            sch,
            heads_kv,
            group,
            sample(counts),
            tuple(sample(options) for options in qk_choices[form]),
            1 if mma else sample(block_chunks),
            # The z threads of a chunk split its rows evenly.
            1 if mma else sample([z for z in (1, 2, 4, 8) if rows % z == 0]),
            form=form,
            lanes=lanes,
            pv_keys=sample(v_tiles(head_dim, score_bytes(rows, config))[:2] if mma else [4, 8, 16]),
            packed=packs_queries(group, seq_q, head_dim, config),
            combine_slices=sample([1, 2, 4]),
        )

    return space


def _shape(sch):
    return [int(sch.get(l).extent) for l in sch.get_loops(sch.get_sblock("max"))]


def apply_decode_schedule(
    sch, heads_kv, group, chunks, qk, chunk_rows, z, *, form, lanes, pv_keys, packed, combine_slices
):
    """The decode schedule on a fresh schedule of ``ops.attention``. ``qk`` is kernel 1's
    choices for its :func:`qk_form` ``form``: ``(warps,)`` on tensor cores, ``(keys loaded
    at once,)`` fused, ``(threads, keys per thread, stages)`` tiled, ``(rows, keys per
    row)`` with lanes;
    ``chunk_rows`` and ``z`` are kernel 2's chunks per block and threads per group;
    ``lanes`` (:func:`lanes_for` the head dimension) split the head dimension;
    ``pv_keys`` V rows are loaded at once; ``packed``: :func:`packs_queries`;
    ``combine_slices`` threads of kernel 3 split each row's chunks.
    The choices are ints or sampled ``ExprRV``s."""
    # The query heads of a GQA group (and, packed, the query rows) go below the chunk
    # loop, so that every block placed under it gets its own row loop: the threads of a
    # chunk then hold all its rows and load each V row for them.
    merged = _merges_rows(group, packed)
    if merged:
        _merge_rows(sch, group)
        b, h, r, j = sch.get_loops(sch.get_sblock("max"))
        j0, _ = sch.split(j, [chunks, None])
        sch.reorder(j0, r)
    else:
        b, h, i, j = sch.get_loops(sch.get_sblock("max"))
        _, g = sch.split(h, [heads_kv, group])
        j0, _ = sch.split(j, [chunks, None])
        if packed:  # rows (query, head): a query row's heads are consecutive
            sch.reorder(j0, i, g)
            sch.fuse(i, g)
        else:
            sch.reorder(i, j0, g)
    for name in ("max", "sum", "pv"):
        sch.split_k_update(sch.get_sblock(name), j0)
    if merged:
        for name in ("exp", "pv_partial"):
            _fuse_unit_loops(sch, sch.get_sblock(name), 3)
    sch.compute_inline(sch.get_sblock("score"))
    if form == "mma":
        _schedule_fused_mma(sch, group, *qk, pv_keys, packed)
    else:
        if form == "tiled":
            _schedule_qk_tiled(sch, heads_kv, group, *qk)
        elif form == "lanes":
            _schedule_qk_lanes(sch, heads_kv, group, *qk, lanes)
        cy = _schedule_chunks(sch, chunk_rows, z, lanes, pv_keys, packed)
        if form == "fused":
            _schedule_qk_in_chunks(sch, cy, z, *qk, lanes)
    _schedule_combine(sch, combine_slices)
    inline_padding(sch)


def _merges_rows(group, packed):
    """Whether :func:`_merge_rows` applies: packed query rows of a GQA group (on tensor
    cores, :func:`packs_queries`)."""
    return packed and group > 1


def _merged_rows(group, ndim):
    """The index map ``(b, h, i, ...) -> (b, K/V head, row, ...)`` of ``ndim`` indices,
    the row ``i * group + h % group``."""
    return tvm.tirx.IndexMap.from_func(
        lambda b, h, i, *rest: (b, h // group, i * group + h % group, *rest), ndim=ndim, index_dtype="int32"
    )


def _merge_rows(sch, group):
    """The attention chain's blocks and buffers indexed ``(b, K/V head, row, ...)``, the
    rows (query, head of the group) of a K/V head one axis: tiles of 8 such rows span
    several query rows, and tensorize sees one axis, not a pair, as a tile's columns.
    Blocks first: transform_layout then simplifies the indices the block transforms wrote
    (transform_block_layout does not), which split_k_update must read."""
    chain = [sch.get_sblock(name) for name in ("qk", "score", "max", "exp", "sum", "pv")]
    for block in chain:
        sch.transform_block_layout(block, _merged_rows(group, len(sch.get(block).iter_vars)))
    for block in chain:
        sch.transform_layout(block, ("write", 0), _merged_rows(group, len(sch.get(block).writes[0].region)))


def _fuse_unit_loops(sch, block, after):
    """Fuse each loop of one iteration below ``block``'s first ``after`` loops into the
    loop above it. With one K/V head, :func:`_merge_rows` makes the K/V head index 0,
    and ``split_k_update`` gives the blocks it moves a loop of one iteration for it,
    between the rows and the keys or dims the schedule expects."""
    while True:
        loops = sch.get_loops(block)
        units = [k for k in range(after, len(loops)) if _is_unit(sch.get(loops[k]).extent)]
        if not units:
            return
        sch.fuse(loops[units[0] - 1], loops[units[0]])


def _is_unit(extent):
    return isinstance(extent, tvm.tirx.IntImm) and extent.value == 1


def _schedule_qk_lanes(sch, heads_kv, group, rows, keys_per_row, lanes):
    qk = sch.get_sblock("qk")
    b, h, i, j, rd = sch.get_loops(qk)
    hkv, g = sch.split(h, [heads_kv, group])
    jo, jy, jk = sch.split(j, [None, rows, keys_per_row])
    rx, rv = sch.split(rd, [lanes, VECTOR])
    sch.reorder(b, hkv, jo, jy, jk, g, i, rx, rv)
    sch.bind(sch.fuse(b, hkv), "blockIdx.x")
    sch.bind(jo, "blockIdx.y")
    sch.bind(jy, "threadIdx.y")
    sch.bind(rx, "threadIdx.x")
    # Each lane keeps its slice of the group's query rows in registers for all its keys,
    # and loads the slices of its row's keys at once, each once for all query heads.
    _lane_slices(sch, qk, (jy, jy), lanes)


def _lane_slices(sch, qk, at, lanes):
    """Q's and K's slices of the lanes (``threadIdx.x``, one 128-bit load each over the
    head dimension) in registers, loaded at loops ``at[0]`` and ``at[1]``."""
    for index in (0, 1):
        cache = sch.cache_read(qk, index, "local")
        sch.compute_at(cache, at[index], preserve_unit_loops=True)
        lane, vector = sch.split(sch.get_loops(cache)[-1], [lanes, VECTOR])
        sch.bind(lane, "threadIdx.x")
        sch.vectorize(vector)


def _schedule_qk_tiled(sch, heads_kv, group, threads, keys, stages):
    qk = sch.get_sblock("qk")
    b, h, i, j, rd = sch.get_loops(qk)
    hkv, g = sch.split(h, [heads_kv, group])
    jo, jt, jk = sch.split(j, [None, threads, keys])
    rs, ro, ri = sch.split(rd, [stages, None, VECTOR])
    # Query rows (several for speculative decoding) go to blocks: a thread keeps the
    # dot products of its keys with one query row of each head of the group, not of
    # every row (which outgrows its registers); the rows' blocks read K mostly from L2.
    sch.reorder(b, hkv, i, jo, jt, rs, ro, jk, g, ri)
    sch.bind(sch.fuse(b, hkv, i), "blockIdx.x")
    sch.bind(jo, "blockIdx.y")
    sch.bind(jt, "threadIdx.x")
    # The block stages its group's query rows once, and its keys one slice of the head
    # dimension at a time, in shared memory, all threads loading 128 contiguous bits each.
    q_shared = sch.cache_read(qk, 0, "shared")
    sch.compute_at(q_shared, jo, preserve_unit_loops=True)
    k_shared = sch.cache_read(qk, 1, "shared")
    sch.compute_at(k_shared, rs, preserve_unit_loops=True)
    for cache, loops in ((q_shared, 3), (k_shared, 2)):
        fused = sch.fuse(*sch.get_loops(cache)[-loops:])
        _, tx, vector = sch.split(fused, [None, threads, VECTOR])
        sch.bind(tx, "threadIdx.x")
        sch.vectorize(vector)
    # Threads read consecutive key rows 128 bits at a time: rows an odd number of 128-bit
    # words long (8 halves past a multiple of 16) put neighbouring rows on other banks.
    sch.storage_align(k_shared, 0, axis=-2, factor=2 * VECTOR, offset=VECTOR)
    for index in (0, 1):
        cache = sch.cache_read(qk, index, "local")
        sch.compute_at(cache, ro, preserve_unit_loops=True)
        sch.vectorize(sch.get_loops(cache)[-1])
    acc = sch.cache_write(qk, 0, "local")
    sch.reverse_compute_at(acc, jt, preserve_unit_loops=True)
    sch.decompose_reduction(qk, rs)


def _schedule_chunks(sch, chunk_rows, z, lanes, pv_keys, packed):
    blocks = {n: sch.get_sblock(n) for n in ("max_partial", "exp", "sum_partial", "pv_partial")}
    # Query rows that are not packed go to blocks, not a serial loop: their blocks read
    # the same K/V chunk, mostly from L2.
    *outer, c = sch.get_loops(blocks["max_partial"])[: 3 if packed else 4]
    cb, cy = sch.split(c, [None, chunk_rows])
    sch.bind(sch.fuse(*outer), "blockIdx.x")
    sch.bind(cb, "blockIdx.y")
    sch.bind(cy, "threadIdx.y")
    # The lanes of a row share the chunk's keys for max, exp and sum of its heads ...
    for name in ("max_partial", "exp", "sum_partial"):
        g, r = sch.get_loops(blocks[name])[-2:]
        sch.bind(sch.split(g, [z, None])[0], "threadIdx.z")
        _, lane = sch.split(r, [None, lanes])
        sch.bind(lane, "threadIdx.x")
    sch.set_scope(blocks["exp"], 0, "shared")
    # ... and its head dimension for pv, folding whole V rows into registers, each V row
    # loaded once for all query heads a thread serves.
    pv = blocks["pv_partial"]
    g, d, r = sch.get_loops(pv)[-3:]
    gz, g = sch.split(g, [z, None])
    dx, dv = sch.split(d, [lanes, VECTOR])
    ro, ri = sch.split(r, [None, pv_keys])
    sch.reorder(gz, dx, ro, ri, g, dv)
    sch.bind(gz, "threadIdx.z")
    sch.bind(dx, "threadIdx.x")
    v_local = sch.cache_read(pv, "V_pad" if "V_pad" in padded_inputs(sch) else "V", "local")
    sch.compute_at(v_local, ro, preserve_unit_loops=True)
    sch.vectorize(sch.split(sch.get_loops(v_local)[-1], [None, VECTOR])[-1])
    sch.unroll(ri)
    for name, consumers, at in (
        ("max_partial", [blocks["exp"]], cy),
        ("sum_partial", [], cy),
        ("pv_partial", [], dx),
    ):
        store = sch.cache_write(blocks[name], name, "local", consumer_blocks=consumers)
        sch.reverse_compute_at(store, at, preserve_unit_loops=True)
        if at is cy:  # each z thread stores the maxima and sums of its own rows
            rows = _rows(sch, *sch.get_loops(store)[-2:], packed)
            sch.bind(sch.split(rows, [z, None])[0], "threadIdx.z")
    # float32 partials: 128-bit stores are 4 lanes wide.
    store = sch.get_loops(sch.get_sblock("pv_partial_local"))[-1]
    sch.vectorize(sch.split(store, [None, 4])[-1])
    return cy


def _schedule_qk_in_chunks(sch, cy, z, keys, lanes):
    """Kernel 1 inside kernel 2 (form ``"fused"``): the threads of each chunk (loop
    ``cy``) compute its scores into shared memory, lanes splitting the head dimension as
    in kernel 1's lanes form, ``keys`` K rows loaded at once (their loads in flight
    together), the ``z`` threads splitting the query rows."""
    qk = sch.get_sblock("qk")
    sch.compute_at(qk, cy)
    sch.set_scope(qk, 0, "shared")
    *rows, j, rd = _loops_below(sch, qk, cy)
    jo, jk = sch.split(j, [None, keys])
    rx, rv = sch.split(rd, [lanes, VECTOR])
    q_at = cy
    if rows:
        q_at, row = sch.split(sch.fuse(*rows), [z, None])
        sch.reorder(q_at, jo, jk, row, rx, rv)
        sch.bind(q_at, "threadIdx.z")
    else:  # one query row per chunk: z is 1
        sch.reorder(jo, jk, rx, rv)
    sch.bind(rx, "threadIdx.x")
    # Each lane keeps its slice of its query rows in registers for the whole chunk.
    _lane_slices(sch, qk, (q_at, jo), lanes)


def _loops_below(sch, block, loop):
    """``block``'s loops below ``loop`` (unit loops of its rows were dropped there)."""
    loops = sch.get_loops(block)
    return loops[[sch.get(other).same_as(sch.get(loop)) for other in loops].index(True) + 1 :]


def _rows(sch, head, query, packed):
    """The loop over a block's query rows: its ``head`` loop, or with ``packed`` query
    rows its (``query``, ``head``) loops fused, as the chunk loop's rows are."""
    if not packed:
        return head
    sch.reorder(query, head)
    return sch.fuse(query, head)


def _schedule_fused_mma(sch, group, warps, tile_keys, packed):
    """Kernels 1 and 2 as one, on tensor cores: a block of ``warps`` warps per chunk."""
    mma16x8.register()
    dtype = str(buffer_params(sch.mod["main"])[0].ty.dtype)
    rows, cols, depth, warp = mma16x8.ROWS, mma16x8.COLS, mma16x8.DEPTH, mma16x8.WARP

    merged = _merges_rows(group, packed)

    def rows_last(block, buffer, source=False):
        """The 8 columns of a product are 8 rows (query, head) of a K/V head, which must
        be the last row axis of ``block``'s ``buffer`` (indices ``(..., b, h, i, x)``):
        with a query row per block, its heads, after the query rows; with one head per
        K/V head, the query rows, already last; rows merged by :func:`_merge_rows` are
        one axis already, except in a copy of Q (``source``)."""
        if merged and source:
            sch.transform_layout(block, buffer, _merged_rows(group, 4))
        elif group > 1 and not merged:
            sch.transform_layout(block, buffer, lambda *idx: (*idx[:-3], idx[-2], idx[-3], idx[-1]))
    blocks = {n: sch.get_sblock(n) for n in ("qk", "max_partial", "exp", "sum_partial", "pv_partial")}
    *outer, c = sch.get_loops(blocks["max_partial"])[: 3 if packed else 4]
    sch.bind(sch.fuse(*outer), "blockIdx.x")
    sch.bind(c, "blockIdx.y")
    # The chunk's scores: each warp 16 keys of a tile of warps x 16 at a time by 8 query
    # heads, K staged a tile at a time and the group's query rows once. ldmatrix reads
    # 8 or 16 rows of 16 dims: heads and dims, keys and dims must be the last two axes of
    # their buffers, so the queries' and the scores' rows become (query, head).
    qk = blocks["qk"]
    sch.compute_at(qk, c)
    sch.set_scope(qk, 0, "shared")
    rows_last(qk, ("write", 0))
    g, j, rd = _loops_below(sch, qk, c)  # the rows: heads, packed query rows or merged rows
    gn, g = sch.split(g, [None, cols])
    jt, jw, j16 = sch.split(j, [None, warps, rows])
    ko, kk = sch.split(rd, [None, depth])
    sch.reorder(jt, jw, ko, gn, g, j16, kk)
    sch.bind(jw, "threadIdx.y")
    for index, at in ((0, c), (1, jt)):
        cache = sch.cache_read(qk, index, "shared")
        sch.compute_at(cache, at, preserve_unit_loops=True)
        if index == 0:
            rows_last(cache, ("write", 0), source=True)
        _copy_by_all_threads(sch, cache, warps, loops=3)
    _gemm_on_tensor_cores(sch, qk, dtype, g, (ko, ko, jw, ko), "A", "shared")

    # Max, exp and sum: the warps split the group's heads, lanes the chunk's keys.
    for name in ("max_partial", "exp", "sum_partial"):
        head, key = sch.get_loops(blocks[name])[-2:]
        sch.bind(sch.split(head, [warps, None])[0], "threadIdx.y")
        sch.bind(sch.split(key, [None, warp])[1], "threadIdx.x")
    for name, consumers in (("max_partial", [blocks["exp"]]), ("sum_partial", [])):
        store = sch.cache_write(blocks[name], name, "local", consumer_blocks=consumers)
        sch.reverse_compute_at(store, c, preserve_unit_loops=True)
        sch.bind(sch.split(_rows(sch, *sch.get_loops(store)[-2:], packed), [warps, None])[0], "threadIdx.y")
    # The exps, fp16 like V for the second GEMM, rows (query, head) padded by 128 bits
    # (ldmatrix's row addresses on distinct banks).
    exp = blocks["exp"]
    sch.set_scope(exp, 0, "shared")
    sch.unsafe_set_dtype(exp, 0, dtype)
    rows_last(exp, ("write", 0))
    sch.storage_align(exp, 0, axis=-2, factor=2 * VECTOR, offset=VECTOR)

    # pv: O[dim, head] += V[key, dim] * exp[head, key], 16 dims x 8 heads x 16 keys per
    # product, the warps splitting the head dimension, V staged ``tile_keys`` rows at a time.
    pv = blocks["pv_partial"]
    rows_last(pv, ("write", 0))
    g, d, r = sch.get_loops(pv)[-3:]
    gn, g = sch.split(g, [None, cols])
    dw, dm, dk = sch.split(d, [warps, None, rows])
    rt, r = sch.split(r, [None, tile_keys])  # (tile_keys is an int or a sampled ExprRV)
    rk, r16 = sch.split(r, [None, depth])
    sch.reorder(dw, rt, rk, gn, dm, g, dk, r16)
    sch.bind(dw, "threadIdx.y")
    v_shared = sch.cache_read(pv, "V_pad" if "V_pad" in padded_inputs(sch) else "V", "shared")
    sch.compute_at(v_shared, rt, preserve_unit_loops=True)
    _copy_by_all_threads(sch, v_shared, warps, loops=2)
    _gemm_on_tensor_cores(sch, pv, dtype, g, (gn, dm, dw, rt), "A_T", "global")


def _gemm_on_tensor_cores(sch, block, dtype, product, at, a_operand, out_scope):
    """Tensorize ``block`` (``C[col, row] += B[col, depth] * A[row, depth]`` in tiles of
    16 x 8 x 16 on its buffers' last two axes, A's stored ``[depth, row]`` if
    ``a_operand`` is "A_T"; its loop ``product`` over one tile's columns): B (read 0)
    and A (read 1) loaded into warp fragments at loops ``at[0]`` and ``at[1]`` by
    ldmatrix, the accumulator stored to ``out_scope`` at ``at[2]`` and initialised at
    ``at[3]``."""
    rows, cols, depth = mma16x8.ROWS, mma16x8.COLS, mma16x8.DEPTH

    # Each buffer index -> (its leading indices, the tile's, lane, element).
    def b_fragment(*index):
        *lead, col, k = index
        return (*lead, col // cols, k // depth, *mma16x8.b_layout(col % cols, k % depth))

    def a_fragment(*index):
        *lead, row, k = index
        if a_operand == "A_T":
            row, k = k, row
        return (*lead, row // rows, k // depth, *mma16x8.a_layout(row % rows, k % depth))

    def c_fragment(*index):
        *lead, col, row = index
        return (*lead, col // cols, row // rows, *mma16x8.c_layout(row % rows, col % cols))

    b_warp = sch.cache_read(block, 0, "warp", consumer_blocks=[block])
    a_warp = sch.cache_read(block, 1, "warp", consumer_blocks=[block])
    sch.compute_at(b_warp, at[0])
    sch.compute_at(a_warp, at[1])
    out = sch.cache_write(block, 0, "warp")
    sch.reverse_compute_at(out, at[2])
    init = sch.decompose_reduction(block, at[3])
    for (kind, warp_block), fragment in zip(
        (("write", b_warp), ("write", a_warp), ("read", out)), (b_fragment, a_fragment, c_fragment)
    ):
        sch.transform_layout(warp_block, (kind, 0), fragment)
    sch.tensorize(_row_tiles(sch, b_warp, mma16x8.COLS), mma16x8.load_name("B", dtype))
    sch.tensorize(_row_tiles(sch, a_warp, mma16x8.ROWS), mma16x8.load_name(a_operand, dtype))
    sch.tensorize(product, mma16x8.mma_name(dtype))
    sch.tensorize(_head_tiles(sch, init), mma16x8.FILL)
    sch.tensorize(_head_tiles(sch, out), mma16x8.store_name(out_scope))


def _copy_by_all_threads(sch, cache, warps, loops):
    """The copy ``cache`` (its last ``loops`` loops) by all threads of the block, 128 bits
    each, into rows padded by 128 bits (ldmatrix's row addresses on distinct banks)."""
    fused = sch.fuse(*sch.get_loops(cache)[-loops:])
    _, ty, tx, vector = sch.split(fused, [None, warps, mma16x8.WARP, VECTOR])
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(vector)
    sch.storage_align(cache, 0, axis=-2, factor=2 * VECTOR, offset=VECTOR)


def _row_tiles(sch, block, rows):
    """The loop over one ``rows``-row tile of ``block``'s last two loops (rows, 16 cols)."""
    return sch.split(sch.get_loops(block)[-2], [None, rows])[1]


def _head_tiles(sch, block):
    """The loop over one 8 x 16 tile of ``block``'s last two loops (heads, keys or dims)."""
    heads, other = sch.get_loops(block)[-2:]
    outer_heads, heads = sch.split(heads, [None, mma16x8.COLS])
    outer_other, other = sch.split(other, [None, mma16x8.ROWS])
    sch.reorder(outer_heads, outer_other, heads, other)
    return heads


def _schedule_combine(sch, slices):
    # One kernel: a block per query row, a thread per output dim and slice of the chunks
    # (``threadIdx.y``). Each thread combines its slice's chunk maxima and sums itself
    # (the same few partials across the block, read as broadcasts), then its dim of the
    # output; the slices' results meet in shared memory (cross-thread reductions).
    b, h, i, d = sch.get_loops(sch.get_sblock("out"))
    sch.bind(sch.fuse(b, h, i), "blockIdx.x")
    sch.bind(d, "threadIdx.x")
    for name in ("pv", "sum", "max"):
        block = sch.get_sblock(name)
        sch.compute_at(block, d)
        sch.set_scope(block, 0, "local")
        # (A single chunk leaves no chunk loop to split.)
        chunks = _loops_below(sch, block, d)
        if chunks and not (isinstance(slices, int) and slices == 1):  # an int, or a sampled ExprRV
            sch.bind(sch.split(chunks[0], [slices, None])[0], "threadIdx.y")
