"""CUDA-event timing in the style of ``triton.testing.do_bench`` (torch imported lazily).

Every timed iteration is preceded by an L2 flush (:data:`FLUSHES`): by default reading a
256 MiB buffer, which evicts the L2 cache (50 MB on H100 and H200), so each call
reads its inputs from HBM as it would inside a model; only the call itself lies between
its two events.
"""

from __future__ import annotations

import math
import statistics

L2_FLUSH_BYTES = 256 << 20
#: How :func:`bench` evicts the L2 cache before each timed call: ``"read"`` reads the
#: flush buffer, leaving L2 holding clean lines; ``"zero"`` writes it, as
#: ``triton.testing.do_bench`` does, leaving L2 holding dirty lines whose write-back to
#: HBM then runs during the timed call (H200: a bare streaming read of 134 MB timed 33.8
#: µs after a read flush and 42.1 µs after a zeroing one: RESULTS, "The L2 flush");
#: ``"none"`` flushes nothing.
FLUSHES = ("read", "zero", "none")
WARMUP_ITERS = 10
WARMUP_MS = 100.0
REP_MS = 200.0
MIN_REPS, MAX_REPS = 5, 100
COPY_BYTES = 1 << 30


def l2_flush(kind: str = "read"):
    """A function that evicts the L2 cache as ``kind`` (one of :data:`FLUSHES`) says."""
    if kind not in FLUSHES:
        raise ValueError(f"no L2 flush '{kind}': one of {', '.join(FLUSHES)}")
    if kind == "none":
        return lambda: None
    import torch

    buffer = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    if kind == "zero":
        return buffer.zero_
    total = torch.empty((), dtype=torch.int64, device="cuda")
    return lambda: torch.sum(buffer, dim=0, out=total)


def bench(fn, flush: str = "read") -> float:
    """Median milliseconds of ``fn()``, the L2 cache flushed before each timed call as
    ``flush`` says (:data:`FLUSHES`): warm-up, then ``REP_MS`` worth of repetitions.

    Up to ``WARMUP_ITERS`` warm-up calls (fewer if they would exceed
    ``WARMUP_MS``), then ``ceil(REP_MS / estimate)`` timed calls clamped to
    ``[MIN_REPS, MAX_REPS]``.
    """
    import torch

    evict = l2_flush(flush)

    def timed(n: int):
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)
        ]
        for start, end in events:
            evict()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in events]

    estimate = timed(1)[0]
    for _ in range(min(WARMUP_ITERS, max(1, math.ceil(WARMUP_MS / max(estimate, 1e-3))))):
        fn()
    estimate = statistics.median(timed(3))
    reps = min(MAX_REPS, max(MIN_REPS, math.ceil(REP_MS / max(estimate, 1e-3))))
    return statistics.median(timed(reps))


def copy_bandwidth_gbps() -> float:
    """Measured device-to-device copy bandwidth: (bytes read + written) / time, in GB/s."""
    import torch

    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), flush="none")
    return 2 * COPY_BYTES / (ms * 1e6)
