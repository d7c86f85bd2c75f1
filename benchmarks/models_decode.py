"""Decode at the shapes models have: ``tvm_cascade.kernels.attention_kernel`` (one kernel a
model, lengths at run time) beside PyTorch SDPA (cuDNN, FlashAttention-2) on one GPU.

    python -m benchmarks.models_decode [--out DIR] [--only NAME ...]

Each configuration runs the library's kernel in the bhsd layout and in the paged layout
(pages of 16 keys in a shuffled pool, as TVM's paged KV cache holds them; the call
planned once, as a model's layers share a step's plan), and SDPA on the bhsd tensors
where one query row makes causal masking moot. Every output is checked against float32
SDPA first; times are medians of CUDA-event timed calls with the L2 cache flushed before
each (:func:`benchmarks.timing.bench`); the roofline is the bytes of K, V, Q and the
output over the measured copy bandwidth. Prints a table, writes ``models_decode.json``.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import List, Optional, Sequence

from .attention import environment, skip_without_gpu
from .timing import bench, copy_bandwidth_gbps

PAGE_SIZE = 16
#: Relative Frobenius error allowed against float32 SDPA (fp16 inputs and output).
TOLERANCE = 2e-3


@dataclass(frozen=True)
class Shape:
    name: str
    heads_q: int
    heads_kv: int
    head_dim: int
    batch: int
    queries: int
    keys: int


SHAPES = (
    Shape("llama3-8b-b1-kv4096", 32, 8, 128, 1, 1, 4096),
    Shape("llama3-8b-b16-kv8000", 32, 8, 128, 16, 1, 8000),
    Shape("llama3-8b-b64-kv4096", 32, 8, 128, 64, 1, 4096),
    Shape("llama3-8b-b1-kv32768", 32, 8, 128, 1, 1, 32768),
    Shape("llama3-70b-tp8-b16-kv8000", 8, 1, 128, 16, 1, 8000),
    Shape("qwen2-7b-b16-kv8000", 28, 4, 128, 16, 1, 8000),
    Shape("gemma2-9b-b16-kv4096", 16, 8, 256, 16, 1, 4096),
    Shape("d64-b16-kv4096", 16, 16, 64, 16, 1, 4096),
    Shape("mha-b1-kv2048", 32, 32, 128, 1, 1, 2048),
    Shape("llama3-8b-spec4-b16-kv4096", 32, 8, 128, 16, 4, 4096),
)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.models_decode", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/out"), help="where models_decode.json goes")
    p.add_argument("--only", nargs="+", choices=[s.name for s in SHAPES], help="run these shapes only")
    return p.parse_args(argv)


def paged(q, k, v, page_size: int = PAGE_SIZE):
    """The paged layout's tensors of bhsd ``q, k, v``: ragged queries, and K/V in pages
    of ``page_size`` keys taken from the pool in a random order."""
    import torch

    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    count = -(-skv // page_size)
    pad = count * page_size - skv

    def pages_of(x):
        x = torch.nn.functional.pad(x, (0, 0, 0, pad)).reshape(b, hkv, count, page_size, d)
        return x.permute(0, 2, 1, 3, 4).reshape(b * count, hkv, page_size, d)

    order = torch.randperm(b * count, device=q.device)
    pool = torch.empty(b * count, 2, hkv, page_size, d, device=q.device, dtype=q.dtype)
    pool[order, 0] = pages_of(k)
    pool[order, 1] = pages_of(v)
    as_i32 = lambda x: x.to(torch.int32)  # noqa: E731
    return (
        q.permute(0, 2, 1, 3).reshape(b * sq, hq, d).contiguous(),
        pool,
        as_i32(torch.arange(b + 1, device=q.device) * sq),
        as_i32(torch.arange(b + 1, device=q.device) * count),
        as_i32(order),
        torch.full((b,), skv - (count - 1) * page_size, device=q.device, dtype=torch.int32),
    )


def run_shape(shape: Shape, bandwidth: float) -> List[dict]:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tvm_cascade.kernels import attention_kernel

    sdpa = torch.nn.functional.scaled_dot_product_attention
    s = shape
    q, k, v = (torch.randn(s.batch, h, n, s.head_dim, device="cuda", dtype=torch.float16)
               for h, n in ((s.heads_q, s.queries), (s.heads_kv, s.keys), (s.heads_kv, s.keys)))
    group = s.heads_q // s.heads_kv
    visible = torch.arange(s.keys, device="cuda")[None, :] <= torch.arange(s.queries, device="cuda")[:, None] + s.keys - s.queries
    ref = sdpa(q.float(), k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1), attn_mask=visible)
    moved = 2 * (q.numel() + 2 * k.numel())  # bytes of Q, K, V and the output
    roofline = moved / (bandwidth * 1e9) * 1e3
    rows = []

    def record(name, run, out):
        err = ((out.float() - ref).norm() / ref.norm()).item()
        ms = bench(run) if err < TOLERANCE else None
        rows.append({"shape": s.name, "implementation": name, "error": err, "ms": ms,
                     "roofline": roofline / ms if ms else None})

    for layout in ("bhsd", "paged"):
        kernel = attention_kernel(s.heads_q, s.heads_kv, s.head_dim, variant="causal", dtype="float16",
                                  layout=layout, target="cuda")
        args = (q, k, v) if layout == "bhsd" else paged(q, k, v)
        plan = kernel.plan(*args)
        out = kernel(*args, plan=plan)
        if layout == "paged":
            out = out.reshape(s.batch, s.queries, s.heads_q, s.head_dim).permute(0, 2, 1, 3)
        record(f"tvm-cascade {layout} ({plan.family.name})", lambda: kernel(*args, plan=plan), out)
    if s.queries == 1:
        for backend in ("CUDNN_ATTENTION", "FLASH_ATTENTION"):
            def peer(backend=backend):
                with sdpa_kernel(getattr(SDPBackend, backend)):
                    return sdpa(q, k, v, enable_gqa=group > 1)

            record(f"sdpa {backend.split('_')[0].lower()}", peer, peer())
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if skip_without_gpu("benchmarks.models_decode"):
        return 0
    bandwidth = copy_bandwidth_gbps()
    shapes = [s for s in SHAPES if not args.only or s.name in args.only]
    results = []
    print(f"copy bandwidth {bandwidth:.0f} GB/s", flush=True)
    for shape in shapes:
        rows = run_shape(shape, bandwidth)
        results.extend(rows)
        best = min((r["ms"] for r in rows if r["ms"] and r["implementation"].startswith("sdpa")), default=None)
        for r in rows:
            ms = f"{r['ms']:.4f}" if r["ms"] else "wrong"
            ratio = f"{best / r['ms']:.2f}x best SDPA" if best and r["ms"] else ""
            roof = f"{100 * r['roofline']:.0f}% roofline" if r["roofline"] else ""
            print(f"{shape.name:28s} {r['implementation']:36s} {ms:>8s} ms  {roof:14s} {ratio}  (err {r['error']:.1e})",
                  flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    env = environment(argv)
    env["command"] = " ".join(["python", "-m", "benchmarks.models_decode", *argv])
    (args.out / "models_decode.json").write_text(json.dumps(
        {"environment": env, "copy_bandwidth_gbps": bandwidth, "shapes": [asdict(s) for s in shapes],
         "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
