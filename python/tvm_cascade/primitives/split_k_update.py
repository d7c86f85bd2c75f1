"""``Schedule.split_k_update``: chunk-local partial reductions plus a repairing combine."""
import tvm
import tvm_ffi
from tvm.ir import expr as ir_expr
from tvm.s_tir.stmt import SBlock

from ..algebra.reducers import match_reducer, tir_identity
from ..analysis.scope import REDUCE, accumulator_store, buffer_accesses, dtype_of, uses_var
from ..analysis.split_chain import SplitKChain
from ..analysis.chain import substitute
from . import ir
from .fusion import derive, repair_to_tir
from .rewrite import ScopeRewrite
from .rolling_update import chain_of

DATA_PAR = 0


def split_k_update(sch, block_rv, loop_rv) -> None:
    """Rewrite the IR for ``Schedule.split_k_update`` (the public method documents it)."""
    root_sref, params, chain = chain_of(sch, block_rv, loop_rv, SplitKChain, "split_k_update")
    fusion = derive(chain, required=not chain.target_is_under)
    edit = ScopeRewrite(chain, params, root_sref.stmt)
    target = chain.target
    acc = accumulator_store(target.block).buffer
    partial = edit.add_buffer(_chunked_buffer(chain, acc))

    if chain.target_is_under:
        # Already rolled under the chunk loop: the target's snapshots become per chunk too,
        # and the blocks beside it read the partials of their own chunk.
        private = {acc: partial}
        for region in target.block.writes:
            buf = region.source
            if not buf.same_as(acc):
                private[buf] = edit.add_buffer(_chunked_buffer(chain, buf))
        block = target.block
        bindings, predicate = list(target.realize.iter_values), target.realize.predicate
        edit.replaced[target.realize] = _partial_realize(
            chain, edit, block, bindings, predicate, private
        )
        for buf in private:
            readers = chain.readers.get(buf, [])
            if not buf.same_as(acc) and all(r.under(chain.loop) for r in readers):
                edit.dead_buffers.append(buf)
        for site in chain.under:
            if site is target or not any(b in private for b in site.read_buffers()):
                continue
            axis = _axis_var_of(chain, site.block)
            if axis is None:
                chain._fail(
                    f"block '{site.name}' under loop '{chain.loop.loop_var.name}' reads its "
                    "result but does not iterate the reduced axis, so its chunk is unknown"
                )
            chunk = tvm.tirx.floordiv(axis, chain.chunk)
            body = _to_partials(site.block.body, private, chunk)
            edit.update(site, edit.regions(ir.copy_block(site.block, body=body)))
    else:
        edit.keep_complete_copies()
        edit.drop_dead_twins()
        chunked = {}
        for site in chain.movers[:-1]:
            _move_intermediate(chain, edit, site, chunked)
        block = ir.copy_block(target.block, body=ir.replace_buffers(target.block.body, chain.redirects))
        bindings, predicate, loops = edit.placement.bind(block)
        realize = _partial_realize(chain, edit, block, bindings, predicate, {acc: partial, **chunked})
        edit.replaced[target.realize] = None
        edit.appended.append(ir.nest(loops, realize))

    combine, nest = _global_combine(chain, edit, fusion, partial)
    edit.reuse[target.block] = combine
    edit.insert_after([target] + chain.producers, nest)
    edit.commit(sch, root_sref)


def _move_intermediate(chain, edit, site, chunked: dict):
    """Move a spatial block between earlier reductions and the target under the chunk
    loop, reading the partials of its chunk. One that walks the reduced axis finds its
    chunk from its position; one that does not (a per-row block such as RMSNorm's
    ``rstd``) runs once per chunk, with a chunk iterator, into ``<buffer>_partial``."""
    body = ir.replace_buffers(site.block.body, chain.redirects)
    axis = _axis_var_of(chain, site.block)
    if axis is not None:
        chunk = tvm.tirx.floordiv(axis, chain.chunk)
        body = _to_partials(chain.localize(body, chunk), chunked, chunk)
        edit.move_under_loop(site, edit.regions(ir.copy_block(site.block, body=body)))
        return
    buf = site.write_buffers()[0]
    chunked[buf] = edit.add_buffer(_chunked_buffer(chain, buf))
    chunk_iv = tvm.tirx.IterVar(
        tvm.ir.Range(0, chain.chunks), tvm.tirx.Var("v_chunk", dtype_of(chain.loop.loop_var)), DATA_PAR
    )
    body = _to_partials(chain.localize(body, chunk_iv.var), chunked, chunk_iv.var)
    bindings, predicate, loops = edit.placement.bind(site.block)
    block = ir.copy_block(site.block, iter_vars=[chunk_iv] + list(site.block.iter_vars), body=body)
    block = edit.regions(block)
    edit.reuse[site.block] = block
    edit.replaced.setdefault(site.realize, None)
    edit.appended.append(
        ir.nest(loops, ir.realize([chain.loop.loop_var] + list(bindings), predicate, block))
    )


def _axis_var_of(chain, block):
    axis = [iv.var for iv in block.iter_vars if chain.axes.same(iv.var, chain.target_axis.var)]
    return axis[0] if axis else None


