"""``Schedule.rolling_update``: fuse a cascaded reduction into its producer's loop."""
import tvm
from tvm.s_tir.stmt import SBlock

from ..algebra.reducers import match_reducer
from ..analysis.chain import Chain
from ..analysis.scope import accumulator_store, buffer_params, dtype_of, snapshot_buffer
from ..errors import FusionError
from . import ir
from .rewrite import ScopeRewrite
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


def chain_of(sch, block_rv, loop_rv, kind=Chain, primitive="rolling_update"):
    """``(root block sref, buffer params, chain)``: the ``kind`` chain of ``block_rv``
    reduced across ``loop_rv`` in the root scope of its PrimFunc, for ``primitive``."""
    func, root_sref = scope_of(sch, block_rv)
    params = buffer_params(func)
    return root_sref, params, kind(root_sref.stmt, params, sch.get(block_rv), sch.get(loop_rv), primitive)


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


def rolling_update(sch, block_rv, loop_rv) -> None:
    """Rewrite the IR for ``Schedule.rolling_update`` (the public method documents it)."""
    root_sref, params, chain = chain_of(sch, block_rv, loop_rv)
    fusion = derive(chain)

    edit = ScopeRewrite(chain, params, root_sref.stmt)

    # Producers keep a copy of their value from before each tile: the repair's old values.
    prev_loads = []
    for producer, load in zip(fusion.producers, fusion.loads):
        prev = snapshot_buffer(producer.block)
        if prev is None:
            block, prev = add_snapshot(producer.block, chain.axis_var[producer].var, chain.tile)
            edit.add_buffer(prev)
            edit.update(producer, edit.regions(block))
        prev_loads.append(tvm.tirx.BufferLoad(prev, load.indices))

    edit.keep_complete_copies()
    edit.drop_dead_twins()

    # Move the intermediates and the target under the loop; the target gets the repair.
    for site in chain.movers:
        body = ir.replace_buffers(site.block.body, chain.redirects)
        if site is chain.target:
            body = _repaired_store(chain, fusion, prev_loads, body)
        edit.move_under_loop(site, edit.regions(ir.copy_block(site.block, body=body)))
    edit.commit(sch, root_sref)


def _repaired_store(chain: Chain, fusion, prev_loads, store):
    """``X = f(X, e)`` becomes ``X = f(first_in_tile ? h(X) : X, e)``."""
    acc = tvm.tirx.BufferLoad(store.buffer, store.indices)
    axis = chain.target_axis.var
    h = repair_to_tir(fusion, acc, prev_loads, fusion.loads, axis, store.buffer.dtype)
    entering = tvm.tirx.all(tvm.tirx.const(0, dtype_of(axis)) < axis, tile_start(axis, chain.tile))
    repaired = tvm.tirx.if_then_else(entering, h, acc)
    _, rest = match_reducer(store)
    return tvm.tirx.BufferStore(store.buffer, chain.reducer.tir_combine(repaired, rest), store.indices)
