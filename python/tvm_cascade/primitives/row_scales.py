"""``Schedule.defer_row_scales``, ``Schedule.fold_from_copy`` and
``Schedule.over_padded_rows``: the steps that make a GEMM scaled per row by a statistic
of its own rows (RMSNorm + GEMM, abs-max scaling + GEMM) one kernel.

``ops.rmsnorm_gemm``'s GEMM is ``y[i,n] = Σ_k X[i,k]·r_i·γ_k·W[k,n]`` with
``r_i = 1/sqrt(Σ_k X[i,k]²/K + eps)``. The scale is constant along k, so
``Σ_k r_i·t_k = r_i·Σ_k t_k``: ``defer_row_scales`` moves it out of the sum, after
which the statistic and the GEMM depend on nothing of each other and read the same
tiles of X; ``fold_from_copy`` then folds the statistic from the GEMM's tiles of X as
they are copied; ``over_padded_rows`` lets the output run over the GEMM's rows padded
to whole tiles. Each is a traced instruction (``DeferRowScales``, ``FoldFromCopy``,
``OverPaddedRows``) that replays from a trace's JSON.
"""
import tvm
import tvm_ffi
from tvm.ir import expr as ir_expr
from tvm.s_tir import Schedule
from tvm.s_tir.stmt import SBlock

from ..analysis.chain import substitute
from ..analysis.scope import buffer_accesses, dtype_of, uses_var
from ..errors import FusionError
from ..trace import append_instruction
from ..trace.kinds import register_kind
from . import ir

_SPATIAL, _REDUCE = 0, 2


def defer_row_scales(self: Schedule, block) -> None:
    """Apply the per-row factors of the GEMM ``block`` after its sum, in the blocks that
    read its result, and fold its factors indexed by k alone into a copy of its A
    operand (``<A>_global``, A's dtype).

    ``block`` computes ``C[i, j] += A[i, k] * B[k, j] * ...`` (B may be indexed
    ``[j, k]``), its other factors indexed by ``i`` alone or ``k`` alone; the blocks that
    read ``C`` are elementwise. Multiplication distributes over the sum, so the result
    is the same; the GEMM no longer reads the statistic its row factor comes from.

    Parameters
    ----------
    block : SBlockRV
        The GEMM, e.g. ``gemm`` of ``ops.rmsnorm_gemm``.

    Examples
    --------
    Before defer_row_scales, in TensorIR, the IR is:

    .. code-block:: python

        @T.prim_func(s_tir=True)
        def before(X: T.Buffer((M, K), "float16"), gamma: T.Buffer((K,), "float16"),
                   W: T.Buffer((K, N), "float16"), out: T.Buffer((M, N), "float16")):
            ...  # sumsq[i] = sum_k X[i, k]^2; rstd[i] = 1 / sqrt(sumsq[i] / K + eps)
            for i, j, k in T.grid(M, N, K):
                with T.sblock("gemm"):
                    vi, vj, vk = T.axis.remap("SSR", [i, j, k])
                    with T.init():
                        gemm[vi, vj] = T.float32(0)
                    gemm[vi, vj] = gemm[vi, vj] + T.Cast("float32", X[vi, vk]) * rstd[vi] \
                        * T.Cast("float32", gamma[vk]) * T.Cast("float32", W[vk, vj])
            for i, j in T.grid(M, N):
                with T.sblock("out"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    out[vi, vj] = T.Cast("float16", gemm[vi, vj])

    Create the schedule and do defer_row_scales:

    .. code-block:: python

        sch = tvm.s_tir.Schedule(before)
        sch.defer_row_scales(sch.get_sblock("gemm"))

    After applying defer_row_scales, the IR becomes:

    .. code-block:: python

            for i, k in T.grid(M, K):
                with T.sblock("X_global"):
                    vi, vk = T.axis.remap("SS", [i, k])
                    X_global[vi, vk] = T.Cast("float16", T.Cast("float32", X[vi, vk]) * T.Cast("float32", gamma[vk]))
            for i, j, k in T.grid(M, N, K):
                with T.sblock("gemm"):
                    ...
                    gemm[vi, vj] = gemm[vi, vj] + T.Cast("float32", X_global[vi, vk]) * T.Cast("float32", W[vk, vj])
            for i, j in T.grid(M, N):
                with T.sblock("out"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    out[vi, vj] = T.Cast("float16", gemm[vi, vj] * rstd[vi])

    Raises :class:`tvm_cascade.FusionError` naming the block if it is not such a GEMM,
    has no per-row factor, or a block that reads its result reduces over it; the
    schedule is then unchanged.
    """
    func = self.mod["main"]
    name = self.get(block).name_hint
    gemm, _ = find_gemm(func)
    if gemm is None or gemm.name_hint != name:
        raise FusionError(
            f"defer_row_scales: block '{name}' does not compute C[i, j] += A[i, k] * B[k, j] with other "
            "factors indexed by i alone or k alone"
        )
    new = _deferred(func)
    old = {b.name_hint: b for b in ir.blocks_in(func.body.block)}
    reuse = {old[b.name_hint]: b for b in ir.blocks_in(new.body.block) if b.name_hint in old}
    ir.replace_root(self, self.get_sref(self.get_sblock("root")), new.body.block, reuse)
    append_instruction(self, "DeferRowScales", [block])