def _chunked_buffer(chain, buf):
    """A buffer like ``buf`` with a leading chunk dimension, named ``<buf>_partial``."""
    return ir.like_buffer(buf, f"{buf.name}_partial", [chain.chunks] + list(buf.shape))


def _to_partials(node, partials: dict, chunk):
    """``node`` with loads and stores of each buffer in ``partials`` moved to its chunked
    counterpart, at chunk ``chunk``."""

    def find(buf):
        return next((p for b, p in partials.items() if b.same_as(buf)), None)

    def load(l):
        new = find(l.source)
        return l if new is None else tvm.tirx.BufferLoad(new, [chunk] + list(l.indices))

    def store(s):
        new = find(s.buffer)
        return s if new is None else tvm.tirx.BufferStore(new, s.value, [chunk] + list(s.indices))

    return tvm_ffi.structural_map(node, [(ir_expr.TensorLoad, load), (tvm.tirx.BufferStore, store)])


def _partial_realize(chain, edit, block: SBlock, bindings, predicate, partials: dict):
    """``block`` folding one chunk into ``partial[chunk, ...]``: iterators (chunk, its own
    spatial ones, position in the chunk), with earlier results read from their partials."""
    axis = chain.target_axis
    index = [k for k, iv in enumerate(block.iter_vars) if iv.var.same_as(axis.var)][0]
    loop_var = chain.loop.loop_var
    inner = tvm.sym.Analyzer().simplify(bindings[index] - loop_var * chain.chunk)
    if uses_var(inner, loop_var):
        chain._fail(
            f"its reduced axis is not split as chunk * {chain.chunk} + position by loop "
            f"'{loop_var.name}'"
        )
    dtype = dtype_of(axis.var)
    chunk_iv = tvm.tirx.IterVar(
        tvm.ir.Range(0, chain.chunks), tvm.tirx.Var("v_chunk", dtype), DATA_PAR
    )
    inner_iv = tvm.tirx.IterVar(
        tvm.ir.Range(0, chain.chunk), tvm.tirx.Var(f"{axis.var.name}_in", dtype), REDUCE
    )
    position = chunk_iv.var * chain.chunk + inner_iv.var
    extent = axis.dom.min + axis.dom.extent
    ragged = not tvm.sym.Analyzer().can_prove(chain.chunks * chain.chunk <= axis.dom.extent)
    # The last chunk runs past the axis. Rather than a predicate over (chunk, position),
    # which TVM cannot prove an affine binding (so the chunk loop could be neither bound
    # nor parallel), the block runs every position: reads kept in the axis (shifted or
    # clamped), the fold skipped where they repeat. Not beside reductions rolled within
    # the chunks, whose tiles TVM's region cover then no longer proves covered.
    ragged = ragged and _clamps(chain)
    inside = position < extent
    if not ragged:
        reads = {axis.var: position}
    elif _shifts(chain, block, axis.var, partials, extent):
        # The last chunk reads a whole chunk's window ending at the axis' end and folds
        # its positions past the previous chunk: its reads stay contiguous (whole loads).
        start = tvm.tirx.min(chunk_iv.var * chain.chunk, extent - chain.chunk)
        reads = {axis.var: start + inner_iv.var}
        inside = start + inner_iv.var >= chunk_iv.var * chain.chunk
    else:
        reads = {axis.var: tvm.tirx.min(position, extent - 1)}
    if ragged:
        predicate = _without_var(predicate, loop_var)

    def rewrite(stmt, guard=False):
        stmt = substitute(stmt, reads)
        if guard:
            stmt = _guard_fold(stmt, accumulator_store(block).buffer, inside)
        stmt = chain.localize(stmt, chunk_iv.var)
        return _to_partials(stmt, partials, chunk_iv.var)

    body = rewrite(block.body, guard=ragged)
    others = [(iv, b) for iv, b in zip(block.iter_vars, bindings) if not iv.var.same_as(axis.var)]
    new_block = ir.copy_block(
        block,
        name_hint=f"{block.name_hint}_partial",
        iter_vars=[chunk_iv] + [iv for iv, _ in others] + [inner_iv],
        body=body,
        init=rewrite(block.init),
    )
    new_bindings = [loop_var] + [b for _, b in others] + [inner]
    return ir.realize(new_bindings, predicate, edit.regions(new_block))


def _clamps(chain) -> bool:
    """Whether the chain's partials run every position of a ragged last chunk: as the
    partials already split do, else where no other reduction of the chain runs under the
    loop (rolled by ``rolling_update`` within each chunk)."""
    loop_var = chain.loop.loop_var
    if chain.partial_of:
        return not any(uses_var(p.realize.predicate, loop_var) for p in chain.partial_of.values())

    def partial(site):
        first = site.block.iter_vars[0]
        return first.iter_type != REDUCE and site.binding(first).same_as(loop_var)

    return not any(site.is_reduction and site is not chain.target and not partial(site) for site in chain.under)


