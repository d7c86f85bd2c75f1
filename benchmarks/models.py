"""Causal attention at the shapes models have, prefill and decode:
``tvm_cascade.kernels.attention_kernel`` (one kernel a model, lengths at run time)
beside PyTorch SDPA (cuDNN, FlashAttention-2), compiled FlexAttention and TVM's own LLM
kernels (``relax.frontend.nn.llm``'s paged decode and ragged prefill, what a TVM model's
KV cache runs) on one GPU.

    python -m benchmarks.models [--out DIR] [--only NAME ...] [--peers sdpa flex tvm-llm]

Each configuration runs the library's kernel in the bhsd layout and in the layout a
server holds it in: paged for decode (pages of 16 keys in a shuffled pool, as TVM's
paged KV cache holds them), ragged for prefill (sequences packed along tokens, as
FlashAttention's varlen); calls are planned once, as a model's layers share a step's
plan. SDPA runs on the bhsd tensors, causal aligned to the end of the keys (its
``causal_lower_right`` where there are more keys than queries). Every output is checked
against float32 SDPA first; times are medians of CUDA-event timed calls with the L2
cache flushed before each (:func:`benchmarks.timing.bench`); the roofline (decode) is
the bytes of K, V, Q and the output over the measured copy bandwidth, the TFLOP/s
(prefill) count the visible (query, key) pairs' 4·head_dim FLOPs. Prints a table,
writes ``models.json``.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import List, Optional, Sequence

from .attention import environment, skip_without_gpu
from .prebuild import prebuild
from .timing import bench, copy_bandwidth_gbps

PAGE_SIZE = 16
PEERS = ("sdpa", "flex", "tvm-llm")
#: Relative Frobenius error allowed against float32 SDPA (fp16 or bf16 inputs and output).
TOLERANCE = {"float16": 2e-3, "bfloat16": 1.6e-2}


@dataclass(frozen=True)
class Shape:
    name: str
    heads_q: int
    heads_kv: int
    head_dim: int
    batch: int
    queries: int
    keys: int
    dtype: str = "float16"
    window: Optional[int] = None  # a sliding window (of keys a query sees) on the causal mask
    softcap: Optional[float] = None

    @property
    def decode(self) -> bool:
        """Whether the shape is a decode step (at most 8 query rows: speculative decode)."""
        return self.queries <= 8

    def variant(self):
        from tvm_cascade.ops import AttentionVariant

        return AttentionVariant(self.name, causal=True, window=self.window, softcap=self.softcap)


@dataclass(frozen=True)
class _Operator:
    """What :func:`benchmarks.peers.flex` reads of a :class:`benchmarks.configs.Operator`,
    for a shape's own window and softcap."""

    kind: str
    name: str
    heads_q: int
    heads_kv: int
    window: Optional[int]
    softcap: Optional[float]
    causal: bool = True
    alibi: bool = False


