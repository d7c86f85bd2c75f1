"""A GPU schedule for cascaded reductions that fold each row to a few values
(log-sum-exp, cross-entropy, softmax statistics): one CUDA block per row, one pass over it.

Each thread of a row's block folds one contiguous chunk of the row (``split_k_update``
over a loop of ``chunks`` iterations, bound to ``threadIdx.x``), ``tile`` positions at a
time with the later reductions rolled within the chunk (``rolling_update``): the thread
keeps its running maximum and sum in registers and reads every element once. The chunk
partials are then folded across the block's threads (the split-k combines, TVM's
cross-thread reduction), and what follows per row (the log, the softmax's
normalisation) runs in the same kernel. Chunks are whole tiles; where they do not divide
the row, the last chunk reads the tiles that end the row and skips those the chunk
before it folded. Each tile is loaded into registers, 16 bytes at a time where the row
is a whole number of such loads. Reductions over the row that no repair lets fuse (MoE
routing's top-k rounds) follow in the same block, each across the row's threads; they
read a copy of the block's rows that is made once in shared memory.

Before::

    @T.prim_func(s_tir=True)
    def main(X: T.Buffer((rows, n), "bfloat16"), out: T.Buffer((rows,), "float32")):
        m = T.sblock_alloc_buffer((rows,))
        e = T.sblock_alloc_buffer((rows, n))
        s = T.sblock_alloc_buffer((rows,))
        for i, j in T.grid(rows, n):
            with T.sblock("max"): ...      # m[i] = max(m[i], X[i, j])
        for i, j in T.grid(rows, n):
            with T.sblock("exp"): ...      # e[i, j] = exp(X[i, j] - m[i])
        for i, j in T.grid(rows, n):
            with T.sblock("sum"): ...      # s[i] = s[i] + e[i, j]
        for i in range(rows):
            with T.sblock("out"): ...      # out[i] = m[i] + log(s[i])

After ``schedule_rows(sch, chunks=167, tile=32)`` (n = 128256; the row loop is split
by ``rows_per_block`` over ``blockIdx.x`` and ``threadIdx.y``, here 1)::

    for i in T.thread_binding(rows, thread="blockIdx.x"):
        for c in T.thread_binding(167, thread="threadIdx.x"):
            for t in range(24):                       # 768 positions per chunk
                for u, v in T.grid(4, T.vectorized(8)): ...  # X_local = X[i, c*768 + t*32 + u*8 + v]
                for v in T.unroll(32):
                    with T.sblock("max_partial"): ... # and the maximum before the tile
                for v in T.unroll(32):
                    with T.sblock("sum_partial"): ... # repaired at the tile's start
        for c in T.thread_binding(167, thread="threadIdx.x"):
            with T.sblock("max"): ...                 # across the threads
        for c in T.thread_binding(167, thread="threadIdx.x"):
            with T.sblock("sum"): ...                 # each partial repaired to the max
        with T.sblock("out"): ...
"""
from __future__ import annotations

import dataclasses

import tvm

from ..analysis.scope import REDUCE, buffer_params, collect_sites
from ..relax.gpu_schedule import UnsupportedOnGpu, inline_spatial
from ..transform.detect import find_candidates
from ..transform.fuse import fusing_dependents, key_loop, named_site, only_func

#: The most threads one row's block uses.
MAX_THREADS = 256
#: Bytes per load of a tile.
LOAD_BYTES = 16


def row_chains(func) -> list:
    """The candidate chains (:func:`~tvm_cascade.transform.detect.find_candidates`) of
    ``func`` that fold each row to values of their own: every block of the chain has the
    root's row iterators and the reduced one, nothing else (softmax statistics, not
    P·V). A chain keeps the dependents that ``split_k_update`` fuses (MoE routing's
    top-k rounds, each a maximum below a bound the one before sets, have no repair:
    they follow the chain in the row's block)."""
    sites = {s.name: s for s in collect_sites(func.body.block)}
    chains = []
    for candidate in find_candidates(func):
        spatial = _spatial_count(sites[candidate.root])
        if all(_spatial_count(sites[n]) == spatial for n in candidate.dependents):
            fused = fusing_dependents(func, candidate, "split_k")
            if fused:
                chains.append(dataclasses.replace(candidate, dependents=fused))
    return chains


