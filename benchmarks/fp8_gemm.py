"""Per-token fp8 quantisation + GEMM on the GPU: tvm-cascade's one kernel (X's rows
quantised to e4m3 inside the GEMM's k loop by their running abs-max, the accumulators
repaired when it grows: :mod:`tvm_cascade.schedules.warp_specialized_fp8_gemm`, the
kernel :func:`~tvm_cascade.schedules.warp_specialized_fp8_gemm.kernel_for` picks for
the shape's M, and its one function for any M that picks at run time), and its two
kernels for the usual two-pass quantisation (each row by its abs-max over all of K:
:mod:`tvm_cascade.schedules.fp8_two_pass`), beside
the two-kernel path users run (a quantisation kernel, then ``torch._scaled_mm`` with
row-wise scales; the quantisation eager and ``torch.compile``d), ``torch.compile`` of
the whole (both compiled for each shape: :func:`benchmarks.peers.compiled_per_shape`),
and cuBLAS's float16 GEMM of the unquantised operands for reference.

    python -m benchmarks.fp8_gemm [--out DIR] [--only NAME ...] [--tune TRIALS] [--records DIR]

X is [M, K] float16, W [N, K] float8_e4m3fn with a float32 scale per output channel,
the output [M, N] float16. Every output is checked first against float64 PyTorch:
tvm-cascade's against its definition (:func:`tvm_cascade.ops.reference.fp8_quant_gemm_ref`
with the kernel's k tile, 128 or all of K, emulated in float64 on the GPU; largest error under 0.1% of
the largest output), every peer's against the unquantised product (under 5%: fp8's
own rounding); the table gives each one's error against the unquantised product. Times
are medians of CUDA-event timed calls with the L2 cache flushed before each
(:func:`benchmarks.timing.bench`). Prints a progress line per shape and a table; writes
``fp8_gemm.json`` and ``fp8_gemm.md``. With ``--records DIR`` or ``--tune TRIALS``,
"tvm-cascade (tuned)" and "tvm-cascade (tuned), two passes" are the unfused
``ops.fp8_quant_gemm`` with k tiles of 128 and of all of K from their best MetaSchedule
records in ``DIR`` (:mod:`benchmarks.tuned_peer`; the package's,
``python/tvm_cascade/tuned/cascades``, hold 16 x 4096 x 14336 with both k tiles and 2048 x
4096 x 14336 with one), ``--tune`` tuning into it first (random cost model), each checked against its
definition.
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from . import tuned_peer
from .cascades import _reason, eager
from .peers import compiled_per_shape
from .timing import bench

PEERS = (
    "tvm-cascade", "tvm-cascade, any M", "tvm-cascade, two passes", "quantise + _scaled_mm",
    "quantise (compiled) + _scaled_mm", "torch.compile", "fp16 cuBLAS GEMM",
)
#: The peers checked against the definition (tvm-cascade's kernels), by the definition's
#: k tile (None: all of k, the two-pass quantisation).
OURS = {"tvm-cascade": 128, "tvm-cascade, any M": 128, "tvm-cascade, two passes": None}
TWO_KERNELS = "quantise (compiled) + _scaled_mm"
#: The compiled two-kernel paths; a row's speed-up is against the faster of them (which
#: one is faster depends on the shape: each fuses the quantisation its own way).
COMPILED = (TWO_KERNELS, "torch.compile")
VS = "vs compiled"
#: (name, M, K, N)
SHAPES = (
    ("fp8 gemm 1 x 4096 x 14336", 1, 4096, 14336),
    ("fp8 gemm 16 x 4096 x 14336", 16, 4096, 14336),
    ("fp8 gemm 32 x 4096 x 14336", 32, 4096, 14336),
    ("fp8 gemm 16 x 14336 x 4096", 16, 14336, 4096),
    ("fp8 gemm 16 x 4096 x 4096", 16, 4096, 4096),
    ("fp8 gemm 64 x 4096 x 14336", 64, 4096, 14336),
    ("fp8 gemm 256 x 4096 x 14336", 256, 4096, 14336),
    ("fp8 gemm 2048 x 4096 x 14336", 2048, 4096, 14336),
    ("fp8 gemm 8192 x 4096 x 14336", 8192, 4096, 14336),
    ("fp8 gemm 2048 x 14336 x 4096", 2048, 14336, 4096),
    ("fp8 gemm 8192 x 4096 x 4096", 8192, 4096, 4096),
    ("fp8 gemm 2000 x 4096 x 14336", 2000, 4096, 14336),
)
FP8_MAX = 448.0
EPS = 1e-12
#: Largest error against the definition (tvm-cascade) and against the unquantised
#: product (every peer), relative to the largest output.
DEFINITION_ERROR, PRODUCT_ERROR = 1e-3, 5e-2


def quantise(x):
    """Per-token e4m3 quantisation: X's rows scaled to 448 at their abs-max; the scales to
    undo it."""
    import torch

    peak = x.abs().amax(dim=1, keepdim=True).float().clamp(min=EPS)
    return (x.float() * (FP8_MAX / peak)).to(torch.float8_e4m3fn), peak / FP8_MAX


def scaled_mm(xq, x_scale, w, w_scale):
    import torch

    return torch._scaled_mm(xq, w.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1), out_dtype=torch.float16)


def rolling_reference(x, w, w_scale, tile):
    """:func:`tvm_cascade.ops.reference.fp8_quant_gemm_ref` with ``tile``, in float64 on
    the GPU (the quantised values exactly as a float32 GPU computes them)."""
    import torch

    x32 = x.float()
    out = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float64, device=x.device)
    peak = torch.zeros(x.shape[0], 1, device=x.device)
    w64 = w.double()
    for k0 in range(0, x.shape[1], tile):
        part = x32[:, k0:k0 + tile]
        peak = torch.maximum(peak, part.abs().amax(dim=1, keepdim=True))
        # (a tensor divided: PyTorch computes a number over a tensor as a reciprocal times it)
        scale = torch.full_like(peak, FP8_MAX) / peak.clamp(min=EPS)
        q = (part * scale).to(torch.float8_e4m3fn).double()
        out += (q @ w64[:, k0:k0 + tile].T) / scale.double()
    return out * w_scale.double()[None, :]


#: The tuned peers (with ``--tune`` or ``--records``): ``ops.fp8_quant_gemm`` with k tiles
#: of 128 and with one of all of K (the two-pass quantisation), from their best records.
TUNED_TILES = {tuned_peer.TUNED: 128, f"{tuned_peer.TUNED}, two passes": None}


def run_shape(shape, tune: int = 0, work_dir: Optional[Path] = None, records: Optional[Path] = None) -> List[Dict]:
    import torch
    import tvm

    from tvm_cascade.schedules import warp_specialized_fp8_gemm as fp8

    name, m, k, n = shape
    target = tvm.target.Target.from_device(tvm.cuda(0))
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    w_full = torch.randn(n, k, device="cuda") / k**0.5
    w_scale = w_full.abs().amax(dim=1) / FP8_MAX
    w = (w_full / w_scale[:, None]).to(torch.float8_e4m3fn)
    product = x.double() @ (w.double() * w_scale.double()[:, None]).T
    definitions = {tile: rolling_reference(x, w, w_scale, tile or k) for tile in set(OURS.values())}
    w16 = (w.float() * w_scale[:, None]).half().T.contiguous()
    out = torch.empty(m, n, device="cuda", dtype=torch.float16)

    def ours(build):
        def built():
            kernel = build()
            tvm_args = [tvm.runtime.from_dlpack(t) for t in (x, w, w_scale, out)]
            return (lambda: kernel(*tvm_args)), (lambda: out)

        return built

    def tuned(tile):
        def build():
            from tvm_cascade.ops import cascades

            func = cascades.fp8_quant_gemm(m, n, k, tile=tile or k)
            logs = work_dir / f"{name}, {tile or k}".replace(" ", "_").replace(",", "")
            return tuned_peer.tuned_kernel(func, target, tune, records, logs, cost_model="random")[0]

        return ours(build)

    two_kernels = lambda q: lambda a, b, s: scaled_mm(*q(a), b, s)  # noqa: E731
    builders = {
        "tvm-cascade": ours(lambda: fp8.build(fp8.kernel_for(m, n, k), target)["main"]),
        "tvm-cascade, any M": ours(lambda: _any_m(n, k, target)),
        "tvm-cascade, two passes": ours(lambda: fp8.build(fp8.kernel_for(m, n, k, tile=k), target)["main"]),
        "quantise + _scaled_mm": eager(two_kernels(quantise), x, w, w_scale),
        TWO_KERNELS: eager(two_kernels(compiled_per_shape(quantise)), x, w, w_scale),
        "torch.compile": eager(compiled_per_shape(two_kernels(quantise)), x, w, w_scale),
        "fp16 cuBLAS GEMM": eager(torch.matmul, x, w16),
        **{peer: tuned(tile) for peer, tile in TUNED_TILES.items()},
    }
    ours_by_tile = {**OURS, **TUNED_TILES}
    results = []
    for peer in PEERS + (tuple(TUNED_TILES) if tune or records is not None else ()):
        row = {"shape": name, "peer": peer}
        try:
            call, result = builders[peer]()
            call()
            torch.cuda.synchronize()
            got = result().double()
            row["relative error"] = (got - product).abs().max().item() / product.abs().max().item()
            wrong = None
            if peer in ours_by_tile:
                definition = definitions[ours_by_tile[peer]]
                off = (got - definition).abs().max().item() / definition.abs().max().item()
                if off > DEFINITION_ERROR:
                    wrong = f"off its definition by {off:.2e} of the largest output"
            if row["relative error"] > PRODUCT_ERROR:
                wrong = f"off the product by {row['relative error']:.2e} of the largest output"
            if wrong:
                row["error"] = wrong
            else:
                row["ms"] = bench(call)
                row["TFLOP/s"] = 2 * m * n * k / row["ms"] / 1e9
        except Exception as err:  # a peer that fails shows why, the others still run
            row["error"] = _reason(err)
        results.append(row)
    return against_compiled(results)


def against_compiled(results: List[Dict]) -> List[Dict]:
    """``results`` (one shape's rows), each with its speed-up over the faster of the
    :data:`COMPILED` peers that ran, under :data:`VS`."""
    base = min((r["ms"] for r in results if r["peer"] in COMPILED and r.get("ms")), default=None)
    for row in results:
        row[VS] = base / row["ms"] if base and row.get("ms") else None
    return results


@functools.lru_cache(maxsize=None)
def _any_m(n, k, target):
    """:func:`~tvm_cascade.schedules.warp_specialized_fp8_gemm.kernel_for`'s one function
    for a variable token count (its kernel chosen at run time), built once per N and K."""
    import tvm

    from tvm_cascade.schedules import warp_specialized_fp8_gemm as fp8

    return fp8.build(fp8.kernel_for(tvm.tirx.Var("m", "int64"), n, k), target)["main"]


def markdown(results: List[Dict]) -> str:
    peers = PEERS + tuple(p for p in TUNED_TILES if any(r["peer"] == p for r in results))
    lines = [
        "| shape | " + " | ".join(f"{p} ms" for p in peers)
        + " | tvm-cascade TFLOP/s | vs the faster compiled two-kernel path: one kernel / two passes"
        " | error: tvm-cascade / two kernels |",
        "|---|" + "---|" * (len(peers) + 3),
    ]
    for shape in dict.fromkeys(r["shape"] for r in results):
        rows = {r["peer"]: r for r in results if r["shape"] == shape}
        cells = [f"{rows[p]['ms']:.4f}" if rows.get(p, {}).get("ms") else "fails" if p in rows else "--" for p in peers]
        ours = rows["tvm-cascade"]
        extra = [f"{ours['TFLOP/s']:.0f}" if ours.get("ms") else "--"]
        extra.append(" / ".join(f"{rows[p][VS]:.2f}x" if rows.get(p, {}).get(VS) else "--"
                                for p in ("tvm-cascade", "tvm-cascade, two passes")))
        errors = [rows.get(p, {}).get("relative error") for p in ("tvm-cascade", TWO_KERNELS)]
        extra.append(" / ".join(f"{e:.2e}" if e is not None else "--" for e in errors))
        lines.append(f"| {shape} | " + " | ".join(cells + extra) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    tuned_peer.main("benchmarks.fp8_gemm", __doc__, "fp8_gemm.json and .md", SHAPES, run_shape, markdown,
                    list(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
