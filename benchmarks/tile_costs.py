"""Where a prefill's time goes: the warp-specialised prefill and cuDNN's SDPA over as many
128-row tiles with more and more key tiles, timed side by side on one GPU.

    python -m benchmarks.tile_costs [--out DIR] [--only NAME ...]

4 sequences of 1024 queries (32/8 heads, head dim 128, fp16, no mask: 1024 row tiles of
128 queries and one head) over 128 to 2048 keys. A least-squares line through each
peer's times splits them into a cost per key tile (the slope, over all row tiles) and a
cost per row tile (the line at no keys, per row tile a multiprocessor takes in turn):
short sequences have few key tiles per row tile, so the second decides their time. To
see inside one call: ``ncu --clock-control none --set full -k regex:warp_specialized -c 1
python -m benchmarks.tile_costs --only "over 128 keys"``. Every output is checked first
against float32 SDPA. Times are medians of CUDA-event timed calls with the L2 cache
flushed before each (:func:`benchmarks.timing.bench`). Prints a progress line per shape
and a table; writes ``tile_costs.json`` and ``tile_costs.md``.
"""
from __future__ import annotations

import sys
from typing import Dict, List, Optional, Sequence

from .attention import named, run_shapes, shapes_parser, write_table
from .timing import bench

PEERS = ("tvm-cascade", "sdpa cudnn")
BATCH, QUERIES, HEADS_Q, HEADS_KV, HEAD_DIM = 4, 1024, 32, 8, 128
ROWS, KEYS = 128, 128
#: (name, keys)
SHAPES = tuple((f"{BATCH} x {QUERIES} over {keys} keys", keys) for keys in (128, 256, 512, 1024, 2048))
TOLERANCE = 2e-3


def run_shape(shape) -> List[Dict]:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tvm_cascade.kernels import attention_kernel

    name, keys = shape
    torch.manual_seed(0)
    q = torch.randn(BATCH, HEADS_Q, QUERIES, HEAD_DIM, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(BATCH, HEADS_KV, keys, HEAD_DIM, device="cuda", dtype=torch.float16) for _ in range(2))
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
    kernel = attention_kernel(HEADS_Q, HEADS_KV, HEAD_DIM, dtype="float16", target="cuda")
    plan = kernel.plan(q, k, v)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    rows = []
    for peer, call in zip(PEERS, (lambda: kernel(q, k, v, plan=plan), cudnn)):
        out = call()
        row = {"shape": name, "peer": peer, "keys": keys,
               "relative error": ((out.float() - ref).norm() / ref.norm()).item()}
        if peer == PEERS[0]:
            row["family"] = plan.family.name
        if row["relative error"] < TOLERANCE:
            row["ms"] = bench(call)
        else:
            row["error"] = f"relative error {row['relative error']:.2e}"
        rows.append(row)
    return rows


def fit(results: List[Dict], peer: str, multiprocessors: int):
    """``(per key tile, per row tile)`` in us of ``peer``'s times: the slope of the
    least-squares line through (key tiles, time), and its value at no key tiles over the
    row tiles each of ``multiprocessors`` takes; None with fewer than two times."""
    points = [(-(-r["keys"] // KEYS), r["ms"] * 1e3) for r in results if r["peer"] == peer and r.get("ms")]
    if len({x for x, _ in points}) < 2:
        return None
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    row_tiles = BATCH * HEADS_Q * -(-QUERIES // ROWS)
    return slope, (my - slope * mx) / (row_tiles / multiprocessors)


def markdown(results: List[Dict], multiprocessors: int) -> str:
    lines = ["| shape (heads 32/8, head dim 128, no mask) | " + " | ".join(f"{p} ms" for p in PEERS) + " | ratio |",
             "|---|" + "---|" * (len(PEERS) + 1)]
    for shape in dict.fromkeys(r["shape"] for r in results):
        rows = {r["peer"]: r for r in results if r["shape"] == shape}
        times = [rows.get(p, {}).get("ms") for p in PEERS]
        cells = [f"{t:.4f}" if t else "fails" for t in times]
        ratio = f"{times[1] / times[0]:.2f}x" if all(times) else "--"
        lines.append(f"| {shape} | " + " | ".join(cells) + f" | {ratio} |")
    lines += ["", "| peer | per key tile (all row tiles) | per row tile (each multiprocessor's) |", "|---|---|---|"]
    for peer in PEERS:
        costs = fit(results, peer, multiprocessors)
        cells = [f"{costs[0]:.1f} us", f"{costs[1]:.1f} us"] if costs else ["--", "--"]
        lines.append(f"| {peer} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = shapes_parser("benchmarks.tile_costs", __doc__, "tile_costs.json and .md").parse_args(argv)
    results = run_shapes("benchmarks.tile_costs", args.out, argv, named(SHAPES, args.only), run_shape)
    if results is None:
        return 0
    import torch

    multiprocessors = torch.cuda.get_device_properties(0).multi_processor_count
    write_table("benchmarks.tile_costs", args.out, results, lambda rows: markdown(rows, multiprocessors))
    return 0


if __name__ == "__main__":
    sys.exit(main())
