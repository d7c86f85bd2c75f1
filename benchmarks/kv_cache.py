"""The attention kernels of TVM's paged KV cache (``relax.frontend.nn.llm``'s
``TIRPagedKVCache``): TVM's own and tvm-cascade's (:mod:`tvm_cascade.library.kv_cache`,
what the ``"cascade"`` pipeline puts in the cache), called with the cache's calling
convention on the same tensors, beside cuDNN's SDPA on the same attention (dense
tensors), timed side by side on one GPU.

    python -m benchmarks.kv_cache [--out DIR] [--only SUBSTR ...] [--rope-inside]

With ``--rope-inside`` every call rotates Q and K inside attention (``rotary_mode`` 1,
a cache of ``RopeMode.INLINE``: queries at positions after their sequence's keys, keys
from a random offset): TVM's kernel, and tvm-cascade's built for it (its rotation pass,
then the kernel), against a reference and cuDNN's SDPA over Q and K rotated beforehand
(untimed).

Every output is checked against float32 SDPA, and each lse against the float32 log-sum-
exp of the scores (base 2). Times are medians of CUDA-event timed calls with the L2 cache
flushed before each (:func:`benchmarks.timing.bench`). Prints a table, writes
``kv_cache.json``.
"""
from __future__ import annotations

import functools
import math
import sys
from typing import Optional, Sequence

from .attention import named, run_shapes, shapes_parser
from .timing import bench

PAGE = 16
#: Where ``o`` is among each kind's arguments (``lse`` follows).
OUTPUT_AT = {"ragged": 7, "prefill": 8, "prefill_window": 8, "decode": 7, "decode_window": 7}
#: (name, kind, query lengths, key lengths (cached keys for "prefill"), heads q, heads
#: kv, head dim). "ragged": the new tokens among themselves (causal); "prefill": new
#: tokens over cached pages (no mask); "prefill_window": a sliding layer's new tokens
#: over its window's cached keys (``causal=1``); "decode": one query per sequence over
#: its pages; "decode_window": over a sliding-window cache's sink and window.
SHAPES = (
    ("ragged 1x2048 llama3-8b", "ragged", [2048], [2048], 32, 8, 128),
    ("ragged 4x512 llama3-8b", "ragged", [512] * 4, [512] * 4, 32, 8, 128),
    ("ragged 3x(700,1000,300) d64", "ragged", [700, 1000, 300], [700, 1000, 300], 32, 8, 64),
    ("prefill 1x2048 over 2048 llama3-8b", "prefill", [2048], [2048], 32, 8, 128),
    ("sliding layer 2x511 over 4096 llama3-8b", "prefill_window", [511] * 2, [4096] * 2, 32, 8, 128),
    ("decode 16x8000 llama3-8b", "decode", [1] * 16, [8000] * 16, 32, 8, 128),
    ("decode 32x4096 llama3-8b", "decode", [1] * 32, [4096] * 32, 32, 8, 128),
    ("decode 1x16000 llama3-8b", "decode", [1], [16000], 32, 8, 128),
    ("decode 1x1024 llama3-8b", "decode", [1], [1024], 32, 8, 128),
    ("decode 32x1024 llama3-8b", "decode", [1] * 32, [1024] * 32, 32, 8, 128),
    ("decode 32x16000 llama3-8b", "decode", [1] * 32, [16000] * 32, 32, 8, 128),
    ("decode 16x(1000..8000) mha d64", "decode", [1] * 16, [1000 + 467 * i for i in range(16)], 32, 32, 64),
    ("decode window 16x(4 sink + 4092) llama3-8b", "decode_window", [1] * 16, [4096] * 16, 32, 8, 128),
)
#: The sliding-window shapes' sink: the first keys kept, stored first; the window's keys
#: are stored from :data:`WINDOW_START` on (the positions between hold evicted keys).
SINK, WINDOW_START = 4, 4000
#: The sliding layers' window (keys; the new token's own among them), and where their
#: kept keys start in their pages (an offset inside a page: the cache trims a layer's
#: pages to its last window).
LAYER_WINDOW, LAYER_START = 4096, 8


