"""``Schedule.rolling_update``: fuse a cascaded reduction into its producer's loop."""
import tvm
from tvm.ir import expr as ir_expr
from tvm.s_tir.stmt import SBlock

from ..algebra.reducers import match_reducer
from ..analysis.chain import Chain, substitute
from ..analysis.scope import buffer_params, dtype_of
from ..errors import FusionError
from . import ir
from .fusion import derive, repair_to_tir


def scope_of(sch, block_rv):
    """(function, root block sref) of the PrimFunc whose root scope holds ``block_rv``."""
    sref = sch.get_sref(block_rv).parent
    while sref is not None and not isinstance(sref.stmt, SBlock):
        sref = sref.parent
    for _, func in sch.mod.functions.items():
        if isinstance(func, tvm.tirx.PrimFunc) and func.body.block.same_as(sref.stmt):
            return func, sref
    raise FusionError(
        f"block '{sch.get(block_rv).name_hint}' must sit in the root scope of a PrimFunc"
    )


def snapshot_buffer(block: SBlock):
    """The buffer an earlier fusion made ``block`` copy its accumulator into, or None."""
    body = block.body
    if isinstance(body, tvm.tirx.SeqStmt) and isinstance(body[0], tvm.tirx.IfThenElse):
        then = body[0].then_case
        if (
            isinstance(then, tvm.tirx.BufferStore)
            and isinstance(then.value, ir_expr.TensorLoad)
            and then.value.source.same_as(block.writes[0].source)
        ):
            return then.buffer
    return None


def accumulator_store(block: SBlock):
    body = block.body
    return body[len(body) - 1] if isinstance(body, tvm.tirx.SeqStmt) else body


def tile_start(axis_var, tile):
    return tvm.tirx.floormod(axis_var, tile) == tvm.tirx.const(0, dtype_of(axis_var))


def add_snapshot(block: SBlock, axis_var, tile):
    """``block`` that copies its accumulator to a new ``<buffer>_prev`` when a tile starts,
    before folding the tile's first element; returns (block, prev buffer)."""
    store = accumulator_store(block)
    acc = store.buffer
    prev = ir.like_buffer(acc, f"{acc.name}_prev")
    copy = tvm.tirx.BufferStore(prev, tvm.tirx.BufferLoad(acc, store.indices), store.indices)
    body = tvm.tirx.SeqStmt([tvm.tirx.IfThenElse(tile_start(axis_var, tile), copy, None), block.body])
    return ir.copy_block(block, body=body), prev


class Placement:
    """Binds the iterators of blocks moved under the loop the way the template block's are."""

    def __init__(self, chain: Chain):
        self.chain = chain

    def place(self, block: SBlock):
        """A loop nest, to go under the chain's loop, that runs ``block`` for one tile."""
        chain = self.chain
        tmpl = chain.template
        bindings, free, reduced = [], [], False
        fresh = {l.loop_var: tvm.tirx.Var(l.loop_var.name, dtype_of(l.loop_var)) for l in chain.inner_loops}
        for iv in block.iter_vars:
            if chain.axes.same(iv.var, chain.target_axis.var):
                bindings.append(chain.axis_binding(fresh))
                reduced = True
                continue
            row = [r for r in chain.row_vars if chain.axes.same(iv.var, r.var)]
            if row:
                bindings.append(tmpl.binding(row[0]))
                continue
            var = tvm.tirx.Var(f"ax{len(free)}", dtype_of(iv.var))
            free.append((var, iv.dom.extent))
            bindings.append(iv.dom.min + var if not _is_zero(iv.dom.min) else var)
        predicate = substitute(tmpl.realize.predicate, fresh) if reduced else tvm.tirx.const(True, "bool")
        body = ir.realize(bindings, predicate, block)
        if reduced:
            body = ir.nest([(fresh[l.loop_var], l.extent) for l in chain.inner_loops], body)
        return ir.nest(free, body)


def _is_zero(expr) -> bool:
    return isinstance(expr, tvm.tirx.IntImm) and expr.value == 0


