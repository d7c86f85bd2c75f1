"""RMSNorm + GEMM for few rows (decode steps, small batches) on sm_90a: the
warp-specialised kernel (:mod:`.warp_specialized_gemm`) runs wgmma over 128-row tiles,
so at 16 rows seven eighths of its products are of rows past M, and its 256-column
blocks are too few to stream W at the memory's rate.

``main(X[m, k], gamma[k], W, out[m, n])`` (W ``[k, n]``, layout "kn", or ``[n, k]``,
"nk"; :func:`.warp_specialized_gemm.kernel`'s parameters) computes ``outᵀ = Wᵀ·X̃ᵀ`` so
that W's columns are the wgmma's M (:data:`W_COLS` a block) and the rows of X its N
(``tokens`` a block, 16 or 32): a block of one consumer warpgroup and a producer warp,
several to an SM, per k tile of :data:`~.warp_specialized_gemm.DEPTH`:

* the producer thread copies X's ``tokens x DEPTH`` box and W's ``DEPTH x 64`` box by
  TMA (128-byte swizzled) into ``stages`` stages;
* the consumers write ``X̃ = X·γ`` (products of 16-bit pairs, as the 128-row kernel
  rounds them) into one of two tiles in shared memory, adding the squares of X to their
  rows' sums, ``128 / tokens`` threads a row; the next tile's X̃ is written while this
  tile's ``wgmma`` m64n{tokens}k16 (W's box as A, MN-major for ``[k, n]``, K-major for
  ``[n, k]``; X̃ as B, K-major) run;
* the epilogue scales row ``i`` by ``1 / sqrt(mean(x_i²) + eps)`` (``defer_row_scales``'s
  row scale) and stores.

With ``splits`` > 1 the k tiles are shared among that many blocks per output tile
(``split_k_update`` of the row scale's sum of squares and of the products: the scale is
common to every split, so its repair is a sum of the unscaled parts): each block stores
its unscaled products and, for the first 64 columns, its rows' partial sums of squares
in float32 workspaces, and a second kernel adds the splits up, scales and stores
(launched as a programmatic dependent: it launches while the splits end). A
block's k loop is a chain of waits on its stages; with few rows the blocks are too few
to keep enough of W in flight, and splitting the chain is what lets W stream.
"""
from __future__ import annotations

import tvm
from tvm.script import tirx as T

from ..cuda import ALL_LANES, sm_count
from ..cuda.wgmma import descriptor
from ..cuda.wgmma_batches import register_fence
from ..primitives.ir import prepend_in_root
from .warp_specialized import PTX_TYPE, SHARED_BYTES, serves_target
from .warp_specialized_fp8_gemm import _store
from .warp_specialized_gemm import (
    _TMA, DEPTH, build_function, pair_product, params, split_count, split_of_block, split_refusal, split_sum,
    stage_barriers, tma_kernel,
)
from .warp_specialized_gemm import unsupported as _unsupported

#: Columns of W (output columns) a block: the wgmma's M.
W_COLS = 64
#: Rows of X a block: the wgmma's N.
TOKEN_CHOICES = (16, 32)
_THREADS = 160  # a consumer warpgroup and a producer warp


def skinny_unsupported(n, k, layout, dtype, out_dtype, tokens=16, stages=4, splits=1):
    """Why :func:`skinny_kernel` cannot serve this GEMM (M is free), or None."""
    reason = _unsupported(n, k, layout, dtype, out_dtype)  # (its dtypes, layouts and TMA's rows)
    if reason is not None:
        return reason
    if tokens not in TOKEN_CHOICES:
        return f"{tokens} rows of X a block: one of {TOKEN_CHOICES}"
    if stages < 2 or _shared_bytes(tokens, stages) > SHARED_BYTES // 3:
        return f"{stages} stages of {tokens} rows: 2 or more, in a third of the shared memory"
    return split_refusal(splits, k, DEPTH)


def _shared_bytes(tokens, stages):
    """Each stage's X and W boxes, then the two X̃ tiles (16-bit elements)."""
    return 2 * DEPTH * ((tokens + W_COLS) * stages + 2 * tokens)


