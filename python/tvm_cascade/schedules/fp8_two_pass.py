"""Per-token fp8 quantisation + GEMM in two kernels (sm_90a), for many tokens: the
one-kernel form (:mod:`.warp_specialized_fp8_gemm`) quantises X's rows again for every
block of output columns, which costs more than a pass of its own once the GEMM is
compute-bound.

``main(X[m, k], W[n, k], w_scale[n], out[m, n])`` computes ``ops.fp8_quant_gemm`` with
one k tile (the two-pass quantisation: each row's abs-max over all of k first):

* the quantisation kernel, a block of :data:`QUANTISE_THREADS` a row: the row's
  abs-max ``p`` (16-byte loads, a warp shuffle and the block's warps through shared
  memory), then its elements times ``448 / max(eps, p)`` in e4m3 into a workspace
  ``q[m, k]`` and ``max(eps, p) / 448`` into ``q_scale[m]``;
* the GEMM, tiles of :data:`~.warp_specialized_fp8_gemm.ROWS` x ``cols`` as the
  one-kernel form's (:func:`~.warp_specialized_fp8_gemm.tiled_block`: a TMA producer
  thread, two consumer warpgroups of 64 rows), each k tile's ``q`` box and W box read by
  ``wgmma`` m64n{cols}k32 e4m3 from shared memory (both K-major) into a tile's
  accumulators, added to the running ones in float32 (as the one-kernel form does); the
  tiles go in unrolled runs (up to 8), each tile's products in one of two sets of
  accumulators while the tile before's are added, so the additions run under the
  wgmmas; the epilogue scales row ``i`` by ``q_scale[i]`` and column ``c`` by
  ``w_scale[c]``; it is launched as a programmatic dependent of the quantisation
  (:func:`.warp_specialized_gemm.build_function`): it launches while the quantisation
  ends, asks for its first stages of W in L2, and waits for the quantisation's results.

With ``config.cluster`` 2 (the form's fourth choice) the GEMM's blocks go in clusters
of two over two row tiles of one column tile, each block fetching half the W tile's
rows into both by TMA multicast (:func:`~.warp_specialized_fp8_gemm.tiled_block`): a k
tile's copies from L2 fall from 32 KB a block to 24.
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ..cuda import ALL_LANES
from ..cuda.wgmma_batches import register_fence
from ..primitives.ir import prepend_in_root
from .warp_specialized import THREADS, stage_release
from .warp_specialized_fp8_gemm import (
    _QUANTISE, _QUANTISE_SOURCE, DEPTH, EPS, FP8_MAX, ROWS, TWO_PASS_CONFIG, _k_major, _params, _producer, tile_store,
    tiled_block, unsupported,
)

#: Threads of a block of the quantisation kernel (a row).
QUANTISE_THREADS = 128
#: Elements a thread loads at once (16 bytes of 16-bit X).
_VECTOR = 8
_WARPS = QUANTISE_THREADS // 32


def two_pass_unsupported(n, k, dtype, out_dtype, config=TWO_PASS_CONFIG):
    """Why :func:`two_pass_kernel` cannot serve this GEMM (M is free), or None."""
    if k % _VECTOR:
        return f"the quantisation kernel loads rows in 16-byte pieces: K = {k} is not a multiple of {_VECTOR}"
    if config.cluster not in (1, 2):
        return f"the two-pass GEMM shares W tiles in clusters of 1 or 2 blocks, not {config.cluster}"
    return unsupported(n, k, dtype, out_dtype, config, x_bytes=1)


def two_pass_kernel(m, n, k, dtype="float16", out_dtype="float16", config=TWO_PASS_CONFIG):
    """The two kernels' PrimFunc ``main(X[m, k], W[n, k], w_scale[n], out[m, n])``
    (:func:`~.warp_specialized_fp8_gemm.kernel`'s parameters; ``m`` an int or a
    variable), their workspace allocated in it."""
    reason = two_pass_unsupported(n, k, dtype, out_dtype, config)
    if reason is not None:
        raise ValueError(reason)
    params = X, W, w_scale, out = _params(m, n, k, dtype, out_dtype)
    # q holds four e4m3 bytes an element (the quantisation's stores); its TMA map reads bytes
    q = tirx.decl_buffer((m, k // 4), "uint32", "q")
    q_scale = tirx.decl_buffer((m,), "float32", "q_scale")
    quantise = _quantise(X, q, q_scale, m, k, dtype)
    gemm = _gemm(q, q_scale, W, w_scale, out, m, n, k, config)

    @T.prim_func(private=True, check_well_formed=False)
    def main():
        quantise()
        q_map = T.tvm_stack_alloca("tensormap", 1)
        w_map = T.tvm_stack_alloca("tensormap", 1)
        T.evaluate(T.tensormap_encode_tiled(q_map, q.data, k, m, k, DEPTH, ROWS, 1, 1,
                                            descriptor_dtype="float8_e4m3fn", rank=2, swizzle=3))
        T.evaluate(T.tensormap_encode_tiled(w_map, W.data, k, n, k, DEPTH, config.cols // config.cluster, 1, 1,
                                            descriptor_dtype="float8_e4m3fn", rank=2, swizzle=3))
        gemm(q_map, w_map)

    return tirx.PrimFunc(params, prepend_in_root(main.body, [], [q, q_scale])).with_attr("global_symbol", "main")


def _quantise(X, q, q_scale, m, k, dtype):
    """The quantisation kernel's macro: row ``b`` of ``X`` into ``q`` and ``q_scale``."""
    pieces = k // _VECTOR
    rounds = -(-pieces // QUANTISE_THREADS)

    @T.macro
    def quantise():
        with T.launch_thread("blockIdx.x", m) as b:
            tx = T.launch_thread("threadIdx.x", QUANTISE_THREADS)
            xv = T.alloc_local((_VECTOR,), dtype)
            peak = T.alloc_local((1,), "float32")
            scale = T.alloc_local((1,), "float32")
            warps = T.alloc_shared((_WARPS,), "float32")
            peak[0] = T.float32(0)
            for r in T.serial(rounds):
                if r * QUANTISE_THREADS + tx < pieces:
                    xv.vstore([0], X.vload([b, (r * QUANTISE_THREADS + tx) * _VECTOR], f"{dtype}x{_VECTOR}"))
                    for e in T.unroll(_VECTOR):
                        peak[0] = T.max(peak[0], T.abs(T.Cast("float32", xv[e])))
            for d in T.unroll(5):
                peak[0] = T.max(peak[0], T.cuda.__shfl_xor_sync(T.uint32(ALL_LANES), peak[0], 1 << d, 32))
            if tx % 32 == 0:
                warps[tx // 32] = peak[0]
            T.tvm_storage_sync("shared")
            for w in T.unroll(_WARPS):
                peak[0] = T.max(peak[0], warps[w])
            # rounded as the definition's (and numpy's) division, whatever the compiler's flags
            scale[0] = T.call_pure_extern("float32", "__fdiv_rn", T.float32(FP8_MAX), T.max(peak[0], T.float32(EPS)))
            if tx == 0:
                q_scale[b] = T.max(peak[0], T.float32(EPS)) / T.float32(FP8_MAX)
            for r in T.serial(rounds):
                if r * QUANTISE_THREADS + tx < pieces:
                    at = T.meta_var((r * QUANTISE_THREADS + tx) * _VECTOR)
                    xv.vstore([0], X.vload([b, at], f"{dtype}x{_VECTOR}"))
                    for h in T.unroll(_VECTOR // 4):
                        q[b, at // 4 + h] = T.cuda.func_call(
                            _QUANTISE, *[T.Cast("float32", xv[4 * h + e]) * scale[0] for e in range(4)],
                            source_code=_QUANTISE_SOURCE, return_type="uint32")

    return quantise


def _gemm(q, q_scale, W, w_scale, out, m, n, k, config):
    """The GEMM kernel's macro ``gemm(q_map, w_map)`` over the quantised rows."""
    cols, stages, cluster = config.cols, config.stages, config.cluster
    m_tiles = (m + ROWS - 1) // ROWS
    n_tiles = -(-n // cols)
    k_tiles = -(-k // DEPTH)
    run = next(r for r in (8, 4, 2, 1) if k_tiles % r == 0)
    # shared memory in 16-bit elements: per stage q's tile, then W's
    x_tile, w_tile = ROWS * DEPTH // 2, cols * DEPTH // 2
    w_base = stages * x_tile
    n_acc = cols // 2  # a thread's accumulators: 64 x cols over 128 threads
    mma = getattr(T.ptx.wgmma.mma_async.sync.aligned, f"m64n{cols}k32").f32.e4m3.e4m3
    fence_accumulators = register_fence(n_acc)
    store_tile = tile_store(out, w_scale, m, n, cols)
    release = stage_release(cluster)

    @T.macro
    def wait(bar, t):
        T.cuda.mbarrier_wait(bar.ptr_to([t % stages]), (t // stages) & 1)

    @T.macro
    def join(acc, part, empty, t, which, rank):
        """k tile ``t``'s products, done in set ``which`` of ``part``: its stage released
        (in both blocks of a cluster) and the products added to ``acc``."""
        fence_accumulators(part, which * n_acc)
        release(empty, t % stages, rank)
        for i in T.unroll(n_acc):
            acc[i] = acc[i] + part[which * n_acc + i]

    @T.macro
    def consume(smem, full, empty, r0, c0, tx, cw, rank=0):
        w = T.meta_var((tx // 32) % 4)
        lane = T.meta_var(tx % 32)
        acc = T.alloc_local((n_acc,), "float32")
        part = T.alloc_local((2 * n_acc,), "float32")  # two tiles' products, before they join acc
        scale = T.alloc_local((2,), "float32")
        for i in T.unroll(n_acc):
            acc[i] = T.float32(0)
        # Over `run` k tiles at a time, unrolled, a tile's products go to one of two sets
        # while the other's, the tile before's, join acc: the wgmmas run under the
        # additions. (No group stays in flight across the loop's back edge: there ptxas
        # serialises every wgmma.)
        for u in T.serial(k_tiles // run):
            for v in T.unroll(run):
                t = T.meta_var(u * run + v)
                wait(full, t)
                fence_accumulators(part, v % 2 * n_acc)
                T.ptx.wgmma.fence.sync.aligned()
                for ks in T.unroll(DEPTH // 32):
                    T.evaluate(mma(
                        *[part[v % 2 * n_acc + i] for i in range(n_acc)],
                        # (consumer cw's 64 rows: eight 1024-byte atoms into the tile)
                        _k_major(smem, t % stages * x_tile + cw * 64 * DEPTH // 2, ks),
                        _k_major(smem, w_base + t % stages * w_tile, ks), ks > 0, 1, 1,
                    ))
                T.ptx.wgmma.commit_group.sync.aligned()
                if v > 0:
                    T.ptx.wgmma.wait_group.sync.aligned(1)
                    join(acc, part, empty, t - 1, (v - 1) % 2, rank)
            T.ptx.wgmma.wait_group.sync.aligned(0)
            join(acc, part, empty, u * run + run - 1, (run - 1) % 2, rank)
        for g in T.unroll(2):
            scale[g] = q_scale[T.min(r0 + 64 * cw + 16 * w + lane // 4 + 8 * g, m - 1)]
        store_tile(acc, scale, r0, c0, cw, w, lane)

    produce = _producer(k_tiles, stages, x_tile, lambda st: st * x_tile, lambda st: w_base + st * w_tile,
                        (x_tile + w_tile) * 2, x_boxes=1, w_rows=cols // cluster if cluster > 1 else None)
    # (W's first stages asked for in L2 while the quantisation ends)
    block = tiled_block(m, n_tiles, config, stages * (x_tile + w_tile), "float16", produce, consume,
                        prefetch=min(stages, k_tiles))

    @T.macro
    def gemm(q_map, w_map):
        if cluster > 1:
            with T.launch_thread("blockIdx.x", (m_tiles + cluster - 1) // cluster * cluster * n_tiles) as bx:
                rank = T.launch_thread("clusterCtaIdx.x", cluster)
                tx = T.launch_thread("threadIdx.x", THREADS)
                block(q_map, w_map, bx, tx, rank)
        else:
            with T.launch_thread("blockIdx.x", m_tiles * n_tiles) as bx:
                tx = T.launch_thread("threadIdx.x", THREADS)
                block(q_map, w_map, bx, tx)

    return gemm
