"""The decode attention of ``examples/llama_block.py`` alone, with the L2 cache in the states a call
can meet: flushed by reading 256 MiB (what the examples' "alone" column and the benchmarks do), flushed
by writing 256 MiB (L2 full of dirty lines), K/V just written by the concatenation that makes them in the
block (their lines partly still in L2, dirty), and nothing before the call; with the plan's chunks and
with one of a quarter and all of the keys a chunk. A sleep kernel is queued before each timed call, as
``examples/compare.py`` times the kernel in the block. The output is checked against float32 SDPA first.

usage (CUDA): python -m benchmarks.attention_cache_state [--shapes 32x1023,32x8191]
(without a CUDA GPU it says it is skipping and exits 0)
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics

from .attention import skip_without_gpu
from .timing import l2_flush
from tvm_cascade.kernels import attention_kernel
from tvm_cascade.library import MaskTensor

HEADS_Q, HEADS_KV, HEAD_DIM = 16, 4, 128  # the example's --hidden 2048 --heads-q 16 --heads-kv 4


def _timed(kernel, tensors, out, plan, before, calls=30):
    import torch

    times = []
    for _ in range(calls):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before()
        torch.cuda._sleep(1_000_000)
        start.record()
        kernel(*tensors, out=out, plan=plan)
        stop.record()
        times.append((start, stop))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="32x1023,32x8191", help="batch x past keys, ...")
    parser.add_argument("--dtype", default="float16")
    args = parser.parse_args(argv)
    if skip_without_gpu("benchmarks.attention_cache_state"):
        return 0
    import torch

    dtype = getattr(torch, args.dtype)
    kernel = attention_kernel(HEADS_Q, HEADS_KV, HEAD_DIM, dtype=args.dtype,
                              mask=MaskTensor(args.dtype, batch=False, heads=False, queries=True))
    for batch, past in (tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")):
        keys = past + 1
        q = torch.randn(batch, HEADS_Q, 1, HEAD_DIM, dtype=dtype, device="cuda")
        past_k, past_v = (torch.randn(batch, HEADS_KV, past, HEAD_DIM, dtype=dtype, device="cuda") for _ in "kv")
        new_k, new_v = (torch.randn(batch, HEADS_KV, 1, HEAD_DIM, dtype=dtype, device="cuda") for _ in "kv")
        k, v = torch.cat([past_k, new_k], 2), torch.cat([past_v, new_v], 2)
        mask = torch.zeros(1, 1, 1, keys, dtype=dtype, device="cuda")
        tensors = (q, k, v, mask)
        plan = kernel.plan(*tensors)
        out = kernel(*tensors, plan=plan)
        group = HEADS_Q // HEADS_KV
        expected = torch.nn.functional.scaled_dot_product_attention(
            q.float(), k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1))
        error = ((out.float() - expected).abs().max() / expected.abs().max()).item()
        if error > 1e-2:
            raise SystemExit(f"{batch} x {past}: the kernel's output is off by {error:.1e} of the largest")
        states = {
            "read flush": l2_flush("read"),
            "write flush": l2_flush("zero"),
            "K/V just concatenated": lambda: (torch.cat([past_k, new_k], 2, out=k), torch.cat([past_v, new_v], 2, out=v)),
            "nothing": l2_flush("none"),
        }
        chunk_keys = plan.scalars[-1]
        plans = {f"plan ({chunk_keys} keys a chunk)": plan}
        for each in (keys, -(-keys // 4)):
            if each != chunk_keys:
                plans[f"{each} keys a chunk"] = dataclasses.replace(plan, scalars=plan.scalars[:-1] + (each,))
        print(f"{batch} x 1 over {past} ({args.dtype}, {plan.family.name}; max error {error:.1e} of the largest):")
        for name, each in plans.items():
            times = ", ".join(f"{state} {_timed(kernel, tensors, out, each, before):.4f}"
                              for state, before in states.items())
            print(f"  {name}: {times} ms", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