SHAPES = (
    Shape("llama3-8b-b1-kv4096", 32, 8, 128, 1, 1, 4096),
    Shape("llama3-8b-b16-kv8000", 32, 8, 128, 16, 1, 8000),
    Shape("llama3-8b-b64-kv4096", 32, 8, 128, 64, 1, 4096),
    Shape("llama3-8b-b1-kv32768", 32, 8, 128, 1, 1, 32768),
    Shape("llama3-70b-tp8-b16-kv8000", 8, 1, 128, 16, 1, 8000),
    Shape("qwen2-7b-b16-kv8000", 28, 4, 128, 16, 1, 8000),
    Shape("gemma2-9b-b16-kv4096", 16, 8, 256, 16, 1, 4096),
    Shape("d64-b16-kv4096", 16, 16, 64, 16, 1, 4096),
    Shape("phi3-mini-b16-kv4096", 32, 32, 96, 16, 1, 4096),
    Shape("mha-b1-kv2048", 32, 32, 128, 1, 1, 2048),
    Shape("llama3-8b-spec4-b16-kv4096", 32, 8, 128, 16, 4, 4096),
    Shape("llama3-8b-prefill-1x2048", 32, 8, 128, 1, 2048, 2048),
    Shape("llama3-8b-prefill-1x8192", 32, 8, 128, 1, 8192, 8192),
    Shape("llama3-8b-prefill-4x1000", 32, 8, 128, 4, 1000, 1000),
    Shape("llama3-8b-prefill-1x500", 32, 8, 128, 1, 500, 500),
    Shape("llama3-8b-chunk-512-on-3000", 32, 8, 128, 1, 512, 3512),
    Shape("llama3-70b-tp8-prefill-2x4096", 8, 1, 128, 2, 4096, 4096),
    Shape("qwen2-7b-prefill-1x4096", 28, 4, 128, 1, 4096, 4096),
    Shape("mha-prefill-2x2048", 32, 32, 128, 2, 2048, 2048),
    Shape("gemma2-9b-prefill-1x2048", 16, 8, 256, 1, 2048, 2048),
    Shape("d64-prefill-1x2048", 16, 16, 64, 1, 2048, 2048),
    Shape("phi3-mini-prefill-1x2048", 32, 32, 96, 1, 2048, 2048),
    Shape("llama3-8b-prefill-2x4096-bf16", 32, 8, 128, 2, 4096, 4096, "bfloat16"),
    Shape("llama3-8b-b16-kv8000-bf16", 32, 8, 128, 16, 1, 8000, "bfloat16"),
    Shape("mistral-7b-prefill-1x8192-window4096", 32, 8, 128, 1, 8192, 8192, window=4096),
    Shape("mistral-7b-b16-kv8000-window4096", 32, 8, 128, 16, 1, 8000, window=4096),
    Shape("gemma2-9b-prefill-1x2048-softcap50", 16, 8, 256, 1, 2048, 2048, softcap=50.0),
    Shape("gemma2-9b-b16-kv4096-softcap50", 16, 8, 256, 16, 1, 4096, softcap=50.0),
)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.models", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/out"), help="where models.json goes")
    p.add_argument("--only", nargs="+", choices=[s.name for s in SHAPES], help="run these shapes only")
    p.add_argument("--peers", nargs="+", choices=PEERS, default=list(PEERS), help="the peers to run (default: all)")
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


def ragged(q, k, v):
    """The ragged layout's tensors of bhsd ``q, k, v``: sequences packed along tokens."""
    import torch

    def pack(x):
        return x.permute(0, 2, 1, 3).reshape(-1, x.shape[1], x.shape[3]).contiguous()

    def indptr(n):
        return (torch.arange(q.shape[0] + 1, device=q.device) * n).to(torch.int32)

    return pack(q), pack(k), pack(v), indptr(q.shape[2]), indptr(k.shape[2])


def causal_mask(queries: int, keys: int, device="cpu", window: Optional[int] = None):
    """The (query, key) pairs a causal mask aligned to the end of the keys leaves visible
    (within ``window`` keys of the query, if given)."""
    import torch

    behind = torch.arange(queries, device=device)[:, None] + keys - queries - torch.arange(keys, device=device)[None, :]
    return (behind >= 0) & (behind < window) if window is not None else behind >= 0


def reference(s: Shape, q, k, v, visible):
    """The float32 output of ``s``'s attention."""
    import torch

    group = s.heads_q // s.heads_kv
    k, v = (x.float().repeat_interleave(group, 1) for x in (k, v))
    if s.softcap is None:
        return torch.nn.functional.scaled_dot_product_attention(q.float(), k, v, attn_mask=visible)
    scores = q.float() @ k.transpose(-1, -2) / math.sqrt(s.head_dim)
    scores = (s.softcap * torch.tanh(scores / s.softcap)).masked_fill(~visible, float("-inf"))
    return torch.softmax(scores, -1) @ v