def _shifts(chain, block, axis_var, partials, extent) -> bool:
    """Whether the last chunk of ``block`` may read the window of one chunk that ends at
    the axis' end: a chunk no longer than the axis, and nothing it reads along the axis
    written under the chunk loop (those values are computed for the chunk's own
    positions only)."""
    if not tvm.sym.Analyzer().can_prove(chain.chunk <= extent):
        return False
    under = [b for site in [*chain.under, *chain.movers] for b in site.write_buffers()] + [*partials, *partials.values()]
    return not any(
        any(buf.same_as(u) for u in under) and any(uses_var(i, axis_var) for i in indices)
        for buf, indices in buffer_accesses(block.body)
    )


def _without_var(predicate, var):
    """``predicate`` without its conjuncts that use ``var``."""
    if isinstance(predicate, tvm.tirx.And):
        kept = tvm.tirx.And(_without_var(predicate.a, var), _without_var(predicate.b, var))
        return tvm.sym.Analyzer().simplify(kept)
    return tvm.tirx.const(True, "bool") if uses_var(predicate, var) else predicate


def _guard_fold(stmt, acc, inside):
    """``stmt`` with its stores to ``acc`` keeping ``acc`` unchanged where not ``inside``:
    the folded term replaced there by the reducer's identity, so that the update stays a
    reducer of its accumulator and one term (``rolling_update`` can then fuse within the
    chunks)."""

    def store(s):
        if not s.buffer.same_as(acc):
            return s
        matched = match_reducer(s)
        if matched is None or not isinstance(_other_operand(s.value, matched[1]), ir_expr.TensorLoad):
            value = tvm.tirx.Select(inside, s.value, tvm.tirx.BufferLoad(acc, s.indices))
        else:
            reducer, term = matched
            value = reducer.tir_combine(
                tvm.tirx.BufferLoad(acc, s.indices),
                tvm.tirx.Select(inside, term, tir_identity(reducer, s.buffer.dtype)),
            )
        return tvm.tirx.BufferStore(s.buffer, value, s.indices)

    return tvm_ffi.structural_map(stmt, (tvm.tirx.BufferStore, store))


def _other_operand(value, term):
    """The operand of the binary ``value`` that is not ``term``."""
    return value.b if value.a.same_as(term) else value.a


def _global_combine(chain, edit, fusion, partial):
    """The block that folds the chunks' partials into the target's buffer, repairing each
    partial from the earlier results it used (their partials) to their global values."""
    target = chain.target.block
    store = accumulator_store(target)
    acc = store.buffer
    vmap, iter_vars, loops, bindings = {}, [], [], []
    for iv in target.iter_vars:
        if iv.iter_type == REDUCE:
            continue
        var = tvm.tirx.Var(iv.var.name, dtype_of(iv.var))
        loop = tvm.tirx.Var(f"ax{len(loops)}", dtype_of(iv.var))
        vmap[iv.var] = var
        iter_vars.append(tvm.tirx.IterVar(iv.dom, var, DATA_PAR))
        loops.append((loop, iv.dom.extent))
        bindings.append(iv.dom.min + loop)
    dtype = dtype_of(chain.target_axis.var)
    chunk = tvm.tirx.IterVar(tvm.ir.Range(0, chain.chunks), tvm.tirx.Var("v_chunk", dtype), REDUCE)
    chunk_loop = tvm.tirx.Var("chunk", dtype)
    iter_vars.append(chunk)
    loops.append((chunk_loop, chain.chunks))
    bindings.append(chunk_loop)

    extent = chain.target_axis.dom.extent
    idx = [substitute(i, vmap) for i in store.indices]
    running = tvm.tirx.BufferLoad(acc, idx)
    part = tvm.tirx.BufferLoad(partial, [chunk.var] + idx)
    if fusion is None:
        term = part
    else:
        prev_loads, cur_loads = [], []
        for producer, load in zip(fusion.producers, fusion.loads):
            global_buf = producer.write_buffers()[0]
            partial_buf = chain.partial_of[producer].write_buffers()[0]
            rows = list(load.indices)
            if load.source.same_as(partial_buf):
                rows = rows[1:]
            rows = [substitute(r, vmap) for r in rows]
            prev_loads.append(tvm.tirx.BufferLoad(partial_buf, [chunk.var] + rows))
            cur_loads.append(tvm.tirx.BufferLoad(global_buf, rows))
        count = tvm.tirx.min(chain.chunk, extent - chunk.var * chain.chunk)
        term = repair_to_tir(fusion, part, prev_loads, cur_loads, count, acc.dtype)
    value = chain.reducer.tir_combine(running, term)
    block = ir.copy_block(
        target,
        iter_vars=iter_vars,
        body=tvm.tirx.BufferStore(acc, value, idx),
        init=substitute(target.init, vmap),
    )
    block = edit.regions(block)
    # A chunk past the last key folds nothing (its init never runs): skip it.
    predicate = tvm.tirx.const(True, "bool")
    if not tvm.sym.Analyzer().can_prove((chain.chunks - 1) * chain.chunk < extent):
        predicate = chunk_loop * chain.chunk < extent
    return block, ir.nest(loops, ir.realize(bindings, predicate, block))
