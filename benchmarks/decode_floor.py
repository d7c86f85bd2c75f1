"""What bounds a short decode call: harness time beside kernel span, against Triton kernels.

``python -m benchmarks.decode_floor decode-gqa-b8-kv4096`` times, in one process, at one
decode configuration of plain softmax attention (causal or GQA decode: one query row,
which sees every key, so no mask, bias or cap):

* ``tvm-cascade`` and ``sdpa-cudnn``;
* ``read``: a Triton kernel that reads K and V once, linearly: no call that reads those
  bytes can take less;
* ``read-chunks``: a Triton kernel that reads them in split-k's pattern, a program per
  K/V head and chunk of keys, K and V a tile at a time;
* ``split-k``: a plain Triton split-k decode: a program per K/V head and chunk (the
  group's query heads as the rows of ``tl.dot``, the online softmax in registers, the
  chunk's partials to global memory), then a combine kernel;
* ``last-block``: the same with no combine kernel: the last chunk program of a K/V head
  to finish (a ticket from a per-head atomic counter) combines the head's chunks; the
  counters are zeroed in every call, by a kernel in front;
* ``last-block-kept``: the same with counters zeroed once, at allocation, and reset by
  each head's last program: what that combine would gain if the counters outlived a
  call. Not a usable design (two calls at once on different streams, or one aborted
  call, corrupt the counters); it is here as a bound;
* ``last-block-tagged``: the last program found without counters to zero: each chunk
  program marks its arrival in a per-head word by compare-and-swap, the word tagged with
  an epoch the host counts up per call (a word of another epoch, left by an earlier call
  or never written, counts as empty), so scratch memory of any content serves.

Each is checked before it is timed (attention against the float32 reference, a reader's
sum against torch's), then given the harness's median ms (:func:`.timing.bench`) and the
median span from a call's first kernel start to its last kernel end
(:func:`.profile.kernel_times`): their difference is what the timing events add.
"""
import argparse
import itertools
import math
import sys

from .attention import close_to, random_inputs, skip_without_gpu
from .configs import suite

#: The Triton kernels' choices, the best of sweeps at GQA kv4096 on an H200: split-k of
#: 4/8/16 chunks, 32/64 keys a step, 4/8 warps, 2/3 stages;
#: the linear reader of 8192-32768-element blocks, 4/8/16 warps; the chunked reader of
#: 2-16 chunks, 32/64-key tiles, 4/8 warps, 1/3 stages.
SPLIT = dict(chunks=4, keys=64, warps=4, stages=3)
READ = dict(block=16384, warps=16)
READ_CHUNKS = dict(chunks=8, keys=64, warps=8, stages=1)
#: Query heads per K/V head at most: the rows of the Triton kernels' products.
ROWS = 16
LOG2E = 1.4426950408889634


def supported(cfg):
    """Why ``cfg`` is outside what this module's Triton kernels compute, or None."""
    op = cfg.op
    if op.kind != "decode" or cfg.seq_q != 1:
        return f"{cfg.name}: one query row (a decode configuration) only"
    if op.alibi or op.softcap or op.window:
        return f"{cfg.name}: plain softmax only (no ALiBi, softcap or window)"
    group = op.heads_q // op.heads_kv
    if group > ROWS:
        return f"{cfg.name}: at most {ROWS} query heads per K/V head, got {group}"
    step = max(SPLIT["chunks"] * SPLIT["keys"], READ_CHUNKS["chunks"] * READ_CHUNKS["keys"])
    if cfg.seq_kv % step:
        return f"{cfg.name}: the key count must be a multiple of {step}"
    return None


