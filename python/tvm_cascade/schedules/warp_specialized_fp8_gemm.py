"""Per-token fp8 quantisation + GEMM as one warp-specialised Hopper kernel (sm_90a):
``out[i, n] = w_scale[n] · Σ_k q[i, k]·W[n, k] / s_i`` where W is already fp8 (e4m3, one
scale per output channel) and X's rows are quantised to e4m3 on their way into the
tensor cores, ``q[i, k] = e4m3(X[i, k]·s_i)``, ``s_i = 448 / max_k |X[i, k]|``.

Two kernels are how this is usually run (a quantisation pass over X, then an fp8 GEMM
such as ``torch._scaled_mm``): the GEMM cannot start a row before that row's abs-max is
known. This kernel reads X once: it keeps each row's *running* abs-max over the k tiles
seen so far, quantises each tile with the scale of that running max, and when the max
grows multiplies the row's accumulators by the repair that
:meth:`~tvm.s_tir.Schedule.rolling_update` derives and proves for ``ops.absmax_quant_gemm``
(``max(eps, m_old) / max(eps, m_new)``, :func:`derived_repair`). Tiles quantised before
the row reached its max use a finer scale than the two-pass form would; the result is
:func:`~tvm_cascade.ops.reference.fp8_quant_gemm_ref` with ``tile=DEPTH``: the two-pass
quantisation is the case of one tile. ``ops.fp8_quant_gemm`` is that definition in TIR.

A thread block owns :data:`ROWS` rows and ``cols`` columns of the output:

* warpgroup 0, the producer: one thread issues the TMA copies of each k tile, X's
  ``ROWS x DEPTH`` fp16 tile (two 128-byte swizzled boxes) and W's ``cols x DEPTH``
  bytes (one box, K-major), into ``stages`` stages. Boxes past X's rows or W's rows read
  zeros: any M (a variable included) and N serve.
* warpgroups 1 and 2, the consumers, 64 rows each: every thread loads its elements of
  the tile in the register layout of wgmma's 8-bit A operand (rows ``lane / 4`` and
  ``+ 8`` of its warp's 16, four consecutive k at ``4 (lane % 4)`` and ``+ 16``), takes
  its rows' abs-max over them in 16-bit pairs (a quad shuffle completes the row),
  converts them to e4m3 with the new scale, and issues ``wgmma`` m64n{cols}k32 e4m3
  with W from shared memory into a tile's accumulators. The next tile's operand is
  prepared while those instructions run; then each row's running accumulators are
  repaired and the tile's added, in float32 (Hopper's fp8 tensor cores add with fewer
  bits than float32: accumulated there over all of K, outputs drifted by ~0.3% of the
  largest from the definition; added per tile, they agree to the output's rounding).
  The epilogue scales each row by ``max(eps, m) / 448`` and each column by ``w_scale``
  and stores four columns a thread at a time.
  A consumer whose 64 rows all lie past M does nothing.

Two sets of accumulators a thread bound a block to 128 columns. The kernel is bound by
the consumers' per-element work (load, abs-max, scale, convert: repeated for every
column block) and by X's 16-bit tiles, read from L2 once per column block: it loses to
the two-kernel path from 64 tokens on (H200, ``python -m benchmarks.fp8_gemm``,
RESULTS.md). For few tokens :func:`skinny_kernel` computes the same with the tokens as
the wgmma's N and wins (1.15-1.21x at 1 to 16 tokens); :func:`kernel_for` chooses. The
definition with one k tile (the usual two-pass quantisation) runs as two kernels
(:mod:`.fp8_two_pass`), the ``"two_pass"`` form.

Reached as a schedule of ``ops.fp8_quant_gemm`` (the definition, with this kernel's k
tile): :func:`schedule` annotates the kernel's form and choices on its GEMM block, which
:func:`build` lowers, as :mod:`.warp_specialized_gemm` does for RMSNorm + GEMM;
MetaSchedule's :class:`~tvm_cascade.meta_schedule.CascadeFusion` proposes the same
schedules with the choices sampled.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass
from typing import Optional, Tuple

import sympy
import tvm
import tvm_ffi
from tvm.script import tirx as T

from ..algebra.convert import to_tir
from ..analysis.scope import buffer_params
from ..cuda import ALL_LANES, dependent_launch, sm_count
from ..cuda.accumulator_stores import first_column, store_four, trade_halves
from ..cuda.wgmma import descriptor
from ..cuda.wgmma_batches import register_fence
from ..errors import FusionError
from ..ops import cascades
from ..primitives import ir
from ..primitives.fusion import derive
from ..primitives.rolling_update import chain_of
from .warp_specialized import PTX_TYPE, SHARED_BYTES, THREADS, TMA_COPY, serves_target
from .warp_specialized_gemm import (
    BLOCKS_PER_SM, build_function, split_count, split_of_block, split_refusal, split_sum, stage_barriers, tma_kernel,
)

#: Rows of the output per thread block (two consumer warpgroups of 64).
ROWS = 128
#: k per tile: one 128-byte swizzled row of W's bytes, two of X's 16-bit floats.
DEPTH = 128
#: The largest finite e4m3 value: a row's abs-max maps to it.
FP8_MAX = 448.0
#: The floor of a row's abs-max (an all-zero row, or a row past M, scales by 448 / EPS).
EPS = 1e-12
_TMA = TMA_COPY.format(2)
_QUANTISE = "tvm_cascade_e4m3x4"
# Four floats to four e4m3 bytes, the first in the lowest byte (cvt's first source goes
# to the upper half of its pair).
_QUANTISE_SOURCE = f"""
__forceinline__ __device__ unsigned {_QUANTISE}(float a, float b, float c, float d) {{
  unsigned r;
  asm("{{.reg .b16 lo, hi;\\n"
      "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\\n"
      "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\\n"
      "mov.b32 %0, {{lo, hi}};}}"
      : "=r"(r) : "f"(a), "f"(b), "f"(c), "f"(d));
  return r;
}}
"""
# The larger magnitude of two 16-bit pairs, pairwise (its sign is of no use here), and
# the larger magnitude of a pair's two as a float.
_ABS_MAX = "tvm_cascade_abs_max2_{}"
_ABS_MAX_SOURCE = """
__forceinline__ __device__ unsigned {name}(unsigned a, unsigned b) {{
  unsigned r;
  asm("max.xorsign.abs.{ptx}x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}}
"""
# A 2-d TMA box (at element {c0, c1} of the tensor map's tensor) asked for in L2.
_PREFETCH = "tvm_cascade_prefetch_box_2d"
_PREFETCH_SOURCE = f"""
__forceinline__ __device__ void {_PREFETCH}(unsigned long long map, int c0, int c1) {{
  asm volatile("cp.async.bulk.prefetch.tensor.2d.L2.global.tile [%0, {{%1, %2}}];"
               :: "l"(map), "r"(c0), "r"(c1) : "memory");
}}
"""
_PAIR_MAX = "tvm_cascade_pair_max_{}"
_PAIR_MAX_SOURCE = """
__forceinline__ __device__ float {name}(unsigned a) {{
  float r;
  asm("{{.reg .b16 lo, hi;\\n"
      ".reg .f32 l, h;\\n"
      "mov.b32 {{lo, hi}}, %1;\\n"
      "cvt.f32.{ptx} l, lo;\\n"
      "cvt.f32.{ptx} h, hi;\\n"
      "abs.f32 l, l;\\n"
      "abs.f32 h, h;\\n"
      "max.f32 %0, l, h;}}" : "=f"(r) : "r"(a));
  return r;
}}
"""


@dataclass(frozen=True)
class Fp8GemmConfig:
    """Choices of :func:`kernel`. A consumer thread holds two sets of accumulators (the
    running ones and a tile's), which bounds the columns to 128; four stages of 128 rows
    of X (fp16) and ``cols`` rows of W (e4m3), 128 deep, take 192 KB."""

    cols: int = 128  # output columns per block: the wgmma's N (64 or 128)
    stages: int = 4  # k tiles in shared memory
    group: int = 16  # row tiles taken together (L2 reuse)
    # (240 x 256 + 24 x 128 registers fill the register file; ptxas spills at 232)
    producer_registers: int = 24
    consumer_registers: int = 240
    # Blocks that share each W tile (the two-pass form's GEMM: :mod:`.fp8_two_pass`): with
    # 2, a cluster takes two row tiles of one column tile, each block fetching half the
    # W tile into both by TMA multicast.
    cluster: int = 1

    def shared_bytes(self, x_bytes: int = 2) -> int:
        """The dynamic shared memory of the kernel's stages: each stage's X tile (of
        ``x_bytes`` an element: 16-bit X, or 1 for X quantised beforehand) and W tile."""
        return self.stages * (x_bytes * ROWS + self.cols) * DEPTH


_OLD, _NEW = sympy.symbols("m_old m_new", real=True)


@functools.lru_cache(maxsize=None)
def derived_repair():
    """The factor :meth:`~tvm.s_tir.Schedule.rolling_update` derives and proves for
    ``ops.absmax_quant_gemm``'s GEMM over k tiles when the running abs-max moves from
    ``m_old`` to ``m_new``, as a SymPy expression of the symbols ``m_old`` and ``m_new``
    (``max(eps, m_old) / max(eps, m_new)``). The algebra does not depend on the shapes,
    so a small instance serves."""
    sch = tvm.s_tir.Schedule(cascades.absmax_quant_gemm(1, 1, 2 * DEPTH, FP8_MAX, "float16", eps=EPS))
    k_tiles, _ = sch.split(sch.get_loops(sch.get_sblock("absmax"))[-1], [None, DEPTH])
    fusion = derive(chain_of(sch, sch.get_sblock("gemm"), k_tiles)[2])
    factor, old, new = fusion.single_factor("the fp8 GEMM repairs its accumulators by one factor of the running abs-max")
    return factor.subs({old: _OLD, new: _NEW}, simultaneous=True)


def repair_factor(m_old, m_new):
    """:func:`derived_repair` as float32 TIR of the running abs-max before and after."""
    return to_tir(derived_repair(), {_OLD: m_old, _NEW: m_new}, "float32")


def _magnitude_helpers(dtype):
    """The names and CUDA sources of the pairwise magnitude maximum and of a pair's
    largest magnitude as a float, for 16-bit ``dtype``: ``(abs_max, its source,
    pair_max, its source)``."""
    ptx = PTX_TYPE[dtype]
    abs_max, pair_max = _ABS_MAX.format(ptx), _PAIR_MAX.format(ptx)
    return (
        abs_max, _ABS_MAX_SOURCE.format(name=abs_max, ptx=ptx), pair_max, _PAIR_MAX_SOURCE.format(name=pair_max, ptx=ptx)
    )


def _k_major(smem, at, ks):
    """The wgmma descriptor of the e4m3 tile at 16-bit element ``at`` of ``smem``: rows of
    DEPTH bytes, 128-byte swizzled, read K-major; step ``ks`` is 32 bytes into the row."""
    return descriptor(smem.ptr_to([at + ks * 16]), 16, 1024, swizzle=True)


def unsupported(n, k, dtype, out_dtype, config=Fp8GemmConfig(), x_bytes=2):
    """Why the kernel cannot serve this GEMM (M is free), or None; ``x_bytes``: of an
    element of X's tiles in shared memory (:meth:`Fp8GemmConfig.shared_bytes`)."""
    if dtype not in PTX_TYPE:
        return f"the fp8 GEMM quantises float16 or bfloat16 rows, not {dtype}"
    if out_dtype not in ("float16", "bfloat16", "float32"):
        return f"the fp8 GEMM stores float16, bfloat16 or float32, not {out_dtype}"
    if k % 16:
        return f"TMA needs rows of a multiple of 16 bytes: W's rows hold K = {k} bytes"
    if config.cols not in (64, 128):
        return f"{config.cols} columns a block: 64 or 128 (two sets of accumulators a thread)"
    if config.shared_bytes(x_bytes) > SHARED_BYTES:
        return (f"{config.stages} stages of {config.cols} columns need {config.shared_bytes(x_bytes)} bytes of "
                f"shared memory")
    return None


def _params(m, n, k, dtype, out_dtype):
    """The kernels' parameters ``X[m, k]``, ``W[n, k]``, ``w_scale[n]``, ``out[m, n]``."""
    return [
        tvm.tirx.decl_buffer((m, k), dtype, "X"),
        tvm.tirx.decl_buffer((n, k), "float8_e4m3fn", "W"),
        tvm.tirx.decl_buffer((n,), "float32", "w_scale"),
        tvm.tirx.decl_buffer((m, n), out_dtype, "out"),
    ]


def _producer(k_tiles, stages, box, x_at, w_at, expect, x_boxes=2, w_rows=None):
    """The producer thread's macro ``produce(x_map, w_map, smem, full, empty, r0, c0,
    first=0, count=k_tiles, rank=0)``: each of ``count`` k tiles from tile ``first``, its
    ``x_boxes`` X boxes (from row ``r0``: two of 16-bit X, one of e4m3) and W box (from
    row ``c0``) into stage ``st``'s places in ``smem``, ``x_at(st)`` and ``w_at(st)``
    (16-bit elements), ``expect`` bytes a stage. With ``w_rows`` (a cluster of two
    blocks over one column tile), block ``rank`` fetches W's rows ``c0 + rank * w_rows``
    onwards (a box of ``w_rows`` rows) into both blocks (TMA multicast)."""
    multicast = w_rows is not None

    @T.macro
    def produce(x_map, w_map, smem, full, empty, r0, c0, first=0, count=k_tiles, rank=0):
        for t in T.serial(count):
            st = T.meta_var(t % stages)
            kt = T.meta_var(first + t)
            T.cuda.mbarrier_wait(empty.ptr_to([st]), ((t // stages) & 1) ^ 1)
            T.ptx.mbarrier.arrive.expect_tx.shared.b64(full.ptr_to([st]), T.uint32(expect))
            for h in T.unroll(x_boxes):
                T.ptx[_TMA](
                    smem.ptr_to([x_at(st) + h * box]), T.address_of(x_map), T.int32(kt * DEPTH + h * DEPTH // x_boxes),
                    T.Cast("int32", r0), full.ptr_to([st]),
                )
            if multicast:
                # (a row of W is DEPTH bytes: half a 16-bit element's row of the stage)
                T.ptx[_TMA + ".multicast::cluster"](
                    smem.ptr_to([w_at(st) + rank * w_rows * DEPTH // 2]), T.address_of(w_map), T.int32(kt * DEPTH),
                    T.Cast("int32", c0 + rank * w_rows), full.ptr_to([st]), T.uint16(0b11),
                )
            else:
                T.ptx[_TMA](
                    smem.ptr_to([w_at(st)]), T.address_of(w_map), T.int32(kt * DEPTH), T.Cast("int32", c0), full.ptr_to([st])
                )

    return produce


def tiled_block(m, n_tiles, config, elements, dtype, produce, consume, prefetch=0):
    """The macro ``block(x_map, w_map, bx, tx)`` of a kernel of :data:`ROWS` x
    ``config.cols`` output tiles: block ``bx``'s tile (groups of ``config.group`` row
    tiles, rows fastest within a group), its ``config.stages`` stages' ``full`` and
    ``empty`` barriers and ``elements`` of shared memory (of ``dtype``), the producer
    thread's ``produce(x_map, w_map, smem, full, empty, r0, c0)`` and the consumer
    warpgroups' ``consume(smem, full, empty, r0, c0, tx, cw)`` (a consumer whose 64 rows
    all lie past ``m`` does nothing: a few tokens' tile).

    ``prefetch``: a kernel launched as a programmatic dependent of the one that writes
    X first asks for the W boxes of its first ``prefetch`` k tiles in L2, then waits
    for that kernel (its own ``griddepcontrol.wait``: :mod:`..cuda.dependent_launch`),
    so W streams in while that kernel ends. (An L2 prefetch reads what any writer left:
    L2 is where the GPU's memory is coherent.)

    With ``config.cluster`` 2 the blocks go in clusters of two over two row tiles of one
    column tile (block ``rank`` the row tile ``2 u + rank`` of unit ``u = bx // 2``):
    ``block(x_map, w_map, bx, tx, rank)`` passes ``rank`` on to ``produce`` and
    ``consume`` (which share the W tile: :func:`_producer`'s ``w_rows``), each stage's
    ``empty`` awaits both blocks' consumers, and the blocks meet at cluster barriers
    after initialisation and before leaving."""
    stages, group, cols, cluster = config.stages, config.group, config.cols, config.cluster
    m_tiles = (m + ROWS - 1) // ROWS
    spans = (m_tiles + cluster - 1) // cluster if cluster > 1 else m_tiles
    span_group = max(group // cluster, 1)
    init_barriers = stage_barriers(stages)

    def consumers_of(r0):
        """The consumer warpgroups of the tile from row ``r0``: the second only where
        its 64 rows reach into ``m``."""
        return T.if_then_else(r0 + 64 < m, 2, 1)

    @T.macro
    def block(x_map, w_map, bx, tx, rank=0):
        # __launch_bounds__(384, 1): ptxas must know the registers at entry to honour setmaxnreg
        T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", 1)
        smem = T.alloc_buffer((elements,), dtype, scope="shared.dyn", align=1024)
        full = T.alloc_shared((stages,), "uint64")
        empty = T.alloc_shared((stages,), "uint64")
        unit = T.meta_var(bx // cluster if cluster > 1 else bx)
        first = unit // (span_group * n_tiles) * span_group
        rows_here = T.min(spans - first, span_group)
        within = unit % (span_group * n_tiles)
        r0 = ((first + within % rows_here) * cluster + rank) * ROWS if cluster > 1 else (first + within % rows_here) * ROWS
        c0 = within // rows_here * cols
        if prefetch > 0:
            if tx == 0:
                for t in T.unroll(prefetch):
                    # (in a cluster, the W rows this block fetches: its map's box is theirs)
                    T.evaluate(T.cuda.func_call(_PREFETCH, T.address_of(w_map), t * DEPTH,
                                                c0 + rank * (cols // cluster) if cluster > 1 else c0,
                                                source_code=_PREFETCH_SOURCE, return_type="void"))
            T.evaluate(dependent_launch.wait())
        warpgroup = T.cuda.__shfl_sync(T.uint32(ALL_LANES), tx // 128, 0, 32)
        consumers = T.meta_var(consumers_of(r0))
        if cluster > 1:
            # every consumer thread of the cluster releases every stage
            init_barriers(full, empty, tx, 128 * (consumers + consumers_of(r0 + (1 - 2 * rank) * ROWS)))
            # The peer's multicasts and arrivals need this block's barriers initialised.
            T.ptx.barrier.cluster.arrive()
            T.ptx.barrier.cluster.wait()
        else:
            init_barriers(full, empty, tx, 128 * consumers)
        if warpgroup == 0:
            T.ptx.setmaxnreg.dec.sync.aligned.u32(config.producer_registers)
            if tx == 0:
                if cluster > 1:
                    produce(x_map, w_map, smem, full, empty, r0, c0, rank=rank)
                else:
                    produce(x_map, w_map, smem, full, empty, r0, c0)
        else:
            T.ptx.setmaxnreg.inc.sync.aligned.u32(config.consumer_registers)
            if warpgroup <= consumers:
                if cluster > 1:
                    consume(smem, full, empty, r0, c0, tx, warpgroup - 1, rank)
                else:
                    consume(smem, full, empty, r0, c0, tx, warpgroup - 1)
        if cluster > 1:
            # No block leaves while its peer may still fill its stages or arrive on its barriers.
            T.ptx.barrier.cluster.arrive()
            T.ptx.barrier.cluster.wait()

    return block


def tile_store(out, w_scale, m, n, cols):
    """The consumers' macro ``store_tile(acc, scale, r0, c0, cw, w, lane)``: a warp's
    accumulators ``acc`` of the output tile at ``(r0, c0)`` (consumer ``cw``, warp
    ``w``), row ``g`` of a lane's two scaled by ``scale[g]`` and each column by its
    ``w_scale``, stored four columns at a time (:mod:`~tvm_cascade.cuda.accumulator_stores`)."""
    part_n = n % cols != 0

    @T.macro
    def store_tile(acc, scale, r0, c0, cw, w, lane):
        sv = T.alloc_local((4,), "float32")
        four = T.alloc_local((4,), "float32")
        ov = T.alloc_local((4,), out.dtype)
        # sv holds the weight scales of this lane's two columns of groups 2p and 2p + 1
        for p in T.unroll(cols // 16):
            for half in T.unroll(2):
                at = T.meta_var(c0 + 8 * (2 * p + half) + 2 * (lane % 4))
                if part_n:
                    for e in T.unroll(2):
                        sv[2 * half + e] = w_scale[T.min(at + e, n - 1)]
                else:
                    sv.vstore([2 * half], w_scale.vload([at], "float32x2"))
            col = T.meta_var(c0 + 16 * p + first_column(lane))
            for g in T.unroll(2):
                row = T.meta_var(r0 + 64 * cw + 16 * w + lane // 4 + 8 * g)
                trade_halves(four, lane, lambda e: acc[8 * p + 2 * g + e] * scale[g] * sv[e],
                             lambda e: acc[8 * p + 4 + 2 * g + e] * scale[g] * sv[2 + e])
                store_four(out, ov, four, row, col, m, n, part_n)

    return store_tile


#: Annotations of ``ops.fp8_quant_gemm``'s GEMM block that ask :func:`build` for a kernel:
#: its form (:data:`FORMS`) and that form's choices, one a key (``CHOICES.0``, ``CHOICES.1``,
#: ...: a trace's dead-code elimination keeps a sampled value only where an instruction
#: takes it itself, not inside a list), ``[cols, stages, group]``
#: (:class:`Fp8GemmConfig`) for "tiles" and "two_pass" (one k tile: X quantised by a
#: kernel of its own first, :mod:`.fp8_two_pass`; a fourth, the cluster size, where not 1), ``[tokens, stages, consumers]`` for "skinny"
#: (records of ``[tokens, stages]`` mean one consumer warpgroup, as before the choice), and for
#: "by_tokens" (a variable token count) the skinny kernels' tokens a block, ascending,
#: each taking the counts up to it at run time, the 128-row kernel the rest
#: (:func:`by_tokens`). On the block, not a loop: MetaSchedule's postprocessors bind and
#: split the loops of a sample's unscheduled blocks.
FORM = "tvm_cascade.fp8_gemm_form"
CHOICES = "tvm_cascade.fp8_gemm_choices"
FORMS = ("tiles", "skinny", "by_tokens", "two_pass")
#: The choices a design space samples (:class:`~tvm_cascade.meta_schedule.CascadeFusion`).
COLS_CHOICES = (64, 128)
GROUP_CHOICES = (8, 16)


@dataclass(frozen=True)
class Fp8QuantGemm:
    """An ``ops.fp8_quant_gemm`` function's arguments (``m`` an int or its variable; its
    k tile :data:`DEPTH`, that of the one-kernel forms, or ``k``: one tile, the two-pass
    quantisation)."""

    m: object
    n: int
    k: int
    dtype: str
    out_dtype: str
    tile: int = DEPTH

    def function(self) -> tvm.tirx.PrimFunc:
        return cascades.fp8_quant_gemm(self.m, self.n, self.k, self.tile, self.dtype, self.out_dtype, FP8_MAX, EPS)

    def one_tile(self) -> bool:
        """Whether each row is quantised by its abs-max over all of k."""
        return self.tile >= self.k


def fp8_quant_gemm_of(func) -> Optional[Fp8QuantGemm]:
    """The arguments of the ``ops.fp8_quant_gemm`` (k tile :data:`DEPTH` or K, 448 and
    :data:`EPS`) that ``func`` is, or None: ``func`` is compared, structurally, with that
    function rebuilt from its parameters."""
    params = _problem_of_params(func)
    if params is None:
        return None
    for tile in dict.fromkeys((DEPTH, params.k)):
        problem = dataclasses.replace(params, tile=tile)
        try:
            expected = problem.function()
        except (ValueError, tvm.TVMError):
            continue
        if tvm_ffi.structural_equal(func, expected, map_free_vars=True):
            return problem
    return None


def default_choices(problem: Fp8QuantGemm):
    """The form and choices :func:`kernel_for` takes for ``problem``."""
    m = problem.m
    if problem.one_tile() and problem.k > DEPTH:
        return "two_pass", config_choices("two_pass")
    if not isinstance(m, int):
        return "by_tokens", list(RUN_TIME_TOKENS)
    if m <= SKINNY_TOKENS:
        return "skinny", [16 if m <= 16 else 32, 4, SKINNY_CONSUMERS]
    return "tiles", config_choices("tiles")


def config_choices(form: str) -> list:
    """The default choices ``[cols, stages, group]`` of the ``"tiles"`` form
    (:class:`Fp8GemmConfig`'s) or the ``"two_pass"`` form (:data:`TWO_PASS_CONFIG`'s)."""
    config = TWO_PASS_CONFIG if form == "two_pass" else Fp8GemmConfig()
    return [config.cols, config.stages, config.group]


def schedule(func, form: Optional[str] = None, choices=None) -> tvm.s_tir.Schedule:
    """The schedule of ``func``, an ``ops.fp8_quant_gemm``, that :func:`build` lowers to
    the kernel of ``form`` with ``choices`` (default: :func:`default_choices`):
    :func:`apply_schedule` on a new schedule. Raises :class:`FusionError` where ``func``
    is not such a function, ``ValueError`` where the kernel cannot serve it."""
    problem = fp8_quant_gemm_of(func)
    if problem is None:
        raise FusionError(
            "the fp8 GEMM kernels serve ops.fp8_quant_gemm functions (k tile 128, or one of K); this function is not one")
    if form is None:
        form, choices = default_choices(problem)
    reason = unsupported_choices(problem, form, choices)
    if reason is not None:
        raise ValueError(reason)
    sch = tvm.s_tir.Schedule(func)
    apply_schedule(sch, form, choices)
    return sch


def apply_schedule(sch, form, choices) -> None:
    """On ``sch``, a schedule of an ``ops.fp8_quant_gemm``: ``form`` and its ``choices``
    (ints, or values a design space sampled) annotated on the GEMM block, which
    :func:`build` reads."""
    gemm = sch.get_sblock("gemm")
    sch.annotate(gemm, FORM, form)
    for i, choice in enumerate(choices):
        sch.annotate(gemm, f"{CHOICES}.{i}", choice)


def chosen(annotations) -> Tuple[str, Tuple[int, ...]]:
    """The form and choices that :func:`apply_schedule` annotated."""
    count = next(i for i in itertools.count() if f"{CHOICES}.{i}" not in annotations)
    return str(annotations[FORM]), tuple(int(annotations[f"{CHOICES}.{i}"]) for i in range(count))


def lowers(mod) -> bool:
    """Whether a block of ``mod`` asks :func:`build` for a kernel."""
    return bool(ir.annotated_blocks(mod, FORM))


def unsupported_choices(problem, form, choices):
    if form == "two_pass":
        if not problem.one_tile():
            return (f"the two-pass form quantises each row by its abs-max over all of k: one k tile, "
                    f"not {problem.tile} of {problem.k}")
        from .fp8_two_pass import two_pass_unsupported  # (it builds on this module)

        return two_pass_unsupported(problem.n, problem.k, problem.dtype, problem.out_dtype, _two_pass_config(choices))
    if problem.tile != DEPTH and form in FORMS:
        return f"the one-kernel forms quantise k tiles of {DEPTH}, not {problem.tile}"
    if form == "tiles":
        cols, stages, group = (int(c) for c in choices)
        return unsupported(problem.n, problem.k, problem.dtype, problem.out_dtype, Fp8GemmConfig(cols, stages, group))
    if form == "skinny":
        if len(choices) not in (2, 3):
            return f"the skinny form's choices are [tokens, stages, consumers], not {list(choices)}"
        tokens, stages, consumers = _skinny_choices(choices)
        return skinny_unsupported(problem.n, problem.k, problem.dtype, problem.out_dtype, tokens, stages,
                                  consumers=consumers)
    if form == "by_tokens":
        tokens = [int(c) for c in choices]
        if not tokens or tokens != sorted(set(tokens)):
            return f"by_tokens takes the skinny kernels' tokens a block in ascending order, not {tokens}"
        reasons = [skinny_unsupported(problem.n, problem.k, problem.dtype, problem.out_dtype, t, 4,
                                      consumers=SKINNY_CONSUMERS) for t in tokens]
        return next((r for r in reasons if r is not None), unsupported(problem.n, problem.k, problem.dtype, problem.out_dtype))
    return f"the fp8 GEMM's forms are {FORMS}, not {form!r}"


def _kernel(problem, form, choices):
    if form == "two_pass":
        from .fp8_two_pass import two_pass_kernel  # (it builds on this module)

        return two_pass_kernel(problem.m, problem.n, problem.k, problem.dtype, problem.out_dtype,
                               _two_pass_config(choices))
    if form == "tiles":
        cols, stages, group = (int(c) for c in choices)
        return kernel(problem.m, problem.n, problem.k, problem.dtype, problem.out_dtype, Fp8GemmConfig(cols, stages, group))
    if form == "by_tokens":
        return by_tokens(problem.m, problem.n, problem.k, problem.dtype, problem.out_dtype, [int(c) for c in choices])
    tokens, stages, consumers = _skinny_choices(choices)
    return skinny_kernel(problem.m, problem.n, problem.k, problem.dtype, problem.out_dtype, tokens, stages,
                         consumers=consumers)


#: The producer warpgroup's registers in a cluster of two: its multicast copies need
#: more than 24 (ptxas spills 292 bytes at 24, none at 32); 240 x 256 + 32 x 128 fill
#: the register file.
CLUSTER_PRODUCER_REGISTERS = 32


def _two_pass_config(choices):
    """The two-pass form's config of its choices ``[cols, stages, group]``, and its
    cluster size where a fourth is given (else 1)."""
    cols, stages, group, *cluster = (int(c) for c in choices)
    if cluster and cluster[0] > 1:
        return Fp8GemmConfig(cols, stages, group, producer_registers=CLUSTER_PRODUCER_REGISTERS, cluster=cluster[0])
    return Fp8GemmConfig(cols, stages, group)


def _skinny_choices(choices):
    tokens, stages, *consumers = (int(c) for c in choices)
    return tokens, stages, consumers[0] if consumers else 1


def build(mod, target):
    """Compile for ``target`` (an H100 or H200: sm_90a is named for it) either one of
    :func:`kernel`, :func:`skinny_kernel`, :func:`by_tokens` or :func:`kernel_for`'s functions (a PrimFunc)
    as ``main``, or a module whose one function is a schedule of ``ops.fp8_quant_gemm``
    that :func:`apply_schedule` annotated (:func:`schedule`, or a sample of
    MetaSchedule's :class:`~tvm_cascade.meta_schedule.CascadeFusion` after the target's
    postprocessors), lowered to the kernel of its annotations under its name.
    ``ValueError`` where the function is not that or the kernel cannot serve it."""
    if not serves_target(target):
        raise ValueError(f"the fp8 GEMM needs sm_90a (wgmma, TMA, setmaxnreg); target is {target}")
    if isinstance(mod, tvm.tirx.PrimFunc):
        symbol, func = "main", mod
    else:
        sites = ir.annotated_blocks(mod, FORM)
        # (a decomposed reduction's init block keeps the GEMM block's annotations)
        notes = {chosen(b.annotations) for _, _, b in sites}
        if len(notes) != 1 or len(mod.functions_items()) != 1:
            raise ValueError(
                f"the fp8 GEMM builds a module of one function annotated once; "
                f"{len(mod.functions_items())} functions, {len(notes)} sets of annotations"
            )
        gvar, scheduled, block = sites[0]
        problem = _problem_of_params(scheduled, kernel_dtypes=True)
        if problem is None:
            raise ValueError(
                f"'{gvar.name_hint}': its parameters are not ops.fp8_quant_gemm's X[M, K] (16-bit), "
                f"W[N, K] (float8_e4m3fn), w_scale[N] (float32), out[M, N]"
            )
        form, choices = chosen(block.annotations)
        if form == "two_pass":  # (the form was chosen for the function's one k tile)
            problem = dataclasses.replace(problem, tile=problem.k)
        reason = unsupported_choices(problem, form, choices)
        if reason is not None:
            raise ValueError(reason)
        symbol = scheduled.attrs["global_symbol"] if "global_symbol" in scheduled.attrs else gvar.name_hint
        func = _kernel(problem, form, choices)
    return build_function(func, target, symbol)


def _problem_of_params(func, kernel_dtypes=False) -> Optional[Fp8QuantGemm]:
    """The problem of ``func``'s parameters, ``X[M, K]``, ``W[N, K]``, ``w_scale[N]``,
    ``out[M, N]`` with static N and K, or None; with ``kernel_dtypes``, also None unless X
    is 16-bit, W float8_e4m3fn and ``w_scale`` float32."""
    params = buffer_params(func)
    if len(params) != 4 or [len(p.shape) for p in params] != [2, 2, 1, 2]:
        return None
    x, w, w_scale, out = params
    (m, k), (n,) = x.shape, w_scale.shape
    analyzer = tvm.sym.Analyzer()
    same = lambda a, b: all(analyzer.can_prove_equal(p, q) for p, q in zip(a, b))  # noqa: E731
    if not (same(w.shape, (n, k)) and same(out.shape, (m, n))):
        return None
    if not (isinstance(k, tvm.tirx.IntImm) and isinstance(n, tvm.tirx.IntImm)):
        return None
    served = (str(x.dtype) in PTX_TYPE, str(w.dtype), str(w_scale.dtype)) == (True, "float8_e4m3fn", "float32")
    if kernel_dtypes and not served:
        return None
    m = int(m) if isinstance(m, tvm.tirx.IntImm) else m
    return Fp8QuantGemm(m, int(n), int(k), str(x.dtype), str(out.dtype))


#: The most tokens :func:`kernel_for` gives :func:`skinny_kernel`, 16 a block up to 16
#: (measured on an H200, N x K 14336 x 4096, ms: one warpgroup a block, 16 tokens a block
#: 0.0253 at M = 1, 0.0257 at 16, 0.0344 at 32; 32 a block 0.0293 at 16, 0.0301 at 32;
#: at 64 tokens 64 a block 0.041 with one warpgroup, 0.046 with two, :func:`kernel` 0.038-0.041).
SKINNY_TOKENS = 32
#: The consumer warpgroups a block of :func:`kernel_for`'s skinny kernels has (measured on
#: an H200, 1-32 tokens at N x K 14336 x 4096, 4096 x 14336 and 4096 x 4096, each with its
#: default splits: two 1.04-1.34x faster than one).
SKINNY_CONSUMERS = 2


#: The two-pass form's choices in :func:`kernel_for`, and the stages a design space
#: samples for it (its stages hold X in e4m3: more fit; six measured on an H200 at 64,
#: 256 and 2048 x 4096 x 14336: 0.0276, 0.0344, 0.2040 ms against four's 0.0281,
#: 0.0370, 0.2052).
TWO_PASS_CONFIG = Fp8GemmConfig(stages=6)
TWO_PASS_STAGE_CHOICES = (4, 6)


#: :func:`by_tokens`' skinny kernels for a variable token count in :func:`kernel_for`.
RUN_TIME_TOKENS = (16, SKINNY_TOKENS)


def kernel_for(m, n, k, dtype="float16", out_dtype="float16", tile=DEPTH):
    """The kernel of ``ops.fp8_quant_gemm`` with k tile ``tile`` for ``m`` tokens: with
    :data:`DEPTH`, :func:`skinny_kernel` up to :data:`SKINNY_TOKENS` (16 tokens a block
    up to 16), else :func:`kernel`, and for a variable ``m`` :func:`by_tokens` of
    :data:`RUN_TIME_TOKENS`; with ``k`` (one tile: each row quantised by its abs-max over
    all of k), :func:`.fp8_two_pass.two_pass_kernel` (any ``m``)."""
    if tile not in (DEPTH, k):
        raise ValueError(f"the fp8 GEMM kernels quantise k tiles of {DEPTH} or one of K = {k}, not {tile}")
    problem = Fp8QuantGemm(m, n, k, dtype, out_dtype, tile)
    return _kernel(problem, *default_choices(problem))


def by_tokens(m, n, k, dtype="float16", out_dtype="float16", tokens=RUN_TIME_TOKENS):
    """One function for a variable token count ``m`` that launches, at run time, the
    :func:`skinny_kernel` of the first of ``tokens`` (ascending) that ``m`` does not
    exceed, else :func:`kernel`: each over the same parameters."""
    params = _params(m, n, k, dtype, out_dtype)
    many = kernel(m, n, k, dtype, out_dtype, params=params).body

    def launches(rows):
        body = many
        for most in sorted(tokens, reverse=True):
            skinny = skinny_kernel(rows, n, k, dtype, out_dtype, tokens=most, params=params, consumers=SKINNY_CONSUMERS)
            body = tvm.tirx.IfThenElse(m <= most, skinny.body, body)
        return body

    return tvm.tirx.PrimFunc(params, _with_rows_in_32_bits(m, launches)).with_attrs({"global_symbol": "main"})


def _with_rows_in_32_bits(m, body_of):
    """``body_of(rows)``, where ``rows`` is a 32-bit variable bound to ``m`` (a variable
    row count) if that is 64-bit, else ``m``: for the skinny kernels (at most
    :data:`SKINNY_TOKENS` rows), whose indices TVM would widen to 64 bits wherever they
    meet a 64-bit ``m``."""
    if str(m.ty) != "int64":
        return body_of(m)
    rows = tvm.tirx.Var("rows", "int32")
    return tvm.tirx.SeqStmt([tvm.tirx.Bind(rows, tvm.tirx.Cast("int32", m)), body_of(rows)])


def kernel(m, n, k, dtype="float16", out_dtype="float16", config=Fp8GemmConfig(), params=None):
    """The kernel's PrimFunc ``main(X[m, k], W[n, k], w_scale[n], out[m, n])``: X
    ``dtype`` (float16 or bfloat16), W float8_e4m3fn, ``w_scale`` float32 (W's
    per-channel scales); ``m`` an int or a variable. ``params``: those buffers, where
    another function's body shares them."""
    reason = unsupported(n, k, dtype, out_dtype, config)
    if reason is not None:
        raise ValueError(reason)
    cols, stages, group = config.cols, config.stages, config.group
    X, W, w_scale, out = params = params or _params(m, n, k, dtype, out_dtype)
    m_tiles = (m + ROWS - 1) // ROWS
    n_tiles = -(-n // cols)
    k_tiles = -(-k // DEPTH)
    # shared memory in 16-bit elements: per stage X's two boxes, then W's bytes
    box = ROWS * DEPTH // 2
    x_tile, w_tile = 2 * box, cols * DEPTH // 2
    w_base = stages * x_tile
    n_acc = cols // 2  # a thread's accumulators: 64 x cols over 128 threads
    store_tile = tile_store(out, w_scale, m, n, cols)
    abs_max, abs_max_source, pair_max, pair_max_source = _magnitude_helpers(dtype)
    mma = getattr(T.ptx.wgmma.mma_async.sync.aligned, f"m64n{cols}k32").f32.e4m3.e4m3

    @T.macro
    def wait(bar, t):
        T.cuda.mbarrier_wait(bar.ptr_to([t % stages]), (t // stages) & 1)

    @T.macro
    def operand(smem, A, xv, peak, factor, scale, half, t, cw, w, lane):
        """Tile ``t``'s A operand into register set ``half``: this thread's elements of
        its rows, their rows' new running abs-max ``peak``, the repair ``factor[half]`` of
        the accumulators, the elements quantised with the new ``scale``."""
        pairs = T.alloc_local((2,), "uint32")  # each row's largest magnitudes, in a pair
        tile_peak = T.alloc_local((2,), "float32")
        for ks in T.unroll(DEPTH // 32):
            for q in T.unroll(4):
                # register q: row lane / 4 (+ 8 for q odd), k 4 (lane % 4) (+ 16 for q >= 2);
                # the 16-byte chunk c of a box's row r lies at c ^ (r % 8)
                row = T.meta_var(64 * cw + 16 * w + lane // 4 + 8 * (q % 2))
                col = T.meta_var(32 * (ks % 2) + 16 * (q // 2) + 4 * (lane % 4))
                at = T.meta_var(
                    (t % stages) * x_tile + (ks // 2) * box + row * 64 + ((col // 8) ^ (row % 8)) * 8 + col % 8
                )
                xv.vstore([16 * ks + 4 * q], smem.vload([at], f"{dtype}x4"))
                for e in T.unroll(2):
                    pair = T.meta_var(T.reinterpret("uint32", xv.vload([16 * ks + 4 * q + 2 * e], f"{dtype}x2")))
                    if ks == 0 and q < 2 and e == 0:
                        pairs[q % 2] = pair
                    else:
                        pairs[q % 2] = T.cuda.func_call(
                            abs_max, pairs[q % 2], pair, source_code=abs_max_source, return_type="uint32"
                        )
        for g in T.unroll(2):
            tile_peak[g] = T.cuda.func_call(pair_max, pairs[g], source_code=pair_max_source, return_type="float32")
        for g in T.unroll(2):
            for d in T.unroll(2):
                tile_peak[g] = T.max(
                    tile_peak[g], T.cuda.__shfl_xor_sync(T.uint32(ALL_LANES), tile_peak[g], 1 << d, 32)
                )
            new_peak = T.meta_var(T.max(peak[g], tile_peak[g]))
            factor[2 * half + g] = repair_factor(peak[g], new_peak)
            peak[g] = new_peak
            # rounded as the definition's (and numpy's) division, whatever the compiler's flags
            scale[g] = T.call_pure_extern("float32", "__fdiv_rn", T.float32(FP8_MAX), T.max(peak[g], T.float32(EPS)))
        for ks in T.unroll(DEPTH // 32):
            for q in T.unroll(4):
                v = T.meta_var([T.Cast("float32", xv[16 * ks + 4 * q + e]) * scale[q % 2] for e in range(4)])
                A[half * 16 + ks * 4 + q] = T.cuda.func_call(
                    _QUANTISE, *v, source_code=_QUANTISE_SOURCE, return_type="uint32"
                )

    fence_accumulators, fence_a = register_fence(n_acc), register_fence(16)

    @T.macro
    def step(smem, full, empty, acc, part, A, xv, peak, factor, scale, half, t, cw, w, lane):
        fence_accumulators(part, 0)
        fence_a(A, 16 * half)
        T.ptx.wgmma.fence.sync.aligned()
        for ks in T.unroll(DEPTH // 32):
            T.evaluate(
                mma(
                    *[part[i] for i in range(n_acc)],
                    *[A[half * 16 + ks * 4 + q] for q in range(4)],
                    _k_major(smem, w_base + t % stages * w_tile, ks), ks > 0, 1, 1,
                )
            )
        T.ptx.wgmma.commit_group.sync.aligned()
        fence_a(A, 16 * (1 - half))
        if t + 1 < k_tiles:
            wait(full, t + 1)
            operand(smem, A, xv, peak, factor, scale, 1 - half, t + 1, cw, w, lane)
        T.ptx.wgmma.wait_group.sync.aligned(0)
        fence_accumulators(part, 0)
        T.ptx.mbarrier.arrive.shared.b64(empty.ptr_to([t % stages]), T.uint32(1))
        # accumulator 4 j + 2 g + e: row 16 w + lane / 4 + 8 g, column 8 j + 2 (lane % 4) + e
        for j in T.unroll(cols // 8):
            for g in T.unroll(2):
                for e in T.unroll(2):
                    at = T.meta_var(4 * j + 2 * g + e)
                    acc[at] = acc[at] * factor[2 * half + g] + part[at]

    @T.macro
    def consume(smem, full, empty, r0, c0, tx, cw):
        w = T.meta_var((tx // 32) % 4)
        lane = T.meta_var(tx % 32)
        acc = T.alloc_local((n_acc,), "float32")
        part = T.alloc_local((n_acc,), "float32")  # a tile's products, before they join acc
        A = T.alloc_local((32,), "uint32")  # two sets of a tile's A operand, e4m3 quads
        xv = T.alloc_local((64,), dtype)  # a tile's elements of this thread
        peak = T.alloc_local((2,), "float32")
        factor = T.alloc_local((4,), "float32")  # a set per register set
        scale = T.alloc_local((2,), "float32")
        for i in T.unroll(n_acc):
            acc[i] = T.float32(0)
        for g in T.unroll(2):
            peak[g] = T.float32(0)
        wait(full, 0)
        operand(smem, A, xv, peak, factor, scale, 0, 0, cw, w, lane)
        # two tiles an iteration: the register set is a constant in each
        for pair in T.serial((k_tiles + 1) // 2):
            for half in T.unroll(2):
                if pair * 2 + half < k_tiles:
                    step(smem, full, empty, acc, part, A, xv, peak, factor, scale, half, pair * 2 + half, cw, w, lane)
        for g in T.unroll(2):
            scale[g] = T.max(peak[g], T.float32(EPS)) / T.float32(FP8_MAX)
        store_tile(acc, scale, r0, c0, cw, w, lane)

    produce = _producer(k_tiles, stages, box, lambda st: st * x_tile, lambda st: w_base + st * w_tile, (x_tile + w_tile) * 2)
    block = tiled_block(m, n_tiles, config, stages * (x_tile + w_tile), dtype, produce, consume)

    maps = ((X, k, m, k * 2, DEPTH // 2, ROWS, 1, 1, dtype), (W, k, n, k, DEPTH, cols, 1, 1, "float8_e4m3fn"))
    return tma_kernel(params, maps, m_tiles * n_tiles, THREADS, block)


#: Token counts a block of :func:`skinny_kernel` takes (the wgmma's N).
TOKEN_CHOICES = (16, 32, 64)
#: W rows a consumer warpgroup of :func:`skinny_kernel` takes (a wgmma's m64).
W_ROWS = 64
#: Consumer warpgroups a block of :func:`skinny_kernel` may have (W rows 64 each).
CONSUMER_CHOICES = (1, 2)
# Stores to shared memory that TVM's barrier planner does not see: the consumers order
# them with their own named barrier (a __syncthreads the planner would insert would
# wait for the producer warp too).
_STORE = "tvm_cascade_st_shared_{}"
_STORE_SOURCE = {
    "v4": """
__forceinline__ __device__ void tvm_cascade_st_shared_v4(unsigned address, unsigned a, unsigned b, unsigned c, unsigned d) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" :: "r"(address), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}
""",
    "v2": """
__forceinline__ __device__ void tvm_cascade_st_shared_v2(unsigned address, unsigned a, unsigned b) {
  asm volatile("st.shared.v2.b32 [%0], {%1, %2};" :: "r"(address), "r"(a), "r"(b) : "memory");
}
""",
    "f32": """
__forceinline__ __device__ void tvm_cascade_st_shared_f32(unsigned address, float a) {
  asm volatile("st.shared.f32 [%0], %1;" :: "r"(address), "f"(a) : "memory");
}
""",
}


def _store(kind, pointer, *values):
    return T.cuda.func_call(
        _STORE.format(kind), T.Cast("uint32", T.cuda.cvta_generic_to_shared(pointer)), *values,
        source_code=_STORE_SOURCE[kind],
    )


def skinny_unsupported(n, k, dtype, out_dtype, tokens, stages, splits=1, consumers=1):
    """Why :func:`skinny_kernel` cannot serve this GEMM (M is free), or None."""
    reason = unsupported(n, k, dtype, out_dtype)
    if reason is not None:
        return reason
    if tokens not in TOKEN_CHOICES:
        return f"{tokens} tokens a block: one of {TOKEN_CHOICES}"
    if consumers not in CONSUMER_CHOICES:
        return f"{consumers} consumer warpgroups a block: one of {CONSUMER_CHOICES}"
    # blocks of one consumer warpgroup three an SM, of two two
    share = 3 if consumers == 1 else 2
    if stages < 2 or stages * (tokens * DEPTH * 2 + consumers * W_ROWS * DEPTH) > SHARED_BYTES // share:
        return (f"{stages} stages of {tokens} tokens and {consumers * W_ROWS} W rows: 2 or more, in 1/{share} of the "
                "shared memory")
    return split_refusal(splits, k, DEPTH)


def skinny_splits(n_tiles, k_tiles, sms=None, consumers=1):
    """The skinny kernel's default splits of K: :func:`.warp_specialized_gemm.split_count`'s
    where a token tile's ``n_tiles`` output tiles of ``consumers`` x 64 W rows, counted as
    64-row tiles, leave some of ``sms`` SMs idle, else one (measured on an H200's 132 SMs:
    at 16 tokens, one warpgroup, 224 tiles one split was faster than two and with 64 tiles
    six 1.4x faster than one; two warpgroups' 112 tiles of N = 14336 one split 1.06-1.17x
    faster than two at 24 and 32 tokens); blocks of ``consumers`` warpgroups aim at that
    many times fewer blocks an SM."""
    sms = sms or sm_count(tvm.cuda(0))
    return split_count(n_tiles, k_tiles, sms, BLOCKS_PER_SM / consumers) if n_tiles * consumers < sms else 1


def skinny_kernel(m, n, k, dtype="float16", out_dtype="float16", tokens=16, stages=4, params=None, splits=None,
                  consumers=1):
    """:func:`kernel`'s function for few tokens (decode, small batches): the same
    ``main(X[m, k], W[n, k], w_scale[n], out[m, n])`` and definition, computed as
    ``outᵀ = W · qᵀ`` so that the tokens are the wgmma's N (``tokens`` a block) and W's
    rows its M (:data:`W_ROWS` a consumer warpgroup): blocks of ``consumers`` consumer
    warpgroups and a producer warp, several to an SM; a block quantises its next k tile
    while this tile's instructions run. Per k tile, each token's elements are
    quantised by ``128 consumers / tokens`` threads (a shuffle completes the token's
    running abs-max) into an e4m3 tile in shared memory that the block's warpgroups
    share (two warpgroups halve the X bytes and the quantisation a W row costs), both
    operands of ``wgmma`` m64n{tokens}k32 are read from shared memory into a tile's
    accumulators, and those are added to the running ones in float32 after the running
    ones' repair (per column here: a token).

    ``splits`` blocks (default :func:`skinny_splits`'s) share each
    output tile's k tiles: a block starts from its tokens' abs-max over the k tiles
    before its own (read from X), so it quantises as the whole loop would, and stores
    its accumulators times its last scale and ``w_scale`` in float32; a second kernel,
    launched as a programmatic dependent of the first, adds the splits up
    (``split_k_update``: each split's running sum is in units of its own last scale, so
    the repair of a split's sum is that scale)."""
    t_tiles = (m + tokens - 1) // tokens
    w_rows = consumers * W_ROWS
    n_tiles = -(-n // w_rows)
    k_tiles = -(-k // DEPTH)
    splits = skinny_splits(n_tiles, k_tiles, consumers=consumers) if splits is None else splits
    reason = skinny_unsupported(n, k, dtype, out_dtype, tokens, stages, splits, consumers)
    if reason is not None:
        raise ValueError(reason)
    X, W, w_scale, out = params = params or _params(m, n, k, dtype, out_dtype)
    parts = tvm.tirx.decl_buffer((splits, m, n), "float32", "parts")
    # shared memory in 16-bit elements: per stage X's two boxes and W's bytes, then two
    # e4m3 tiles of the quantised tokens (all 1024-byte aligned for the 128-byte swizzle)
    box = tokens * DEPTH // 2
    x_tile, w_tile = 2 * box, w_rows * DEPTH // 2
    stage = x_tile + w_tile
    q_base = stages * stage
    q_tile = tokens * DEPTH // 2
    n_acc = tokens // 2  # a thread's accumulators: 64 x tokens over a warpgroup's 128 threads
    threads = 128 * consumers
    per = threads // tokens  # threads a token
    each = DEPTH // per  # a thread's elements of a token's tile
    abs_max, abs_max_source, pair_max, pair_max_source = _magnitude_helpers(dtype)
    mma = getattr(T.ptx.wgmma.mma_async.sync.aligned, f"m64n{tokens}k32").f32.e4m3.e4m3

    fence_part = register_fence(n_acc)

    @T.macro
    def wait(bar, t):
        T.cuda.mbarrier_wait(bar.ptr_to([t % stages]), (t // stages) & 1)

    @T.macro
    def fold(pairs, xv, lo, hi):
        """The largest magnitudes of ``pairs`` and of ``xv``'s pairs ``lo`` to ``hi``."""
        for e in T.unroll(lo, hi):
            pairs[0] = T.cuda.func_call(
                abs_max, pairs[0], T.reinterpret("uint32", xv.vload([2 * e], f"{dtype}x2")),
                source_code=abs_max_source, return_type="uint32",
            )

    @T.macro
    def token_max(result, pairs):
        """The largest magnitude of this token's threads' ``pairs``, by a shuffle."""
        result[0] = T.cuda.func_call(pair_max, pairs[0], source_code=pair_max_source, return_type="float32")
        for d in T.unroll(per.bit_length() - 1):
            result[0] = T.max(result[0], T.cuda.__shfl_xor_sync(T.uint32(ALL_LANES), result[0], 1 << d, 32))

    @T.macro
    def quantise(smem, factors, xv, qv, pairs, peak, tile_peak, scale, t, tx):
        """Tile ``t`` of this thread's token: the token's running abs-max ``peak``, the
        repair of its accumulators into ``factors``, its elements in e4m3 into the
        quantised tile ``t % 2``."""
        token = T.meta_var(tx // per)
        first = T.meta_var(tx % per * each)
        for j in T.unroll(each // 8):
            c = T.meta_var(first % 64 // 8 + j)  # the 16-byte chunk c of row r lies at c ^ (r % 8)
            xv.vstore(
                [8 * j],
                smem.vload([(t % stages) * stage + first // 64 * box + token * 64 + (c ^ (token % 8)) * 8], f"{dtype}x8"),
            )
        pairs[0] = T.reinterpret("uint32", xv.vload([0], f"{dtype}x2"))
        fold(pairs, xv, 1, each // 2)
        token_max(tile_peak, pairs)
        new_peak = T.meta_var(T.max(peak[0], tile_peak[0]))
        if tx % per == 0:
            T.evaluate(_store("f32", factors.ptr_to([t % 2 * tokens + token]), repair_factor(peak[0], new_peak)))
        peak[0] = new_peak
        scale[0] = T.call_pure_extern("float32", "__fdiv_rn", T.float32(FP8_MAX), T.max(peak[0], T.float32(EPS)))
        for e in T.unroll(each // 4):
            v = T.meta_var([T.Cast("float32", xv[4 * e + i]) * scale[0] for i in range(4)])
            qv[e] = T.cuda.func_call(_QUANTISE, *v, source_code=_QUANTISE_SOURCE, return_type="uint32")
        if each == 8:  # half a 16-byte chunk
            c = T.meta_var(first // 16)
            at = T.meta_var(q_base + t % 2 * q_tile + token * 64 + (c ^ (token % 8)) * 8 + first % 16 // 2)
            T.evaluate(_store("v2", smem.ptr_to([at]), qv[0], qv[1]))
        for j in T.unroll(each // 16):
            c = T.meta_var(first // 16 + j)
            at = T.meta_var(q_base + t % 2 * q_tile + token * 64 + (c ^ (token % 8)) * 8)
            T.evaluate(_store("v4", smem.ptr_to([at]), *[qv[4 * j + i] for i in range(4)]))

    @T.macro
    def prefix_peak(peak, xv, pairs, first, t0, tx):
        """This thread's token's abs-max over the k tiles before tile ``first``, read
        from X in 16-byte pieces."""
        token = T.meta_var(tx // per)
        pairs[0] = T.uint32(0)
        for c in T.serial((first * DEPTH // 8 + per - 1) // per):
            at = T.meta_var((c * per + tx % per) * 8)
            if at < first * DEPTH and t0 + token < m:
                xv.vstore([0], X.vload([t0 + token, at], f"{dtype}x8"))
                fold(pairs, xv, 0, 4)
        token_max(peak, pairs)

    @T.macro
    def consume(smem, full, empty, factors, last, t0, n0, first, count, s, tx):
        cw = T.meta_var(tx // 128)
        w = T.meta_var(tx % 128 // 32)
        lane = T.meta_var(tx % 32)
        acc = T.alloc_local((n_acc,), "float32")
        part = T.alloc_local((n_acc,), "float32")  # a tile's products, before they join acc
        xv = T.alloc_local((each,), dtype)
        qv = T.alloc_local((each // 4,), "uint32")
        pairs = T.alloc_local((1,), "uint32")
        peak = T.alloc_local((1,), "float32")
        tile_peak = T.alloc_local((1,), "float32")
        scale = T.alloc_local((1,), "float32")
        for i in T.unroll(n_acc):
            acc[i] = T.float32(0)
        if splits == 1:
            peak[0] = T.float32(0)
        else:
            prefix_peak(peak, xv, pairs, first, t0, tx)
        wait(full, 0)
        quantise(smem, factors, xv, qv, pairs, peak, tile_peak, scale, 0, tx)
        T.ptx.fence.proxy.async_.shared__cta()  # the e4m3 tile, written here, read by wgmma
        T.ptx.bar.sync(T.uint32(1), T.uint32(threads))
        for t in T.serial(count):
            fence_part(part, 0)
            T.ptx.wgmma.fence.sync.aligned()
            for ks in T.unroll(DEPTH // 32):
                T.evaluate(
                    mma(
                        *[part[i] for i in range(n_acc)],
                        _k_major(smem, (t % stages) * stage + x_tile + cw * W_ROWS * DEPTH // 2, ks),
                        _k_major(smem, q_base + t % 2 * q_tile, ks),
                        ks > 0, 1, 1,
                    )
                )
            T.ptx.wgmma.commit_group.sync.aligned()
            # the next tile is quantised while this one's instructions run
            if t + 1 < count:
                wait(full, t + 1)
                quantise(smem, factors, xv, qv, pairs, peak, tile_peak, scale, t + 1, tx)
                T.ptx.fence.proxy.async_.shared__cta()
            T.ptx.wgmma.wait_group.sync.aligned(0)
            fence_part(part, 0)
            T.ptx.mbarrier.arrive.shared.b64(empty.ptr_to([t % stages]), T.uint32(1))
            # accumulator 4 j + 2 g + e: W row 16 w + lane / 4 + 8 g, token 8 j + 2 (lane % 4) + e
            for j in T.unroll(tokens // 8):
                for e in T.unroll(2):
                    f = T.meta_var(factors[t % 2 * tokens + 8 * j + 2 * (lane % 4) + e])
                    for g in T.unroll(2):
                        acc[4 * j + 2 * g + e] = acc[4 * j + 2 * g + e] * f + part[4 * j + 2 * g + e]
            # tile t + 1's e4m3 tile and repairs are whole; tile t's may be overwritten
            T.ptx.bar.sync(T.uint32(1), T.uint32(threads))
        if tx % per == 0:
            T.evaluate(_store("f32", last.ptr_to([tx // per]), T.max(peak[0], T.float32(EPS)) / T.float32(FP8_MAX)))
        T.ptx.bar.sync(T.uint32(1), T.uint32(threads))
        for j in T.unroll(tokens // 8):
            for g in T.unroll(2):
                row = T.meta_var(n0 + W_ROWS * cw + 16 * w + lane // 4 + 8 * g)
                for e in T.unroll(2):
                    token = T.meta_var(8 * j + 2 * (lane % 4) + e)
                    if t0 + token < m and row < n:
                        if splits == 1:
                            out[t0 + token, row] = T.Cast(out_dtype, acc[4 * j + 2 * g + e] * last[token] * w_scale[row])
                        else:
                            parts[s, t0 + token, row] = acc[4 * j + 2 * g + e] * last[token] * w_scale[row]

    produce = _producer(k_tiles, stages, box, lambda st: st * stage, lambda st: st * stage + x_tile, stage * 2)
    init_barriers = stage_barriers(stages)

    @T.macro
    def block(x_map, w_map, bx, tx):
        smem = T.alloc_buffer((q_base + 2 * q_tile,), dtype, scope="shared.dyn", align=1024)
        full = T.alloc_shared((stages,), "uint64")
        empty = T.alloc_shared((stages,), "uint64")
        factors = T.alloc_shared((2 * tokens,), "float32")
        last = T.alloc_shared((tokens,), "float32")
        # token tiles fastest: the blocks that read a tile of W run together
        t0 = bx % t_tiles * tokens
        n_tile, s, first, count = T.meta_var(split_of_block(bx, t_tiles, n_tiles, splits, k_tiles))
        n0 = n_tile * w_rows
        init_barriers(full, empty, tx, threads)
        if tx < threads:
            consume(smem, full, empty, factors, last, t0, n0, first, count, s, tx)
        elif tx == threads:
            produce(x_map, w_map, smem, full, empty, t0, n0, first, count)

    maps = ((X, k, m, k * 2, DEPTH // 2, tokens, 1, 1, dtype), (W, k, n, k, DEPTH, w_rows, 1, 1, "float8_e4m3fn"))
    # the consumers and a producer warp
    func = tma_kernel(params, maps, t_tiles * n_tiles * splits, threads + 32, block)
    if splits == 1:
        return func
    body = ir.prepend_in_root(split_sum(parts, out), [func.body], [parts])
    return tvm.tirx.PrimFunc(params, body).with_attr("global_symbol", "main")