def fold_from_copy(self: Schedule, stat, copy, row_loop=None, slice_rows: int = 0) -> None:
    """Move the reduction ``stat`` (a root-level nest) under the loop that holds block
    ``copy`` (a copy of the tensor ``stat`` reads, into a cache), right after it: each
    pass of that loop folds the part of the tensor the copy just made into ``stat``'s
    accumulator, reading the cache; what read the statistic before that loop's nest
    moves after it. With ``row_loop`` (an outer loop) and ``slice_rows``, the copy's
    first axis is taken in slices of ``slice_rows``: iteration ``r`` of ``row_loop``
    folds rows ``r * slice_rows`` onward.

    TVM's compute-at primitives move a block only to its consumers or producers; the
    statistic and the GEMM only share what they read.

    Parameters
    ----------
    stat : SBlockRV
        The statistic, e.g. ``sumsq`` of ``ops.rmsnorm_gemm``.
    copy : SBlockRV
        The copy of the tensor ``stat`` reads, e.g. X's tile copied to shared memory
        under the GEMM's k loop.
    row_loop : Optional[LoopRV]
        The loop whose iterations take slices of the copy's rows (a warp's rows).
    slice_rows : int
        The rows of a slice (with ``row_loop``).

    Examples
    --------
    Before fold_from_copy, in TensorIR, the IR is:

    .. code-block:: python

        for i, k in T.grid(8, 64):
            with T.sblock("sumsq"):
                vi, vk = T.axis.remap("SR", [i, k])
                with T.init():
                    sumsq[vi] = T.float32(0)
                sumsq[vi] = sumsq[vi] + X[vi, vk] * X[vi, vk]
        for i, j, k_0 in T.grid(8, 16, 4):
            for ax0, ax1 in T.grid(8, 16):
                with T.sblock("X_shared"):
                    v0, v1 = T.axis.remap("SS", [ax0, ax1])  # rows, k_0 * 16 + ax1
                    X_shared[v0, v1] = X[v0, v1]
            ...  # the GEMM's k_0 step reads X_shared

    Create the schedule and do fold_from_copy:

    .. code-block:: python

        sch.fold_from_copy(sch.get_sblock("sumsq"), sch.get_sblock("X_shared"))

    After applying fold_from_copy, ``sumsq`` follows the copy in the k_0 loop, over the
    copy's rows and columns, reading ``X_shared``:

    .. code-block:: python

        for i, j, k_0 in T.grid(8, 16, 4):
            for ax0, ax1 in T.grid(8, 16):
                with T.sblock("X_shared"):
                    ...
            for ax0, ax1 in T.grid(8, 16):
                with T.sblock("sumsq"):
                    ...
                    sumsq[vi] = sumsq[vi] + X_shared[vi, vk] * X_shared[vi, vk]
            ...

    Raises :class:`tvm_cascade.FusionError` naming ``stat`` if it does not read one
    element of the copied tensor per iteration, at its own iterators.
    """
    if row_loop is not None and slice_rows <= 0:
        raise ValueError(f"fold_from_copy: slices of {slice_rows} rows; row_loop needs slice_rows > 0")
    _fold(self, stat, copy, (row_loop, slice_rows) if row_loop is not None else None)
    append_instruction(self, "FoldFromCopy", [stat, copy, row_loop], [slice_rows])


