"""GPU schedule for decode attention (a few query rows, many keys): split-k (FlashDecoding).

Built from the traced ``split_k_update``, then ordinary TVM primitives:

* kernel 1, ``qk``: thread rows (``threadIdx.y``) take a few keys each, 16 lanes
  (``threadIdx.x``) split the head dimension with 128-bit loads of K and reduce with
  shuffles; each lane keeps its slice of the GQA group's query rows in registers, so each
  K row is loaded once for all query heads of its group;
* kernel 2, the chunks: each thread row owns one chunk for all query heads of a GQA group
  (the head loop is moved below the chunk loop before ``split_k_update``); its 16 lanes
  reduce each head's max and sum with shuffles, write the exps to shared memory, and fold
  V rows into registers with 128-bit loads, 8 dims per lane, each V row loaded once for
  all heads of the group;
* kernels 3-6, the combines over chunks and the epilogue.

The chunk count is chosen from the shape and the number of SMs: enough thread blocks to
fill the GPU, as few chunks as that allows, since each chunk writes a partial output.
"""
from dataclasses import dataclass

import tvm

LANES = 16  # threadIdx.x: lanes over the head dimension, 8 fp16 (128 bits) each
VECTOR = 8


@dataclass(frozen=True)
class DecodeConfig:
    """Tunable choices of the decode schedule."""

    rows: int = 8  # threadIdx.y: thread rows per block
    keys_per_row: int = 4  # keys each thread row of kernel 1 reduces
    blocks_per_sm: int = 8  # how many kernel-2 blocks to aim for per SM
    max_chunk: int = 1024  # keys per chunk at most (their exps live in shared memory)


def choose_chunks(batch, heads_kv, group, seq_kv, config, multiprocessors):
    """The chunk count: a divisor of ``seq_kv / LANES`` (chunks split the keys evenly,
    in whole lane groups) closest to what fills ``blocks_per_sm`` blocks per SM."""
    per_block = config.rows
    wanted = config.blocks_per_sm * multiprocessors * per_block / (batch * heads_kv)
    groups = seq_kv // LANES
    fits = [
        c
        for c in range(per_block, groups + 1, per_block)
        if groups % c == 0 and seq_kv // c <= config.max_chunk
    ]
    if seq_kv % LANES or not fits:
        raise ValueError(
            f"the decode schedule needs a key count divisible by {LANES} into chunks of at "
            f"most {config.max_chunk} keys, got {seq_kv}"
        )
    return min(fits, key=lambda c: (abs(c - wanted) / c, c))


def schedule_decode(func, heads_q, heads_kv, head_dim, multiprocessors=132, config=DecodeConfig()):
    """Schedule ``ops.attention(..., seq_q=1..8, ...)`` for CUDA with the choices of
    ``config`` (the chunk count from the shape and the SM count); returns the schedule."""
    group = _group(heads_q, heads_kv, head_dim)
    sch = tvm.s_tir.Schedule(func)
    batch, _, _, seq_kv = _shape(sch)
    chunks = choose_chunks(batch, heads_kv, group, seq_kv, config, multiprocessors)
    apply_decode_schedule(sch, heads_kv, group, chunks, config.rows, config.keys_per_row, config.rows)
    return sch


