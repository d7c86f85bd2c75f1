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
import numpy as np
import tvm
import tvm_ffi
from tvm.ir import expr as ir_expr
from tvm.s_tir import Schedule
from tvm.s_tir.stmt import SBlock, SBlockRealize

from ..algebra.reducers import MAX, MIN, SUM, match_reducer
from ..analysis.chain import substitute
from ..analysis.scope import REDUCE, buffer_accesses, buffer_params, collect_sites, dtype_of, uses_var
from ..errors import FusionError
from ..trace import append_instruction
from ..trace.kinds import register_kind
from . import ir
from .rolling_update import scope_of

SPATIAL = 0  # IterVar.iter_type of a spatial iterator
#: Block annotation of ``split_tile_accumulation``'s per-tile block: the positions of its
#: iterators that number groups (tiles) of the reduced axis.
TILE_ITERATORS = "tvm_cascade.tile_iterators"


def distribute(self: Schedule, loop, sizes=None) -> None:
    """Give every statement in the body of ``loop`` its own copy of ``loop`` (fission),
    or, with ``sizes``, every group of ``sizes[k]`` consecutive statements.

    ``loop``'s body must be a sequence of statements; ``sizes`` (default: all ones)
    must add up to its length. The rewrite is legal when one iteration of ``loop`` only
    touches its own slice of every buffer that groups share: each block below binds
    exactly one iterator to ``loop`` (as ``c + loop``, the same ``c`` for all), and every
    access to a buffer written below ``loop`` and accessed by more than one group indexes
    one common dimension with that iterator (a buffer of one group keeps the order of its
    accesses, as a reduction over ``loop`` needs). Otherwise
    :class:`tvm_cascade.FusionError` is raised and the schedule is left unchanged.

    Block random variables stay valid; ``loop`` and the loops around the moved
    statements keep their objects except the copies of ``loop``, which are new.
    """
    node = self.get(loop)
    _, root_sref = scope_of(self, _any_block_under(self, node))
    children = list(node.body) if isinstance(node.body, tvm.tirx.SeqStmt) else None
    if children is None or len(children) < 2:
        raise FusionError(f"distribute: loop '{node.loop_var.name}' has a single statement")
    sizes = [1] * len(children) if sizes is None else [int(n) for n in sizes]
    if any(n < 1 for n in sizes) or sum(sizes) != len(children):
        raise FusionError(
            f"distribute: group sizes {sizes} do not split the {len(children)} statements of "
            f"loop '{node.loop_var.name}'"
        )
    groups, start = [], 0
    for size in sizes:
        groups.append(children[start] if size == 1 else tvm.tirx.SeqStmt(children[start:start + size]))
        start += size
    _check_row_slices(node, groups)
    copies = []
    for k, group in enumerate(groups):
        var = tvm.tirx.Var(f"{node.loop_var.name}_{k}", dtype_of(node.loop_var))
        copies.append(ir.copy_loop(node, loop_var=var, body=substitute(group, {node.loop_var: var})))
    _replace_stmt(self, root_sref, node, tvm.tirx.SeqStmt(copies), [])
    append_instruction(self, "Distribute", [loop], [sizes])


