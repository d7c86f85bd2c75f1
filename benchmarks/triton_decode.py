"""Triton kernels for :mod:`benchmarks.decode_floor` (imported on a GPU machine only):
readers of K and V, and a plain split-k decode whose combine is a kernel of its own or
the last chunk program of each K/V head (:data:`COUNTER`, :data:`TAGGED`)."""
import triton
import triton.language as tl

from .decode_floor import ROWS as _ROWS

#: A K/V head's query heads, padded to the 16 rows ``tl.dot`` takes at least.
ROWS = tl.constexpr(_ROWS)
#: ``split_k``'s ``LAST_BLOCK``: the last chunk program of a head, found by a per-head
#: counter that must be zero when the call starts (the last program resets it) ...
COUNTER = tl.constexpr(1)
#: ... or by a per-head word tagged with the call's epoch (any value when the call starts).
TAGGED = tl.constexpr(2)
#: Bits of a tagged word below the epoch: one per chunk.
CHUNK_BITS = tl.constexpr(16)


@triton.jit
def read(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(x.to(tl.float32)))


@triton.jit
def read_chunks(k_ptr, v_ptr, out_ptr, seq, KEYS: tl.constexpr, D: tl.constexpr):
    head = tl.program_id(0).to(tl.int64)
    chunks = tl.num_programs(1)
    tiles = seq // KEYS // chunks
    rows = tl.arange(0, KEYS)[:, None] * D + tl.arange(0, D)[None, :]
    acc = tl.zeros([KEYS, D], dtype=tl.float32)
    for t in range(tiles):
        offs = (head * seq + (tl.program_id(1) * tiles + t) * KEYS) * D + rows
        acc += tl.load(k_ptr + offs).to(tl.float32)
        acc += tl.load(v_ptr + offs).to(tl.float32)
    tl.store(out_ptr + head * chunks + tl.program_id(1), tl.sum(acc))


@triton.jit
def zero(ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(ptr + offs, 0, mask=offs < n)


@triton.jit
def combine_head(pm_ptr, pl_ptr, po_ptr, head, rows, dims, C: tl.constexpr, D: tl.constexpr):
    """The output rows of K/V head ``head`` from its C chunks' partials."""
    m = tl.full([ROWS], -float("inf"), tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    o = tl.zeros([ROWS, D], tl.float32)
    for c in tl.static_range(C):
        part = (head * C + c) * ROWS + rows
        mc = tl.load(pm_ptr + part, cache_modifier=".cg")
        m_new = tl.maximum(m, mc)
        old, new = tl.exp2(m - m_new), tl.exp2(mc - m_new)
        l = l * old + tl.load(pl_ptr + part, cache_modifier=".cg") * new
        o = o * old[:, None] + tl.load(po_ptr + part[:, None] * D + dims[None, :], cache_modifier=".cg") * new[:, None]
        m = m_new
    return o / l[:, None]


@triton.jit
def arrive(word_ptr, epoch, c, C: tl.constexpr):
    """Mark chunk ``c`` of a head arrived in the head's word (the call's ``epoch`` above
    :data:`CHUNK_BITS` bits, a bit per arrived chunk below; a word of another epoch, e.g.
    left by an earlier call, counts as none arrived); whether all ``C`` now have. The
    word changes by compare-and-swap only, so the arrivals of a call are totally ordered
    and exactly one sees them all."""
    tl.debug_barrier()  # (every thread's partials stored before the release below)
    bit = tl.full([], 1, tl.int64) << c.to(tl.int64)
    old = tl.atomic_add(word_ptr, 0, sem="relaxed", scope="gpu")
    new = tl.where((old >> CHUNK_BITS) == epoch, old | bit, (epoch << CHUNK_BITS) | bit)
    seen = tl.atomic_cas(word_ptr, old, new, sem="acq_rel", scope="gpu")
    while seen != old:
        old = seen
        new = tl.where((old >> CHUNK_BITS) == epoch, old | bit, (epoch << CHUNK_BITS) | bit)
        seen = tl.atomic_cas(word_ptr, old, new, sem="acq_rel", scope="gpu")
    every = (1 << C) - 1
    return (new & every) == every


@triton.jit(do_not_specialize=["epoch"])
def split_k(q_ptr, k_ptr, v_ptr, o_ptr, pm_ptr, pl_ptr, po_ptr, count_ptr, word_ptr, epoch, seq, scale,
            G: tl.constexpr, D: tl.constexpr, KEYS: tl.constexpr, C: tl.constexpr, LAST_BLOCK: tl.constexpr):
    head = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    chunk = seq // C
    rows = tl.arange(0, ROWS)
    dims = tl.arange(0, D)
    real = rows[:, None] < G
    q = tl.load(q_ptr + (head * G + rows[:, None]) * D + dims[None, :], mask=real, other=0.0)
    m = tl.full([ROWS], -float("inf"), tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D], tl.float32)
    keys = tl.arange(0, KEYS)
    for start in range(c * chunk, (c + 1) * chunk, KEYS):
        offs = (head * seq + start + keys)[:, None] * D + dims[None, :]
        s = tl.dot(q, tl.trans(tl.load(k_ptr + offs))) * scale
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), tl.load(v_ptr + offs))
        m = m_new
    part = (head * C + c) * ROWS + rows
    tl.store(pm_ptr + part, m)
    tl.store(pl_ptr + part, l)
    tl.store(po_ptr + part[:, None] * D + dims[None, :], acc)
    if LAST_BLOCK:
        if LAST_BLOCK == COUNTER:
            last = tl.atomic_add(count_ptr + head, 1, sem="acq_rel", scope="gpu") == C - 1
        else:
            last = arrive(word_ptr + head, epoch, c, C)
        if last:
            out = combine_head(pm_ptr, pl_ptr, po_ptr, head, rows, dims, C, D)
            tl.store(o_ptr + (head * G + rows[:, None]) * D + dims[None, :], out.to(tl.float16), mask=real)
            if LAST_BLOCK == COUNTER:
                tl.store(count_ptr + head, 0)


@triton.jit
def combine(pm_ptr, pl_ptr, po_ptr, o_ptr, G: tl.constexpr, D: tl.constexpr, C: tl.constexpr):
    head = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, ROWS)
    dims = tl.arange(0, D)
    out = combine_head(pm_ptr, pl_ptr, po_ptr, head, rows, dims, C, D)
    tl.store(o_ptr + (head * G + rows[:, None]) * D + dims[None, :], out.to(tl.float16), mask=rows[:, None] < G)
