"""CUDA-event timing in the style of ``triton.testing.do_bench`` (torch imported lazily).

Every timed iteration is preceded by zeroing a 256 MiB buffer, which evicts
the L2 cache (50 MB on H100), so each call reads its inputs from HBM as it
would inside a model; only the call itself lies between its two events.
"""

from __future__ import annotations

import math
import statistics

L2_FLUSH_BYTES = 256 << 20
WARMUP_ITERS = 10
WARMUP_MS = 100.0
REP_MS = 200.0
MIN_REPS, MAX_REPS = 5, 100
COPY_BYTES = 1 << 30


def bench(fn, flush_l2: bool = True) -> float:
    """Median milliseconds of ``fn()``: warm-up, then ``REP_MS`` worth of repetitions.

    Up to ``WARMUP_ITERS`` warm-up calls (fewer if they would exceed
    ``WARMUP_MS``), then ``ceil(REP_MS / estimate)`` timed calls clamped to
    ``[MIN_REPS, MAX_REPS]``.
    """
    import torch

    flush = torch.empty(L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")

    def timed(n: int):
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)
        ]
        for start, end in events:
            if flush_l2:
                flush.zero_()
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
    ms = bench(lambda: dst.copy_(src), flush_l2=False)
    return 2 * COPY_BYTES / (ms * 1e6)
