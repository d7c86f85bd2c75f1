"""Two IR rewrites that turn a rolled chain into per-tile stages a tensor-core schedule
can map: ``Schedule.distribute`` (loop fission of a row loop over the blocks below it)
and ``Schedule.split_tile_accumulation`` (a rolled sum split into a plain per-tile
reduction and the repair that folds each tile's result into the running value).

``rolling_update`` leaves one statement per row: for each query row ``i``, for each key
tile ``t``, every stage of the chain. A tensor-core GEMM needs a tile of rows inside
one key tile, so a schedule splits ``i``, moves its inner part below the key loop and
then gives each stage its own copy of that row loop (``distribute``). The rolled
``pv`` update ``O = (first of a later tile ? O * exp(m_prev - m) : O) + e * V`` mixes
the repair into every accumulation, which no matrix instruction matches;
``split_tile_accumulation`` computes each tile's ``sum_j e * V`` on its own (a GEMM
with a zero start) and repairs once per tile and output element.

Both record themselves in the schedule trace, so traces that use them replay.
"""
import tvm
from tvm.ir import expr as ir_expr
from tvm.s_tir import Schedule
from tvm.s_tir.stmt import SBlockRealize

from .._core import refresh_sblock_flags
from ..algebra.reducers import SUM, match_reducer
from ..analysis.chain import substitute
from ..analysis.scope import REDUCE, buffer_accesses, buffer_params, collect_sites, dtype_of, uses_var
from ..errors import FusionError
from ..trace import append_instruction
from ..trace.kinds import register_kind
from . import ir
from .rolling_update import scope_of

SPATIAL = 0  # IterVar.iter_type of a spatial iterator


def distribute(self: Schedule, loop) -> None:
    """Give every statement in the body of ``loop`` its own copy of ``loop`` (fission).

    ``loop``'s body must be a sequence of statements. The rewrite is legal when one
    iteration of ``loop`` only touches its own slice of every buffer written below it:
    each block below binds exactly one iterator to ``loop`` (as ``c + loop``, the same
    ``c`` for all), and every access to a buffer written below ``loop`` indexes one
    common dimension with that iterator. Otherwise :class:`tvm_cascade.FusionError`
    is raised and the schedule is left unchanged.

    Block random variables stay valid; ``loop`` and the loops around the moved
    statements keep their objects except the copies of ``loop``, which are new.
    """
    node = self.get(loop)
    _, root_sref = scope_of(self, _any_block_under(self, node))
    children = list(node.body) if isinstance(node.body, tvm.tirx.SeqStmt) else None
    if children is None or len(children) < 2:
        raise FusionError(f"distribute: loop '{node.loop_var.name}' has a single statement")
    _check_row_slices(node)
    copies = []
    for k, child in enumerate(children):
        var = tvm.tirx.Var(f"{node.loop_var.name}_{k}", dtype_of(node.loop_var))
        copies.append(
            tvm.tirx.For(
                var, node.min, node.extent, node.kind, substitute(child, {node.loop_var: var}),
                node.thread_binding, node.annotations, node.step,
            )
        )
    _replace_stmt(self, root_sref, node, tvm.tirx.SeqStmt(copies), [])
    append_instruction(self, "Distribute", [loop])