def split_tile_accumulation(self: Schedule, block, loop) -> None:
    """Split the reduction ``block`` over the key-tile ``loop`` into a per-tile
    reduction and the update that folds each tile's result into the running value.

    ``block`` reduces ``X = f(X', term(j))`` with ``f`` a sum, max or min over one
    reduced iterator ``j = t * T + r`` (``t`` the iteration of ``loop``, ``r`` the loops
    below it), where ``X'`` is ``X`` itself or, after ``rolling_update`` over ``loop``
    (sums only), the rolled repair ``(0 < j and j % T == 0 ? h(X) : X)``. Statements
    before the update that save the running value at a tile's first element
    (``if j % T == 0: X_prev = X``, which ``rolling_update`` adds to the reduction its
    repair reads) are kept. It becomes

    * ``<block>_tile``: ``X_tile[t, ...] = f_r term(t * T + r)`` (a plain reduction over
      the tile, from ``f``'s identity), in place of ``block``;
    * ``block``: the saves, then ``X = f(X', X_tile[t, ...])`` with the repair applied at
      ``t`` (``0 < t ? h(X) : X``), reducing over ``t``, placed right after it under
      ``loop`` with copies of the loops of ``block``'s other iterators;
    * for a scaling repair ``h(X) = X * c`` (attention's ``exp(m_prev - m)``), in place
      of the branch: ``<block>_scale``, ``X_scale[t, ...] = (0 < t ? c : 1)`` over only
      the iterators ``c`` uses (a row), right before ``<block>_tile`` (it reads what
      the repair read, complete there), and ``block`` becomes
      ``X = X * X_scale[t, ...] + X_tile[t, ...]``: the factor is computed once per row
      and tile, not per element.

    ``X_tile`` has ``X``'s shape behind a leading tile dimension, so that the tile's
    rows and columns stay its last two dimensions, as matrix instructions want them.

    Without a repair or saves the groups need not be contiguous: ``loop`` may be any
    loop of the reduced axis that no loop above it shares (the lane class
    ``(j % 8) // 2`` of an mma fragment, split out and reordered outward), and
    ``<block>_tile`` reduces the elements of each of its iterations, one reduced
    iterator per loop below it. The per-tile block records its tile iterators in the
    annotation ``TILE_ITERATORS`` (``skip_masked_tiles`` counts them as parts of the key).
    """
    target = self.get(block)
    node = self.get(loop)
    func, root_sref = scope_of(self, block)
    site = _site_under(root_sref.stmt, target, node)
    reduce_ivs = [iv for iv in target.iter_vars if iv.iter_type == REDUCE]
    saves, store = _saves_and_update(target)
    matched = match_reducer(store) if store is not None else None
    if len(reduce_ivs) != 1 or matched is None or matched[0] not in (SUM, MAX, MIN):
        raise FusionError(
            f"split_tile_accumulation: block '{target.name_hint}' is not a sum, max or min "
            "over one reduced axis"
        )
    reducer, term = matched
    axis = reduce_ivs[0]
    binding = site.binding(axis)
    if not uses_var(binding, node.loop_var):
        raise FusionError(
            f"split_tile_accumulation: loop '{node.loop_var.name}' does not iterate the reduced "
            f"axis of '{target.name_hint}'"
        )
    inner = site.loops_below(node)
    reduced = [l for l in inner if uses_var(binding, l.loop_var)]
    outer = [l for l in site.loops_above(node) if uses_var(binding, l.loop_var)]
    if outer:
        raise FusionError(
            f"split_tile_accumulation: loop '{outer[0].loop_var.name}' above '{node.loop_var.name}' "
            f"iterates the reduced axis of '{target.name_hint}' too"
        )
    tile = int(np.prod([int(l.extent) for l in reduced]))
    tiles = int(node.extent)
    analyzer = tvm.sym.Analyzer()
    repaired = store.value.b if store.value.a.same_as(term) else store.value.a
    rolled = _is_if_then_else(repaired)
    if rolled and reducer is not SUM:
        raise FusionError(
            f"split_tile_accumulation: block '{target.name_hint}' repairs a {reducer} "
            "(only a sum's repair is supported)"
        )
    # A repair applies at a tile's first element: the tiles must be contiguous.
    if (rolled or saves) and uses_var(analyzer.simplify(binding - node.loop_var * tile), node.loop_var):
        raise FusionError(
            f"split_tile_accumulation: '{node.loop_var.name}' is not the tile loop of "
            f"'{target.name_hint}'"
        )

    acc = store.buffer
    spatial = [iv for iv in target.iter_vars if iv.iter_type != REDUCE]
    x_tile = ir.like_buffer(acc, f"{acc.name}_tile", shape=[tiles] + list(acc.shape))
    t_var = tvm.tirx.Var("v_t", dtype_of(axis.var))
    # One reduced iterator per loop below the tile loop that iterates the axis.
    r_vars = [
        tvm.tirx.Var("v_r" if len(reduced) == 1 else f"v_r{k}", dtype_of(axis.var))
        for k in range(len(reduced))
    ]
    element = substitute(binding, {node.loop_var: t_var, **{l.loop_var: v for l, v in zip(reduced, r_vars)}})
    tile_index = [t_var] + list(store.indices)
    buffers = buffer_params(func) + list(root_sref.stmt.alloc_buffers) + [x_tile]

    # The tile iterators of a per-tile block group the reduced axis: its mask analysis
    # (skip_masked_tiles) counts them as parts of the key.
    groups = [int(k) for k in target.annotations.get(TILE_ITERATORS, [])] + [len(spatial)]
    per_tile = ir.copy_block(
        target,
        name_hint=f"{target.name_hint}_tile",
        annotations={**target.annotations, TILE_ITERATORS: groups},
        iter_vars=spatial
        + [tvm.tirx.IterVar(tvm.ir.Range(0, tiles), t_var, SPATIAL)]
        + [tvm.tirx.IterVar(tvm.ir.Range(0, l.extent), v, REDUCE) for l, v in zip(reduced, r_vars)],
        init=tvm.tirx.BufferStore(x_tile, identity_of(reducer, acc.dtype), tile_index),
        body=tvm.tirx.BufferStore(
            x_tile,
            reducer.tir_combine(
                tvm.tirx.BufferLoad(x_tile, tile_index), substitute(term, {axis.var: analyzer.simplify(element)})
            ),
            tile_index,
        ),
    )
    per_tile = ir.with_regions(per_tile, buffers)
    spatial_values = [site.binding(iv) for iv in spatial]
    per_tile_realize = SBlockRealize(
        spatial_values + [node.loop_var] + [l.loop_var for l in reduced], site.realize.predicate, per_tile
    )

    # The repair and the saves of the first element of tile t, applied once per tile.
    first = {axis.var: t_var * tile}
    acc_load = tvm.tirx.BufferLoad(acc, store.indices)
    # The combine keeps the loops of block's other iterators, with fresh variables.
    kept = [l for l in inner if not uses_var(binding, l.loop_var)]
    fresh = {l.loop_var: tvm.tirx.Var(l.loop_var.name, dtype_of(l.loop_var)) for l in kept}
    stages, new_buffers = [], [x_tile]
    factor = _scaling_factor(substitute(repaired.args[1], first), acc_load) if rolled else None
    entering = analyzer.simplify(substitute(repaired.args[0], first)) if rolled else None
    if not rolled:
        repaired_acc = acc_load
    elif factor is None:
        repaired_acc = tvm.tirx.if_then_else(entering, substitute(repaired.args[1], first), acc_load)
    else:
        scale = _ScaleStage(target, site, t_var, tiles, factor, entering, buffers)
        new_buffers.append(scale.buffer)
        buffers.append(scale.buffer)
        stages.append(scale.nest(kept, fresh, node.loop_var))
        repaired_acc = acc_load * scale.load()
    update = tvm.tirx.BufferStore(
        acc, reducer.tir_combine(repaired_acc, tvm.tirx.BufferLoad(x_tile, tile_index)), store.indices
    )
    combine = ir.copy_block(
        target,
        iter_vars=spatial + [tvm.tirx.IterVar(tvm.ir.Range(0, tiles), t_var, REDUCE)],
        body=ir.seq([_at_tile_start(save, first, analyzer) for save in saves] + [update]),
    )
    combine = ir.with_regions(ir.with_fresh_iter_vars(combine), buffers)
    combine_realize = SBlockRealize(
        [substitute(v, fresh) for v in spatial_values] + [node.loop_var], True, combine
    )
    stages.append(ir.nest([(fresh[l.loop_var], l.extent) for l in kept], combine_realize))

    old = inner[0] if inner else site.realize
    new_per_tile = _rebuild_nest(old, site.realize, per_tile_realize)
    _replace_stmt(
        self, root_sref, old, tvm.tirx.SeqStmt(stages[:-1] + [new_per_tile, stages[-1]]), new_buffers,
        reuse={target: per_tile},
    )
    append_instruction(self, "SplitTileAccumulation", [block, loop])