def tvm_llm(s: Shape, q, k, v):
    """TVM's own LLM attention kernels, what a ``relax.frontend.nn.llm`` model's paged KV
    cache runs: the paged decode (one query per sequence) or the ragged prefill, compiled
    for the GPU and called on this shape's paged or ragged tensors. Returns ``(run,
    out)``, ``out`` as bhsd; None where the shape is neither."""
    import torch
    import tvm
    from tvm.relax.frontend.nn.llm import _decode_kernels, _prefill_kernels

    target = tvm.target.Target("cuda")
    sm_scale = 1 / math.sqrt(s.head_dim)
    zeros = lambda n: torch.zeros(n, dtype=torch.int32, device="cuda")  # noqa: E731  (no RoPE positions)
    if s.queries == 1:
        func = _decode_kernels._attention_decode(s.heads_kv, s.heads_q, s.head_dim, s.dtype, False, {}, target)
        q_, pages, _, page_indptr, page_ids, last = paged(q, k, v)
        args = (q_, pages, page_indptr, page_ids, last, zeros(s.batch), zeros(s.batch))
        tail = (0, 1.0, 1e4, sm_scale)
    elif s.queries > 8:
        func = _prefill_kernels._attention_prefill_ragged(s.heads_kv, s.heads_q, s.head_dim, s.head_dim, s.dtype, {},
                                                          target)
        q_, k_, v_, q_indptr, kv_indptr = ragged(q, k, v)
        args = (q_, q_indptr, k_, v_, kv_indptr, zeros(q_.shape[0]), zeros(s.batch))
        tail = (1, 0, 1.0, 1e4, sm_scale)  # causal, aligned to the end of the keys
    else:
        return None
    function = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=target)["main"]
    out = torch.empty_like(q_)
    lse = torch.empty(q_.shape[:2], dtype=torch.float32, device="cuda")

    def run():
        function(*args, out, lse, *tail)

    run()
    return run, out.reshape(s.batch, s.queries, s.heads_q, s.head_dim).permute(0, 2, 1, 3)


def flex_peer(s: Shape, q, k, v):
    """Compiled FlexAttention (:func:`benchmarks.peers.flex`) with the causal block mask
    aligned to the end of the keys (and the shape's window and softcap). Returns ``(run,
    out)``."""
    from .configs import Config
    from .peers import flex

    op = _Operator("decode" if s.decode else "prefill", s.name, s.heads_q, s.heads_kv, s.window, s.softcap)
    config = Config(op, s.batch, s.queries, s.keys, s.head_dim, s.dtype)
    run, _ = flex(config, q, k, v)
    return (lambda: run(q, k, v)), run(q, k, v)


def kernel_configs(s: Shape) -> List[dict]:
    """``attention_kernel``'s arguments for the layouts ``s`` is timed in: bhsd, and
    paged (decode) or ragged (prefill)."""
    return [dict(heads_q=s.heads_q, heads_kv=s.heads_kv, head_dim=s.head_dim, variant=s.variant(), dtype=s.dtype,
                 layout=layout, target="cuda") for layout in ("bhsd", "paged" if s.decode else "ragged")]