def split_tile_accumulation(self: Schedule, block, loop) -> None:
    """Split the rolled sum ``block`` under the key-tile ``loop`` into a per-tile sum
    and a repair.

    ``block`` must be the target of an earlier ``rolling_update`` over ``loop``: its
    update is ``X = (0 < j and j % T == 0 ? h(X) : X) + term(j)`` where ``j = t * T + r``
    (``t`` the iteration of ``loop``, ``r`` the loops below it). It becomes

    * ``<block>_tile``: ``X_tile[t, ...] = sum_r term(t * T + r)`` (a plain
      reduction over the tile, zero at its start), in place of ``block``;
    * ``block``: ``X = (0 < t ? h(X) : X) + X_tile[t, ...]``, reducing over ``t``,
      placed right after it under ``loop`` with copies of the loops of ``block``'s other
      iterators.

    ``X_tile`` has ``X``'s shape behind a leading tile dimension, so that the tile's
    rows and columns stay its last two dimensions, as matrix instructions want them.
    """
    target = self.get(block)
    node = self.get(loop)
    func, root_sref = scope_of(self, block)
    site = _site_under(root_sref.stmt, target, node)
    reduce_ivs = [iv for iv in target.iter_vars if iv.iter_type == REDUCE]
    store = target.body
    matched = match_reducer(store) if isinstance(store, tvm.tirx.BufferStore) else None
    if len(reduce_ivs) != 1 or matched is None or matched[0] is not SUM:
        raise FusionError(
            f"split_tile_accumulation: block '{target.name_hint}' is not a rolled sum over "
            "one reduced axis"
        )
    axis = reduce_ivs[0]
    inner = site.loops_below(node)
    tile = 1
    for l in inner:
        if uses_var(site.binding(axis), l.loop_var):
            tile *= int(l.extent)
    tiles = int(node.extent)
    analyzer = tvm.sym.Analyzer()
    offset = analyzer.simplify(site.binding(axis) - node.loop_var * tile)
    if uses_var(offset, node.loop_var):
        raise FusionError(
            f"split_tile_accumulation: '{node.loop_var.name}' is not the tile loop of "
            f"'{target.name_hint}'"
        )
    term = matched[1]
    repaired = store.value.b if store.value.a.same_as(term) else store.value.a
    _entering_condition(repaired)

    acc = store.buffer
    spatial = [iv for iv in target.iter_vars if iv.iter_type != REDUCE]
    x_tile = ir.like_buffer(acc, f"{acc.name}_tile", shape=[tiles] + list(acc.shape))
    t_var = tvm.tirx.Var("v_t", dtype_of(axis.var))
    r_var = tvm.tirx.Var("v_r", dtype_of(axis.var))
    tile_index = [t_var] + list(store.indices)
    buffers = buffer_params(func) + list(root_sref.stmt.alloc_buffers) + [x_tile]

    per_tile = ir.copy_block(
        target,
        name_hint=f"{target.name_hint}_tile",
        iter_vars=spatial
        + [
            tvm.tirx.IterVar(tvm.ir.Range(0, tiles), t_var, SPATIAL),
            tvm.tirx.IterVar(tvm.ir.Range(0, tile), r_var, REDUCE),
        ],
        init=tvm.tirx.BufferStore(x_tile, tvm.tirx.const(0, acc.dtype), tile_index),
        body=tvm.tirx.BufferStore(
            x_tile,
            tvm.tirx.BufferLoad(x_tile, tile_index) + substitute(term, {axis.var: t_var * tile + r_var}),
            tile_index,
        ),
    )
    per_tile = ir.with_regions(per_tile, buffers)
    spatial_values = [site.binding(iv) for iv in spatial]
    per_tile_realize = SBlockRealize(
        spatial_values + [node.loop_var, offset], site.realize.predicate, per_tile
    )

    # The repair of the first element of tile t, applied once per tile.
    first = {axis.var: t_var * tile}
    entering = analyzer.simplify(substitute(_entering_condition(repaired), first))
    repair = substitute(repaired.args[1], first)
    acc_load = tvm.tirx.BufferLoad(acc, store.indices)
    combine = ir.copy_block(
        target,
        iter_vars=spatial + [tvm.tirx.IterVar(tvm.ir.Range(0, tiles), t_var, REDUCE)],
        body=tvm.tirx.BufferStore(
            acc,
            tvm.tirx.if_then_else(entering, repair, acc_load) + tvm.tirx.BufferLoad(x_tile, tile_index),
            store.indices,
        ),
    )
    combine = ir.with_regions(ir.with_fresh_iter_vars(combine), buffers)
    # The combine keeps the loops of block's other iterators, with fresh variables.
    kept = [l for l in inner if not uses_var(site.binding(axis), l.loop_var)]
    fresh = {l.loop_var: tvm.tirx.Var(l.loop_var.name, dtype_of(l.loop_var)) for l in kept}
    combine_realize = SBlockRealize(
        [substitute(v, fresh) for v in spatial_values] + [node.loop_var], True, combine
    )
    combine_nest = ir.nest([(fresh[l.loop_var], l.extent) for l in kept], combine_realize)

    old = inner[0] if inner else site.realize
    new_per_tile = _rebuild_nest(old, site.realize, per_tile_realize)
    _replace_stmt(
        self, root_sref, old, tvm.tirx.SeqStmt([new_per_tile, combine_nest]), [x_tile],
        reuse={target: per_tile},
    )
    append_instruction(self, "SplitTileAccumulation", [block, loop])


def _entering_condition(repaired):
    """The condition of ``if_then_else(cond, h, X)``, the rolled repair's form."""
    if not (isinstance(repaired, ir_expr.Call) and repaired.op.name.endswith(".if_then_else")):
        raise FusionError("split_tile_accumulation: the update has no rolled repair")
    return repaired.args[0]