def _saves_and_update(block):
    """``(saves, update)`` of a reduction block whose body is the update, optionally
    after statements ``if cond: Y = X`` that save its accumulator; ``(None, None)`` for
    any other body."""
    *saves, update = ir.statements(block.body)
    if not isinstance(update, tvm.tirx.BufferStore):
        return None, None
    for save in saves:
        inner = save.then_case if isinstance(save, tvm.tirx.IfThenElse) and save.else_case is None else None
        if not (
            isinstance(inner, tvm.tirx.BufferStore)
            and isinstance(inner.value, ir_expr.TensorLoad)
            and inner.value.source.same_as(update.buffer)
        ):
            return None, None
    return saves, update


def _at_tile_start(save, first, analyzer):
    """A save ``if cond: Y = X`` at a tile's first element: the plain store where
    ``cond`` holds there, else the save with its condition there."""
    cond = analyzer.simplify(substitute(save.condition, first))
    then = substitute(save.then_case, first)
    if analyzer.can_prove(cond):
        return then
    return tvm.tirx.IfThenElse(cond, then, None)


def identity_of(reducer, dtype):
    """The value ``reducer`` starts from, of type ``dtype``."""
    if reducer is SUM:
        return tvm.tirx.const(0, dtype)
    return tvm.tirx.min_value(dtype) if reducer is MAX else tvm.tirx.max_value(dtype)


def _is_if_then_else(expr):
    return isinstance(expr, ir_expr.Call) and expr.op.name.endswith(".if_then_else")


def _scaling_factor(repair, acc_load):
    """``c`` if the repair is ``X * c`` with ``c`` free of ``X``, else None."""
    if isinstance(repair, tvm.tirx.Mul):
        for x, factor in ((repair.a, repair.b), (repair.b, repair.a)):
            if tvm_ffi.structural_equal(x, acc_load) and not any(
                load.source.same_as(acc_load.source) for load in _loads(factor)
            ):
                return factor
    return None


def _loads(expr):
    found = []
    tvm_ffi.structural_walk(expr, lambda n: found.append(n) if isinstance(n, ir_expr.TensorLoad) else None)
    return found


class _ScaleStage:
    """The factor ``c`` of a scaling repair ``X * c`` as a stage of its own,
    ``X_scale[t, ...] = 0 < t ? c : 1`` over only the iterators ``c`` uses (a row's
    ``exp(m_prev - m)``): the combine multiplies by a load, once per element, instead
    of branching around ``c``'s loads and evaluating it per element."""

    def __init__(self, target, site, t_var, tiles, factor, entering, buffers):
        spatial = [iv for iv in target.iter_vars if iv.iter_type != REDUCE]
        self.used = [iv for iv in spatial if uses_var(factor, iv.var)]
        self.site, self.t_var = site, t_var
        acc = target.body.buffer
        self.buffer = ir.like_buffer(
            acc, f"{acc.name}_scale", shape=[tiles] + [iv.dom.extent for iv in self.used]
        )
        index = [t_var] + [iv.var for iv in self.used]
        one = tvm.tirx.const(1, acc.dtype)
        block = ir.copy_block(
            target,
            name_hint=f"{target.name_hint}_scale",
            iter_vars=[tvm.tirx.IterVar(tvm.ir.Range(0, tiles), t_var, SPATIAL)] + self.used,
            init=None,
            body=tvm.tirx.BufferStore(self.buffer, tvm.tirx.if_then_else(entering, factor, one), index),
        )
        self.block = ir.with_regions(ir.with_fresh_iter_vars(block), buffers + [self.buffer])

    def load(self):
        """``X_scale[t, ...]`` in the combine (its iterators, before they are renamed)."""
        return tvm.tirx.BufferLoad(self.buffer, [self.t_var] + [iv.var for iv in self.used])

    def nest(self, kept, fresh, tile_loop_var):
        """The stage under the tile loop, in copies of the kept loops its iterators use."""
        values = [substitute(self.site.binding(iv), fresh) for iv in self.used]
        loops = [l for l in kept if any(uses_var(v, fresh[l.loop_var]) for v in values)]
        realize = SBlockRealize([tile_loop_var] + values, True, self.block)
        return ir.nest([(fresh[l.loop_var], l.extent) for l in loops], realize)


