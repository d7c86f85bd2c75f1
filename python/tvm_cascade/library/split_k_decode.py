"""The split-k decode family: a few query rows per sequence over many keys
(FlashDecoding), lengths and chunk size at run time, for CUDA.

Two kernels. The first takes one chunk of a sequence's keys for the query rows of one
K/V head (the group's heads of each query row, a few per block, more in further
blocks): its 128 threads work as subgroups of up to 32 lanes, each lane holding a slice
of each row's query and output, each subgroup a few keys a step (K and V read once for
all the rows; the next step's keys loaded while this step's are used), scores reduced
by shuffles; each subgroup keeps a running max, sum and output per row, repaired as the
max grows, and at the chunk's end the subgroups are merged through shared memory into
the chunk's partial (max, sum, output). The second combines a row's chunks
(:mod:`.split_k`). Both repairs, within a chunk and across chunks, are the factor the
algebra derives and proves for ``ops.attention``'s sum and output
(:func:`~tvm_cascade.schedules.warp_specialized.repair_factor`); scores are kept in log2
units.

The host plans the chunk size from the longest sequence, the blocks it needs and the
GPU's SMs (:meth:`SplitKDecode.plan`), so short and long contexts fill the GPU alike.

Its schedule of static lengths (:mod:`.static_lengths`) is
:mod:`tvm_cascade.schedules.decode`'s: ``ops.attention`` split by the traced
``split_k_update``, on tensor cores where a K/V head has enough query rows.
"""
from __future__ import annotations

import math

import tvm
from tvm import tirx
from tvm.script import tirx as T

from ..cuda import ALL_LANES, mma16x8, tensor_cores
from ..schedules import decode
from ..schedules.warp_specialized import repair_factor
from .layouts import views
from .spec import AttentionSpec
from .split_k import (
    ACC, NEG_INF, QUERIES, chunking, combine_kernel, finite, first_key, partial_shape, partials_store,
    maximum, plan_chunk_keys, score_of, sm_count, unsupported,
)

THREADS = 128
#: Registers a thread spends on its rows' query and output slices and its keys in flight.
REGISTERS = 64
#: Blocks per SM the chunk size is planned for.
WAVES = 4


