"""A GPU schedule for the PrimFuncs :class:`.FuseAttention` fuses: one row of threads per
row of the fused key loop.

Each chain's fused nest (rows, then the key loop that carries the chain) gets one row of
threads (``threadIdx.y``) per row (rolling: the row walks all keys tile by tile) or per
row and chunk (split-k), :data:`ROWS` rows per CUDA block. Inside it, every block of the
chain whose loops below the key loop include a spatial one (the scores of a tile's keys,
the output's head dimension) spreads that loop over the row's :data:`LANES` threads; the
reductions over keys (max, sum) run in every thread on the shared scores, so their
running state stays in registers and needs no cross-thread step. Values one thread
writes and others read go to shared memory, the rest to registers; the accumulators
later kernels read are stored once, after the last key. Blocks left outside (split-k
combines, copies that could not be inlined, the epilogue) become kernels of their own,
their leading spatial loops over threads.

It exists so that fused attention runs on a GPU without a hand-written schedule; it uses
no tensor cores.
"""

import tvm
from tvm.s_tir.schedule import ScheduleError

from ..analysis.buffers import compacted_buffers
from ..analysis.scope import REDUCE, buffer_params, collect_sites, uses_var, vars_in

LANES = 64  # threads (threadIdx.x) that serve one row (and chunk) of a fused nest
ROWS = 4  # rows (threadIdx.y) of a fused nest per CUDA block: they share K and V in L1
THREADS = 128  # threads per CUDA block of the kernels outside the fused nests


#: Marks a block that reads an accumulator's register copy (what ``cache_write`` made).
READS_REGISTERS = "tvm_cascade.reads_registers_of"


class UnsupportedOnGpu(ValueError):
    """The fused PrimFunc has a form this schedule cannot bind."""


def schedule_fused_for_gpu(sch, chains, lanes=LANES) -> None:
    """Bind every block of the one PrimFunc in ``sch`` (fused by
    :func:`tvm_cascade.transform.fuse_cascaded_reductions`, which returned ``chains``)
    to GPU blocks and threads; ``lanes``, the threads of a row (an int, or a sampled
    ExprRV)."""
    for chain in chains:
        if chain.method == "split_k" and not _static_key_length(sch, chain):
            raise UnsupportedOnGpu(
                f"'{chain.root}': split-k over a symbolic key length has chunks of "
                "symbolic length; the rolling update's tiles have a static one"
            )
    drop_layout_hints(sch)
    inline_spatial(sch)
    for chain in chains:
        _schedule_nest(sch, chain, lanes)
    _bind_remaining(sch, THREADS)
    _check_static_allocations(_func(sch))


def _func(sch):
    return sch.mod["main"]


def drop_layout_hints(sch) -> None:
    """Remove the matmuls' ``layout_free_placeholders`` annotations: they name buffers
    that inlining removes, and would reach code generation dangling."""
    for site in collect_sites(_func(sch).body.block):
        if "layout_free_placeholders" in site.block.annotations:
            sch.unannotate(sch.get_sblock(site.name), "layout_free_placeholders")


def inline_spatial(sch) -> None:
    """Inline every spatial block that writes an intermediate (layout copies, scaling,
    masking, exp, normalisation): its consumers recompute it instead of storing it."""
    changed = True
    while changed:
        changed = False
        func = _func(sch)
        params = buffer_params(func)
        for site in collect_sites(func.body.block):
            writes = site.write_buffers()
            if site.is_reduction or len(writes) != 1 or _is_param(writes[0], params):
                continue
            try:
                sch.compute_inline(sch.get_sblock(site.name))
            except ScheduleError:
                continue
            changed = True
            break


def _schedule_nest(sch, chain, lanes) -> None:
    """:data:`ROWS` rows (and chunks) of the chain's nest per CUDA block, one thread row
    each, its lanes over the spatial loops of the blocks inside."""
    key = sch.get(chain.loop)
    block = sch.get_child_blocks(chain.loop)[0]
    loops = sch.get_loops(block)
    depth = next(k for k, loop in enumerate(loops) if sch.get(loop).same_as(key))
    rows = loops[: depth + 1] if chain.method == "split_k" else loops[:depth]
    # A block's thread rows are consecutive iterations of the innermost row loop, so
    # what they share spans ROWS of it even where the row loops' extents are symbolic.
    outer, row = sch.split(rows[-1], [None, ROWS])
    block_rows = sch.fuse(*rows[:-1], outer) if len(rows) > 1 else outer
    sch.bind(block_rows, "blockIdx.x")
    sch.bind(row, "threadIdx.y")
    # Below this loop each block's own loops start: the tile loop (rolling) or the row.
    inner = chain.loop if chain.method == "rolling" else row
    tile = _tile(sch, chain) if chain.method == "rolling" else None
    _place_buffers(sch, row, inner, tile)
    _bind_lanes(sch, row, inner, lanes)