def skip_masked_tiles(self: Schedule, block, loop) -> None:
    """Let the key-tile ``loop`` visit only the tiles where ``block``'s mask can be true.

    ``block`` reads its scores as ``select(mask, score, lowest)`` (``ops.attention``'s
    masking: ``lowest`` is the smallest finite value of the score type, the identity of
    the running max), or computes them so into a buffer of their own, and sits below
    ``loop``. Each conjunct of ``mask`` that compares expressions linear in the loops'
    variables bounds the tiles where it can hold, for the rows below ``loop``: the
    smallest value of ``lhs - rhs`` over the loops below ``loop`` must be at most
    (``<``: below) zero, a linear condition on the tile. ``loop`` visits the tiles
    ``lo`` to ``hi - 1``, with ``lo``/``hi`` in the loops above it (for causal and
    window masks, the first and last tile a thread block's rows can see): it becomes
    ``for t in range(lo, hi)``, or, where ``lo`` can be above the loop's start,
    ``t_first = lo`` followed by ``for t in range(hi - t_first)`` over tiles
    ``t_first + t``.

    Skipping a fully masked tile leaves a rolled chain's state as it was (the max keeps
    its value, every later reduction of the chain adds ``exp(lowest - m) = 0``), except
    for a row that sees no key at all (its running max stays ``lowest`` and every masked
    key counts with weight 1 in the reference). The rewrite raises
    :class:`tvm_cascade.FusionError` unless every reduction over ``loop`` is ``block``
    or reads what ``block`` or its consumers below ``loop`` write, no block below
    ``loop`` initialises such a reduction in its first tile (``decompose_reduction`` at
    ``loop`` first: that tile may be skipped), every row of ``block``'s domain sees a
    key, and the mask bounds the tiles at all.
    """
    target = self.get(block)
    node = self.get(loop)
    _, root_sref = scope_of(self, block)
    site = _site_under(root_sref.stmt, target, node, "skip_masked_tiles")
    _check_reductions_follow(root_sref.stmt, target, node)
    mask = mask_condition(target)
    if mask is None:
        raise FusionError(f"skip_masked_tiles: block '{target.name_hint}' reads no masked scores")
    _check_every_row_sees_a_key(site, node, mask)
    analyzer = _analyzer_above(site, node)
    t = node.loop_var
    lo, hi = node.min, node.min + node.extent
    bounded = False
    # A conjunct can hold in tile t iff it holds for the smallest difference there.
    for slope, limit in _tile_inequalities(analyzer, site, node, mask, "min_value"):
        if slope is not None and slope > 0:
            hi = tvm.tirx.min(hi, _tiles_end(slope, limit))
            bounded = True
        elif slope is not None and slope < 0:
            lo = tvm.tirx.max(lo, _tiles_first(slope, limit))
            bounded = True
    if not bounded:
        raise FusionError(
            f"skip_masked_tiles: the mask of block '{target.name_hint}' bounds no tiles of loop "
            f"'{t.name}'"
        )
    lo, hi = analyzer.simplify(lo), analyzer.simplify(hi)
    def tile_loop(start, first, body):
        return ir.copy_loop(node, min=start, extent=analyzer.simplify(hi - first), body=body)

    if analyzer.can_prove(lo <= node.min):
        new_loop = tile_loop(node.min, node.min, node.body)
    else:
        # The first tile goes to a variable of its own, outside the loop's bounds and the
        # blocks' bindings: where a reduction's binding depends on ``blockIdx`` (also
        # through its loop's start), TVM allocates the reduction's state above the kernel
        # launch, in global memory.
        first = tvm.tirx.Var(f"{t.name}_first", dtype_of(t))
        shifted = tile_loop(tvm.tirx.const(0, dtype_of(t)), first, substitute(node.body, {t: t + first}))
        new_loop = tvm.tirx.SeqStmt([tvm.tirx.Bind(first, lo), shifted])
    _replace_stmt(self, root_sref, node, new_loop, [])
    append_instruction(self, "SkipMaskedTiles", [block, loop])