#: Blocks an SM that :func:`default_config`'s splits aim at (H200, 16 rows, three or
#: four timings each in one process, ms, stages x splits: 4096 x 14336 3 x 3
#: 0.0355-0.0370 beside 4 x 2's 0.0369-0.0384; 4096 x 6144 3 x 6 0.0203-0.0221 beside
#: 4 x 4's 0.0210-0.0228; 14336 x 4096 3 x 9 0.0346-0.0348 beside 4 x 6's
#: 0.0375-0.0377; 4096 x 4096 4 x 8 0.0172-0.0173 beside 4 x 6's 0.0175-0.0176).
BLOCKS_PER_SM = 4.5
#: An SM's shared memory, and what a block takes beyond its dynamic shared memory: its
#: static barriers (the dynamic part is aligned to 1 KiB after them) and the 1 KiB the
#: driver reserves a block.
SM_SHARED_BYTES = 228 * 1024
_BLOCK_OVERHEAD_BYTES = 2 * 1024


def blocks_an_sm(stages, tokens=16):
    """How many blocks of ``stages`` stages fit in an SM's shared memory at once."""
    return SM_SHARED_BYTES // (_shared_bytes(tokens, stages) + _BLOCK_OVERHEAD_BYTES)


def default_config(n, k, sms=None):
    """The stages and splits of K for 16 rows: splits for about :data:`BLOCKS_PER_SM`
    blocks an SM (:func:`.warp_specialized_gemm.split_count` of a block's 64 columns),
    in four stages where all the blocks fit in the SMs at once, else in three (six
    blocks an SM: blocks past the first wave cost 15-26%)."""
    sms = sms or sm_count(tvm.cuda(0))
    tiles = -(-n // W_COLS)
    splits = split_count(tiles, -(-k // DEPTH), sms, BLOCKS_PER_SM)
    return (4 if tiles * splits <= blocks_an_sm(4) * sms else 3), splits


def skinny_kernel(m, n, k, eps=1e-6, layout="kn", out_dtype="float16", tokens=16, stages=4, dtype="float16",
                  splits=1, buffers=None):
    """The kernel's PrimFunc (module docstring); ``m`` an int or a variable. ``buffers``:
    its parameters (:func:`.warp_specialized_gemm.params`), where another function's
    body shares them."""
    reason = skinny_unsupported(n, k, layout, dtype, out_dtype, tokens, stages, splits)
    if reason is not None:
        raise ValueError(reason)
    kn = layout == "kn"
    ptx = PTX_TYPE[dtype]
    mul2, mul2_source = pair_product(dtype)
    X, gamma, W, out = buffers or params(m, n, k, layout, dtype, out_dtype)
    t_tiles = (m + tokens - 1) // tokens
    n_tiles = -(-n // W_COLS)
    k_tiles = -(-k // DEPTH)
    part_k = k % DEPTH != 0
    # shared memory in 16-bit elements: per stage X's box, then W's; then two X̃ tiles
    # (each a multiple of 1024 bytes: the 128-byte swizzle's atoms)
    x_tile, w_tile = tokens * DEPTH, DEPTH * W_COLS
    stage = x_tile + w_tile
    g_base = stages * stage
    n_acc = tokens // 2  # a thread's accumulators: 64 x tokens over 128 threads
    per = 128 // tokens  # threads a row of X
    chunks = 8 // per  # a thread's 16-byte chunks of its row's DEPTH elements
    mma = getattr(getattr(getattr(T.ptx.wgmma.mma_async.sync.aligned, f"m64n{tokens}k16").f32, ptx), ptx)
    fence_accumulators = register_fence(n_acc)
    # with splits: each split's unscaled products and its rows' partial sums of squares
    parts = tvm.tirx.decl_buffer((splits, m, n), "float32", "parts")
    squares = tvm.tirx.decl_buffer((splits, m), "float32", "squares")

    def row_scale(ss):
        return T.float32(1) / T.sqrt(ss / T.float32(k) + T.float32(eps))

    def w_operand(smem, st, ks):
        if kn:
            # DEPTH rows of k of 64 columns, read MN-major: the stride steps 8 rows of k
            return descriptor(smem.ptr_to([st * stage + x_tile + ks * 16 * W_COLS]), DEPTH * W_COLS * 2, 1024,
                              swizzle=True)
        # 64 rows of n of DEPTH, read K-major: step ks is 32 bytes into the swizzled row
        return descriptor(smem.ptr_to([st * stage + x_tile + ks * 16]), 16, 1024, swizzle=True)

    def x_operand(smem, half, ks):
        return descriptor(smem.ptr_to([g_base + half * x_tile + ks * 16]), 16, 1024, swizzle=True)

    @T.macro
    def wait(bar, t):
        T.cuda.mbarrier_wait(bar.ptr_to([t % stages]), (t // stages) & 1)

    @T.macro
    def scaled(smem, ss, xv, gv, i, t, tx):
        """The block's tile ``i`` (K's tile ``t``): its X̃ into tile ``i % 2``, this thread's
        chunks of its row, their squares added to ``ss``."""
        row = T.meta_var(tx // per)
        for j in T.unroll(chunks):
            c = T.meta_var(tx % per * chunks + j)
            # the 16-byte chunk c of row r lies at c ^ (r % 8)
            at = T.meta_var(row * DEPTH + (c ^ (row % 8)) * 8)
            xv.vstore([0], smem.vload([i % stages * stage + at], f"{dtype}x8"))
            for e in T.unroll(8):
                x = T.meta_var(T.Cast("float32", xv[e]))
                ss[0] = ss[0] + x * x
            col = T.meta_var(t * DEPTH + c * 8)
            if part_k:
                for e in T.unroll(8):
                    gv[e] = T.if_then_else(col + e < k, gamma[T.min(col + e, k - 1)], T.Cast(dtype, 0))
            else:
                gv.vstore([0], gamma.vload([col], f"{dtype}x8"))
            # in pairs: the product of two 16-bit floats rounds once either way (stored by
            # an instruction of its own: the consumers' barriers order it, not TVM's)
            T.evaluate(_store("v4", smem.ptr_to([g_base + i % 2 * x_tile + at]), *[T.cuda.func_call(
                mul2, T.reinterpret("uint32", xv.vload([2 * p], f"{dtype}x2")),
                T.reinterpret("uint32", gv.vload([2 * p], f"{dtype}x2")),
                source_code=mul2_source, return_type="uint32",
            ) for p in range(4)]))

    @T.macro
    def consume(smem, full, empty, scales, t0, n0, s, first, count, tx):
        w = T.meta_var(tx // 32)
        lane = T.meta_var(tx % 32)
        acc = T.alloc_local((n_acc,), "float32")
        ss = T.alloc_local((1,), "float32")
        xv = T.alloc_local((8,), dtype)
        gv = T.alloc_local((8,), dtype)
        for i in T.unroll(n_acc):
            acc[i] = T.float32(0)
        ss[0] = T.float32(0)
        wait(full, 0)
        scaled(smem, ss, xv, gv, 0, first, tx)
        T.ptx.fence.proxy.async_.shared__cta()  # X̃, written here, read by wgmma
        T.ptx.bar.sync(T.uint32(1), T.uint32(128))
        for i in T.serial(count):
            fence_accumulators(acc, 0)
            T.ptx.wgmma.fence.sync.aligned()
            for ks in T.unroll(DEPTH // 16):
                T.evaluate(mma(
                    *[acc[a] for a in range(n_acc)], w_operand(smem, i % stages, ks), x_operand(smem, i % 2, ks),
                    True, 1, 1, 1 if kn else 0, 0,
                ))
            T.ptx.wgmma.commit_group.sync.aligned()
            # the next tile's X̃ is written while this one's instructions run
            if i + 1 < count:
                wait(full, i + 1)
                scaled(smem, ss, xv, gv, i + 1, first + i + 1, tx)
                T.ptx.fence.proxy.async_.shared__cta()
            T.ptx.wgmma.wait_group.sync.aligned(0)
            fence_accumulators(acc, 0)
            T.ptx.mbarrier.arrive.shared.b64(empty.ptr_to([i % stages]), T.uint32(1))
            # tile i + 1's X̃ is whole; tile i's may be overwritten
            T.ptx.bar.sync(T.uint32(1), T.uint32(128))
        for d in T.unroll(per.bit_length() - 1):
            ss[0] = ss[0] + T.cuda.__shfl_xor_sync(T.uint32(ALL_LANES), ss[0], 1 << d, 32)
        if splits == 1:
            if tx % per == 0:
                T.evaluate(_store("f32", scales.ptr_to([tx // per]), row_scale(ss[0])))
            T.ptx.bar.sync(T.uint32(1), T.uint32(128))
        elif tx % per == 0 and n0 == 0:
            if t0 + tx // per < m:
                squares[s, t0 + tx // per] = ss[0]
        # accumulator 4 j + 2 g + e: W column 16 w + lane / 4 + 8 g, row 8 j + 2 (lane % 4) + e of X
        for j in T.unroll(tokens // 8):
            for g in T.unroll(2):
                col = T.meta_var(n0 + 16 * w + lane // 4 + 8 * g)
                for e in T.unroll(2):
                    row = T.meta_var(8 * j + 2 * (lane % 4) + e)
                    if t0 + row < m and col < n:
                        if splits == 1:
                            out[t0 + row, col] = T.Cast(out_dtype, acc[4 * j + 2 * g + e] * scales[row])
                        else:
                            parts[s, t0 + row, col] = acc[4 * j + 2 * g + e]

    @T.macro
    def produce(x_map, w_map, smem, full, empty, t0, n0, first, count):
        for i in T.serial(count):
            st = T.meta_var(i % stages)
            t = T.meta_var(first + i)
            T.cuda.mbarrier_wait(empty.ptr_to([st]), ((i // stages) & 1) ^ 1)
            T.ptx.mbarrier.arrive.expect_tx.shared.b64(full.ptr_to([st]), T.uint32(stage * 2))
            T.ptx[_TMA](smem.ptr_to([st * stage]), T.address_of(x_map), T.int32(t * DEPTH), T.Cast("int32", t0),
                        full.ptr_to([st]))
            if kn:
                T.ptx[_TMA](smem.ptr_to([st * stage + x_tile]), T.address_of(w_map), T.Cast("int32", n0),
                            T.int32(t * DEPTH), full.ptr_to([st]))
            else:
                T.ptx[_TMA](smem.ptr_to([st * stage + x_tile]), T.address_of(w_map), T.int32(t * DEPTH),
                            T.Cast("int32", n0), full.ptr_to([st]))

    init_barriers = stage_barriers(stages)

    @T.macro
    def block(x_map, w_map, bx, tx):
        smem = T.alloc_buffer((g_base + 2 * x_tile,), dtype, scope="shared.dyn", align=1024)
        full = T.alloc_shared((stages,), "uint64")
        empty = T.alloc_shared((stages,), "uint64")
        scales = T.alloc_shared((tokens,), "float32")
        # row tiles of X fastest: the blocks that read a box of W run together
        t0 = bx % t_tiles * tokens
        n_tile, s, first, count = T.meta_var(split_of_block(bx, t_tiles, n_tiles, splits, k_tiles))
        n0 = n_tile * W_COLS
        init_barriers(full, empty, tx, 128)
        if tx < 128:
            consume(smem, full, empty, scales, t0, n0, s, first, count, tx)
        elif tx == 128:
            produce(x_map, w_map, smem, full, empty, t0, n0, first, count)

    w_dims, w_box = ((n, k, n * 2), (W_COLS, DEPTH)) if kn else ((k, n, k * 2), (DEPTH, W_COLS))
    maps = ((X, k, m, k * 2, DEPTH, tokens, 1, 1, dtype), (W, *w_dims, *w_box, 1, 1, dtype))
    func = tma_kernel([X, gamma, W, out], maps, t_tiles * n_tiles * splits, _THREADS, block)
    if splits == 1:
        return func

    adds = split_sum(parts, out, lambda row: row_scale(sum(squares[p, row] for p in range(splits))))
    body = prepend_in_root(adds, [func.body], [parts, squares])
    return tvm.tirx.PrimFunc([X, gamma, W, out], body).with_attr("global_symbol", "main")


def build(func, target):
    """Compile :func:`skinny_kernel`'s ``func`` as ``main`` for ``target`` (an H100 or
    H200: sm_90a is named for it)."""
    if not serves_target(target):
        raise ValueError(f"the skinny RMSNorm + GEMM needs sm_90a (wgmma, TMA); target is {target}")
    return build_function(func, target)