def _static_key_length(sch, chain) -> bool:
    """Whether the loops below the chain's key loop (keys of a tile or of a chunk) have
    static extents."""
    key = sch.get(chain.loop)
    for block in sch.get_child_blocks(chain.loop):
        loops = [sch.get(loop) for loop in sch.get_loops(block)]
        depth = next(k for k, loop in enumerate(loops) if loop.same_as(key))
        if not all(isinstance(loop.extent, tvm.tirx.IntImm) for loop in loops[depth + 1 :]):
            return False
    return True


def _tile(sch, chain) -> int:
    """Keys per tile of a rolling chain: the extent of the root's loop below the tile loop."""
    loops = sch.get_loops(sch.get_sblock(chain.root))
    key = sch.get(chain.loop)
    depth = next(k for k, loop in enumerate(loops) if sch.get(loop).same_as(key))
    return int(sch.get(loops[depth + 1]).extent)


def _lane_loop(site, row, inner):
    """Position in ``site.loops`` of the loop below ``inner`` (below ``row`` for blocks
    after the key loop, such as stores) to spread over the lanes: the first one of more
    than one iteration that binds spatial iterators only; None for reductions over keys
    alone."""
    reduce_vars, spatial_vars = [], []
    for iv, value in zip(site.block.iter_vars, site.realize.iter_values):
        (reduce_vars if iv.iter_type == REDUCE else spatial_vars).extend(vars_in(value))
    below = site.loops_below(inner if site.under(inner) else row)
    offset = len(site.loops) - len(below)
    for k, loop in enumerate(below):
        var = loop.loop_var
        if (
            not (isinstance(loop.extent, tvm.tirx.IntImm) and loop.extent.value == 1)
            and any(v.same_as(var) for v in spatial_vars)
            and not any(v.same_as(var) for v in reduce_vars)
        ):
            return offset + k
    return None


def _place_buffers(sch, row_rv, inner_rv, tile) -> None:
    """Scopes of what the nest writes: values one lane writes and other blocks read in
    shared memory, other intermediates in registers; accumulators read after the nest
    (or outputs) computed in registers and stored once, after the last key.

    An intermediate with a symbolic key axis (a rolling chain over a symbolic key count;
    ``tile`` keys per tile) has that axis split into (tile, key in the tile): a thread
    row uses one tile of it at a time, which then has the static size that registers and
    shared memory need. A symbolic row axis is split likewise into (block's rows, row in
    the block): a block's thread rows share :data:`ROWS` of it."""
    done = set()
    while True:
        func = _func(sch)
        params = buffer_params(func)
        row, inner = sch.get(row_rv), sch.get(inner_rv)
        sites = collect_sites(func.body.block)
        nest = [s for s in sites if s.under(row)]
        outside = [s for s in sites if not s.under(row)]
        pending = [
            (site, index, buf)
            for site in nest
            for index, buf in enumerate(site.write_buffers())
            if (site.name, index) not in done and _scope(buf) == "global"
        ]
        if not pending:
            return
        site, index, buf = pending[0]
        done.add((site.name, index))
        block = sch.get_sblock(site.name)
        escapes = _is_param(buf, params) or any(_reads(s, buf) for s in outside)
        if escapes:
            if site.is_reduction:
                readers = [sch.get_sblock(s.name) for s in nest if s is not site and _reads(s, buf)]
                store = sch.cache_write(block, index, "local", consumer_blocks=readers)
                # TVM's trace simplification looks for used blocks in an instruction's own
                # inputs, not in its list inputs: without a use of their own, the readers'
                # get_sblock would leave the simplified trace (MetaSchedule's records),
                # which then no longer replays.
                for reader in readers:
                    sch.annotate(reader, READS_REGISTERS, buf.name)
                done.add((sch.get(store).name_hint, 0))
                if not any(sch.get(l).same_as(sch.get(row_rv)) for l in sch.get_loops(store)):
                    sch.reverse_compute_at(store, row_rv, preserve_unit_loops=True)
            continue
        splits = {} if _is_static(buf) else _symbolic_splits(site, index, row, inner, tile)
        shared = _lane_loop(site, row, inner) is not None and any(
            s is not site and _reads(s, buf) for s in nest
        )
        if shared and site.is_reduction:
            # Accumulate in a register and store to shared memory once: accumulating in
            # shared memory puts a barrier into every step of the reduction. (The store
            # is made while the buffer is global, so that it covers this thread row only.)
            store = sch.cache_write(block, index, "local")
            sch.set_scope(store, 0, "shared")
            done.add((sch.get(store).name_hint, 0))
            block, index = store, 0
        else:
            sch.set_scope(block, index, "shared" if shared else "local")
        if splits:
            sch.transform_layout(
                block,
                ("write", index),
                _split_axes(splits, len(buf.ty.shape)),
                # Not bijective where a length is no multiple of its factor: the last
                # tile's tail is never written nor read (the blocks' predicates).
                assume_injective_transform=True,
            )


def _is_static(buf) -> bool:
    return all(isinstance(e, tvm.tirx.IntImm) for e in buf.ty.shape)