def unmask_inner_tiles(self: Schedule, loop) -> None:
    """Compute the key tiles of ``loop`` where every mask below it holds for every row
    without the mask: ``loop`` is split into its inner tiles, whose blocks read their
    scores unmasked, and the boundary tiles before and after them, which keep the masks.

    Every block below ``loop`` that reads masked scores (``select(mask, score, lowest)``,
    ``ops.attention``'s masking) bounds the tiles where its mask holds for all the rows
    and keys of a tile, as :meth:`skip_masked_tiles` bounds the tiles where it can hold:
    each conjunct of ``mask`` compares expressions linear in the loops' variables, so it
    holds on a whole tile when the *largest* value of ``lhs - rhs`` over the loops below
    ``loop`` is at most (``<``: below) zero. The inner tiles are those where all conjuncts
    of all masks hold. With a causal mask, one row per iteration of ``i`` and key tiles
    of 4:

    .. code-block:: python

        for i in range(8):
            with T.sblock("init"):
                ...
            for t, r in T.grid(2, 4):
                with T.sblock("masked_max"):
                    vi = T.axis.spatial(8, i)
                    vj = T.axis.reduce(8, t * 4 + r)
                    m[vi] = T.max(m[vi], T.Select(vj <= vi, x[vi, vj], T.min_value("float32")))

    ``sch.unmask_inner_tiles(t)`` gives

    .. code-block:: python

        for i in range(8):
            with T.sblock("init"):
                ...
            t_outer: T.let[T.int32] = T.max(T.min(2, (i - 3) // 4 + 1), 0)
            for t, r in T.grid(T.max(T.min(2, (i - 3) // 4 + 1), 0), 4):
                with T.sblock("masked_max_inner"):
                    vi = T.axis.spatial(8, i)
                    vj = T.axis.reduce(8, t * 4 + r)
                    m[vi] = T.max(m[vi], x[vi, vj])
            for t, r in T.grid(2 - t_outer, 4):
                with T.sblock("masked_max"):
                    vi = T.axis.spatial(8, i)
                    vj = T.axis.reduce(8, (t + t_outer) * 4 + r)
                    m[vi] = T.max(m[vi], T.Select(vj <= vi, x[vi, vj], T.min_value("float32")))

    (``T.reads``/``T.writes`` omitted.) Every block below ``loop`` is copied for the inner
    tiles (``<name>_inner``), with a copy of each buffer only a tile uses (a tile's scores,
    its K and V in shared memory), so that each loop's buffers stay one tile large; the
    original blocks compute the boundary tiles after them.
    (A mask that also bounds keys from below, a window, adds a loop over the boundary
    tiles before the inner ones, with blocks ``<name>_head``; a mask that bounds them
    only from below leaves the original blocks there.) The tiles are visited in
    their order, so every reduction over ``loop`` sees the same values in the same order
    and the result is unchanged. The loops start at zero, with their first tiles in
    variables of their own (see :meth:`skip_masked_tiles`). Raises
    :class:`tvm_cascade.FusionError` when no block below ``loop`` reads masked scores or
    a mask has a conjunct that is not linear in the tile, or that fails on whole tiles
    regardless of the tile. Pieces that have no tile for any thread block, as far as the
    arithmetic analyzer can tell, are left out; without an inner piece ``loop`` stays as
    it is.
    """
    node = self.get(loop)
    func, root_sref = scope_of(self, _any_block_under(self, node))
    # The copies share the buffers that live across tiles; those a tile writes and reads
    # itself get a copy each, or the buffer would span every tile of both loops.
    across = _buffers_used_outside(root_sref.stmt, node)
    crosses = [any(b.same_as(u) for u in across) for b in root_sref.stmt.alloc_buffers]
    shared = buffer_params(func) + [b for b, c in zip(root_sref.stmt.alloc_buffers, crosses) if c]
    per_tile = [b for b, c in zip(root_sref.stmt.alloc_buffers, crosses) if not c]
    copies = []
    analyzer = tvm.sym.Analyzer()
    t = node.loop_var
    start, end = node.min, node.min + node.extent
    inner_first, inner_end = start, end
    head = tail = False
    masked = False
    for site in collect_sites(root_sref.stmt):
        mask = mask_condition(site.block) if site.under(node) else None
        if mask is None:
            continue
        if not masked:
            analyzer = _analyzer_above(site, node)
        masked = True
        # A conjunct holds on all of tile t iff it holds for the largest difference there.
        for slope, limit in _tile_inequalities(analyzer, site, node, mask, "max_value"):
            if slope is None:
                raise FusionError(
                    f"unmask_inner_tiles: a mask conjunct of block '{site.name}' is not linear "
                    f"in loop '{t.name}'"
                )
            limit = analyzer.simplify(limit)
            if slope > 0:
                inner_end = tvm.tirx.min(inner_end, _tiles_end(slope, limit))
                tail = True
            elif slope < 0:
                inner_first = tvm.tirx.max(inner_first, _tiles_first(slope, limit))
                head = True
            elif not analyzer.can_prove(limit >= 0):
                raise FusionError(
                    f"unmask_inner_tiles: a mask conjunct of block '{site.name}' does not hold "
                    f"on whole tiles of loop '{t.name}'"
                )
    if not masked:
        raise FusionError(f"unmask_inner_tiles: no block below loop '{t.name}' reads masked scores")
    if not (head or tail):
        raise FusionError(f"unmask_inner_tiles: the masks below loop '{t.name}' do not depend on it")
    zero = tvm.tirx.const(0, dtype_of(t))
    pieces = []

    def tile_loop(first, last, body, extent=None):
        # Tiles first .. last - 1 as t = first + t' for t' from zero.
        var = tvm.tirx.Var(t.name, dtype_of(t))
        extent = analyzer.simplify(last - first) if extent is None else extent
        return ir.copy_loop(node, loop_var=var, min=zero, extent=extent, body=substitute(body, {t: var + first}))

    def bound(name, value):
        var = tvm.tirx.Var(f"{t.name}_{name}", dtype_of(t))
        pieces.append(tvm.tirx.Bind(var, analyzer.simplify(value)))
        return var

    first_value = tvm.tirx.min(tvm.tirx.max(inner_first, start), end)
    last_value = tvm.tirx.min(tvm.tirx.max(inner_end, first_value), end)
    # Pieces that are empty for every thread block are left out (a loop with no tile
    # would still get its tile's buffers), and with no inner tile the loop stays as it is.
    head = head and not analyzer.can_prove(first_value <= start)
    tail = tail and not analyzer.can_prove(last_value >= end)
    if analyzer.can_prove(last_value <= first_value):
        append_instruction(self, "UnmaskInnerTiles", [loop])
        return
    first = bound("inner", first_value) if head else start
    last = bound("outer", last_value) if tail else end

    def copy(suffix, unmask):
        fresh = [ir.like_buffer(b, f"{b.name}_{suffix}") for b in per_tile]
        copies.extend(fresh)
        return _copy_tile_body(node.body, shared + per_tile, shared + fresh, suffix, unmask)

    # The original blocks compute the last boundary tiles.
    if head:
        pieces.append(tile_loop(start, first, copy("head", unmask=False) if tail else node.body))
    # The inner loop's extent as an expression, not through the bound variables: what
    # it is a multiple of stays visible (a causal block's inner tiles come in whole
    # blocks of rows, which a schedule can split off without a predicate).
    inner_extent = analyzer.simplify(
        (last_value if tail else end) - (first_value if head else start)
    )
    pieces.append(tile_loop(first, last, copy("inner", unmask=True), inner_extent))
    if tail:
        pieces.append(tile_loop(last, end, node.body))
    _replace_stmt(self, root_sref, node, ir.seq(pieces), copies)
    append_instruction(self, "UnmaskInnerTiles", [loop])