def run_shape(shape: Shape, bandwidth: float, peers: Sequence[str] = PEERS) -> List[dict]:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tvm_cascade.kernels import attention_kernel

    sdpa = torch.nn.functional.scaled_dot_product_attention
    s = shape
    q, k, v = (torch.randn(s.batch, h, n, s.head_dim, device="cuda", dtype=getattr(torch, s.dtype))
               for h, n in ((s.heads_q, s.queries), (s.heads_kv, s.keys), (s.heads_kv, s.keys)))
    group = s.heads_q // s.heads_kv
    visible = causal_mask(s.queries, s.keys, "cuda", s.window)
    ref = reference(s, q, k, v, visible)
    seen = s.keys if s.window is None else min(s.keys, s.window + s.queries - 1)
    moved = 2 * (2 * q.numel() + 2 * k.numel() // s.keys * seen)  # bytes of Q, the output and the K, V rows seen
    roofline = moved / (bandwidth * 1e9) * 1e3
    flops = 4 * s.head_dim * s.batch * s.heads_q * int(visible.sum())
    rows = []

    def record(name, run, out):
        err = ((out.float() - ref).norm() / ref.norm()).item() if out is not None else None
        ms = bench(run) if err is not None and err < TOLERANCE[s.dtype] else None
        rows.append({"shape": s.name, "implementation": name, "error": err, "ms": ms,
                     "roofline": roofline / ms if ms and s.decode else None,
                     "tflops": flops / ms / 1e9 if ms else None})

    for config in kernel_configs(s):
        layout = config["layout"]
        kernel = attention_kernel(**config)
        args = (q, k, v) if layout == "bhsd" else paged(q, k, v) if s.decode else ragged(q, k, v)
        plan = kernel.plan(*args)
        out = kernel(*args, plan=plan)
        if layout != "bhsd":
            out = out.reshape(s.batch, s.queries, s.heads_q, s.head_dim).permute(0, 2, 1, 3)
        record(f"tvm-cascade {layout} ({plan.family.name})", lambda: kernel(*args, plan=plan), out)
    if s.softcap is not None:
        mask = None  # SDPA has no softcap
    elif s.window is not None:
        mask = {"attn_mask": visible}
    elif s.queries == 1:
        mask = {}
    elif s.queries == s.keys:
        mask = {"is_causal": True}
    else:
        from torch.nn.attention.bias import causal_lower_right

        mask = {"attn_mask": causal_lower_right(s.queries, s.keys)}
    for backend in ("CUDNN_ATTENTION", "FLASH_ATTENTION") if "sdpa" in peers else ():
        def peer(backend=backend):
            with sdpa_kernel(getattr(SDPBackend, backend)):
                return sdpa(q, k, v, enable_gqa=group > 1, **mask)

        try:
            out = peer() if mask is not None else None
        except RuntimeError:  # the backend does not take this configuration
            out = None
        record(f"sdpa {backend.split('_')[0].lower()}", peer, out)
    if "flex" in peers:
        record("flex", *flex_peer(s, q, k, v))
    llm = tvm_llm(s, q, k, v) if "tvm-llm" in peers and s.window is None and s.softcap is None else None
    if llm is not None:
        record("tvm llm (relax.frontend.nn.llm)", *llm)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if skip_without_gpu("benchmarks.models"):
        return 0
    bandwidth = copy_bandwidth_gbps()
    shapes = [s for s in SHAPES if not args.only or s.name in args.only]
    results = []
    args.out.mkdir(parents=True, exist_ok=True)
    env = environment(argv)
    env["command"] = " ".join(["python", "-m", "benchmarks.models", *argv])
    print(f"copy bandwidth {bandwidth:.0f} GB/s", flush=True)
    built = prebuild(config for s in shapes for config in kernel_configs(s))
    print(f"built {len(built)} kernels in parallel", flush=True)
    for done, shape in enumerate(shapes, 1):
        rows = run_shape(shape, bandwidth, args.peers)
        results.extend(rows)
        best = min((r["ms"] for r in rows if r["ms"] and not r["implementation"].startswith("tvm-cascade")), default=None)
        for r in rows:
            ms = f"{r['ms']:.4f}" if r["ms"] else "wrong" if r["error"] is not None else "n/a"
            ratio = f"{best / r['ms']:.2f}x best peer" if best and r["ms"] else ""
            rate = (f"{100 * r['roofline']:.0f}% roofline" if r["roofline"]
                    else f"{r['tflops']:.0f} TFLOP/s" if r["tflops"] else "")
            err = f"(err {r['error']:.1e})" if r["error"] is not None else "(not run: backend refused)"
            print(f"{shape.name:30s} {r['implementation']:44s} {ms:>8s} ms  {rate:14s} {ratio}  {err}", flush=True)
        # Written after every shape: a run cut short keeps what it measured.
        (args.out / "models.json").write_text(json.dumps(
            {"environment": env, "copy_bandwidth_gbps": bandwidth, "shapes": [asdict(s) for s in shapes[:done]],
             "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