def rolling_update(sch, block_rv, loop_rv) -> None:
    """Rewrite the IR for ``Schedule.rolling_update`` (the public method documents it)."""
    func, root_sref = scope_of(sch, block_rv)
    root = root_sref.stmt
    params = buffer_params(func)
    chain = Chain(root, params, sch.get(block_rv), sch.get(loop_rv), "rolling_update")
    fusion = derive(chain)

    buffers = params + list(root.alloc_buffers)
    new_buffers, dead_buffers = [], []
    replaced, reuse = {}, {}

    def update(site, block):
        replaced[site.realize] = ir.realize(site.realize.iter_values, site.realize.predicate, block)
        reuse[site.block] = block

    # Producers keep a copy of their value from before each tile: the repair's old values.
    prev_loads = []
    for producer, load in zip(fusion.producers, fusion.loads):
        prev = snapshot_buffer(producer.block)
        if prev is None:
            block, prev = add_snapshot(producer.block, chain.axis_var[producer].var, chain.tile)
            new_buffers.append(prev)
            update(producer, ir.with_regions(block, buffers + new_buffers))
        prev_loads.append(tvm.tirx.BufferLoad(prev, load.indices))

    # Intermediates that feed blocks left outside keep an unfused copy for them.
    complete = {}
    for site in chain.complete_copies:
        buf = site.write_buffers()[0]
        complete[buf] = ir.like_buffer(buf, f"{buf.name}_complete")
        new_buffers.append(complete[buf])
    for site in chain.complete_copies:
        copy = ir.copy_block(
            ir.with_fresh_iter_vars(site.block),
            name_hint=f"{site.name}_complete",
        )
        copy = ir.copy_block(copy, body=ir.replace_buffers(copy.body, complete))
        replaced[site.realize] = ir.realize(
            site.realize.iter_values,
            site.realize.predicate,
            ir.with_regions(copy, buffers + new_buffers),
        )
    movers = set(chain.movers)
    for site in chain.sites:
        if site in movers or site.realize in replaced:
            continue
        if any(buf in complete for buf in site.read_buffers()):
            block = ir.copy_block(
                site.block,
                body=ir.replace_buffers(site.block.body, complete),
                init=site.block.init,
            )
            update(site, ir.with_regions(block, buffers + new_buffers))

    # Twins outside the loop that only the movers read are now dead.
    for old_buf in chain.redirects:
        twin = chain.writer[old_buf]
        readers = [r for r in chain.readers.get(old_buf, []) if r not in movers]
        if not readers and not any(p.same_as(old_buf) for p in params):
            replaced[twin.realize] = None
            dead_buffers.append(old_buf)

    # Move the intermediates and the target under the loop; the target gets the repair.
    placement = Placement(chain)
    appended = []
    for site in chain.movers:
        block = site.block
        body = ir.replace_buffers(block.body, chain.redirects)
        if site is chain.target:
            body = _repaired_store(chain, fusion, prev_loads, body)
        block = ir.with_regions(ir.copy_block(block, body=body), buffers + new_buffers)
        reuse[site.block] = block
        if site.realize not in replaced:
            replaced[site.realize] = None
        appended.append(placement.place(block))

    body = ir.rebuild_scope(root.body, replaced, chain.loop, appended)
    allocs = [b for b in root.alloc_buffers if not any(b.same_as(d) for d in dead_buffers)]
    new_root = ir.copy_block(root, body=body, alloc_buffers=allocs + new_buffers)
    reuse[root] = new_root
    sch.state.replace(root_sref, new_root, reuse)


def _repaired_store(chain: Chain, fusion, prev_loads, store):
    """``X = f(X, e)`` becomes ``X = f(first_in_tile ? h(X) : X, e)``."""
    acc = tvm.tirx.BufferLoad(store.buffer, store.indices)
    axis = chain.target_axis.var
    h = repair_to_tir(fusion, acc, prev_loads, axis, store.buffer.dtype)
    entering = tvm.tirx.all(tvm.tirx.const(0, dtype_of(axis)) < axis, tile_start(axis, chain.tile))
    repaired = tvm.tirx.if_then_else(entering, h, acc)
    _, rest = match_reducer(store)
    return tvm.tirx.BufferStore(store.buffer, chain.reducer.tir_combine(repaired, rest), store.indices)