def _buffers_used_outside(root, loop):
    """The buffers that blocks of ``root`` outside ``loop`` read or write."""
    return [
        region.source
        for realize in _realizes(root.body, skip=loop)
        for region in list(realize.block.reads) + list(realize.block.writes)
    ]


def _analyzer_above(site, loop):
    """An analyzer that knows the value of each loop of one iteration above ``loop``
    (the tile bounds then do not read it)."""
    analyzer = tvm.sym.Analyzer()
    for outer in site.loops_above(loop):
        if isinstance(outer.extent, tvm.tirx.IntImm) and outer.extent.value == 1:
            analyzer.bind(outer.loop_var, outer.min)
    return analyzer


def linear_slope(analyzer, expr, var):
    """``(slope, value at var = 0)`` of ``expr`` if it is ``slope * var + c`` with a
    constant integer slope, else ``(None, None)``."""
    at = [analyzer.simplify(substitute(expr, {var: tvm.tirx.const(k, dtype_of(var))})) for k in range(2)]
    slope = analyzer.simplify(at[1] - at[0])
    if isinstance(slope, tvm.tirx.IntImm) and analyzer.can_prove_equal(expr, slope * var + at[0]):
        return slope.value, at[0]
    return None, None


def _tile_inequalities(analyzer, site, loop, mask, extreme):
    """``(slope, limit)`` for each linear conjunct ``difference <= -strict`` of ``mask``
    read by ``site``'s block: the conjunct holds for the ``extreme`` (``"min_value"`` or
    ``"max_value"``) of its difference over tile ``t`` of ``loop`` iff
    ``slope * t <= limit``; ``(None, None)`` where that extreme is not linear in t."""
    bindings = {iv.var: site.binding(iv) for iv in site.block.iter_vars}
    # Threads of a block above ``loop`` count as rows below it: every thread must walk
    # the same tiles, since a tile's body may synchronise them.
    threads = [
        l for l in site.loops_above(loop)
        if l.thread_binding is not None and l.thread_binding.thread_tag.startswith("threadIdx")
    ]
    below = {
        l.loop_var: tvm.sym.IntervalSet(l.min, l.min + l.extent - 1) for l in threads + site.loops_below(loop)
    }
    for difference, strict in linear_conjuncts(mask):
        bound = getattr(analyzer.int_set(substitute(difference, bindings), below), extreme)
        slope, at_zero = linear_slope(analyzer, bound, loop.loop_var)
        yield slope, (None if slope is None else -at_zero - int(strict))


def _tiles_end(slope, limit):
    """One past the last tile t with ``slope * t <= limit`` (``slope > 0``)."""
    return tvm.tirx.floordiv(limit, slope) + 1


def _tiles_first(slope, limit):
    """The first tile t with ``slope * t <= limit`` (``slope < 0``)."""
    return tvm.tirx.floordiv(-limit - slope - 1, -slope)


def _copy_tile_body(body, buffers, replacements, suffix, unmask):
    """A copy of a tile loop's ``body`` with fresh definitions of what it defines, each of
    ``buffers`` (defined outside it) replaced by the one at its place in ``replacements``,
    its blocks named ``<name>_<suffix>``, and, if ``unmask``, every masked score read
    plain."""
    renewed = tvm_ffi.get_global_func("s_tir.RenewDefs")(tvm.tirx.PrimFunc(list(buffers), body))
    fresh = substitute(renewed.body, dict(zip(renewed.params, replacements)))

    def rename(block):
        return ir.copy_block(block, name_hint=f"{block.name_hint}_{suffix}")

    def plain(select):
        if _is_masked_read(select):
            return select.true_value
        return select

    callbacks = [(SBlock, rename)] + ([(tvm.tirx.Select, plain)] if unmask else [])
    return tvm_ffi.structural_map(fresh, callbacks)