def _symbolic_splits(site, index, row_loop, tile_loop, tile) -> dict:
    """Axis -> factor: how to split the symbolic axes of ``site``'s ``index``-th written
    buffer that the thread row (by :data:`ROWS`) or the tile loop (by ``tile``; None for
    split-k) indexes. Other symbolic axes must shrink to one element once lowering
    compacts the buffer (:func:`_check_static_allocations`)."""
    buf = site.write_buffers()[index]
    region = site.block.writes[index].region
    splits = {}
    for loop, factor in ((row_loop, ROWS), (tile_loop, tile)):
        if factor is None:
            continue
        along = [
            axis
            for axis, extent in enumerate(region)
            if any(uses_var(_binding(site, v), loop.loop_var) for v in vars_in(extent.min))
        ]
        if len(along) > 1:
            raise UnsupportedOnGpu(f"'{buf.name}': one loop indexes several of its axes")
        if along and not isinstance(buf.ty.shape[along[0]], tvm.tirx.IntImm):
            splits[along[0]] = factor
    return splits


def _binding(site, var):
    """What ``site``'s realize binds the block iterator ``var`` to (``var`` itself if it
    is no block iterator)."""
    for iv, value in zip(site.block.iter_vars, site.realize.iter_values):
        if iv.var.same_as(var):
            return value
    return var


def _split_axes(splits: dict, ndim: int):
    """The index map that splits each axis of ``splits`` into (index // factor, index %
    factor)."""

    def mapping(*indices):
        out = []
        for axis, index in enumerate(indices):
            factor = splits.get(axis)
            out.extend([index] if factor is None else [index // factor, index % factor])
        return tuple(out)

    return tvm.tirx.IndexMap.from_func(mapping, ndim=ndim)


def _check_static_allocations(func) -> None:
    """Raise :class:`UnsupportedOnGpu` where a register or shared-memory buffer of
    ``func`` keeps a symbolic size once lowering has shrunk each to the region it uses
    (the CUDA code generator would refuse it)."""
    dynamic = [
        buf.name
        for buf in compacted_buffers(tvm.IRModule({"main": func}), gpu=True)
        if _scope(buf) != "global" and not _is_static(buf)
    ]
    if dynamic:
        raise UnsupportedOnGpu(f"{', '.join(dynamic)}: symbolic size in registers or shared memory")


def _bind_lanes(sch, row_rv, inner_rv, lanes) -> None:
    """Spread each nest block's lane loop (see :func:`_lane_loop`) over ``lanes`` threads."""
    done = set()
    while True:
        row, inner = sch.get(row_rv), sch.get(inner_rv)
        pending = [
            (site, position)
            for site in collect_sites(_func(sch).body.block)
            if site.under(row) and site.name not in done
            for position in [_lane_loop(site, row, inner)]
            if position is not None
        ]
        if not pending:
            return
        site, position = pending[0]
        done.add(site.name)
        loop = sch.get_loops(sch.get_sblock(site.name))[position]
        _, lane = sch.split(loop, [None, lanes])
        sch.bind(lane, "threadIdx.x")


def _bind_remaining(sch, threads) -> None:
    """Give every root-level loop nest not yet on the GPU its own kernel: its leading
    loops that only spatial iterators use go over blocks and threads."""
    bound = set()
    while True:
        sites = [s for s in collect_sites(_func(sch).body.block) if not _is_bound(s)]
        sites = [s for s in sites if s.name not in bound]
        if not sites:
            return
        site = sites[0]
        nest = [s for s in sites if s.loops and site.loops and s.loops[0].same_as(site.loops[0])]
        block = sch.get_sblock(site.name)
        count = min(_spatial_prefix(s) for s in nest) if site.loops else 0
        if count == 0:
            loops = [sch.add_unit_loop(block)]
        else:
            loops = sch.get_loops(block)[:count]
        _bind(sch, loops, threads)
        bound.update(s.name for s in (nest or [site]))


def _bind(sch, loops, threads):
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    bx, tx = sch.split(fused, [None, threads])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")


def _spatial_prefix(site) -> int:
    """How many outer loops of ``site`` bind spatial iterators only."""
    reduce_vars = [
        v
        for iv, value in zip(site.block.iter_vars, site.realize.iter_values)
        if iv.iter_type == REDUCE
        for v in vars_in(value)
    ]
    for count, loop in enumerate(site.loops):
        if any(v.same_as(loop.loop_var) for v in reduce_vars):
            return count
    return len(site.loops)


def _is_bound(site) -> bool:
    return any(loop.kind == tvm.tirx.ForKind.THREAD_BINDING for loop in site.loops)


def _reads(site, buf) -> bool:
    return any(b.same_as(buf) for b in site.read_buffers())


def _is_param(buf, params) -> bool:
    return any(buf.same_as(p) for p in params)


def _scope(buf) -> str:
    return str(buf.ty.storage_scope) or "global"