def _rebuild_nest(stmt, old_realize, new_realize):
    if stmt.same_as(old_realize):
        return new_realize
    if isinstance(stmt, tvm.tirx.For):
        return tvm.tirx.For(
            stmt.loop_var, stmt.min, stmt.extent, stmt.kind,
            _rebuild_nest(stmt.body, old_realize, new_realize),
            stmt.thread_binding, stmt.annotations, stmt.step,
        )
    raise FusionError("split_tile_accumulation: the block's loops below the tile loop hold other statements")


def _site_under(root, block, loop):
    for site in collect_sites(root):
        if site.block.same_as(block):
            if not site.under(loop):
                raise FusionError(
                    f"split_tile_accumulation: block '{block.name_hint}' is not under loop "
                    f"'{loop.loop_var.name}'"
                )
            return site
    raise FusionError(f"block '{block.name_hint}' is not in the root scope")


def _any_block_under(sch, node):
    found = []

    def visit(stmt):
        if isinstance(stmt, SBlockRealize) and not found:
            found.append(stmt.block)
        elif isinstance(stmt, tvm.tirx.For):
            visit(stmt.body)
        elif isinstance(stmt, tvm.tirx.SeqStmt):
            for item in stmt:
                visit(item)

    visit(node)
    if not found:
        raise FusionError(f"loop '{node.loop_var.name}' holds no block")
    return sch.get_sblock(found[0].name_hint)


def _check_row_slices(node):
    """Raise unless every iteration of ``node`` touches only its own slice of the buffers
    written below it (see :func:`distribute`)."""
    var = node.loop_var
    sites = []

    def visit(stmt):
        if isinstance(stmt, SBlockRealize):
            sites.append(stmt)
        elif isinstance(stmt, tvm.tirx.For):
            visit(stmt.body)
        elif isinstance(stmt, tvm.tirx.SeqStmt):
            for item in stmt:
                visit(item)

    visit(node.body)
    analyzer = tvm.sym.Analyzer()
    row_of, offset = {}, None
    for realize in sites:
        bound = [
            (iv.var, value)
            for iv, value in zip(realize.block.iter_vars, realize.iter_values)
            if uses_var(value, var)
        ]
        if len(bound) != 1 or bound[0][1].ty.dtype != var.ty.dtype:
            raise FusionError(
                f"distribute: block '{realize.block.name_hint}' must bind exactly one iterator "
                f"to loop '{var.name}'"
            )
        rest = analyzer.simplify(bound[0][1] - var)
        if uses_var(rest, var) or (offset is not None and not analyzer.can_prove_equal(rest, offset)):
            raise FusionError(
                f"distribute: block '{realize.block.name_hint}' does not bind its row as the "
                "other blocks do"
            )
        offset = rest
        row_of[realize.block] = bound[0][0]
    written = set()
    for realize in sites:
        for region in realize.block.writes:
            written.add(region.source)
    dims = {}
    for realize in sites:
        row = row_of[realize.block]
        stmts = [realize.block.body] + ([realize.block.init] if realize.block.init is not None else [])
        for stmt in stmts:
            for buf, indices in buffer_accesses(stmt):
                if not any(buf.same_as(w) for w in written):
                    continue
                at = {k for k, index in enumerate(indices) if index.same_as(row)}
                key = next((w for w in dims if w.same_as(buf)), buf)
                dims[key] = dims.get(key, at) & at
                if not dims[key]:
                    raise FusionError(
                        f"distribute: buffer '{buf.name}' is not indexed by the row of loop "
                        f"'{var.name}' in one common dimension, so iterations would share it"
                    )


def _replace_stmt(sch, root_sref, old, new, new_buffers, reuse=None):
    """Replace statement ``old`` of the root scope by ``new`` and add ``new_buffers``."""
    root = root_sref.stmt

    def go(stmt):
        if stmt.same_as(old):
            return new
        if isinstance(stmt, tvm.tirx.For):
            body = go(stmt.body)
            if body.same_as(stmt.body):
                return stmt
            return tvm.tirx.For(
                stmt.loop_var, stmt.min, stmt.extent, stmt.kind, body,
                stmt.thread_binding, stmt.annotations, stmt.step,
            )
        if isinstance(stmt, tvm.tirx.SeqStmt):
            items = [go(item) for item in stmt]
            if all(x.same_as(y) for x, y in zip(items, stmt)):
                return stmt
            return ir.seq(items)
        return stmt

    body = go(root.body)
    new_root = ir.copy_block(root, body=body, alloc_buffers=list(root.alloc_buffers) + list(new_buffers))
    block_reuse = dict(reuse or {})
    block_reuse[root] = new_root
    sch.state.replace(root_sref, new_root, block_reuse)
    refresh_sblock_flags(sch.state)


register_kind("Distribute", "distribute", ("loop",))
register_kind("SplitTileAccumulation", "split_tile_accumulation", ("block", "loop"))