def _is_masked_read(node):
    """Whether ``node`` is ``select(mask, score, lowest)``, ``ops.attention``'s masking."""
    if not (isinstance(node, tvm.tirx.Select) and isinstance(node.false_value, tvm.tirx.FloatImm)):
        return False
    return node.false_value.value == tvm.tirx.min_value(str(node.false_value.ty.dtype)).value


def _check_reductions_follow(root, block, loop):
    """Raise unless every reduction over ``loop`` below it is ``block`` or downstream of
    it there, with its initial value outside ``loop``."""
    downstream = set()
    for site in collect_sites(root):
        if not site.under(loop):
            continue
        follows = site.block.same_as(block) or any(
            any(b.same_as(d) for d in downstream) for b in site.read_buffers()
        )
        if follows:
            downstream.update(site.write_buffers())
        over_loop = any(
            iv.iter_type == REDUCE and uses_var(site.binding(iv), loop.loop_var)
            for iv in site.block.iter_vars
        )
        if not over_loop:
            continue
        if not follows:
            raise FusionError(
                f"skip_masked_tiles: block '{site.name}' reduces over loop "
                f"'{loop.loop_var.name}' without reading the masked scores of "
                f"'{block.name_hint}'"
            )
        if site.block.init is not None:
            raise FusionError(
                f"skip_masked_tiles: block '{site.name}' initialises its reduction in the first "
                f"tile of loop '{loop.loop_var.name}', which may be skipped; decompose the "
                "reduction at that loop first"
            )


def mask_condition(block):
    """The condition ``mask`` of the ``select(mask, score, lowest)`` that ``block`` reads
    (``lowest``: the smallest finite value of the score type), or None; raises
    :class:`tvm_cascade.FusionError` when it reads several different ones."""
    found = []

    def visit(node):
        if _is_masked_read(node):
            found.append(node.condition)

    tvm_ffi.structural_walk(ir.body_and_init(block), visit)
    if not found:
        return None
    if any(not tvm_ffi.structural_equal(c, found[0]) for c in found[1:]):
        raise FusionError(f"block '{block.name_hint}' reads scores under different masks")
    return found[0]


_COMPARISONS = {
    tvm.tirx.LE: (False, 1), tvm.tirx.LT: (True, 1), tvm.tirx.GE: (False, -1), tvm.tirx.GT: (True, -1),
}


def linear_conjuncts(cond):
    """``(lhs - rhs, strict)`` (or ``rhs - lhs`` for ``>=``/``>``) of each comparison
    conjunct of ``cond``, such that it holds iff the difference is <= 0 (< 0 if strict)."""
    if isinstance(cond, tvm.tirx.And):
        yield from linear_conjuncts(cond.a)
        yield from linear_conjuncts(cond.b)
        return
    for kind, (strict, sign) in _COMPARISONS.items():
        if isinstance(cond, kind) and str(cond.a.ty.dtype).startswith("int"):
            yield (cond.a - cond.b) if sign > 0 else (cond.b - cond.a), strict


_NUMPY_BINARY = {
    tvm.tirx.Add: np.add, tvm.tirx.Sub: np.subtract, tvm.tirx.Mul: np.multiply,
    tvm.tirx.FloorDiv: np.floor_divide, tvm.tirx.FloorMod: np.mod, tvm.tirx.Min: np.minimum,
    tvm.tirx.Max: np.maximum, tvm.tirx.LT: np.less, tvm.tirx.LE: np.less_equal,
    tvm.tirx.GT: np.greater, tvm.tirx.GE: np.greater_equal, tvm.tirx.EQ: np.equal,
    tvm.tirx.NE: np.not_equal, tvm.tirx.And: np.logical_and, tvm.tirx.Or: np.logical_or,
}


def _evaluate(expr, values):
    """``expr`` (integer and boolean arithmetic) on numpy arrays ``values[var]``."""
    if isinstance(expr, tvm.tirx.Var):
        return values[expr]
    if isinstance(expr, tvm.tirx.IntImm):
        return np.int64(expr.value)
    if isinstance(expr, tvm.tirx.Not):
        return np.logical_not(_evaluate(expr.a, values))
    if isinstance(expr, tvm.tirx.Cast) and str(expr.ty.dtype).startswith("int"):
        return _evaluate(expr.value, values)
    op = _NUMPY_BINARY.get(type(expr))
    if op is None:
        raise FusionError(f"skip_masked_tiles: cannot evaluate mask term {expr}")
    return op(_evaluate(expr.a, values), _evaluate(expr.b, values))


