"""Attention in a Relax module, ``R.nn.attention`` or written by hand, compiled with TVM's
default pipeline and with ``relax_pipeline="cascade"`` (which dispatches it to the kernel
library), timed side by side on one GPU; lengths static, or symbolic and run at the
given length.

    python -m benchmarks.relax_attention [--out DIR]

Each output's error against float32 SDPA is measured and reported (the default pipeline
legalizes the softmax in fp16: its error is the larger); times are medians of CUDA-event timed VM calls with the L2 cache flushed before each
(:func:`benchmarks.timing.bench`). Prints a table, writes ``relax_attention.json``.
"""
from __future__ import annotations

import json
import sys
from typing import Optional, Sequence

from .attention import run_environment, shapes_parser, skip_without_gpu
from .timing import bench

#: (name, form, batch, queries, keys, heads q, heads kv, head dim, symbolic). "op":
#: ``R.nn.attention`` (bshd, ``causal_mask="BottomRight"``; MHA: the default pipeline's
#: legalization repeats no K/V heads). "chain": the hand-written layer (bhsd, K/V heads
#: repeated, scale, an additive causal mask constant, a float32 softmax). fp16.
SHAPES = (
    ("op prefill-1x2048", "op", 1, 2048, 2048, 32, 32, 128, False),
    ("op prefill-1x2048-symbolic", "op", 1, 2048, 2048, 32, 32, 128, True),
    ("op decode-b8-kv4096", "op", 8, 1, 4096, 32, 32, 128, False),
    ("op decode-b8-kv4096-symbolic", "op", 8, 1, 4096, 32, 32, 128, True),
    ("chain prefill-1x2048 gqa 32/8", "chain", 1, 2048, 2048, 32, 8, 128, False),
    ("chain decode-b8-kv4096 gqa 32/8", "chain", 8, 1, 4096, 32, 8, 128, False),
)


def module(form, batch, seq_q, seq_kv, heads_q, heads_kv, head_dim, symbolic):
    from tvm import tirx

    from tvm_cascade.relax.testing import attention_module, chain_module

    if form == "chain":
        return chain_module(batch, seq_q, seq_kv, heads_q, heads_kv, head_dim)
    if symbolic:  # one length for as many queries as keys, else the keys'
        n = tirx.Var("n", "int64")
        seq_q, seq_kv = (n, n) if seq_q == seq_kv else (seq_q, n)
    return attention_module(batch, seq_q, seq_kv, heads_q, heads_kv, head_dim)


def run_shape(shape) -> list:
    import torch
    import tvm
    from torch.nn.attention.bias import causal_lower_right
    from tvm import relax

    import tvm_cascade  # noqa: F401  (the "cascade" pipeline)

    name, form, batch, seq_q, seq_kv, heads_q, heads_kv, head_dim, _ = shape
    bhsd = form == "chain"
    q, k, v = (torch.randn(batch, n, h, head_dim, device="cuda", dtype=torch.float16)
               for n, h in ((seq_q, heads_q), (seq_kv, heads_kv), (seq_kv, heads_kv)))
    causal = {"attn_mask": causal_lower_right(seq_q, seq_kv)} if seq_q != seq_kv else {"is_causal": True}
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(x.transpose(1, 2).float() for x in (q, k, v)), enable_gqa=heads_q != heads_kv, **causal)
    ref = ref if bhsd else ref.transpose(1, 2)
    target = tvm.target.Target.from_device(tvm.cuda(0))
    args = [tvm.runtime.from_dlpack(x.transpose(1, 2).contiguous() if bhsd else x) for x in (q, k, v)]
    rows = []
    for pipeline in ("default", "cascade"):
        vm = relax.VirtualMachine(tvm.compile(module(*shape[1:]), target=target, relax_pipeline=pipeline), tvm.cuda(0))
        out = torch.from_dlpack(vm["main"](*args)).float()
        err = ((out - ref).norm() / ref.norm()).item()
        ms = bench(lambda: vm["main"](*args))
        rows.append({"shape": name, "pipeline": pipeline, "error": err, "ms": ms})
        print(f"{name:28s} {pipeline:8s} {ms:8.4f} ms  (err {err:.1e})", flush=True)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = shapes_parser("benchmarks.relax_attention", __doc__, "relax_attention.json", only=False)
    args = p.parse_args(argv)
    if skip_without_gpu("benchmarks.relax_attention"):
        return 0
    env = run_environment("benchmarks.relax_attention", args.out, argv)
    results = []
    for shape in SHAPES:
        results += run_shape(shape)
        (args.out / "relax_attention.json").write_text(json.dumps({"environment": env, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