def over_padded_rows(self: Schedule, block) -> None:
    """Make ``block`` (a root nest over its rows, then columns) run over the rows of the
    buffers it reads at its row (a GEMM's result and row statistics over rows padded to
    whole tiles), its body under a condition that keeps its own rows: from
    reverse-compute-at, a block over fewer rows than the GEMM's tiles would get a
    predicate that bounds the thread-block loop by itself, which TVM's affine-binding
    checks do not see through.

    Parameters
    ----------
    block : SBlockRV
        The output block, e.g. ``out`` of ``ops.rmsnorm_gemm(pad_rows=...)``.

    Examples
    --------
    Before over_padded_rows, in TensorIR, the IR is:

    .. code-block:: python

        for i, j in T.grid(48, 128):
            with T.sblock("out"):
                vi, vj = T.axis.remap("SS", [i, j])
                out[vi, vj] = T.Cast("float16", gemm[vi, vj] * rstd[vi])  # gemm, rstd: 64 rows

    Create the schedule and do over_padded_rows:

    .. code-block:: python

        sch.over_padded_rows(sch.get_sblock("out"))

    After applying over_padded_rows, the IR becomes:

    .. code-block:: python

        for i, j in T.grid(64, 128):
            with T.sblock("out"):
                vi, vj = T.axis.remap("SS", [i, j])
                if vi < 48:
                    out[vi, vj] = T.Cast("float16", gemm[vi, vj] * rstd[vi])

    Raises :class:`tvm_cascade.FusionError` naming the block if it is not such a nest,
    or the buffers it reads at its row differ in rows.
    """
    node = self.get(block)
    row = node.iter_vars[0].var
    extents = [
        r.source.shape[0] for r in node.reads
        if len(r.region) and isinstance(r.region[0].min, tvm.tirx.Var) and r.region[0].min.same_as(row)
    ]
    if not extents or any(not tvm_ffi.structural_equal(e, extents[0]) for e in extents):
        raise FusionError(
            f"over_padded_rows: block '{node.name_hint}' must read buffers of one row count at its row, "
            f"not {list(map(str, extents))}"
        )
    _pad(self, block, extents[0])
    append_instruction(self, "OverPaddedRows", [block])


def _factors(expr):
    """The factors of a product tree."""
    if isinstance(expr, tvm.tirx.Mul):
        return _factors(expr.a) + _factors(expr.b)
    return [expr]


def _product(factors):
    result = factors[0]
    for factor in factors[1:]:
        result = result * factor
    return result


def _loads(expr):
    return ir.nodes(expr, ir_expr.TensorLoad)


def _buffers(node):
    """Every buffer ``node`` loads or stores (what :func:`.ir.with_regions` resolves)."""
    return {buffer for buffer, _ in buffer_accesses(node)}


def readers(func, block):
    """The blocks of ``func`` other than ``block`` that read what ``block`` writes."""
    acc = block.writes[0].source
    return [b for b in ir.blocks_in(func.body.block) if not b.same_as(block) and any(r.source.same_as(acc) for r in b.reads)]


def find_gemm(func):
    """The block ``C[i, j] += Π factors`` over loops (i, j, k) and its factors by role."""
    for block in ir.blocks_in(func.body.block):
        kinds = [int(v.iter_type) for v in block.iter_vars]
        if kinds != [_SPATIAL, _SPATIAL, _REDUCE] or block.init is None:
            continue
        store = block.body
        if not isinstance(store, tvm.tirx.BufferStore) or not isinstance(store.value, tvm.tirx.Add):
            continue
        acc = store.value.a
        if not (isinstance(acc, ir_expr.TensorLoad) and acc.source.same_as(store.buffer)):
            continue
        i, j, k = (v.var for v in block.iter_vars)
        roles = {"a": [], "b": [], "row": [], "col": []}
        for factor in _factors(store.value.b):
            loads = _loads(factor)
            if len(loads) != 1:
                break
            used = {name for name, var in (("i", i), ("j", j), ("k", k)) if uses_var(factor, var)}
            role = {frozenset("ik"): "a", frozenset("kj"): "b", frozenset("i"): "row", frozenset("k"): "col"}.get(
                frozenset(used)
            )
            if role is None:
                break
            roles[role].append(factor)
        else:
            if len(roles["a"]) == 1 and len(roles["b"]) == 1:
                return block, roles
    return None, None