def plan_chunks(length: int, tile: int, max_threads: int = MAX_THREADS) -> int:
    """Threads per row for ``tile``: the most (up to ``max_threads``) whose chunks are
    whole tiles that divide ``length``, unless those are fewer than a warp in a row of
    more tiles; then as few chunks of equally many whole tiles as cover the row with
    ``max_threads`` threads at most (the last one ends at the row's end)."""
    tiles = -(-length // tile)
    if length % tile == 0:
        exact = max(d for d in range(1, min(tiles, max_threads) + 1) if tiles % d == 0)
        if exact >= min(32, tiles):
            return exact
    return -(-tiles // -(-tiles // max_threads))


def plan_rows(length: int, dtype: str) -> dict:
    """``schedule_rows``' arguments for rows of ``length`` elements of ``dtype``, as
    measured fastest on an H200 (benchmarks/RESULTS.md): tiles of 64 positions on rows
    of a vocabulary, one warp of 128-position tiles on rows of a few thousand (whose
    later reductions across the row, as top-k's rounds, then need no barrier), 16 on
    rows of a few hundred, whole loads on short ones; blocks of at least 128 threads."""
    lanes = _lanes(dtype)
    if length > 8192:
        tile = 64
    elif length > 1024:
        tile = 128
    else:
        tile = max(lanes, 16) if length >= 16 * 16 else lanes
    chunks = plan_chunks(length, tile)
    return {"chunks": chunks, "tile": tile, "rows_per_block": max(1, 128 // chunks)}


def plan_chain(func, chain) -> dict:
    """:func:`plan_rows` for ``chain`` (one of :func:`row_chains`, of a static length) of
    ``func``: rows of its length, of the element type its root reads from the inputs
    (what the tile loads are sized for)."""
    params = buffer_params(func)
    root = next(s for s in collect_sites(func.body.block) if s.name == chain.root)
    read = [b for b in root.read_buffers() if any(b.same_as(p) for p in params)]
    return plan_rows(chain.length, str((read or root.read_buffers())[0].ty.dtype))


def schedule_rows(sch, chunks=None, tile: int = 32, rows_per_block: int = 1) -> None:
    """Schedule the one PrimFunc in ``sch`` (a chain of :func:`row_chains`, with the
    blocks around it) as one CUDA block per ``rows_per_block`` rows (``threadIdx.y``;
    module docstring). ``chunks`` (threads per row), ``tile`` and ``rows_per_block`` are
    ints or sampled ExprRVs; ``chunks`` defaults to :func:`plan_chunks`."""
    chains = row_chains(only_func(sch))
    if len(chains) != 1:
        raise UnsupportedOnGpu(f"expected one chain folding each row, found {len(chains)}")
    (chain,) = chains
    if chunks is None:
        if chain.length is None:
            raise UnsupportedOnGpu(f"'{chain.root}': a symbolic row length needs chunks given")
        chunks = plan_chunks(chain.length, tile)
    names = (chain.root, *chain.dependents)
    inline_spatial(sch)
    # Chunks of whole tiles: where they do not divide the row, the last one reads the
    # tiles that end the row, which keeps every tile's loads aligned.
    chunk_loop = sch.split(key_loop(sch, chain.root), [chunks, None, tile], preserve_unit_iters=True)[0]
    for name in names:
        sch.split_k_update(sch.get_sblock(name), chunk_loop)
    partials = [sch.get_sblock(f"{name}_partial") for name in names]
    tile_loop = sch.get_loops(partials[0])[-2]
    for partial in partials[1:]:
        sch.rolling_update(partial, tile_loop)
    loops = sch.get_loops(partials[0])
    depth = next(k for k, loop in enumerate(loops) if sch.get(loop).same_as(sch.get(chunk_loop)))
    if depth == 0:
        raise UnsupportedOnGpu(f"'{chain.root}': no rows to spread over blocks")
    rows = sch.fuse(*loops[:depth]) if depth > 1 else loops[0]
    blocks, rows = sch.split(rows, [None, rows_per_block])
    sch.bind(blocks, "blockIdx.x")
    sch.bind(rows, "threadIdx.y")
    sch.bind(chunk_loop, "threadIdx.x")
    if chain.length is not None:
        _load_tiles(sch, partials, tile_loop, chain.length, _value(sch, tile))
    for partial in partials:
        for index in range(len(sch.get(partial).writes)):
            sch.set_scope(partial, index, "local")
        sch.unroll(sch.get_loops(partial)[-1])
    for name in names:
        combine = sch.get_sblock(name)
        sch.reverse_compute_at(combine, rows)
        sch.bind(sch.get_loops(combine)[-1], "threadIdx.x")
        sch.set_scope(combine, 0, _scope_across_threads(named_site(sch, name)))
    whole = chain.rows is not None and chain.rows % _value(sch, rows_per_block) == 0
    _epilogue(sch, rows, chunks, depth=2, rows_per_block=rows_per_block if whole else None)


def _scope_across_threads(site) -> str:
    """Where a value the row's threads share goes: a reduction across them leaves its
    result in every thread's registers (TVM's cross-thread reduction broadcasts it; a
    store to shared memory would be made by one thread, which TVM does not order before
    the others' reads within a warp); an element one thread writes, in shared memory."""
    return "local" if site.is_reduction else "shared"


def _spatial_count(site) -> int:
    return sum(1 for iv in site.block.iter_vars if iv.iter_type != REDUCE)


def _lanes(dtype: str) -> int:
    """Elements of ``dtype`` in one load of :data:`LOAD_BYTES`."""
    return max(1, LOAD_BYTES * 8 // tvm.DataType(dtype).bits)


def _value(sch, x) -> int:
    return x if isinstance(x, int) else int(sch.get(x))


def _load_tiles(sch, partials, tile_loop, length: int, tile: int) -> None:
    """Each input the chunk partials read along the row, loaded a tile at a time into
    registers, :data:`LOAD_BYTES` per load where the row's and the tile's lengths are
    whole loads (so every tile starts on one)."""
    params = buffer_params(only_func(sch))
    root = sch.get(partials[0])
    for index, region in enumerate(root.reads):
        buf = region.source
        if not any(buf.same_as(p) for p in params):
            continue
        readers = [p for p in partials if any(r.source.same_as(buf) for r in sch.get(p).reads)]
        cache = sch.cache_read(partials[0], index, "local", consumer_blocks=readers)
        sch.compute_at(cache, tile_loop)
        lanes = _lanes(str(buf.ty.dtype))
        if length % lanes == 0 and tile % lanes == 0:
            sch.vectorize(sch.split(sch.get_loops(cache)[-1], [None, lanes])[-1])


def _epilogue(sch, rows, chunks, depth, rows_per_block) -> None:
    """What follows the combines (per row, per element of the row as a softmax's
    normalisation, or reductions over the row as top-k's rounds) in the row's block, its
    loops over the row's threads; what it writes for later blocks where
    :func:`_scope_across_threads` says. ``rows_per_block`` (an int or a sampled value)
    where every block's rows exist (a static number of rows that it divides), which
    :func:`_row_in_shared` needs; else None."""
    params = buffer_params(only_func(sch))
    in_row = set()
    along_row, folds_row = [], False
    for site in collect_sites(only_func(sch).body.block):
        if site.under(sch.get(rows)):
            in_row.update(site.write_buffers())
            continue
        if not any(buf in in_row for buf in site.read_buffers()):
            # reverse_compute_at would place it whole inside every row's block.
            raise UnsupportedOnGpu(f"'{site.name}' reads nothing the row's block computes: no row of it to place there")
        in_row.update(site.write_buffers())
        block = sch.get_sblock(site.name)
        sch.reverse_compute_at(block, rows)
        inner = sch.get_loops(block)[depth:]
        if inner:
            fused = sch.fuse(*inner) if len(inner) > 1 else inner[0]
            sch.bind(sch.split(fused, [None, chunks])[1], "threadIdx.x")
            along_row.append(block)
            folds_row |= site.is_reduction
        for index, buf in enumerate(site.write_buffers()):
            if not any(buf.same_as(p) for p in params):
                sch.set_scope(block, index, _scope_across_threads(site))
    if folds_row and rows_per_block is not None:
        _row_in_shared(sch, along_row, rows_per_block, chunks, depth)


#: The most bytes of shared memory the rows of one block take in :func:`_row_in_shared`.
ROW_CACHE_BYTES = 32 * 1024


def _row_in_shared(sch, readers, rows_per_block, chunks, depth) -> None:
    """Where a reduction over the row follows the chain (top-k's rounds), the inputs the
    blocks ``readers`` read along the row, loaded once per row into shared memory
    (16 bytes a load where the row is whole loads): each later pass over the row reads
    it there, not again from memory. Rows of a block that would take more than
    :data:`ROW_CACHE_BYTES` are left in memory. (The copy of a block's rows is sized by
    them: where a block's last rows lie past the input's, TVM's buffer compaction
    cannot size it.)"""
    params = buffer_params(only_func(sch))
    per_block = _value(sch, rows_per_block)
    for index, region in enumerate(sch.get(readers[0]).reads):
        buf = region.source
        length = buf.shape[-1]
        if not any(buf.same_as(p) for p in params) or not isinstance(length, tvm.tirx.IntImm):
            continue
        if per_block * int(length) * tvm.DataType(buf.ty.dtype).bits // 8 > ROW_CACHE_BYTES:
            continue
        users = [r for r in readers if any(x.source.same_as(buf) for x in sch.get(r).reads)]
        cache = sch.cache_read(readers[0], index, "shared", consumer_blocks=users)
        # At the block's level, the block's threads sharing the copy of its rows.
        sch.compute_at(cache, sch.get_loops(readers[0])[depth - 2], preserve_unit_loops=True)
        row, along = sch.get_loops(cache)[depth - 1:]
        sch.bind(sch.split(row, [None, rows_per_block])[1], "threadIdx.y")
        lanes = _lanes(str(buf.ty.dtype))
        if isinstance(chunks, int) and int(length) % (chunks * lanes) == 0:
            _, threads, vector = sch.split(along, [None, chunks, lanes])
            sch.vectorize(vector)
        else:
            threads = sch.split(along, [None, chunks])[1]
        sch.bind(threads, "threadIdx.x")