class SplitKDecode:
    """Split-k decode on CUDA for up to :data:`QUERIES` query rows per sequence."""

    name = "split_k_decode"
    queries = QUERIES
    # Its schedule of static lengths (:mod:`.static_lengths`).
    kind = "decode"
    space = "decode"
    config_type = decode.DecodeConfig
    needs_variant = False
    verifies_gpu_code = True
    build_func = tensor_cores.BUILD_FUNC

    def supports(self, spec: AttentionSpec):
        reason = unsupported(spec)
        if reason is not None:
            return reason
        vec = _vec(spec.head_dim)
        lanes = spec.head_dim // vec
        if spec.head_dim % vec or lanes & (lanes - 1):
            return f"head dim {spec.head_dim}: a power of two times {vec} (a key row over 2^k lanes)"
        return None

    def build(self, spec: AttentionSpec) -> tvm.tirx.PrimFunc:
        return decode_kernel(spec)

    def plan(self, spec: AttentionSpec, batch, max_q, max_kv, device) -> list:
        """``[chunk_keys]``: keys per chunk (a cache layout's ``[chunks]``, chunks per
        sequence: :func:`.split_k.plan_chunk_keys`), so that the first kernel launches
        about :data:`WAVES` blocks per SM (no chunk shorter than a step of every
        subgroup)."""
        _, rows, _, step = _shape(spec)
        blocks = batch * spec.heads_kv * -(-spec.group * maximum(max_q, 1) // rows)
        return [plan_chunk_keys(spec, blocks, max_q, max_kv, device, WAVES, step, step, whole_waves=False)]

    def compile_target(self, target):
        return target

    def schedule_supports(self, spec: AttentionSpec, seq_q, seq_kv):
        if spec.target_kind != "cuda":
            return f"the decode schedule is for CUDA, not {spec.target_kind}"
        return None

    def padding(self, group, seq_q, head_dim, config=None):
        """Whole key tiles of every choice, and the query rows that fill tensor-core
        tiles where that serves better (:func:`~tvm_cascade.schedules.decode.query_rows`)."""
        return decode.query_rows(group, seq_q, head_dim, config or decode.DecodeConfig()), decode.PAD_KEYS

    def schedule(self, func, spec: AttentionSpec, config=None):
        config = config or decode.DecodeConfig()
        # (the SMs of this machine's GPU, an H100/H200's without one)
        return decode.schedule_decode(func, spec.heads_q, spec.heads_kv, spec.head_dim, sm_count(tvm.cuda(0)), config)

    def design_space(self, spec: AttentionSpec):
        return decode.decode_design_space(spec.heads_q, spec.heads_kv, spec.head_dim)

    def scheduled(self, mod):
        # The only decode schedule.
        return True

    def prefers(self, spec: AttentionSpec):
        return True

    def compile(self, mod, target):
        return tensor_cores.build(mod, target)

    def register_intrinsics(self):
        mma16x8.register()


def _vec(head_dim):
    """Elements of a key row a lane loads: a warp's 32 lanes span a row of 128 or more."""
    return max(head_dim // 32, min(4, head_dim))


def _shape(spec):
    """(elements a lane holds of a row, rows a block takes, keys a subgroup loads per step,
    keys all subgroups take per step)."""
    vec = _vec(spec.head_dim)
    rows = min(spec.group, max(1, 32 // vec), 8)
    # Query and output slices (2 rows x vec floats), and two steps' K and V (vec halves).
    unroll = max(1, min(8, (REGISTERS - 2 * rows * vec) // (2 * vec)))
    subgroups = THREADS // (spec.head_dim // vec)
    return vec, rows, unroll, unroll * subgroups


def decode_kernel(spec: AttentionSpec) -> tvm.tirx.PrimFunc:
    """The family's PrimFunc for ``spec``: the layout's tensors, its scalars, then
    the scalar of its chunking (:func:`.split_k.chunking`), then ``out`` (and ``lse``
    where the layout has one)."""
    view = views(spec, tirx.decl_buffer)
    d, group, heads_kv, heads_q = spec.head_dim, spec.group, spec.heads_kv, spec.heads_q
    vec, rows, unroll, step = _shape(spec)
    lanes = d // vec
    subgroups = THREADS // lanes
    acc = ACC
    out = tirx.decl_buffer(view.out_shape, spec.dtype, "out")
    q_len, kv_len = view.query_length, view.key_length
    score = score_of(spec, view)
    batch = view.batch
    chunks = chunking(spec, view, step, step)
    num_chunks, chunk_keys = chunks.count, chunks.keys
    lse = view.lse_buffer()
    passes = (group * view.rows + rows - 1) // rows
    neg_inf = NEG_INF
    combine = combine_kernel(spec, view, chunks, out, lse, THREADS)
    store = partials_store(spec, rows, THREADS // lanes, THREADS)

    row_parts = len(view.kv_row(0, 0))

    @T.macro
    def load(k_buf, v_buf, row, b, hk, start, end, t, sub, lane):
        """Step ``t``'s keys of this subgroup, zeros past ``end`` (each key located
        once, into ``row``, before its vector loads)."""
        for u in T.unroll(unroll):
            j = T.meta_var(start + (t * unroll + u) * subgroups + sub)
            if j < end:
                parts = T.meta_var(view.kv_row(b, j))
                row[0] = parts[0]
                if row_parts > 1:
                    row[1] = parts[1]
                located = T.meta_var((row[0], row[1]) if row_parts > 1 else (row[0],))
                for x in T.vectorized(vec):
                    k_buf[u * vec + x] = view.key_at(located, hk, lane * vec + x)
                for x in T.vectorized(vec):
                    v_buf[u * vec + x] = view.value_at(located, hk, lane * vec + x)
            else:
                for x in T.vectorized(vec):
                    k_buf[u * vec + x] = T.Cast(spec.dtype, 0)
                for x in T.vectorized(vec):
                    v_buf[u * vec + x] = T.Cast(spec.dtype, 0)

    @T.prim_func(private=True, check_well_formed=False)
    def body():
        # Partials of row (b, query position, head) and chunk: output, max, sum.
        part_o = T.alloc_buffer(partial_shape(view, num_chunks, heads_q) + (d,), acc)
        part_m = T.alloc_buffer(partial_shape(view, num_chunks, heads_q), acc)
        part_l = T.alloc_buffer(partial_shape(view, num_chunks, heads_q), acc)
        with T.launch_thread("blockIdx.x", num_chunks) as c:
            by = T.launch_thread("blockIdx.y", batch * heads_kv)
            bz = T.launch_thread("blockIdx.z", passes)
            tx = T.launch_thread("threadIdx.x", THREADS)
            q_reg = T.alloc_local((rows * vec,), acc)
            o = T.alloc_local((rows * vec,), acc)
            m = T.alloc_local((rows,), acc)
            l = T.alloc_local((rows,), acc)
            k_reg = T.alloc_local((unroll * vec,), spec.dtype)
            v_reg = T.alloc_local((unroll * vec,), spec.dtype)
            k_next = T.alloc_local((unroll * vec,), spec.dtype)
            v_next = T.alloc_local((unroll * vec,), spec.dtype)
            row = T.alloc_local((row_parts,), "int32")
            s = T.alloc_local((unroll,), acc)
            dot = T.alloc_local((1,), acc)
            m_new = T.alloc_local((1,), acc)
            repair = T.alloc_local((1,), acc)
            merged_m = T.alloc_shared((subgroups, rows), acc)
            merged_l = T.alloc_shared((subgroups, rows), acc)
            merged_o = T.alloc_shared((subgroups, rows, d), acc)
            b = by // heads_kv
            hk = by % heads_kv
            sub = tx // lanes
            lane = tx % lanes
            n_rows = group * q_len(b)
            start = first_key(spec, view, b) + c * chunk_keys(b)
            end = T.min(start + chunk_keys(b), kv_len(b))
            for r in T.unroll(rows):
                rr = bz * rows + r
                m[r] = neg_inf
                l[r] = T.float32(0)
                for x in T.unroll(vec):
                    q_reg[r * vec + x] = T.float32(0)
                    o[r * vec + x] = T.float32(0)
                if rr < n_rows:
                    for x in T.vectorized(vec):
                        q_reg[r * vec + x] = T.Cast(acc, view.query(b, hk * group + rr % group, rr // group, lane * vec + x))
            load(k_next, v_next, row, b, hk, start, end, 0, sub, lane)
            for t in T.serial(T.max(end - start + step - 1, 0) // step):
                for i in T.unroll(unroll * vec):
                    k_reg[i] = k_next[i]
                    v_reg[i] = v_next[i]
                load(k_next, v_next, row, b, hk, start, end, t + 1, sub, lane)
                for r in T.unroll(rows):
                    rr = bz * rows + r
                    for u in T.unroll(unroll):
                        j = start + (t * unroll + u) * subgroups + sub
                        dot[0] = T.float32(0)
                        for x in T.unroll(vec):
                            dot[0] = dot[0] + q_reg[r * vec + x] * T.Cast(acc, k_reg[u * vec + x])
                        for k in T.unroll(int(math.log2(lanes))):
                            dot[0] = dot[0] + T.cuda.__shfl_xor_sync(T.uint32(ALL_LANES), dot[0], 1 << k, 32)
                        s[u] = T.if_then_else(j < end, score(dot[0], b, hk * group + rr % group, rr // group, j), neg_inf)
                    m_new[0] = m[r]
                    for u in T.unroll(unroll):
                        m_new[0] = T.max(m_new[0], s[u])
                    repair[0] = repair_factor(spec.variant, m[r], finite(m_new[0]))
                    l[r] = l[r] * repair[0]
                    for x in T.unroll(vec):
                        o[r * vec + x] = o[r * vec + x] * repair[0]
                    for u in T.unroll(unroll):
                        s[u] = T.exp2(s[u] - finite(m_new[0]))
                        l[r] = l[r] + s[u]
                        for x in T.unroll(vec):
                            o[r * vec + x] = o[r * vec + x] + s[u] * T.Cast(acc, v_reg[u * vec + x])
                    m[r] = m_new[0]
            # The subgroups' states merged: each repaired to the rows' common max.
            for r in T.unroll(rows):
                if lane == 0:
                    merged_m[sub, r] = m[r]
            T.tvm_storage_sync("shared")
            for r in T.unroll(rows):
                m_new[0] = merged_m[0, r]
                for g in T.serial(1, subgroups):
                    m_new[0] = T.max(m_new[0], merged_m[g, r])
                repair[0] = repair_factor(spec.variant, m[r], finite(m_new[0]))
                if lane == 0:
                    merged_l[sub, r] = l[r] * repair[0]
                for x in T.unroll(vec):
                    merged_o[sub, r, lane * vec + x] = o[r * vec + x] * repair[0]
            T.tvm_storage_sync("shared")
            store(merged_m, merged_l, merged_o, part_o, part_m, part_l, tx, b, hk, c, bz * rows, n_rows, dot, m_new)
        combine(part_o, part_m, part_l)

    params = list(view.inputs) + [chunks.param, out] + ([] if lse is None else [lse])
    return tirx.PrimFunc(params, body.body).with_attr("global_symbol", SplitKDecode.name)