def triton_calls(cfg, q, k, v):
    """``{name: (fn, check)}``: each Triton implementation's call (which returns its
    output buffer) and how to check that (None: against the attention reference; else a
    function of the buffer)."""
    import torch
    import triton

    from .triton_decode import COUNTER, TAGGED, combine, read, read_chunks, split_k, zero
    batch, heads_q, _, dim = q.shape
    heads_kv, seq = k.shape[1], k.shape[2]
    heads, group = batch * heads_kv, heads_q // heads_kv
    chunks = SPLIT["chunks"]
    flat = torch.cat([k.reshape(-1), v.reshape(-1)])
    total = flat.float().sum()
    magnitude = flat.float().abs().sum()
    read_sums = torch.empty(math.ceil(flat.numel() / READ["block"]), device="cuda")
    chunk_sums = torch.empty(heads * READ_CHUNKS["chunks"], device="cuda")
    m_part = torch.empty(heads * chunks * ROWS, device="cuda")
    l_part = torch.empty_like(m_part)
    o_part = torch.empty(heads * chunks * ROWS * dim, device="cuda")
    counts = torch.zeros(heads, dtype=torch.int32, device="cuda")
    # Tagged words start as garbage: any content must do.
    words = torch.randint(-(2**62), 2**62, (heads,), dtype=torch.int64, device="cuda")
    epochs = itertools.count(2**32)
    out = torch.empty_like(q)
    scale = LOG2E / math.sqrt(dim)
    launch = dict(num_warps=SPLIT["warps"], num_stages=SPLIT["stages"])

    def chunk_programs(last_block):
        split_k[(heads, chunks)](q, k, v, out, m_part, l_part, o_part, counts, words, next(epochs), seq, scale,
                                 G=group, D=dim, KEYS=SPLIT["keys"], C=chunks, LAST_BLOCK=last_block, **launch)

    def two_kernels():
        chunk_programs(0)
        combine[(heads,)](m_part, l_part, o_part, out, G=group, D=dim, C=chunks, num_warps=4)
        return out

    def zeroed():
        # (A kernel of its own name: a memset would pass for the L2 flush's in the profile.)
        zero[(1,)](counts, heads, BLOCK=triton.next_power_of_2(heads))
        chunk_programs(COUNTER)
        return out

    def kept():
        chunk_programs(COUNTER)
        return out

    def tagged():
        chunk_programs(TAGGED)
        return out

    def sums_to(sums):
        # A reader sums K and V in its own order: close to torch's sum, relative to |K| + |V|.
        return bool(abs(sums.sum() - total) <= 1e-5 * magnitude)

    def read_all():
        read[(read_sums.numel(),)](flat, read_sums, flat.numel(), BLOCK=READ["block"], num_warps=READ["warps"])
        return read_sums

    def read_in_chunks():
        read_chunks[(heads, READ_CHUNKS["chunks"])](k, v, chunk_sums, seq, KEYS=READ_CHUNKS["keys"], D=dim,
                                                   num_warps=READ_CHUNKS["warps"], num_stages=READ_CHUNKS["stages"])
        return chunk_sums

    return {
        "read": (read_all, sums_to),
        "read-chunks": (read_in_chunks, sums_to),
        "split-k": (two_kernels, None),
        "last-block": (zeroed, None),
        "last-block-kept": (kept, None),
        "last-block-tagged": (tagged, None),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decode_floor", description=__doc__.splitlines()[0])
    parser.add_argument("name", help="a decode configuration of plain softmax, e.g. decode-gqa-b8-kv4096")
    parser.add_argument("--calls", type=int, default=30, help="profiled calls per implementation (spans)")
    args = parser.parse_args(argv)
    configs = {cfg.name: cfg for cfg in suite("decode")}
    if args.name not in configs:
        parser.error(f"unknown configuration {args.name!r}; known: {sorted(configs)}")
    cfg = configs[args.name]
    why = supported(cfg)
    if why is not None:
        parser.error(why)
    if skip_without_gpu("benchmarks.decode_floor"):
        return 0
    from .peers import Unsupported, sdpa, tvm_cascade
    from .profile import kernel_times
    from .reference import attention_reference
    from .timing import bench, copy_bandwidth_gbps

    q, k, v = random_inputs(cfg)
    reference = attention_reference(cfg, q, k, v)
    calls = {}
    for name, peer in (("tvm-cascade", tvm_cascade), ("sdpa-cudnn", sdpa("CUDNN_ATTENTION"))):
        try:
            fn = peer(cfg, q, k, v)[0]
        except Unsupported as err:
            print(f"  {name}: n/a ({err})", flush=True)
            continue
        calls[name] = (lambda fn=fn: fn(q, k, v), None)
    calls.update(triton_calls(cfg, q, k, v))
    bandwidth = copy_bandwidth_gbps()
    print(f"{cfg.name}: copy bandwidth {bandwidth:.0f} GB/s; µs in the harness, span, difference", flush=True)
    for name, (call, check) in calls.items():
        call()  # (a first call: the kept counters must come back to zero for the second)
        got = call()
        if not (close_to(got, reference) if check is None else check(got)):
            print(f"  {name}: wrong result, not timed", flush=True)
            continue
        ms = bench(call)
        _, span = kernel_times(call, args.calls)
        percent = 100 * cfg.kv_bytes() / (ms * 1e6) / bandwidth
        print(f"  {name}: {ms * 1e3:.1f} ({percent:.0f}%), span {span:.1f}, difference {ms * 1e3 - span:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
