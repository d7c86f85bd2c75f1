"""RMSNorm + GEMM as one warp-specialised Hopper kernel (sm_90a): TMA copies into a ring of
shared-memory stages, ``wgmma`` from two consumer warpgroups, the norm folded from the
A operand on its way into registers. A TVMScript kernel template compiled by TVM's own
CUDA codegen, as :mod:`.warp_specialized`'s attention is.

``ops.rmsnorm_gemm``'s chain, after ``Schedule.defer_row_scales`` (:mod:`.scaled_gemm`),
is ``y[i, n] = r_i · Σ_k (X[i, k]·γ_k)·W[k, n]`` with ``r_i = 1/sqrt(Σ_k X[i, k]²/K +
eps)``: the statistic and the GEMM read the same tiles of X in one pass over k. An output
tile is :data:`ROWS` rows and ``cols`` columns; the blocks are persistent, one per SM
(or per output tile where there are fewer), each taking output tiles in turn, its ring
of stages running on from one tile to the next:

* warpgroup 0, the producer: one thread issues the TMA copies of each k tile (X's
  ``ROWS x DEPTH`` box, W's ``DEPTH x cols`` in 64-column boxes), 128-byte swizzled, into
  ``stages`` stages (``full``/``empty`` mbarriers as in the attention kernel). Boxes past
  X's rows or W's columns read zeros: any M (a variable included) and N serve.
* warpgroups 1 and 2, the consumers, 64 rows each: every thread reads its elements of
  X's tile from shared memory in the register layout of wgmma's A operand
  (``ldmatrix``), adds their squares to its rows' running sums, multiplies them by γ in
  pairs (γ copied to shared memory once per block where it fits), and issues
  ``wgmma`` m64n{cols}k16 with that register operand and W's tile from shared memory
  (MN-major for W as ``[K, N]``, K-major for ``[N, K]``). The next tile's operand is
  read while the instructions of this one run (two register sets). The epilogue sums
  each row's squares across its quad, scales the accumulators by ``r_i`` and stores
  four columns a thread at a time.

H200, 2048 x 4096 x 14336, ms: A's elements by 32-bit loads and γ from global memory
0.410, by ``ldmatrix`` and γ from shared memory 0.366; the squares folded by two
producer warps instead (two rows a thread) 0.412 against 0.402 in the consumers.

Output tiles go in groups of ``group`` row tiles, rows fastest, so that the blocks
running together share their W columns and X rows in L2. The producer loads a block's
next tile's first k tiles during the consumers' epilogue of its last.

With ``cluster=2`` two blocks form a cluster that takes two row tiles of one column tile
at a time: each block's producer copies its own X tile and half of the W tile (as
``[K, N]`` every other 64-column panel, as ``[N, K]`` half the rows) by TMA multicast
into both blocks, so W leaves L2 once per cluster instead of once per block (a 128 x 256
tile's k tile reads 48 KB a block alone, 32 KB in a cluster); every consumer thread
releases a stage in both blocks (``mapa`` and a remote mbarrier arrival), and the blocks
meet at cluster barriers after initialisation and before leaving.

Reached as a schedule of ``ops.rmsnorm_gemm`` (:func:`schedule`: the traced
``defer_row_scales``, then the choices of :class:`WarpSpecializedGemmConfig` annotated
on the GEMM block), which :func:`build` lowers to this kernel, as
:mod:`.warp_specialized` lowers its annotated key-tile loop; MetaSchedule's
:class:`~tvm_cascade.meta_schedule.CascadeFusion` proposes the same schedule with the
choices sampled.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import tvm
import tvm_ffi
from tvm.ir import expr as ir_expr
from tvm.script import tirx as T

from ..analysis.scope import buffer_params
from ..cuda import ALL_LANES, sm_count, tensor_cores
from ..cuda.accumulator_stores import first_column, store_four, trade_halves
from ..cuda.wgmma import descriptor
from ..cuda.wgmma_batches import register_fence
from ..errors import FusionError
from ..ops import cascades
from ..primitives import ir
from ..primitives.row_scales import find_gemm
# (the producer and two consumer warpgroups, the shared memory of an sm_90 block: as the
# attention kernel's)
from .warp_specialized import PTX_TYPE, SHARED_BYTES, THREADS, TMA_COPY, serves_target, sm90a, stage_release

#: Rows of the output per thread block (two consumer warpgroups of 64).
ROWS = 128
#: k per tile (one 128-byte swizzled row of 16-bit floats).
DEPTH = 64
_TMA = TMA_COPY.format(2)
_LAYOUTS = ("kn", "nk")
#: Annotations of the GEMM block that ask :func:`build` for this kernel: ``[eps, W's
#: layout]`` of the function, and the choices of :class:`WarpSpecializedGemmConfig`. On
#: the block, not a loop: MetaSchedule's postprocessors bind and split the loops of a
#: sample's unscheduled blocks.
PROBLEM = "tvm_cascade.warp_specialized_gemm"
COLS = "tvm_cascade.warp_specialized_gemm_cols"
STAGES = "tvm_cascade.warp_specialized_gemm_stages"
GROUP = "tvm_cascade.warp_specialized_gemm_group"
REGISTERS = "tvm_cascade.warp_specialized_gemm_registers"
#: The cluster size, annotated where it is not 1 (:attr:`WarpSpecializedGemmConfig.cluster`).
CLUSTER = "tvm_cascade.warp_specialized_gemm_cluster"
#: The choices a design space samples (:class:`~tvm_cascade.meta_schedule.CascadeFusion`).
COLS_CHOICES = (128, 256)
STAGE_CHOICES = (3, 4)
GROUP_CHOICES = (8, 16)
_LDMATRIX = "tvm_cascade_ldmatrix_x4"
# Four 8 x 8 matrices of 16-bit floats from shared memory, a register of each per
# thread: a 16 x 16 A operand's fragment (after the mbarrier wait that made the tile
# visible: volatile, with a memory clobber).
_LDMATRIX_SOURCE = f"""
__forceinline__ __device__ void {_LDMATRIX}(unsigned& a, unsigned& b, unsigned& c, unsigned& d, unsigned address) {{
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{%0, %1, %2, %3}}, [%4];"
               : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "r"(address) : "memory");
}}
"""
# A pair of products in one instruction (TVM's codegen splits vector calls per lane).
_MUL2 = "tvm_cascade_mul2_{}"
_MUL2_SOURCE = """
__forceinline__ __device__ unsigned {name}(unsigned a, unsigned b) {{
  unsigned r;
  asm("mul.rn.{ptx}x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}}
"""


#: Rows up to which :func:`build` makes the kernel for few rows (H200, 16 x 4096 x 14336:
#: 0.036 ms against this kernel's 0.049; at 32 rows 0.050 against 0.049).
SKINNY_ROWS = 16


@dataclass(frozen=True)
class WarpSpecializedGemmConfig:
    """Choices of the kernel. The defaults measured fastest at every row count tried
    (H200, K x N = 4096 x 14336, ms, 256 / 128 columns: 16 rows 0.047 / 0.058, 512 rows
    0.107 / 0.143; 2048 rows with 3 stages and groups of 8 row tiles 0.406, with the
    defaults 0.364)."""

    cols: int = 256  # output columns per block: the wgmma's N (64 to 256, by 64)
    stages: int = 4  # k tiles in shared memory
    group: int = 16  # row tiles taken together (L2 reuse)
    producer_registers: int = 40
    consumer_registers: int = 232
    # Blocks that share each W tile: with 2, a cluster takes two row tiles of one column
    # tile and each block fetches half of every W tile into both (TMA multicast), so the
    # blocks read W from L2 half as often (:func:`kernel`).
    cluster: int = 1

    def shared_bytes(self) -> int:
        """The dynamic shared memory of the kernel's stages: each stage's X and W tiles."""
        return 2 * self.stages * (ROWS + self.cols) * DEPTH

    def gamma_in_shared(self, k) -> bool:
        """Whether γ (``k`` elements, zero-padded to whole tiles) fits in shared memory
        beside the stages; else the consumers read it from global memory."""
        return self.shared_bytes() + 2 * -(-k // DEPTH) * DEPTH <= SHARED_BYTES


@dataclass(frozen=True)
class RmsNormGemm:
    """An ``ops.rmsnorm_gemm`` function's arguments (``m`` an int or its variable)."""

    m: object
    n: int
    k: int
    eps: float
    layout: str
    out_dtype: str
    pad_rows: Optional[int] = None
    dtype: str = "float16"

    def function(self) -> tvm.tirx.PrimFunc:
        return cascades.rmsnorm_gemm(
            self.m, self.n, self.k, self.eps, self.dtype, weight_layout=self.layout, pad_rows=self.pad_rows,
            out_dtype=self.out_dtype,
        )


def rmsnorm_gemm_of(func, change=lambda f: f) -> Optional[RmsNormGemm]:
    """The arguments of the ``ops.rmsnorm_gemm`` that ``func`` is (after
    ``change``, a function of an ``ops.rmsnorm_gemm`` function), or None: ``func`` is
    compared, structurally, with that function rebuilt from its shapes and eps."""
    params = buffer_params(func)
    sqrt = [c for c in ir.nodes(func.body, ir_expr.Call) if getattr(c.op, "name", "") == "tirx.sqrt"]
    if len(params) != 4 or len(sqrt) != 1 or not isinstance(sqrt[0].args[0], tvm.tirx.Add):
        return None
    eps = sqrt[0].args[0].b
    x, _, w, out = params
    if not isinstance(eps, tvm.tirx.FloatImm) or len(x.shape) != 2 or len(out.shape) != 2 or len(w.shape) != 2:
        return None
    m, k, n = x.shape[0], x.shape[1], out.shape[1]
    if not all(isinstance(d, tvm.tirx.IntImm) for d in (k, n)):
        return None
    m = int(m) if isinstance(m, tvm.tirx.IntImm) else m
    padded = {b.name_hint for b in ir.blocks_in(func.body.block)} >= {"X_pad"}
    for layout in _LAYOUTS:
        for pad in (32, 64, 128) if padded else (None,):
            problem = RmsNormGemm(m, int(n), int(k), float(eps.value), layout, str(out.dtype), pad, str(x.dtype))
            try:
                expected = change(problem.function())
            except (ValueError, tvm.TVMError):
                continue
            if tvm_ffi.structural_equal(func, expected, map_free_vars=True):
                return problem
    return None


def schedule(func, config: Optional[WarpSpecializedGemmConfig] = None) -> tvm.s_tir.Schedule:
    """The schedule of ``func``, an ``ops.rmsnorm_gemm``, that :func:`build` lowers to
    this kernel with ``config``'s choices (default :class:`WarpSpecializedGemmConfig`'s):
    :func:`apply_schedule` on a new
    schedule. Raises :class:`FusionError` where ``func`` is not such a function,
    ``ValueError`` where the kernel cannot serve it."""
    problem = rmsnorm_gemm_of(func)
    if problem is None:
        raise FusionError(
            "the warp-specialised scaled GEMM serves ops.rmsnorm_gemm functions; this function is not one"
        )
    config = config or WarpSpecializedGemmConfig()
    reason = unsupported(problem.n, problem.k, problem.layout, problem.dtype, problem.out_dtype, config)
    if reason is not None:
        raise ValueError(reason)
    sch = tvm.s_tir.Schedule(func)
    registers = (config.producer_registers, config.consumer_registers)
    apply_schedule(sch, problem, config.cols, config.stages, config.group, registers, config.cluster)
    return sch


def apply_schedule(
    sch, problem: RmsNormGemm, cols, stages, group,
    registers=(WarpSpecializedGemmConfig.producer_registers, WarpSpecializedGemmConfig.consumer_registers),
    cluster=1,
) -> None:
    """On ``sch``, a schedule of the ``ops.rmsnorm_gemm`` that ``problem`` describes: the
    traced ``defer_row_scales`` of its GEMM, then the kernel's choices (ints, or values a
    design space sampled; the cluster size annotated only where it is not 1), its eps and
    W's layout annotated on the GEMM block (:data:`PROBLEM`), which :func:`build` reads."""
    gemm_block, _ = find_gemm(sch.mod["main"])
    sch.defer_row_scales(sch.get_sblock(gemm_block.name_hint))
    gemm = sch.get_sblock(gemm_block.name_hint)
    sch.annotate(gemm, PROBLEM, [problem.eps, problem.layout])
    for key, value in ((COLS, cols), (STAGES, stages), (GROUP, group), (REGISTERS, list(registers))):
        sch.annotate(gemm, key, value)
    if cluster != 1:
        sch.annotate(gemm, CLUSTER, cluster)


def lowers(mod) -> bool:
    """Whether a block of ``mod`` asks for this kernel (:func:`build`)."""
    return bool(ir.annotated_blocks(mod, PROBLEM))


def chosen_config(mod) -> Optional[WarpSpecializedGemmConfig]:
    """The choices ``mod``'s annotations ask :func:`build` for (a tuning record's), or
    None where no block asks for this kernel."""
    sites = ir.annotated_blocks(mod, PROBLEM)
    return _config(sites[0][2].annotations) if sites else None


def _config(notes) -> WarpSpecializedGemmConfig:
    return WarpSpecializedGemmConfig(
        int(notes[COLS]), int(notes[STAGES]), int(notes[GROUP]), *(int(r) for r in notes[REGISTERS]),
        int(notes[CLUSTER]) if CLUSTER in notes else 1,
    )


def build(mod, target):
    """Compile ``mod``, whose one function is a schedule of ``ops.rmsnorm_gemm`` that
    :func:`apply_schedule` annotated (:func:`schedule`, or a sample of MetaSchedule's
    :class:`~tvm_cascade.meta_schedule.CascadeFusion` after the target's postprocessors),
    to this kernel for ``target`` (an H100 or H200: sm_90a is named for it), under the
    function's name (up to :data:`SKINNY_ROWS` rows the kernel for few rows, the choices
    unused: :func:`kernel_for`): the kernel computes ``ops.rmsnorm_gemm`` of the
    function's parameters with the annotated eps and layout. ``ValueError`` where the
    parameters are not that function's or the kernel cannot serve them."""
    sites = ir.annotated_blocks(mod, PROBLEM)
    # (a decomposed reduction's init block keeps the GEMM block's annotations)
    notes = {tvm_ffi.structural_hash(_choices(block)): _choices(block) for _, _, block in sites}
    if len(notes) != 1 or len(mod.functions_items()) != 1:
        raise ValueError(
            f"the warp-specialised scaled GEMM builds a module of one function annotated once; "
            f"{len(mod.functions_items())} functions, {len(notes)} sets of annotations"
        )
    gvar, func, block = sites[0]
    if not serves_target(target):
        raise ValueError(f"the warp-specialised scaled GEMM needs sm_90a (wgmma, TMA, setmaxnreg); target is {target}")
    notes = block.annotations
    eps, layout = float(notes[PROBLEM][0]), str(notes[PROBLEM][1])
    config = _config(notes)
    problem = _problem_of_params(func, eps, layout)
    if problem is None:
        raise ValueError(
            f"'{gvar.name_hint}': its parameters are not ops.rmsnorm_gemm's X[M, K], gamma[K], W[K, N] "
            f"(or [N, K]), out[M, N] in one 16-bit dtype (W's layout annotated: {layout})"
        )
    reason = unsupported(problem.n, problem.k, problem.layout, problem.dtype, problem.out_dtype, config)
    if reason is not None:
        raise ValueError(reason)
    symbol = func.attrs["global_symbol"] if "global_symbol" in func.attrs else gvar.name_hint
    return build_function(kernel_for(problem, config), target, symbol)


def build_function(func, target, symbol="main"):
    """Compile the kernels' function ``func`` as ``symbol`` for ``target`` named sm_90a.
    Where it launches several kernels they are launched as programmatic dependents
    (:func:`.tensor_cores.build`): a split-K kernel's sum, or a two-pass GEMM's GEMM,
    launches while the kernel before it ends and waits for its results."""
    target = sm90a(target)
    with target:  # TVM's CUDA compile callback takes the arch from the current target
        return tensor_cores.build(tvm.IRModule({symbol: func.with_attr("global_symbol", symbol)}), target)


def kernel_for(problem: RmsNormGemm, config=WarpSpecializedGemmConfig()) -> tvm.tirx.PrimFunc:
    """The kernel :func:`build` makes of ``problem``: up to :data:`SKINNY_ROWS` rows the
    kernel for few rows (:func:`.rmsnorm_gemm_skinny.skinny_kernel`, its stages and
    splits of K :func:`.rmsnorm_gemm_skinny.default_config`'s), else :func:`kernel` with
    ``config``; for a variable row count one function that launches one of the two by
    the rows at run time (a decode batch and a prompt alike)."""
    # the kernel for few rows builds on this module's helpers: imported where it is used
    from . import rmsnorm_gemm_skinny as skinny

    m, n, k, layout, out_dtype, dtype = problem.m, problem.n, problem.k, problem.layout, problem.out_dtype, problem.dtype
    if isinstance(m, int) and m > SKINNY_ROWS:
        return kernel(m, n, k, problem.eps, layout, out_dtype, config, dtype)
    buffers = params(m, n, k, layout, dtype, out_dtype)
    stages, splits = skinny.default_config(n, k)
    few = skinny.skinny_kernel(m, n, k, problem.eps, layout, out_dtype, dtype=dtype, stages=stages, splits=splits,
                               buffers=buffers)
    if isinstance(m, int):
        return few
    many = kernel(m, n, k, problem.eps, layout, out_dtype, config, dtype, buffers=buffers)
    body = tvm.tirx.IfThenElse(m <= SKINNY_ROWS, few.body, many.body)
    return tvm.tirx.PrimFunc(buffers, body).with_attr("global_symbol", "main")


def _choices(block):
    return {key: block.annotations[key] for key in (PROBLEM, COLS, STAGES, GROUP, REGISTERS, CLUSTER)
            if key in block.annotations}


def _problem_of_params(func, eps, layout) -> Optional[RmsNormGemm]:
    params = buffer_params(func)
    if len(params) != 4 or any(len(p.shape) != (1 if i == 1 else 2) for i, p in enumerate(params)):
        return None
    x, gamma, w, out = params
    (m, k), (n,) = x.shape, out.shape[1:]
    w_shape = (k, n) if layout == "kn" else (n, k)
    analyzer = tvm.sym.Analyzer()
    same = lambda a, b: all(analyzer.can_prove_equal(p, q) for p, q in zip(a, b))  # noqa: E731
    if layout not in _LAYOUTS or not (same(gamma.shape, (k,)) and same(w.shape, w_shape) and same(out.shape[:1], (m,))):
        return None
    static = isinstance(k, tvm.tirx.IntImm) and isinstance(n, tvm.tirx.IntImm)
    if not static or len({str(p.dtype) for p in (x, gamma, w)}) != 1:
        return None
    m = int(m) if isinstance(m, tvm.tirx.IntImm) else m
    return RmsNormGemm(m, int(n), int(k), eps, layout, str(out.dtype), None, str(x.dtype))


def unsupported(n, k, layout, dtype, out_dtype, config=WarpSpecializedGemmConfig()):
    """Why the kernel cannot serve this GEMM (M is free), or None."""
    if dtype not in PTX_TYPE:
        return f"the warp-specialised scaled GEMM computes in float16 or bfloat16, not {dtype}"
    if out_dtype not in (dtype, "float32"):
        return f"the warp-specialised scaled GEMM stores {dtype} or float32, not {out_dtype}"
    if layout not in _LAYOUTS:
        return f"W's layout must be one of {_LAYOUTS}, not {layout!r}"
    if k % 8 or (layout == "kn" and n % 8):
        return f"TMA needs rows of a multiple of 16 bytes: K = {k}" + (f", N = {n}" if layout == "kn" else "")
    if config.cols % 64 or not 64 <= config.cols <= 256:
        return f"{config.cols} columns a block: a multiple of 64 up to 256 (wgmma's N)"
    if config.shared_bytes() > SHARED_BYTES:
        return f"{config.stages} stages of {config.cols} columns need {config.shared_bytes()} bytes of shared memory"
    if config.cluster not in (1, 2):
        return f"the warp-specialised scaled GEMM shares W tiles in clusters of 1 or 2 blocks, not {config.cluster}"
    return None


def params(m, n, k, layout, dtype, out_dtype):
    """The kernels' parameters ``X[m, k]``, ``gamma[k]``, ``W`` (``[k, n]`` for
    ``layout`` "kn", else ``[n, k]``), ``out[m, n]``."""
    return [
        tvm.tirx.decl_buffer((m, k), dtype, "X"),
        tvm.tirx.decl_buffer((k,), dtype, "gamma"),
        tvm.tirx.decl_buffer((k, n) if layout == "kn" else (n, k), dtype, "W"),
        tvm.tirx.decl_buffer((m, n), out_dtype, "out"),
    ]


def pair_product(dtype):
    """The name and CUDA source of the function that multiplies pairs of ``dtype``
    elements in one instruction (as 32-bit words)."""
    name = _MUL2.format(PTX_TYPE[dtype])
    return name, _MUL2_SOURCE.format(name=name, ptx=PTX_TYPE[dtype])


def kernel(m, n, k, eps=1e-6, layout="kn", out_dtype="float16", config=WarpSpecializedGemmConfig(), dtype="float16",
           buffers=None):
    """The kernel's PrimFunc ``main(X[m, k], gamma[k], W, out[m, n])``, W ``[k, n]``
    (``layout`` "kn") or ``[n, k]`` ("nk"), ``dtype`` inputs (float16 or bfloat16), as
    ``ops.rmsnorm_gemm`` takes them; ``m`` an int or a variable. ``buffers``: those
    parameters, where another function's body shares them."""
    reason = unsupported(n, k, layout, dtype, out_dtype, config)
    if reason is not None:
        raise ValueError(reason)
    mul2, mul2_source = pair_product(dtype)
    cols, stages = config.cols, config.stages
    kn = layout == "kn"
    X, gamma, W, out = buffers or params(m, n, k, layout, dtype, out_dtype)
    m_tiles = (m + ROWS - 1) // ROWS
    n_tiles = -(-n // cols)
    k_tiles = -(-k // DEPTH)
    x_tile, w_tile = ROWS * DEPTH, DEPTH * cols
    w_base = stages * x_tile
    g_base = stages * (x_tile + w_tile)  # γ, where it is in shared memory
    gamma_shared = config.gamma_in_shared(k)
    smem_elements = g_base + (k_tiles * DEPTH if gamma_shared else 0)
    panels = cols // 64
    n_acc = cols // 2  # a thread's accumulators: 64 x cols over 128 threads
    part_k, part_n = k % DEPTH != 0, n % cols != 0
    ptx = PTX_TYPE[dtype]
    mma = getattr(getattr(getattr(T.ptx.wgmma.mma_async.sync.aligned, f"m64n{cols}k16").f32, ptx), ptx)
    group, cluster = config.group, config.cluster
    # Persistent blocks, one per SM (or per output tile where there are fewer), each
    # taking output tiles in turn: a tile's first k tiles load during the last one's
    # epilogue, and γ is read once a block. A cluster takes a unit at a time: `cluster`
    # consecutive row tiles of one column tile, a row tile a block.
    spans = (m_tiles + cluster - 1) // cluster if cluster > 1 else m_tiles
    units = spans * n_tiles
    clusters = ir.minimum(units, sm_count(tvm.cuda(0)) // cluster)
    blocks = clusters * cluster if cluster > 1 else clusters
    rounds = (units + clusters - 1) // clusters
    span_group = max(group // cluster, 1)
    multicast, mask = (".multicast::cluster", (T.uint16(0b11),)) if cluster > 1 else ("", ())

    def tile_at(unit, rank):
        """(first row, first column) of block ``rank``'s output tile of ``unit``: groups of
        ``group`` row tiles, rows fastest within a group."""
        first = unit // (span_group * n_tiles) * span_group
        rows_here = T.min(spans - first, span_group)
        within = unit % (span_group * n_tiles)
        row_tile = (first + within % rows_here) * cluster + rank if cluster > 1 else first + within % rows_here
        return row_tile * ROWS, within // rows_here * cols

    def unit_of(j, bx):
        """The unit block ``bx``'s cluster takes in round ``j``."""
        return j * clusters + (bx // cluster if cluster > 1 else bx)

    release = stage_release(cluster)

    def w_operand(smem, st, ks):
        if kn:
            # [k, n] in 64-column panels of DEPTH rows, read MN-major: the leading byte
            # offset steps to the next panel, the stride to the next 8 rows of k.
            return descriptor(smem.ptr_to([w_base + st * w_tile + ks * 16 * 64]), DEPTH * 64 * 2, 1024, swizzle=True)
        # [n, k] rows of DEPTH, read K-major: step ks is 32 bytes into the swizzled row.
        return descriptor(smem.ptr_to([w_base + st * w_tile + ks * 16]), 16, 1024, swizzle=True)

    @T.macro
    def wait(bar, t):
        T.cuda.mbarrier_wait(bar.ptr_to([t % stages]), (t // stages) & 1)

    @T.macro
    def gamma_pair(smem, gv, t, col):
        """γ at columns ``col``, ``col + 1`` of tile ``t`` into ``gv``."""
        if gamma_shared:
            gv.vstore([0], smem.vload([g_base + t * DEPTH + col], f"{dtype}x2"))
        elif part_k:
            for e in T.unroll(2):
                at = T.meta_var(t * DEPTH + col + e)
                gv[e] = T.if_then_else(at < k, gamma[T.min(at, k - 1)], T.Cast(dtype, 0))
        else:
            gv.vstore([0], gamma.vload([t * DEPTH + col], f"{dtype}x2"))

    @T.macro
    def operand(smem, A, ss, xv, gv, half, t, st, cw, w, lane):
        """Tile ``t``'s A operand (in stage ``st``) into register set ``half``: this
        thread's elements of its rows, squares into ``ss``, times γ, in pairs."""
        for ks in T.unroll(DEPTH // 16):
            # Lane L points at row L % 8 of matrix L // 8: rows + 8 for matrices 1 and 3,
            # columns + 8 for 2 and 3; the 16-byte chunk c of row r lies at c ^ (r % 8).
            row = T.meta_var(64 * cw + 16 * w + lane % 8 + 8 * (lane // 8 % 2))
            chunk = T.meta_var(2 * ks + lane // 16)
            T.evaluate(
                T.cuda.func_call(
                    _LDMATRIX, *[A[half * 16 + ks * 4 + q] for q in range(4)],
                    T.Cast("uint32", T.cuda.cvta_generic_to_shared(
                        smem.ptr_to([st * x_tile + row * DEPTH + (chunk ^ (row % 8)) * 8])
                    )),
                    source_code=_LDMATRIX_SOURCE,
                )
            )
            for q in T.unroll(4):
                # register q: row lane / 4 (+ 8 for q odd), columns 2 (lane % 4) (+ 8 for q >= 2)
                g = T.meta_var(q % 2)
                xv.vstore([0], T.reinterpret(f"{dtype}x2", A[half * 16 + ks * 4 + q]))
                for e in T.unroll(2):
                    x = T.meta_var(T.Cast("float32", xv[e]))
                    ss[g] = ss[g] + x * x
                gamma_pair(smem, gv, t, ks * 16 + 8 * (q // 2) + 2 * (lane % 4))
                # in pairs: the product of two 16-bit floats rounds once either way
                A[half * 16 + ks * 4 + q] = T.cuda.func_call(
                    mul2, A[half * 16 + ks * 4 + q], T.reinterpret("uint32", gv.vload([0], f"{dtype}x2")),
                    source_code=mul2_source, return_type="uint32",
                )

    fence_accumulators, fence_a = register_fence(n_acc), register_fence(16)

    @T.macro
    def issue(acc, A, smem, half, st):
        for ks in T.unroll(DEPTH // 16):
            T.evaluate(
                mma(
                    *[acc[i] for i in range(n_acc)],
                    *[A[half * 16 + ks * 4 + q] for q in range(4)],
                    w_operand(smem, st, ks), True, 1, 1, 1 if kn else 0,
                )
            )
        T.ptx.wgmma.commit_group.sync.aligned()

    @T.macro
    def step(smem, full, empty, acc, A, ss, xv, gv, half, t, base, cw, w, lane, rank):
        # Tile t's instructions run while tile t + 1's operand is read into the other set;
        # the set tile t - 1 read is free once at most one batch is in flight. The ring's
        # k tile `base + t` (`base`: the k tiles of the block's earlier output tiles).
        fence_accumulators(acc, 0)
        fence_a(A, 16 * half)
        T.ptx.wgmma.fence.sync.aligned()
        issue(acc, A, smem, half, (base + t) % stages)
        T.ptx.wgmma.wait_group.sync.aligned(1)
        fence_a(A, 16 * (1 - half))
        if t > 0:
            release(empty, (base + t - 1) % stages, rank)
        if t + 1 < k_tiles:
            wait(full, base + t + 1)
            operand(smem, A, ss, xv, gv, 1 - half, t + 1, (base + t + 1) % stages, cw, w, lane)

    @T.macro
    def consume(smem, full, empty, bx, tx, cw, rank):
        w = T.meta_var((tx // 32) % 4)
        lane = T.meta_var(tx % 32)
        acc = T.alloc_local((n_acc,), "float32")
        A = T.alloc_local((32,), "uint32")  # two sets of a tile's A operand, 16-bit pairs
        ss = T.alloc_local((2,), "float32")
        xv = T.alloc_local((2,), dtype)
        gv = T.alloc_local((2,), dtype)
        four = T.alloc_local((4,), "float32")
        ov = T.alloc_local((4,), out_dtype)
        for j in T.serial(rounds):
            if unit_of(j, bx) < units:
                r0, c0 = T.meta_var(tile_at(unit_of(j, bx), rank))
                base = T.meta_var(j * k_tiles)
                for i in T.unroll(n_acc):
                    acc[i] = T.float32(0)
                for g in T.unroll(2):
                    ss[g] = T.float32(0)
                wait(full, base)
                operand(smem, A, ss, xv, gv, 0, 0, base % stages, cw, w, lane)
                # two tiles an iteration: the register set is a constant in each
                for pair in T.serial((k_tiles + 1) // 2):
                    for half in T.unroll(2):
                        if pair * 2 + half < k_tiles:
                            step(smem, full, empty, acc, A, ss, xv, gv, half, pair * 2 + half, base, cw, w, lane, rank)
                T.ptx.wgmma.wait_group.sync.aligned(0)
                fence_accumulators(acc, 0)
                # (the producer fills the stages with the next tile's k tiles during the epilogue)
                release(empty, (base + k_tiles - 1) % stages, rank)
                for g in T.unroll(2):
                    ss[g] = ss[g] + T.cuda.__shfl_xor_sync(T.uint32(ALL_LANES), ss[g], 1, 32)
                    ss[g] = ss[g] + T.cuda.__shfl_xor_sync(T.uint32(ALL_LANES), ss[g], 2, 32)
                    ss[g] = T.float32(1) / T.sqrt(ss[g] / T.float32(k) + T.float32(eps))
                # accumulator 4 j + 2 g + e: row 16 w + lane / 4 + 8 g, column 8 j + 2 (lane % 4) + e;
                # stored four columns at a time (:mod:`~tvm_cascade.cuda.accumulator_stores`)
                for p in T.unroll(cols // 16):
                    for g in T.unroll(2):
                        row = T.meta_var(r0 + 64 * cw + 16 * w + lane // 4 + 8 * g)
                        col = T.meta_var(c0 + 16 * p + first_column(lane))
                        trade_halves(four, lane, lambda e: acc[8 * p + 2 * g + e] * ss[g], lambda e: acc[8 * p + 4 + 2 * g + e] * ss[g])
                        store_four(out, ov, four, row, col, m, n, part_n)

    @T.macro
    def produce(x_map, w_map, smem, full, empty, bx, rank):
        # In a cluster each block fetches its own X tile and half of the W tile, the
        # latter into both blocks (each block's `full` awaits the whole W tile's bytes).
        for j in T.serial(rounds):
            if unit_of(j, bx) < units:
                r0, c0 = T.meta_var(tile_at(unit_of(j, bx), rank))
                for t in T.serial(k_tiles):
                    # the ring's k tile j * k_tiles + t
                    st = T.meta_var((j * k_tiles + t) % stages)
                    T.cuda.mbarrier_wait(empty.ptr_to([st]), (((j * k_tiles + t) // stages) & 1) ^ 1)
                    T.ptx.mbarrier.arrive.expect_tx.shared.b64(full.ptr_to([st]), T.uint32((x_tile + w_tile) * 2))
                    T.ptx[_TMA](smem.ptr_to([st * x_tile]), T.address_of(x_map), T.int32(t * DEPTH), r0, full.ptr_to([st]))
                    if kn:
                        for p in T.unroll(panels):
                            if cluster == 1 or p % cluster == rank:
                                T.ptx[_TMA + multicast](
                                    smem.ptr_to([w_base + st * w_tile + p * DEPTH * 64]), T.address_of(w_map),
                                    c0 + p * 64, T.int32(t * DEPTH), full.ptr_to([st]), *mask,
                                )
                    elif cluster == 1:
                        T.ptx[_TMA](
                            smem.ptr_to([w_base + st * w_tile]), T.address_of(w_map), T.int32(t * DEPTH), c0,
                            full.ptr_to([st]),
                        )
                    else:
                        # rows of W ([n, k]) in halves, each block's at its place in the tile
                        T.ptx[_TMA + multicast](
                            smem.ptr_to([w_base + st * w_tile + rank * (cols // cluster) * DEPTH]),
                            T.address_of(w_map), T.int32(t * DEPTH), c0 + rank * (cols // cluster),
                            full.ptr_to([st]), *mask,
                        )

    init_barriers = stage_barriers(stages)

    @T.macro
    def block(x_map, w_map, bx, tx, rank):
        # __launch_bounds__(384, 1): ptxas must know the registers at entry to honour setmaxnreg
        T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", 1)
        smem = T.alloc_buffer((smem_elements,), dtype, scope="shared.dyn", align=1024)
        full = T.alloc_shared((stages,), "uint64")
        empty = T.alloc_shared((stages,), "uint64")
        warpgroup = T.cuda.__shfl_sync(T.uint32(ALL_LANES), tx // 128, 0, 32)
        if gamma_shared:
            # γ in 16-byte pieces, zeros past k (k is a multiple of 8)
            for i in T.serial(-(-k_tiles * DEPTH // 8 // THREADS)):
                piece = T.meta_var(i * THREADS + tx)
                if piece < k_tiles * DEPTH // 8:
                    if piece < k // 8:
                        smem.vstore([g_base + piece * 8], gamma.vload([piece * 8], f"{dtype}x8"))
                    else:
                        smem.vstore([g_base + piece * 8], T.Broadcast(T.Cast(dtype, 0), 8))
        # every consumer thread of the cluster releases every stage
        init_barriers(full, empty, tx, 256 * cluster)
        if cluster > 1:
            # The peer's multicasts and arrivals need this block's barriers initialised.
            T.ptx.barrier.cluster.arrive()
            T.ptx.barrier.cluster.wait()
        if warpgroup == 0:
            T.ptx.setmaxnreg.dec.sync.aligned.u32(config.producer_registers)
            if tx == 0:
                produce(x_map, w_map, smem, full, empty, bx, rank)
        else:
            T.ptx.setmaxnreg.inc.sync.aligned.u32(config.consumer_registers)
            consume(smem, full, empty, bx, tx, warpgroup - 1, rank)
        if cluster > 1:
            # No block leaves while its peer may still fill its stages or arrive on its barriers.
            T.ptx.barrier.cluster.arrive()
            T.ptx.barrier.cluster.wait()

    if kn:
        w_dims, w_box = (n, k, n * 2), (64, DEPTH)
    else:
        w_dims, w_box = (k, n, k * 2), (DEPTH, cols // cluster)
    maps = ((X, k, m, k * 2, DEPTH, ROWS, 1, 1, dtype), (W, *w_dims, *w_box, 1, 1, dtype))
    return tma_kernel([X, gamma, W, out], maps, blocks, THREADS, block, cluster)


def stage_barriers(stages):
    """The macro ``init(full, empty, tx, consumers)``: thread 0 initialises the
    ``stages`` stages' mbarriers (``full`` awaited by the producer's one arrival and its
    TMA bytes, ``empty`` by an arrival of each of ``consumers`` threads: an int, or an
    expression), then the block meets, at a barrier TVM's sync planner knows: it orders
    the shared memory written before it too (the planner would insert a barrier of its
    own, which it cannot where the kernel is a branch of a function)."""

    @T.macro
    def init(full, empty, tx, consumers):
        if tx == 0:
            for s in T.unroll(stages):
                T.ptx.mbarrier.init.shared.b64(full.ptr_to([s]), T.uint32(1))
                T.ptx.mbarrier.init.shared.b64(
                    empty.ptr_to([s]), T.uint32(consumers) if isinstance(consumers, int) else T.Cast("uint32", consumers))
            T.ptx.fence.mbarrier_init.release.cluster()
        T.tvm_storage_sync("shared")

    return init


#: Blocks an SM that :func:`split_count` aims at by default, the fp8 kernel for few
#: tokens' (first measured on the RMSNorm + GEMM kernel for 16 rows, H200, 4 stages, ms:
#: 4096 x 14336 1 split 0.050, 2 0.036, 4 0.040; 4096 x 4096 2 0.026, 4 0.018; 14336 x
#: 4096 4 0.046, 6 (6 stages) 0.040; that kernel now aims at more:
#: :data:`.rmsnorm_gemm_skinny.BLOCKS_PER_SM`).
BLOCKS_PER_SM = 3
#: The fewest k tiles a split (the shortest splits measured had 11).
MIN_SPLIT_TILES = 4
#: Threads a block of :func:`split_sum`'s kernel: a row's columns.
SPLIT_SUM_THREADS = 256


def split_count(out_tiles, k_tiles, sms=None, per_sm=BLOCKS_PER_SM):
    """How many blocks share each of ``out_tiles`` output tiles' ``k_tiles`` k tiles, a
    split each (``split_k_update``'s chunks): blocks for about ``per_sm`` to
    each of ``sms`` SMs (the GPU's, by default), each split at least
    :data:`MIN_SPLIT_TILES` k tiles and none empty."""
    sms = sms or sm_count(tvm.cuda(0))
    splits = max(1, min(round(per_sm * sms / out_tiles), k_tiles // MIN_SPLIT_TILES))
    while _leaves_a_split_empty(splits, k_tiles):
        splits -= 1
    return splits


def _leaves_a_split_empty(splits, k_tiles):
    # splits of -(-k_tiles // splits) tiles each, the last taking what is left
    return (splits - 1) * -(-k_tiles // splits) >= k_tiles


def split_refusal(splits, k, depth):
    """Why ``splits`` blocks cannot share K's k tiles of ``depth`` (each split needs a
    tile), or None."""
    k_tiles = -(-k // depth)
    if splits < 1 or _leaves_a_split_empty(splits, k_tiles):
        return f"{splits} splits of K = {k}'s {k_tiles} tiles of {depth}: each split needs a tile"
    return None


def split_of_block(bx, t_tiles, n_tiles, splits, k_tiles):
    """Block ``bx``'s output tile along N (row tiles fastest, then N's tiles, then the
    splits), its split, and the split's first k tile and count: ``splits``' share of
    ``k_tiles`` each, the last taking what is left."""
    if splits == 1:
        return bx // t_tiles, 0, 0, k_tiles
    s = bx // (t_tiles * n_tiles)
    first = s * -(-k_tiles // splits)
    return bx // t_tiles % n_tiles, s, first, T.min(-(-k_tiles // splits), k_tiles - first)


def split_sum(parts, out, factor=None):
    """The statement of a kernel that adds ``parts[splits, m, n]`` (float32, a split's
    share of every output each) into ``out[m, n]``, times ``factor(row)`` where given:
    a block for each row and :data:`SPLIT_SUM_THREADS` columns."""
    splits, m, n = int(parts.shape[0]), parts.shape[1], int(parts.shape[2])
    chunks = -(-n // SPLIT_SUM_THREADS)

    def finished(row, col):
        total = sum(parts[p, row, col] for p in range(splits))
        return total if factor is None else total * factor(row)

    @T.prim_func(private=True, check_well_formed=False)
    def adds():
        with T.launch_thread("blockIdx.x", m * chunks) as b:
            tx = T.launch_thread("threadIdx.x", SPLIT_SUM_THREADS)
            col = T.meta_var(b % chunks * SPLIT_SUM_THREADS + tx)
            if col < n:
                out[b // chunks, col] = T.Cast(out.dtype, finished(b // chunks, col))

    return adds.body


def tma_kernel(params, maps, blocks, threads, block, cluster=None):
    """The PrimFunc ``main`` over ``params`` that encodes two 2-d TMA maps with 128-byte
    swizzled boxes (``maps``: each the tensor, then ``tensormap_encode_tiled``'s extents,
    row stride, box and element strides, the contiguous axis first, then the element
    dtype) and runs the macro ``block(x_map, w_map, bx, tx)`` in ``blocks`` blocks of
    ``threads`` threads; given ``cluster``, ``block(x_map, w_map, bx, tx, rank)`` in
    clusters of that many blocks (``rank`` the block's in its cluster, 0 without)."""
    (x, *x_args, x_dtype), (w, *w_args, w_dtype) = maps

    @T.prim_func(private=True, check_well_formed=False)
    def main():
        x_map = T.tvm_stack_alloca("tensormap", 1)
        w_map = T.tvm_stack_alloca("tensormap", 1)
        T.evaluate(T.tensormap_encode_tiled(x_map, x.data, *x_args, descriptor_dtype=x_dtype, rank=2, swizzle=3))
        T.evaluate(T.tensormap_encode_tiled(w_map, w.data, *w_args, descriptor_dtype=w_dtype, rank=2, swizzle=3))
        bx = T.launch_thread("blockIdx.x", blocks)
        if cluster is not None and cluster > 1:
            rank = T.launch_thread("clusterCtaIdx.x", cluster)
            tx = T.launch_thread("threadIdx.x", threads)
            block(x_map, w_map, bx, tx, rank)
        elif cluster is not None:
            tx = T.launch_thread("threadIdx.x", threads)
            block(x_map, w_map, bx, tx, 0)
        else:
            tx = T.launch_thread("threadIdx.x", threads)
            block(x_map, w_map, bx, tx)

    return tvm.tirx.PrimFunc(params, main.body).with_attr("global_symbol", "main")