def decode_design_space(heads_q, heads_kv, head_dim, config=DecodeConfig()):
    """A MetaSchedule design space (``fn(sch)``) over the decode schedule: the chunk
    count, the chunks per thread block and kernel 1's thread rows and keys per row are
    ``sample_categorical`` decisions, applied through the traced ``split_k_update``."""
    group = _group(heads_q, heads_kv, head_dim)
    chunk_rows = [1, 2, 4, 8]

    def space(sch):
        seq_kv = _shape(sch)[3]
        step = max(chunk_rows)
        counts = [
            c
            for c in range(step, seq_kv // LANES + 1, step)
            if (seq_kv // LANES) % c == 0 and seq_kv // c <= config.max_chunk
        ]
        if not counts:
            raise ValueError(f"no chunk count splits {seq_kv} keys for this design space")

        def sample(options):
            return sch.sample_categorical(options, [1.0 / len(options)] * len(options))

        apply_decode_schedule(
            sch,
            heads_kv,
            group,
            sample(counts),
            sample([4, 8, 16]),
            sample([1, 2, 4, 8]),
            sample(chunk_rows),
        )

    return space


def _group(heads_q, heads_kv, head_dim):
    if head_dim != LANES * VECTOR:
        raise ValueError(f"the decode schedule needs head_dim {LANES * VECTOR}, got {head_dim}")
    return heads_q // heads_kv


def _shape(sch):
    return [int(sch.get(l).extent) for l in sch.get_loops(sch.get_sblock("max"))]


def apply_decode_schedule(sch, heads_kv, group, chunks, qk_rows, keys_per_row, chunk_rows):
    """The decode schedule on a fresh schedule of ``ops.attention``; the last four
    choices are ints or sampled ``ExprRV``s."""
    # The query heads of a GQA group go below the chunk loop, so that every block placed
    # under it gets its own head loop: one thread then holds all heads of its group and
    # loads each V row once for them.
    b, h, i, j = sch.get_loops(sch.get_sblock("max"))
    _, g = sch.split(h, [heads_kv, group])
    j0, _ = sch.split(j, [chunks, None])
    sch.reorder(i, j0, g)
    for name in ("max", "sum", "pv"):
        sch.split_k_update(sch.get_sblock(name), j0)
    sch.compute_inline(sch.get_sblock("score"))
    _schedule_qk(sch, heads_kv, group, qk_rows, keys_per_row)
    _schedule_chunks(sch, chunk_rows)
    _schedule_combines(sch)


def _schedule_qk(sch, heads_kv, group, rows, keys_per_row):
    qk = sch.get_sblock("qk")
    b, h, i, j, rd = sch.get_loops(qk)
    hkv, g = sch.split(h, [heads_kv, group])
    jo, jy, jk = sch.split(j, [None, rows, keys_per_row])
    rx, rv = sch.split(rd, [LANES, VECTOR])
    sch.reorder(b, hkv, jo, jy, jk, g, i, rx, rv)
    sch.bind(sch.fuse(b, hkv), "blockIdx.x")
    sch.bind(jo, "blockIdx.y")
    sch.bind(jy, "threadIdx.y")
    sch.bind(rx, "threadIdx.x")
    # Each lane keeps its slice of the group's query rows in registers for all its keys,
    # and loads the slices of its row's keys at once, each once for all query heads.
    for index in (0, 1):
        cache = sch.cache_read(qk, index, "local")
        sch.compute_at(cache, jy, preserve_unit_loops=True)
        lanes, vector = sch.split(sch.get_loops(cache)[-1], [LANES, VECTOR])
        sch.bind(lanes, "threadIdx.x")
        sch.vectorize(vector)


def _schedule_chunks(sch, chunk_rows):
    blocks = {n: sch.get_sblock(n) for n in ("max_partial", "exp", "sum_partial", "pv_partial")}
    b, hkv, i, c = sch.get_loops(blocks["max_partial"])[:4]
    cb, cy = sch.split(c, [None, chunk_rows])
    sch.bind(sch.fuse(b, hkv), "blockIdx.x")
    sch.bind(cb, "blockIdx.y")
    sch.bind(cy, "threadIdx.y")
    # The lanes of a row share the chunk's keys for max, exp and sum ...
    for name in ("max_partial", "exp", "sum_partial"):
        _, lane = sch.split(sch.get_loops(blocks[name])[-1], [None, LANES])
        sch.bind(lane, "threadIdx.x")
    sch.set_scope(blocks["exp"], 0, "shared")
    # ... and its head dimension for pv, folding whole V rows into registers, each V row
    # once for all query heads of the group.
    pv = blocks["pv_partial"]
    g, d, r = sch.get_loops(pv)[-3:]
    dx, dv = sch.split(d, [LANES, VECTOR])
    ro, ri = sch.split(r, [None, 4])
    sch.reorder(dx, ro, ri, g, dv)
    sch.bind(dx, "threadIdx.x")
    v_local = sch.cache_read(pv, "V", "local")
    sch.compute_at(v_local, ro, preserve_unit_loops=True)
    lanes = sch.get_loops(v_local)[-1]
    sch.vectorize(sch.split(lanes, [None, VECTOR])[-1])
    sch.unroll(ri)
    for name, consumers, at in (
        ("max_partial", [blocks["exp"]], cy),
        ("sum_partial", [], cy),
        ("pv_partial", [], dx),
    ):
        store = sch.cache_write(blocks[name], name, "local", consumer_blocks=consumers)
        sch.reverse_compute_at(store, at, preserve_unit_loops=True)
    # float32 partials: 128-bit stores are 4 lanes wide.
    store = sch.get_loops(sch.get_sblock("pv_partial_local"))[-1]
    sch.vectorize(sch.split(store, [None, 4])[-1])


def _schedule_combines(sch):
    for name in ("max", "sum", "pv", "out"):
        block = sch.get_sblock(name)
        loops = sch.get_loops(block)
        fused = sch.fuse(*(loops[:-1] if name != "out" else loops))
        bx, tx = sch.split(fused, [None, 128])
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
