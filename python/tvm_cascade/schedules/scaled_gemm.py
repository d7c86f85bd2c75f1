"""A GEMM scaled per row by a statistic of its own rows (RMSNorm + GEMM, abs-max
scaling + GEMM) as one tensor-core kernel.

``ops.rmsnorm_gemm``'s chain is ``ss_i = Σ_k X[i,k]²``, ``r_i = 1/sqrt(ss_i/K + eps)``,
``y[i,n] = Σ_k X[i,k]·r_i·γ_k·W[k,n]``. Fused by ``rolling_update``, every k tile
would repair every accumulator (``y·r_new/r_old``, FlashAttention's output repair). The
scale is constant along k, so ``Σ_k r_i·t_k = r_i·Σ_k t_k`` (multiplication distributes
over the sum): :func:`defer_row_scales` moves it out of the sum into the GEMM's
consumer. The statistic and the GEMM then depend on nothing of each other and read the
same tiles of X, so one pass over k computes both: the statistic from X's tile in shared
memory, the GEMM on tensor cores; the scale is one multiply in the epilogue. A factor
constant along the rows (``γ_k``) goes into a scaled copy of the A operand, made from
X's tile in shared memory (the copies from global memory stay plain, asynchronous).

Before (``ops.rmsnorm_gemm``)::

    for i, j, k in T.grid(M, N, K):
        with T.sblock("gemm"):
            gemm[i, j] += X[i, k] * rstd[i] * gamma[k] * W[k, j]
    for i, j in T.grid(M, N):
        with T.sblock("out"):
            out[i, j] = T.Cast("float16", gemm[i, j])

After :func:`defer_row_scales`::

    for i, k in T.grid(M, K):
        with T.sblock("X_global"):
            X_global[i, k] = T.Cast("float16", X[i, k] * gamma[k])
    for i, j, k in T.grid(M, N, K):
        with T.sblock("gemm"):
            gemm[i, j] += X_global[i, k] * W[k, j]
    for i, j in T.grid(M, N):
        with T.sblock("out"):
            out[i, j] = T.Cast("float16", gemm[i, j] * rstd[i])
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import tvm
import tvm_ffi
from tvm.ir import expr as ir_expr
from tvm.s_tir.stmt import SBlock

from ..analysis.chain import substitute
from ..analysis.scope import buffer_accesses, dtype_of, uses_var
from ..errors import FusionError
from ..primitives import ir
from ..cuda import software_pipeline
from ..cuda.tensor_cores import cuda_intrinsics
from .mma_tiles import MMA, SHARED, VECTOR, WARP, bind_fragment_lanes, copy_in_words, fragment, tile

_SPATIAL, _REDUCE = 0, 2
#: Shared memory a CUDA kernel may use without opting in. TVM's CUDA launcher opts in
#: only for kernels whose *dynamic* shared memory reaches it; below, static and dynamic
#: memory together must fit (a larger sum fails at launch).
_SHARED_WITHOUT_OPT_IN = 48 << 10


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


def _readers(func, block):
    """The blocks of ``func`` other than ``block`` that read what ``block`` writes."""
    acc = block.writes[0].source
    return [b for b in ir.blocks_in(func.body.block) if not b.same_as(block) and any(r.source.same_as(acc) for r in b.reads)]


def _find_gemm(func):
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


def defer_row_scales(func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc:
    """``func`` with the per-row scale of its GEMM applied after the sum (see the module).

    The GEMM is the block ``C[i, j] += A[i, k] * B[k, j] * ...`` whose other factors are
    indexed by ``i`` alone (the row scale, moved into every block that reads ``C``) or
    by ``k`` alone (folded into a copy of ``A``, which keeps ``A``'s dtype). Raises
    :class:`FusionError` naming what does not fit.
    """
    block, roles = _find_gemm(func)
    if block is None:
        raise FusionError(
            "defer_row_scales: no block computes C[i, j] += A[i, k] * B[k, j] with other factors "
            "indexed by i alone or k alone"
        )
    if not roles["row"]:
        raise FusionError(f"defer_row_scales: block '{block.name_hint}' has no per-row scale to move out of its sum")
    acc = block.writes[0].source
    readers = _readers(func, block)
    for reader in readers:
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
        block, roles = _find_gemm(func)
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
        if any(node.name_hint == r.name_hint for r in readers):
            def scaled(load):
                if not load.source.same_as(acc):
                    return load
                vmap = {i: load.indices[0], j: load.indices[1]}
                return load * _product([substitute(f, vmap) for f in roles["row"]])

            body = tvm_ffi.structural_map(node.body, (ir_expr.TensorLoad, scaled))
            return ir.with_regions(ir.copy_block(node, body=body), buffers)
        return node

    return func.with_body(tvm_ffi.structural_map(func.body, (SBlock, edit)))


def fold_from_copy(sch, stat, copy, rows=None) -> None:
    """Move the reduction ``stat`` (a root-level nest) under the loop that holds block
    ``copy`` (a copy of the tensor ``stat`` reads, into a cache), right after it: each
    pass of that loop folds the part of the tensor the copy just made into ``stat``'s
    accumulator, reading the cache; what read the statistic before that loop's nest
    moves after it. ``rows``, if given as ``(loop, extent)``, takes the
    copy's first axis in slices of ``extent`` indexed by ``loop`` (an outer loop): each
    iteration of ``loop`` folds its own slice.

    TVM's compute-at primitives move a block only to its consumers or producers; the
    statistic and the GEMM only share what they read.
    """
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


def _over_padded_rows(sch, block_rv, rows) -> None:
    """Make the output block ``block_rv`` (a root nest over ``[M, N]``) run over ``rows``
    (M padded to whole tiles), storing only its first M rows: a block over fewer rows
    than the GEMM's tiles would get, from reverse-compute-at, a predicate that bounds the
    thread-block loop by itself, which TVM's affine-binding checks do not see through."""
    realize = _realize_of(sch, block_rv)
    block = realize.block
    row = block.iter_vars[0]
    if tvm_ffi.structural_equal(row.dom.extent, rows):
        return
    top = sch.get(sch.get_loops(block_rv)[0])
    if not (len(sch.get_loops(block_rv)) == 2 and top.loop_var.same_as(realize.iter_values[0])):
        raise FusionError(f"block '{block.name_hint}' must be a nest over its rows, then columns")
    padded = tvm.tirx.IterVar(tvm.ir.Range.from_min_extent(0, rows), row.var, row.iter_type)
    new_block = ir.copy_block(block, iter_vars=[padded] + list(block.iter_vars[1:]))
    inside = realize.iter_values[0] < row.dom.extent
    inner = ir.copy_loop(top.body, body=ir.realize(realize.iter_values, inside, new_block))
    new_top = ir.copy_loop(top, extent=rows, body=inner)
    sch.state.replace(sch.get_sref(sch.get_loops(block_rv)[0]), new_top, {block: new_block})


def _raw_tile_scope(config):
    """The scope of X's tile as copied, which the statistic and the scaled copy of A
    read: static shared memory where the dynamic buffers (two stages of W's tile and the
    scaled copy, fp16 rows padded by a word) reach :data:`_SHARED_WITHOUT_OPT_IN`, else
    dynamic. TVM's barrier planner runs once the dynamic buffers are merged into one and
    takes any two accesses to it for a conflict: with X's tile among them the scaled
    copy got a barrier after each of its words (22 barriers in the kernel, 7 with the
    tile static; H200, 2048 x 4096 x 14336: 1.146 -> 1.083 ms)."""
    row_bytes = 2 * (config.depth + VECTOR)
    dynamic = 2 * config.cols * row_bytes + config.rows * row_bytes
    return "shared" if dynamic >= _SHARED_WITHOUT_OPT_IN else SHARED


def _realize_of(sch, block_rv):
    block = sch.get(block_rv)
    found = ir.nodes(sch.get(sch.get_loops(block_rv)[0]), tvm.s_tir.stmt.SBlockRealize)
    return next(r for r in found if r.block.same_as(block))


@dataclass(frozen=True)
class ScaledGemmConfig:
    """Tile sizes of :func:`schedule_scaled_gemm`."""

    rows: int = 128  # rows of X per thread block, 32 per warp (a row per lane)
    cols: int = 128  # columns of W per thread block (and per warp)
    depth: int = 64  # k per tile

    @staticmethod
    def for_rows(m: int) -> "ScaledGemmConfig":
        """128-row blocks where ``m`` is a multiple of 128 or a variable, else the largest
        of 64 and 32 rows that divides it (else 32: :func:`schedule_scaled_gemm` refuses
        ``m``)."""
        if not isinstance(m, int) and not isinstance(m, tvm.tirx.IntImm):
            return ScaledGemmConfig()
        return ScaledGemmConfig(rows=next((r for r in (128, 64, 32) if int(m) % r == 0), WARP))


def schedule_scaled_gemm(func, config: Optional[ScaledGemmConfig] = None) -> tvm.s_tir.Schedule:
    """The one-kernel GPU schedule (module docstring) of ``ops.rmsnorm_gemm`` or
    ``ops.absmax_quant_gemm`` with float16 inputs; ``config`` defaults to
    :meth:`ScaledGemmConfig.for_rows`. Build it with :func:`.tensor_cores.build`. Raises
    ``ValueError`` where M, N or K is not a whole number of the config's tiles."""
    func = defer_row_scales(func)
    gemm_block, _ = _find_gemm(func)
    m, n, k_extent = (v.dom.extent for v in gemm_block.iter_vars)
    config = config or ScaledGemmConfig.for_rows(m)
    if config.rows % WARP:
        raise ValueError(f"schedule_scaled_gemm: {config.rows} rows a block are not whole warps of {WARP} rows")
    analyzer = tvm.sym.Analyzer()
    for what, extent, size in (("M", m, config.rows), ("N", n, config.cols), ("K", k_extent, config.depth)):
        if not analyzer.can_prove(tvm.tirx.floormod(extent, size) == 0):
            raise ValueError(
                f"schedule_scaled_gemm: {what} = {extent} is not a multiple of the tile's {size} "
                f"(ops.rmsnorm_gemm(pad_rows={config.rows}) pads M)"
            )
    operands = [r.source for r in gemm_block.reads if len(r.region) == 2 and not r.source.same_as(gemm_block.writes[0].source)]
    if any(str(b.dtype) != "float16" for b in operands):
        raise ValueError("schedule_scaled_gemm: the GEMM's operands must be float16 (the mma.sync operands)")
    blocks = ir.blocks_in(func.body.block)
    sch = tvm.s_tir.Schedule(func)
    gemm = sch.get_sblock(gemm_block.name_hint)
    stats = [b for b in blocks if b.init is not None and not b.same_as(gemm_block)]
    if len(stats) != 1:
        names = ", ".join(f"'{b.name_hint}'" for b in stats)
        raise FusionError(f"schedule_scaled_gemm: one row statistic besides '{gemm_block.name_hint}' expected, found {names or 'none'}")
    (stat,) = stats
    rows_of = [b for b in blocks if b.init is None and len(b.iter_vars) == 1]
    warps = config.rows // WARP

    i, j, k = sch.get_loops(gemm)
    bi, warp, ti = sch.split(i, [None, warps, WARP])
    bj, tj = sch.split(j, [None, config.cols])
    ko, ki = sch.split(k, [None, config.depth])
    sch.reorder(bi, bj, warp, ko, ti, tj, ki)
    sch.bind(bi, "blockIdx.x")
    sch.bind(bj, "blockIdx.y")
    # Each warp owns whole rows (all the block's columns): its rows' statistic is its own.
    sch.bind(warp, "threadIdx.y")

    # Operands in shared memory, a tile of k at a time, copied asynchronously while the
    # tile before computes; A scaled by the factors constant along the rows from its copy.
    a_index, b_index = 0, 1
    a_source = sch.get(gemm).reads[a_index].source
    copies = [sch.cache_read(gemm, b_index, SHARED, consumer_blocks=[gemm])]
    if a_source.name.endswith("_global"):
        a_scaled = sch.get_sblock(a_source.name)
        sch.set_scope(a_scaled, 0, SHARED)
        sch.compute_at(a_scaled, ko)
        a_copy = sch.cache_read(a_scaled, 0, _raw_tile_scope(config), consumer_blocks=[a_scaled])
    else:
        a_scaled, a_copy = None, sch.cache_read(gemm, a_index, SHARED, consumer_blocks=[gemm])
    copies.insert(0, a_copy)
    for copy in copies:  # the loop's first statements, B's copy first: A's is folded after it
        sch.compute_at(copy, ko, index=0)

    # Each warp folds its rows of each tile of X from shared memory, a row per lane.
    fold_from_copy(sch, sch.get_sblock(stat.name_hint), a_copy, rows=(warp, WARP))
    # Each lane's running value in a register (through shared memory, every element
    # would be a dependent load and store), stored once after the k loop for the lanes
    # that read the row in the epilogue.
    stat_rv = sch.get_sblock(stat.name_hint)
    sch.set_scope(stat_rv, 0, "shared")
    sch.bind(sch.get_loops(stat_rv)[-2], "threadIdx.x")
    running = sch.cache_write(stat_rv, 0, "local")
    sch.reverse_compute_at(running, warp)
    sch.bind(sch.get_loops(running)[-1], "threadIdx.x")
    if "X_pad" in (b.name_hint for b in blocks):
        sch.compute_inline(sch.get_sblock("X_pad"))  # into X's copy: it reads the last row again past M
    for copy in copies:
        copy_in_words(sch, copy, copy, warps)
    if a_scaled is not None:
        copy_in_words(sch, a_scaled, a_scaled, warps)
    for block in rows_of:
        sch.compute_inline(sch.get_sblock(block.name_hint))
    (out,) = [sch.get_sblock(b.name_hint) for b in _readers(func, gemm_block)]
    _over_padded_rows(sch, out, m)
    sch.reverse_compute_at(out, warp)

    # The warp's GEMM on tensor cores: operands through ldmatrix, fp32 accumulators in
    # registers from the first tile to the epilogue.
    intrin = cuda_intrinsics()
    mi, i16 = sch.split(ti, [None, MMA])
    nj, n16 = sch.split(tj, [None, MMA])
    kk, k16 = sch.split(ki, [None, MMA])
    sch.reorder(kk, mi, nj, i16, n16, k16)
    # B as [N, K] (a linear layer's weight) is mma's "col" operand as it is.
    b_load = next(l for l in _loads(sch.get(gemm).body) if l.source.same_as(sch.get(gemm).reads[b_index].source))
    transposed = uses_var(b_load.indices[-1], sch.get(gemm).iter_vars[2].var)
    b_intrin = intrin.LDMATRIX_f16_B_TRANS_DYN_INTRIN if transposed else intrin.LDMATRIX_f16_B_DYN_INTRIN
    caches = []
    for index, load in ((a_index, intrin.LDMATRIX_f16_A_DYN_INTRIN), (b_index, b_intrin)):
        cache = sch.cache_read(gemm, index, "warp", consumer_blocks=[gemm])
        sch.compute_at(cache, kk)
        caches.append((cache, load))
    init = sch.decompose_reduction(gemm, ko)
    sch.set_scope(gemm, 0, "warp")
    sch.transform_layout(gemm, ("write", 0), fragment)
    for cache, load in caches:
        sch.transform_layout(cache, ("write", 0), fragment)
        sch.tensorize(tile(sch, cache), load)
    sch.tensorize(i16, intrin.MMA_f16f16f32_TRANS_B_INTRIN if transposed else intrin.MMA_f16f16f32_INTRIN)
    sch.tensorize(sch.get_loops(init)[-2], intrin.MMA_fill_16x16_f32_INTRIN)
    bind_fragment_lanes(sch, out)
    # Two stages: three (a third buffer of each tile) and the next 16-deep step's ldmatrix
    # issued before this step's mma (a second set of fragments) measured slower.
    for key, value in software_pipeline.pipeline_annotations(sch.get(ko)).items():
        sch.annotate(ko, key, value)
    return sch


