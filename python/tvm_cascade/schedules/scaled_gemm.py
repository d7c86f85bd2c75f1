"""A GEMM scaled per row by a statistic of its own rows (RMSNorm + GEMM, abs-max
scaling + GEMM) as one tensor-core kernel.

``ops.rmsnorm_gemm``'s chain is ``ss_i = Σ_k X[i,k]²``, ``r_i = 1/sqrt(ss_i/K + eps)``,
``y[i,n] = Σ_k X[i,k]·r_i·γ_k·W[k,n]``. Fused by ``rolling_update``, every k tile
would repair every accumulator (``y·r_new/r_old``, FlashAttention's output repair). The
scale is constant along k, so ``Σ_k r_i·t_k = r_i·Σ_k t_k`` (multiplication distributes
over the sum): ``Schedule.defer_row_scales`` moves it out of the sum into the GEMM's
consumer. The statistic and the GEMM then depend on nothing of each other and read the
same tiles of X, so one pass over k computes both: the statistic from X's tile in shared
memory, the GEMM on tensor cores; the scale is one multiply in the epilogue. A factor
constant along the rows (``γ_k``) goes into a scaled copy of the A operand, made from
X's tile in shared memory (the copies from global memory stay plain, asynchronous).
With ``ScaledGemmConfig(mfma=True)`` the same kernel runs on AMD's matrix cores
(wavefronts of 64 lanes, TVM's MFMA intrinsics: :mod:`tvm_cascade.rocm.mfma`). On an
H100 or H200 RMSNorm + GEMM has a faster kernel, warp-specialised with TMA and
``wgmma`` (:mod:`.warp_specialized_gemm`, a ``WarpSpecializedGemmConfig``):
:func:`schedule_for_target` picks it there, :func:`build` compiles either.

Before (``ops.rmsnorm_gemm``)::

    for i, j, k in T.grid(M, N, K):
        with T.sblock("gemm"):
            gemm[i, j] += X[i, k] * rstd[i] * gamma[k] * W[k, j]
    for i, j in T.grid(M, N):
        with T.sblock("out"):
            out[i, j] = T.Cast("float16", gemm[i, j])

After ``defer_row_scales`` (:mod:`tvm_cascade.primitives.row_scales`)::

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
from tvm.ir import expr as ir_expr

from ..analysis.scope import uses_var
from ..errors import FusionError
from ..primitives import ir
from ..primitives.row_scales import find_gemm, readers
from ..cuda import software_pipeline, tensor_cores
from ..cuda.tensor_cores import cuda_intrinsics
from ..rocm import mfma as matrix_cores
from . import warp_specialized_gemm
from .mma_tiles import MMA, SHARED, VECTOR, WARP, bind_fragment_lanes, copy_in_words, fragment, tile
from .warp_specialized import serves_target
from .warp_specialized_gemm import WarpSpecializedGemmConfig

#: Shared memory a CUDA kernel may use without opting in. TVM's CUDA launcher opts in
#: only for kernels whose *dynamic* shared memory reaches it; below, static and dynamic
#: memory together must fit (a larger sum fails at launch).
_SHARED_WITHOUT_OPT_IN = 48 << 10


def _raw_tile_scope(config):
    """The scope of X's tile as copied, which the statistic and the scaled copy of A
    read: static shared memory where the dynamic buffers (two stages of W's tile and the
    scaled copy, fp16 rows padded by a word) reach :data:`_SHARED_WITHOUT_OPT_IN`, else
    dynamic. TVM's barrier planner runs once the dynamic buffers are merged into one and
    takes any two accesses to it for a conflict: with X's tile among them the scaled
    copy got a barrier after each of its words (22 barriers in the kernel, 7 with the
    tile static; H200, 2048 x 4096 x 14336 with W as [N, K]: 1.146 -> 1.083 ms, with W
    as [K, N] within 1.5%)."""
    if config.mfma:
        return "shared"  # (all static: a ROCm kernel has no dynamic shared memory here)
    row_bytes = 2 * (config.depth + VECTOR)
    dynamic = 2 * config.cols * row_bytes + config.rows * row_bytes
    return "shared" if dynamic >= _SHARED_WITHOUT_OPT_IN else SHARED


@dataclass(frozen=True)
class ScaledGemmConfig:
    """Tile sizes and matrix instructions of :func:`schedule_scaled_gemm`."""

    rows: int = 128  # rows of X per thread block, 32 per warp (64 per wavefront): a row per lane
    cols: int = 128  # columns of W per thread block (and per warp)
    depth: int = 64  # k per tile
    #: AMD's matrix cores (ROCm, gfx90a and later) in place of ``mma.sync``: wavefronts
    #: of 64 lanes, each 64 whole rows of the block; static shared memory, no
    #: asynchronous copies. Build with :func:`.tensor_cores.build` for a ROCm target.
    mfma: bool = False

    @staticmethod
    def for_rows(m: int, mfma: bool = False) -> "ScaledGemmConfig":
        """128-row blocks where ``m`` is a multiple of 128 or a variable, else the largest
        of 64 and 32 rows (64 with ``mfma``: a wavefront's) that divides it (else a
        warp's or wavefront's: :func:`schedule_scaled_gemm` refuses ``m``)."""
        if not isinstance(m, int) and not isinstance(m, tvm.tirx.IntImm):
            return ScaledGemmConfig(mfma=mfma)
        lanes = matrix_cores.LANES if mfma else WARP
        rows = next((r for r in (128, 64, 32) if r % lanes == 0 and int(m) % r == 0), lanes)
        return ScaledGemmConfig(rows=rows, mfma=mfma)


def schedule_scaled_gemm(func, config=None) -> tvm.s_tir.Schedule:
    """The one-kernel GPU schedule (module docstring) of ``ops.rmsnorm_gemm`` or
    ``ops.absmax_quant_gemm`` with float16 inputs (:func:`apply_scaled_gemm_schedule`
    on a new schedule of ``func``), or with a :class:`WarpSpecializedGemmConfig` the
    warp-specialised kernel's schedule of ``ops.rmsnorm_gemm``
    (:func:`.warp_specialized_gemm.schedule`). Build it with :func:`build`."""
    if isinstance(config, WarpSpecializedGemmConfig):
        return warp_specialized_gemm.schedule(func, config)
    sch = tvm.s_tir.Schedule(func)
    apply_scaled_gemm_schedule(sch, config)
    return sch


def schedule_for_target(func, target) -> tvm.s_tir.Schedule:
    """:func:`schedule_scaled_gemm` of ``func`` with the kernel that serves it best on
    ``target``: the warp-specialised one for RMSNorm + GEMM on an H100 or H200 (H200,
    2048 x 4096 x 14336: 0.364 ms against the mma.sync kernel's 1.108), else the
    mma.sync (CUDA) or MFMA (ROCm) one with its default tiles."""
    target = tvm.target.Target(target)
    if serves_target(target) and warp_specialized_gemm.rmsnorm_gemm_of(func) is not None:
        return warp_specialized_gemm.schedule(func)
    gemm, _ = find_gemm(func)
    rows = gemm.iter_vars[0].dom.extent if gemm is not None else None
    return schedule_scaled_gemm(func, ScaledGemmConfig.for_rows(rows, mfma=target.kind.name == "rocm"))


def build(mod, target):
    """Compile a module of :func:`schedule_scaled_gemm`'s schedules for ``target``: the
    warp-specialised kernel's (:func:`.warp_specialized_gemm.build`) or, with
    :func:`.tensor_cores.build`, the mma.sync and MFMA ones."""
    if warp_specialized_gemm.lowers(mod):
        return warp_specialized_gemm.build(mod, target)
    return tensor_cores.build(mod, target)


def apply_scaled_gemm_schedule(sch: tvm.s_tir.Schedule, config: Optional[ScaledGemmConfig] = None) -> None:
    """Schedule ``sch``, a schedule of ``ops.rmsnorm_gemm`` or ``ops.absmax_quant_gemm``
    with float16 inputs as it was made, into the one-kernel GPU schedule (module
    docstring); ``config`` defaults to :meth:`ScaledGemmConfig.for_rows`. Every step is
    a traced instruction. Raises, with ``sch`` unchanged, ``ValueError`` where M, N or K
    is not a whole number of the config's tiles or the operands are not float16, and
    :class:`FusionError` where the function is not such a GEMM with one row statistic."""
    func = sch.mod["main"]
    gemm_block, _ = find_gemm(func)
    if gemm_block is None:
        raise FusionError("schedule_scaled_gemm: no block computes C[i, j] += A[i, k] * B[k, j] * (row and k factors)")
    m, n, k_extent = (v.dom.extent for v in gemm_block.iter_vars)
    config = config or ScaledGemmConfig.for_rows(m)
    lanes = matrix_cores.LANES if config.mfma else WARP
    if config.rows % lanes:
        raise ValueError(f"schedule_scaled_gemm: {config.rows} rows a block are not whole warps of {lanes} rows")
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
    stats = [b for b in ir.blocks_in(func.body.block) if b.init is not None and not b.same_as(gemm_block)]
    if len(stats) != 1:
        names = ", ".join(f"'{b.name_hint}'" for b in stats)
        raise FusionError(f"schedule_scaled_gemm: one row statistic besides '{gemm_block.name_hint}' expected, found {names or 'none'}")
    (stat,) = stats
    sch.defer_row_scales(sch.get_sblock(gemm_block.name_hint))
    func = sch.mod["main"]
    gemm_block, _ = find_gemm(func)
    blocks = ir.blocks_in(func.body.block)
    gemm = sch.get_sblock(gemm_block.name_hint)
    rows_of = [b for b in blocks if b.init is None and len(b.iter_vars) == 1]
    warps = config.rows // lanes
    shared = "shared" if config.mfma else SHARED

    i, j, k = sch.get_loops(gemm)
    bi, warp, ti = sch.split(i, [None, warps, lanes])
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
    copies = [sch.cache_read(gemm, b_index, shared, consumer_blocks=[gemm])]
    if a_source.name.endswith("_global"):
        a_scaled = sch.get_sblock(a_source.name)
        sch.set_scope(a_scaled, 0, shared)
        sch.compute_at(a_scaled, ko)
        a_copy = sch.cache_read(a_scaled, 0, _raw_tile_scope(config), consumer_blocks=[a_scaled])
    else:
        a_scaled, a_copy = None, sch.cache_read(gemm, a_index, shared, consumer_blocks=[gemm])
    copies.insert(0, a_copy)
    for copy in copies:  # the loop's first statements, B's copy first: A's is folded after it
        sch.compute_at(copy, ko, index=0)

    # Each warp folds its rows of each tile of X from shared memory, a row per lane.
    sch.fold_from_copy(sch.get_sblock(stat.name_hint), a_copy, warp, lanes)
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
    for copy in copies + ([a_scaled] if a_scaled is not None else []):
        copy_in_words(sch, copy, copy, warps, lanes)
    for block in rows_of:
        sch.compute_inline(sch.get_sblock(block.name_hint))
    (out,) = [sch.get_sblock(b.name_hint) for b in readers(func, gemm_block)]
    sch.over_padded_rows(out)
    sch.reverse_compute_at(out, warp)

    # The warp's GEMM on tensor cores: operands from shared memory into register
    # fragments, fp32 accumulators in registers from the first tile to the epilogue. B as
    # [N, K] (a linear layer's weight) is loaded as it is.
    b_load = next(l for l in ir.nodes(sch.get(gemm).body, ir_expr.TensorLoad) if l.source.same_as(sch.get(gemm).reads[b_index].source))
    transposed = uses_var(b_load.indices[-1], sch.get(gemm).iter_vars[2].var)
    if config.mfma:
        load_a, load_b, product, fill = matrix_cores.intrinsics(transposed)
        layouts = (
            matrix_cores.a_fragment,
            matrix_cores.a_fragment if transposed else matrix_cores.b_fragment,
            matrix_cores.accumulator,
        )
    else:
        intrin = cuda_intrinsics()
        load_a, load_b, product, fill = (
            intrin.LDMATRIX_f16_A_DYN_INTRIN,
            intrin.LDMATRIX_f16_B_TRANS_DYN_INTRIN if transposed else intrin.LDMATRIX_f16_B_DYN_INTRIN,
            intrin.MMA_f16f16f32_TRANS_B_INTRIN if transposed else intrin.MMA_f16f16f32_INTRIN,
            intrin.MMA_fill_16x16_f32_INTRIN,
        )
        layouts = (fragment, fragment, fragment)
    mi, i16 = sch.split(ti, [None, MMA])
    nj, n16 = sch.split(tj, [None, MMA])
    kk, k16 = sch.split(ki, [None, MMA])
    sch.reorder(kk, mi, nj, i16, n16, k16)
    caches = []
    for index, load, layout in ((a_index, load_a, layouts[0]), (b_index, load_b, layouts[1])):
        cache = sch.cache_read(gemm, index, "warp", consumer_blocks=[gemm])
        sch.compute_at(cache, kk)
        caches.append((cache, load, layout))
    init = sch.decompose_reduction(gemm, ko)
    sch.set_scope(gemm, 0, "warp")
    sch.transform_layout(gemm, ("write", 0), layouts[2])
    for cache, load, layout in caches:
        sch.transform_layout(cache, ("write", 0), layout)
        sch.tensorize(tile(sch, cache), load)
    sch.tensorize(i16, product)
    sch.tensorize(sch.get_loops(init)[-2], fill)
    if config.mfma:
        matrix_cores.bind_accumulator_lanes(sch, out, lambda loop: sch.annotate(loop, tensor_cores.UNROLL, 1))
        return
    bind_fragment_lanes(sch, out)
    # Two stages: three (a third buffer of each tile) and the next 16-deep step's ldmatrix
    # issued before this step's mma (a second set of fragments) measured slower.
    for key, value in software_pipeline.pipeline_annotations(sch.get(ko)).items():
        sch.annotate(ko, key, value)
