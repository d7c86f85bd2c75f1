"""Attention with a mask tensor input on the GPU: tvm-cascade's runtime-length kernel
reading the mask (``attention_kernel(..., mask=MaskTensor(...))``, boolean and float16)
beside the same kernel without a mask and cuDNN's SDPA given the float16 mask, timed
side by side on one GPU.

    python -m benchmarks.masks [--out DIR] [--only NAME ...]

Decode shapes take a ``[b, 1, 1, skv]`` padding mask hiding a tenth of the keys at
random; prefill shapes a ``[b, 1, s, s]`` causal mask with the first eighth of the keys
hidden (left padding; the padded rows see every key), beside the causal kernel without a
mask (which skips the tiles above the diagonal; the prefill reading a mask skips the key
tiles the mask hides from every row of a row tile, found by a scan of the mask first).
Every output is checked first against float32 SDPA with the boolean mask; a peer that is
wrong or fails shows its reason instead of a time (FlashAttention-2 takes no mask).
Times are medians of CUDA-event timed calls with the L2 cache flushed before each
(:func:`benchmarks.timing.bench`). Prints a progress line per shape and a table; writes
``masks.json`` and ``masks.md``.
"""
from __future__ import annotations

import sys
from typing import Dict, List, Optional, Sequence

from .attention import named, run_shapes, shapes_parser, write_table
from .timing import bench

PEERS = ("tvm-cascade, no mask", "tvm-cascade, bool mask", "tvm-cascade, float16 mask", "sdpa cudnn, float16 mask")
#: (name, batch, heads_q, heads_kv, head_dim, queries, keys)
SHAPES = (
    ("decode b16 x 8000", 16, 32, 8, 128, 1, 8000),
    ("decode b64 x 4096", 64, 32, 8, 128, 1, 4096),
    ("decode b1 x 32768", 1, 32, 8, 128, 1, 32768),
    ("prefill 1 x 2048", 1, 32, 8, 128, 2048, 2048),
    ("prefill 4 x 1000", 4, 32, 8, 128, 1000, 1000),
    ("prefill 2 x 4096", 2, 32, 8, 128, 4096, 4096),
)
TOLERANCE = 2e-3


def visible_keys(batch: int, queries: int, keys: int):
    """The boolean mask of a shape (True: the key is seen), as the module docstring says."""
    import torch

    if queries == 1:
        torch.manual_seed(1)
        return torch.rand(batch, 1, 1, keys, device="cuda") < 0.9
    seen = torch.ones(queries, keys, device="cuda", dtype=torch.bool).tril(keys - queries)[None, None]
    seen = seen.repeat(batch, 1, 1, 1)
    seen[:, :, :, : keys // 8] = False
    seen[:, :, : queries // 8] = True
    return seen


def run_shape(shape) -> List[Dict]:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tvm_cascade.kernels import attention_kernel
    from tvm_cascade.library import MaskTensor

    name, batch, heads_q, heads_kv, head_dim, queries, keys = shape
    torch.manual_seed(0)
    q = torch.randn(batch, heads_q, queries, head_dim, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(batch, heads_kv, keys, head_dim, device="cuda", dtype=torch.float16) for _ in range(2))
    seen = visible_keys(batch, queries, keys)
    additive = torch.where(seen, 0.0, float("-inf")).to(torch.float16)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=seen,
                                                           enable_gqa=True)
    broadcast = dict(queries=queries > 1)
    plain = attention_kernel(heads_q, heads_kv, head_dim, variant="causal" if queries > 1 else None,
                             dtype="float16", target="cuda")
    kernels = {form: attention_kernel(heads_q, heads_kv, head_dim, dtype="float16", target="cuda",
                                      mask=MaskTensor(form, **broadcast)) for form in ("bool", "float16")}

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=additive, enable_gqa=True)

    calls = {
        PEERS[0]: lambda: plain(q, k, v),
        PEERS[1]: lambda: kernels["bool"](q, k, v, seen),
        PEERS[2]: lambda: kernels["float16"](q, k, v, additive),
        PEERS[3]: cudnn,
    }
    rows = []
    for peer, call in calls.items():
        row = {"shape": name, "peer": peer}
        try:
            out = call()
        except RuntimeError as err:  # the backend does not take this configuration
            row["error"] = str(err).splitlines()[0]
            rows.append(row)
            continue
        # (the unmasked kernel is the causal one: checked against itself, timed)
        expected = torch.nn.functional.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), is_causal=queries > 1, enable_gqa=True) if peer == PEERS[0] else ref
        row["relative error"] = ((out.float() - expected).norm() / expected.norm()).item()
        if row["relative error"] < TOLERANCE:
            row["ms"] = bench(call)
        else:
            row["error"] = f"relative error {row['relative error']:.2e}"
        rows.append(row)
    return rows


def markdown(results: List[Dict]) -> str:
    lines = ["| shape (heads 32/8, head dim 128) | " + " | ".join(f"{p} ms" for p in PEERS)
             + " | best mask vs cuDNN |", "|---|" + "---|" * (len(PEERS) + 1)]
    for shape in dict.fromkeys(r["shape"] for r in results):
        rows = {r["peer"]: r for r in results if r["shape"] == shape}
        cells = [f"{rows[p]['ms']:.4f}" if rows.get(p, {}).get("ms") else "fails" for p in PEERS]
        masked = [rows[p]["ms"] for p in PEERS[1:3] if rows.get(p, {}).get("ms")]
        cudnn = rows.get(PEERS[3], {}).get("ms")
        ratio = f"{cudnn / min(masked):.2f}x" if masked and cudnn else "--"
        lines.append(f"| {shape} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = shapes_parser("benchmarks.masks", __doc__, "masks.json and .md").parse_args(argv)
    results = run_shapes("benchmarks.masks", args.out, argv, named(SHAPES, args.only), run_shape)
    if results is None:
        return 0
    write_table("benchmarks.masks", args.out, results, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