def _deferred(func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc:
    """``func`` with its GEMM's per-row scale applied after the sum (:func:`defer_row_scales`)."""
    block, roles = find_gemm(func)
    if not roles["row"]:
        raise FusionError(f"defer_row_scales: block '{block.name_hint}' has no per-row scale to move out of its sum")
    acc = block.writes[0].source
    consumers = readers(func, block)
    for reader in consumers:
        if reader.init is not None:
            raise FusionError(
                f"defer_row_scales: block '{reader.name_hint}' reduces over '{acc.name}': the scale of "
                f"'{block.name_hint}' can only move into elementwise readers"
            )
    copy_name = None
    if roles["col"]:
        sch = tvm.s_tir.Schedule(func)
        a_source = _loads(roles["a"][0])[0].source
        index = [n for n, r in enumerate(block.reads) if r.source.same_as(a_source)][0]
        gemm = sch.get_sblock(block.name_hint)
        copy_name = sch.get(sch.cache_read(gemm, index, "global", consumer_blocks=[gemm])).name_hint
        func = sch.mod["main"]
        block, roles = find_gemm(func)
    i, j, k = (v.var for v in block.iter_vars)
    buffers = _buffers(func.body)

    def edit(node):
        if node.name_hint == block.name_hint:
            store = node.body
            kept = [f for f in _factors(store.value.b) if not any(f.same_as(g) for g in roles["row"] + roles["col"])]
            value = tvm.tirx.BufferStore(store.buffer, store.value.a + _product(kept), store.indices)
            return ir.with_regions(ir.copy_block(node, body=value), buffers)
        if node.name_hint == copy_name:
            store = node.body
            _, col = (v.var for v in node.iter_vars)
            scale = _product([substitute(f, {k: col}) for f in roles["col"]])
            value = (store.value.astype(dtype_of(scale)) * scale).astype(str(store.buffer.dtype))
            return ir.with_regions(ir.copy_block(node, body=tvm.tirx.BufferStore(store.buffer, value, store.indices)), buffers)
        if any(node.name_hint == r.name_hint for r in consumers):
            def scaled(load):
                if not load.source.same_as(acc):
                    return load
                vmap = {i: load.indices[0], j: load.indices[1]}
                return load * _product([substitute(f, vmap) for f in roles["row"]])

            body = tvm_ffi.structural_map(node.body, (ir_expr.TensorLoad, scaled))
            return ir.with_regions(ir.copy_block(node, body=body), buffers)
        return node

    return func.with_body(tvm_ffi.structural_map(func.body, (SBlock, edit)))


def _fold(sch, stat, copy, rows) -> None:
    copy_block, stat_block = sch.get(copy), sch.get(stat)
    source, cache = copy_block.reads[0].source, copy_block.writes[0].source
    loads = [l for l in _loads(stat_block.body) if l.source.same_as(source)]
    iter_of = {iv.var: iv for iv in stat_block.iter_vars}
    if not loads or any(len(l.indices) != len(copy_block.iter_vars) or not all(i in iter_of for i in l.indices) for l in loads):
        raise FusionError(f"fold_from_copy: block '{stat_block.name_hint}' must read '{source.name}' at its own iterators")
    if len({tuple(l.indices) for l in loads}) != 1 or len(stat_block.iter_vars) != len(loads[0].indices):
        raise FusionError(f"fold_from_copy: block '{stat_block.name_hint}' must read one element of '{source.name}' per iteration")
    copy_loops = sch.get_loops(copy)
    at = len(copy_loops) - len(copy_block.iter_vars)
    holder, own = copy_loops[at - 1], copy_loops[at:]
    fresh = {sch.get(l).loop_var: tvm.tirx.Var(sch.get(l).loop_var.name, dtype_of(sch.get(l).loop_var)) for l in own}
    loops = [(fresh[sch.get(l).loop_var], sch.get(l).extent) for l in own]
    if rows is not None:
        outer, extent = sch.get(rows[0]).loop_var, rows[1]
        first = sch.get(own[0]).loop_var
        loops[0] = (fresh[first], tvm.tirx.const(extent, dtype_of(first)))
        fresh[first] = outer * extent + fresh[first]
    realize = _realize_of(sch, copy)
    bindings = {v: substitute(b, fresh) for v, b in zip((iv.var for iv in copy_block.iter_vars), realize.iter_values)}
    order = [iter_of[i] for i in loads[0].indices]
    copy_vars = [iv.var for iv in copy_block.iter_vars]
    block = ir.copy_block(
        stat_block,
        iter_vars=order,
        body=ir.replace_buffers(stat_block.body, {source: cache}),
    )
    new_realize = ir.realize([bindings[v] for v in copy_vars], True, block)
    moved = ir.nest(loops, new_realize)
    top = sch.get(sch.get_loops(stat)[0])
    holder_loop, copy_top = sch.get(holder), sch.get(own[0])
    root_sref = sch.get_sref(sch.get_sblock("root"))

    def edit(node):
        if node.same_as(holder_loop):
            items = []
            for item in ir.statements(node.body):
                items.append(item)
                if item.same_as(copy_top):
                    items.append(moved)
            return ir.copy_loop(node, body=ir.seq(items))
        return node

    root = root_sref.stmt
    items = [s for s in ir.statements(root.body) if not s.same_as(top)]
    holder_top = next(s for s in items if ir.contains(s, lambda n: n.same_as(holder_loop)))
    body = ir.seq(_readers_after(items, holder_top, stat_block.writes[0].source))
    body = tvm_ffi.structural_map(body, (tvm.tirx.For, edit))
    new_root = ir.copy_block(root, body=body)
    buffers = _buffers(new_root)
    new_root = tvm_ffi.structural_map(new_root, (SBlock, lambda b: ir.with_regions(b, buffers) if b.same_as(block) else b))
    ir.replace_root(sch, root_sref, new_root, {})


def _readers_after(items, holder, buffer):
    """Root statements ``items`` with those before ``holder`` that read ``buffer``, or
    what such a statement writes, moved after it (in their order)."""
    written, moved = {buffer}, []
    at = next(k for k, s in enumerate(items) if s.same_as(holder))
    for item in items[:at]:
        blocks = ir.nodes(item, SBlock)
        if any(r.source in written for b in blocks for r in b.reads):
            moved.append(item)
            written |= {w.source for b in blocks for w in b.writes}
    kept = [s for s in items[: at + 1] if not any(s.same_as(m) for m in moved)]
    return kept + moved + items[at + 1:]


def _pad(sch, block_rv, rows) -> None:
    realize = _realize_of(sch, block_rv)
    block = realize.block
    row = block.iter_vars[0]
    if tvm_ffi.structural_equal(row.dom.extent, rows):
        return
    top = sch.get(sch.get_loops(block_rv)[0])
    if not (len(sch.get_loops(block_rv)) == 2 and top.loop_var.same_as(realize.iter_values[0])):
        raise FusionError(f"over_padded_rows: block '{block.name_hint}' must be a nest over its rows, then columns")
    padded = tvm.tirx.IterVar(tvm.ir.Range.from_min_extent(0, rows), row.var, row.iter_type)
    # The guard is in the body, not the realize's predicate: compute-at and
    # reverse-compute-at rebuild that predicate from the iteration domain alone.
    guarded = tvm.tirx.IfThenElse(row.var < row.dom.extent, block.body, None)
    new_block = ir.copy_block(block, iter_vars=[padded] + list(block.iter_vars[1:]), body=guarded)
    inner = ir.copy_loop(top.body, body=ir.realize(realize.iter_values, realize.predicate, new_block))
    new_top = ir.copy_loop(top, extent=rows, body=inner)
    sch.state.replace(sch.get_sref(sch.get_loops(block_rv)[0]), new_top, {block: new_block})


#: ``(sch, block_rv) -> SBlockRealize``: TVM's own lookup of a block's realize.
_realize_of = tvm.get_global_func("s_tir.schedule.GetSBlockRealize")


register_kind("DeferRowScales", "defer_row_scales", ("block",))
register_kind("FoldFromCopy", "fold_from_copy", ("stat", "copy", "row_loop"), ("slice_rows",))
register_kind("OverPaddedRows", "over_padded_rows", ("block",))