def _check_every_row_sees_a_key(site, loop, mask):
    """Raise unless ``mask``, evaluated on the domain of ``site``'s block, leaves every row
    a key (the key: the reduced iterators, the tile iterators of a per-tile block and the
    iterators bound to the key-tile ``loop``, which together number the keys; the row:
    the one other iterator the mask uses, if any)."""
    block = site.block
    tiles = [int(k) for k in block.annotations.get(TILE_ITERATORS, [])]

    def is_key(k, iv):
        return iv.iter_type == REDUCE or k in tiles or uses_var(site.binding(iv), loop.loop_var)

    used = [(k, iv) for k, iv in enumerate(block.iter_vars) if uses_var(mask, iv.var)]
    keys = [iv for k, iv in used if is_key(k, iv)]
    rows = [iv for k, iv in used if not is_key(k, iv)]
    if not keys or len(rows) > 1:
        raise FusionError(
            f"skip_masked_tiles: the mask of block '{block.name_hint}' must depend on the key "
            "and at most one other iterator"
        )
    # Each key iterator on an axis of its own, the rows on the first.
    values = {
        iv.var: np.arange(int(iv.dom.min), int(iv.dom.min + iv.dom.extent), dtype=np.int64).reshape(
            (1,) + (1,) * k + (-1,) + (1,) * (len(keys) - k - 1)
        )
        for k, iv in enumerate(keys)
    }
    key_shape = tuple(int(iv.dom.extent) for iv in keys)
    row_min, row_end = (int(rows[0].dom.min), int(rows[0].dom.min + rows[0].dom.extent)) if rows else (0, 1)
    for start in range(row_min, row_end, _ROW_CHUNK):
        stop = min(start + _ROW_CHUNK, row_end)
        if rows:
            values[rows[0].var] = np.arange(start, stop, dtype=np.int64).reshape((-1,) + (1,) * len(keys))
        visible = np.broadcast_to(_evaluate(mask, values), (stop - start,) + key_shape)
        if not np.all(visible.reshape(stop - start, -1).any(axis=1)):
            raise FusionError(
                f"skip_masked_tiles: some row of block '{block.name_hint}' sees no key; its "
                "result depends on the masked tiles"
            )


_ROW_CHUNK = 512


def _rebuild_nest(stmt, old_realize, new_realize):
    if stmt.same_as(old_realize):
        return new_realize
    if isinstance(stmt, tvm.tirx.For):
        return ir.copy_loop(stmt, body=_rebuild_nest(stmt.body, old_realize, new_realize))
    raise FusionError("split_tile_accumulation: the block's loops below the tile loop hold other statements")


def _site_under(root, block, loop, primitive="split_tile_accumulation"):
    for site in collect_sites(root):
        if site.block.same_as(block):
            if not site.under(loop):
                raise FusionError(
                    f"{primitive}: block '{block.name_hint}' is not under loop "
                    f"'{loop.loop_var.name}'"
                )
            return site
    raise FusionError(f"block '{block.name_hint}' is not in the root scope")


def _realizes(stmt, skip=None):
    """The block realizations reachable from ``stmt`` through loops and statement
    sequences (not into blocks), except those under ``skip``."""
    if skip is not None and stmt.same_as(skip):
        return
    if isinstance(stmt, SBlockRealize):
        yield stmt
    elif isinstance(stmt, tvm.tirx.For):
        yield from _realizes(stmt.body, skip)
    elif isinstance(stmt, tvm.tirx.SeqStmt):
        for item in stmt:
            yield from _realizes(item, skip)


def _any_block_under(sch, node):
    found = next(_realizes(node), None)
    if found is None:
        raise FusionError(f"loop '{node.loop_var.name}' holds no block")
    return sch.get_sblock(found.block.name_hint)


def _check_row_slices(node, groups):
    """Raise unless every iteration of ``node`` touches only its own slice of the buffers
    written below it that more than one of ``groups`` accesses (see :func:`distribute`);
    a buffer only one group accesses keeps its order of accesses."""
    var = node.loop_var
    sites = list(_realizes(node.body))
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
    accesses = {realize.block: buffer_accesses(ir.body_and_init(realize.block)) for realize in sites}
    group_of = {realize.block: k for k, group in enumerate(groups) for realize in _realizes(group)}
    accessed_by = {}
    for block, found in accesses.items():
        for buf, _ in found:
            accessed_by.setdefault(buf, set()).add(group_of[block])
    shared = [buf for buf, ks in accessed_by.items() if len(ks) > 1]
    dims = {}
    for realize in sites:
        row = row_of[realize.block]
        for buf, indices in accesses[realize.block]:
            if not any(buf.same_as(w) for w in written) or not any(buf.same_as(b) for b in shared):
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
            return ir.copy_loop(stmt, body=body)
        if isinstance(stmt, tvm.tirx.SeqStmt):
            items = [go(item) for item in stmt]
            if all(x.same_as(y) for x, y in zip(items, stmt)):
                return stmt
            return ir.seq(items)
        return stmt

    body = go(root.body)
    new_root = ir.copy_block(root, body=body, alloc_buffers=list(root.alloc_buffers) + list(new_buffers))
    ir.replace_root(sch, root_sref, new_root, reuse or {})


register_kind("Distribute", "distribute", ("loop",), ("sizes",))
register_kind("SplitTileAccumulation", "split_tile_accumulation", ("block", "loop"))
register_kind("SkipMaskedTiles", "skip_masked_tiles", ("block", "loop"))
register_kind("UnmaskInnerTiles", "unmask_inner_tiles", ("loop",))
# The rewrites become Schedule methods in primitives.install.