def tvm_kernel(kind, heads_q, heads_kv, head_dim, target):
    """TVM's kernel of ``kind`` as ``TIRPagedKVCache`` builds it."""
    from tvm.relax.frontend.nn.llm import kv_cache

    rope = {}
    if kind == "ragged":
        return kv_cache._attention_prefill_ragged(heads_kv, heads_q, head_dim, head_dim, "float16", rope, target)
    if kind in ("prefill", "prefill_window"):
        return kv_cache._attention_prefill(heads_kv, heads_q, head_dim, "float16", kind == "prefill_window", rope,
                                           target, sliding_window_size=LAYER_WINDOW)
    window = kind == "decode_window"
    return kv_cache._attention_decode(heads_kv, heads_q, head_dim, "float16", window, rope, target)


def inputs(kind, q_lens, kv_lens, heads_q, heads_kv, head_dim):
    """The convention's arguments (torch tensors, then the scalars), the dense tensors
    of each sequence for the reference, and the mask: ``(args, sequences, causal)``
    (``causal`` :data:`LAYER_WINDOW` for a sliding layer's window)."""
    import torch

    dev = "cuda"
    q = torch.randn(sum(q_lens), heads_q, head_dim, device=dev, dtype=torch.float16)
    qo_indptr = torch.tensor([0] + list(_cumsum(q_lens)), dtype=torch.int32, device=dev)
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=dev)
    sm_scale = 1.0 / math.sqrt(head_dim)
    rope_pos = torch.zeros(q.shape[0], dtype=torch.int32, device=dev)
    rope_offset = torch.zeros(len(q_lens), dtype=torch.int32, device=dev)
    if kind == "ragged":
        k = torch.randn(sum(kv_lens), heads_kv, head_dim, device=dev, dtype=torch.float16)
        v = torch.randn_like(k)
        kv_indptr = torch.tensor([0] + list(_cumsum(kv_lens)), dtype=torch.int32, device=dev)
        seqs = [(q[a:b], k[c:e], v[c:e]) for a, b, c, e in zip(qo_indptr[:-1].tolist(), qo_indptr[1:].tolist(),
                                                               kv_indptr[:-1].tolist(), kv_indptr[1:].tolist())]
        args = [q, qo_indptr, k, v, kv_indptr, rope_pos, rope_offset, o, lse, 1, 0, 1.0, 1e4, sm_scale]
        return args, seqs, True
    # A sliding-window cache's keys: the sink, then the window stored from WINDOW_START;
    # a sliding layer's: its window's, stored from LAYER_START.
    window = kind == "decode_window"
    layer = kind == "prefill_window"
    stored = [n - SINK + WINDOW_START if window else n + LAYER_START if layer else n for n in kv_lens]
    pages_of = [-(-n // PAGE) for n in stored]
    num_pages = sum(pages_of)
    pages = torch.randn(num_pages, 2, heads_kv, PAGE, head_dim, device=dev, dtype=torch.float16)
    page_indices = torch.randperm(num_pages, device=dev).to(torch.int32)
    page_indptr = torch.tensor([0] + list(_cumsum(pages_of)), dtype=torch.int32, device=dev)
    last = torch.tensor([n - (p - 1) * PAGE for n, p in zip(stored, pages_of)], dtype=torch.int32, device=dev)
    if window:
        last = torch.stack([last, torch.full_like(last, WINDOW_START), torch.full_like(last, SINK)])
    if layer:
        last = torch.stack([last, torch.full_like(last, LAYER_START), torch.zeros_like(last)])
    seqs = []
    for s, (a, b) in enumerate(zip(page_indptr[:-1].tolist(), page_indptr[1:].tolist())):
        kv = pages[page_indices[a:b].long()]  # [pages, 2, hkv, PAGE, d]
        kv = kv.permute(1, 0, 3, 2, 4).reshape(2, -1, heads_kv, head_dim)[:, : stored[s]]
        if window:
            kv = torch.cat([kv[:, :SINK], kv[:, WINDOW_START:]], dim=1)
        if layer:
            kv = kv[:, LAYER_START:]
        seqs.append((q[qo_indptr[s]: qo_indptr[s + 1]], kv[0], kv[1]))
    if kind in ("prefill", "prefill_window"):
        args = [q, qo_indptr, pages, page_indptr, page_indices, last, rope_offset, rope_pos, o, lse, int(layer), 0, 1.0,
                1e4, sm_scale]
    else:
        args = [q, pages, page_indptr, page_indices, last, rope_offset, rope_pos, o, lse, 0, 1.0, 1e4, sm_scale]
    return args, seqs, LAYER_WINDOW if layer else False


def _cumsum(values):
    total = 0
    for v in values:
        total += v
        yield total


def reference(seqs, causal, sm_scale):
    """float32 outputs and base-2 lse of every sequence, concatenated along tokens
    (``causal`` a window: new token ``i`` sees the last ``causal - 1 - i`` keys)."""
    import torch

    outs, lses = [], []
    for q, k, v in seqs:
        group = q.shape[1] // k.shape[1]
        qf, kf, vf = q.float().transpose(0, 1), k.float().transpose(0, 1), v.float().transpose(0, 1)
        kf, vf = kf.repeat_interleave(group, 0), vf.repeat_interleave(group, 0)
        s = qf @ kf.transpose(1, 2) * sm_scale
        n_q, n_k = s.shape[1:]
        rows, keys = torch.arange(n_q, device=s.device)[:, None], torch.arange(n_k, device=s.device)[None]
        if causal is True:
            s = s.masked_fill(~(keys <= rows + n_k - n_q), float("-inf"))
        elif causal:
            s = s.masked_fill(~(keys >= n_k - (causal - 1 - rows).clamp(min=0)), float("-inf"))
        outs.append((torch.softmax(s, -1) @ vf).transpose(0, 1))
        lses.append((torch.logsumexp(s, -1) / math.log(2)).transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)


def cudnn(seqs, causal):
    """A call of cuDNN's SDPA on each sequence's dense tensors (one batched call where the
    sequences are as long)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    def dense(parts):
        return [torch.stack(p).transpose(1, 2) for p in zip(*parts)]

    same = len({(q.shape[0], k.shape[0]) for q, k, _ in seqs}) == 1
    batches = [dense(seqs)] if same else [dense([s]) for s in seqs]

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            for q, k, v in batches:
                n_q, n_k = q.shape[2], k.shape[2]
                mask = {} if not causal else ({"is_causal": True} if n_q == n_k else
                                              {"attn_mask": causal_lower_right(n_q, n_k)})
                torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True, **mask)

    return run


#: RoPE's base in the ``--rope-inside`` calls (Llama-3's).
ROPE_THETA = 5e5


def rotate(x, positions):
    """RoPE of ``x`` (tokens × heads × dim, float16) at ``positions``, the halves of the
    head dim rotated together, computed in float64 and rounded to float16 (as the
    kernels' rotated inputs are)."""
    import torch

    half = x.shape[-1] // 2
    inv = ROPE_THETA ** (-torch.arange(half, device=x.device, dtype=torch.float64) * 2 / x.shape[-1])
    angle = positions.to(torch.float64)[:, None, None] * inv
    first, second = x[..., :half].double(), x[..., half:].double()
    return torch.cat([first * angle.cos() - second * angle.sin(), second * angle.cos() + first * angle.sin()],
                     -1).half()


def rotate_inside(kind, args, seqs):
    """``args`` made a call with RoPE inside attention (positions set, ``rotary_mode``
    1) and ``seqs`` what it attends over: Q and K rotated."""
    import torch

    at = OUTPUT_AT[kind]
    offsets, positions = (args[6], args[5]) if kind == "ragged" else (args[at - 2], args[at - 1])
    offsets.copy_(torch.randint(0, 1000, offsets.shape, dtype=torch.int32, device=offsets.device))
    rotary = at + 2 if kind.startswith("decode") else at + 3
    args[rotary], args[rotary + 2] = 1, ROPE_THETA
    # The paged prefill's new tokens follow the cached keys; the others' queries are
    # their sequence's last keys.
    follow = kind in ("prefill", "prefill_window")
    rotated, first = [], 0
    for s, (q, k, v) in enumerate(seqs):
        offset = int(offsets[s])
        start = offset + k.shape[0] - (0 if follow else q.shape[0])
        rows = slice(first, first + q.shape[0])
        positions[rows] = torch.arange(start, start + q.shape[0], dtype=torch.int32)
        first += q.shape[0]
        keys = offset + torch.arange(k.shape[0], device=k.device)
        rotated.append((rotate(q, positions[rows]), rotate(k, keys), v))
    return rotated


def run_shape(shape, rope_inside=False) -> list:
    import torch
    import tvm

    from tvm_cascade.library.kv_cache import cache_kernel

    name, kind, q_lens, kv_lens, heads_q, heads_kv, head_dim = shape
    target = tvm.target.Target.from_device(tvm.cuda(0))
    args, seqs, causal = inputs(kind, q_lens, kv_lens, heads_q, heads_kv, head_dim)
    if rope_inside:
        seqs = rotate_inside(kind, args, seqs)
    ref_o, ref_lse = reference(seqs, causal, args[-1])
    theirs = tvm_kernel(kind, heads_q, heads_kv, head_dim, target)
    ours, why = cache_kernel(kind, heads_q, heads_kv, head_dim, "float16", target,
                             window=LAYER_WINDOW if kind == "prefill_window" else 0,
                             fallback=theirs if rope_inside else None, rotate_inside=rope_inside)
    if ours is None:
        raise RuntimeError(why)
    funcs = {
        "tvm": tvm.compile(tvm.IRModule({"main": theirs}), target=target),
        "tvm-cascade": tvm.compile(tvm.IRModule({"main": ours.func}), target=ours.func.attrs["target"]),
    }
    rows = []
    o, lse = args[OUTPUT_AT[kind]], args[OUTPUT_AT[kind] + 1]
    # TVM tensors over the same memory (no copies).
    call_args = [tvm.runtime.from_dlpack(a) if isinstance(a, torch.Tensor) else a for a in args]
    for peer, mod in funcs.items():
        fn = mod["main"]
        o.zero_()
        fn(*call_args)
        torch.cuda.synchronize()
        err = ((o.float() - ref_o).norm() / ref_o.norm()).item()
        lse_err = (lse - ref_lse).abs().max().item()
        ms = bench(lambda: fn(*call_args))
        rows.append({"shape": name, "peer": peer, "ms": ms, "error": err, "lse_error": lse_err})
        print(f"{name:36s} {peer:12s} {ms:8.4f} ms  (err {err:.1e}, lse err {lse_err:.1e})", flush=True)
    if causal not in (True, False):  # (no SDPA mask of cuDNN's places queries after the keys)
        print(f"{name:36s} {'cudnn':12s} n/a", flush=True)
        return rows
    ms = bench(cudnn(seqs, causal))
    rows.append({"shape": name, "peer": "cudnn", "ms": ms})
    print(f"{name:36s} {'cudnn':12s} {ms:8.4f} ms", flush=True)
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = shapes_parser("benchmarks.kv_cache", __doc__, "kv_cache.json")
    parser.add_argument("--rope-inside", action="store_true", help="calls with RoPE inside attention")
    args = parser.parse_args(argv)
    run_shapes("benchmarks.kv_cache", args.out, argv, named(SHAPES, args.only),
               functools.partial(run_shape, rope_inside=args.rope_inside))
    return 0


if __name__ == "__main__":
    sys.exit(main())
