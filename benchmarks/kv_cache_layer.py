"""An LLM decoder's attention layer on TVM's paged KV cache: default vs "cascade" pipeline.

The layer is built as ``relax.frontend.nn.llm`` models build theirs (a fused QKV
projection, TVM's paged KV cache ``TIRPagedKVCache`` with RoPE applied before
attention, an output projection), compiled with TVM's default pipeline and with
``relax_pipeline="cascade"`` (which puts tvm-cascade's kernels in the cache:
:class:`tvm_cascade.relax.kv_cache.KVCacheAttention`), timed side by side on one GPU:
prefill of one sequence into an empty cache, a prefill chunk of one sequence over its
cached keys, and one decode step of a batch of sequences over cached keys.

    python -m benchmarks.kv_cache_layer [--out DIR] [--only SUBSTR ...] [--rope {normal,inline,none}]
        [--dtype {float16,bfloat16}] [--layer-window W]
    python -m benchmarks.kv_cache_layer --target llvm --small   # tiny shapes, on the CPU

The model is exported with ``export_tvm`` (functions ``create_paged_kv_cache``,
``prefill`` and ``batch_decode``, the weights plain arguments) and driven with the
runtime's ``vm.builtin.kv_state_*`` functions. A timed call is one VM call of
``prefill`` or ``batch_decode`` (both projections, RoPE, the cache append and attention)
inside one ``kv_state_begin_forward``: repeated calls write the same cache slots, so each
computes the same step. Decode shapes prefill every sequence first (in chunks of at most
the cache's ``prefill_chunk_size``); a decode shape's length counts the decoded token
("decode 32x8192": 8191 cached tokens and one new one in each of 32 sequences), a chunk
shape's its :data:`CHUNK` new tokens. ``--layer-window W`` makes the layer a sliding
one (``AttnKind.MHA_SLIDING``, Gemma-2's local layers: a token sees the last ``W``
keys, its own among them), whose chunks the cache keeps exact up to ``W - 1`` tokens:
shapes with longer steps are left out.

Reported for each shape: the median ms of each pipeline (CUDA-event timed VM calls with
the L2 cache flushed before each, :func:`benchmarks.timing.bench`; with ``--target llvm``
``time.perf_counter`` medians), the speed-up (default / cascade), ``max |cascade -
default| / max |default|`` of the layer's output, and each output's ``max |out - ref| /
max |ref|`` against a float32 torch reference of the layer (projections, RoPE and
attention in float32 from the same 16-bit inputs and weights). Prints a table, writes
``kv_cache_layer.json``; exits 1 if the cascade pipeline's error is more than
:data:`ERROR_RATIO` times the default pipeline's.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Optional, Sequence

from .attention import named, run_environment, shapes_parser, skip_without_gpu
from .timing import bench

PIPELINES = ("default", "cascade")
PAGE = 16
SEED = 0
#: Llama-3's RoPE base.
ROPE_THETA = 500000.0
#: The largest ratio of the cascade pipeline's error to the default pipeline's counted
#: as agreement. The ratio, not ``|cascade - default|``: TVM's projections accumulate in
#: the layer's dtype, which in bfloat16 leaves either output ~15% of its largest value
#: from the reference, and two such outputs differ by as much whatever attention does.
ERROR_RATIO = 1.25
DTYPES = ("float16", "bfloat16")
#: (name, kind, batch, tokens, hidden, heads q, heads kv, head dim). "prefill": one
#: sequence of ``tokens`` into an empty cache; "decode": one token for each of ``batch``
#: sequences holding ``tokens - 1`` cached tokens (``tokens`` keys); in ``--dtype``.
SHAPES = (
    ("prefill 1x512 llama3-8b", "prefill", 1, 512, 4096, 32, 8, 128),
    ("prefill 1x2048 llama3-8b", "prefill", 1, 2048, 4096, 32, 8, 128),
    ("prefill 1x8192 llama3-8b", "prefill", 1, 8192, 4096, 32, 8, 128),
    ("decode 1x1024 llama3-8b", "decode", 1, 1024, 4096, 32, 8, 128),
    ("decode 32x1024 llama3-8b", "decode", 32, 1024, 4096, 32, 8, 128),
    ("decode 1x8192 llama3-8b", "decode", 1, 8192, 4096, 32, 8, 128),
    ("decode 32x8192 llama3-8b", "decode", 32, 8192, 4096, 32, 8, 128),
    ("decode 1x16384 llama3-8b", "decode", 1, 16384, 4096, 32, 8, 128),
    ("decode 32x16384 llama3-8b", "decode", 32, 16384, 4096, 32, 8, 128),
    ("prefill 1x2048 d64", "prefill", 1, 2048, 2048, 32, 8, 64),
    ("decode 32x4096 d64", "decode", 32, 4096, 2048, 32, 8, 64),
    ("chunk 512 over 8192 llama3-8b", "chunk", 1, 8192, 4096, 32, 8, 128),
)
#: ``--small``: lengths off the page size, and fills in several chunks.
SMALL_SHAPES = (
    ("prefill 1x64 small", "prefill", 1, 64, 256, 4, 2, 64),
    ("prefill 1x45 small", "prefill", 1, 45, 256, 4, 2, 64),
    ("decode 1x64 small", "decode", 1, 64, 256, 4, 2, 64),
    ("decode 4x40 small", "decode", 4, 40, 256, 4, 2, 64),
    ("decode 32x40 small", "decode", 32, 40, 256, 4, 2, 64),
    ("chunk 16 over 64 small", "chunk", 1, 64, 256, 4, 2, 64),
)
#: The new tokens of a chunk shape (``--small``: :data:`SMALL_CHUNK`).
CHUNK, SMALL_CHUNK = 512, 16
#: The longest chunk a decode shape's cache is filled with (and the cache's
#: ``prefill_chunk_size`` unless a prefill shape needs more): mlc-llm's default for
#: long contexts; ``--small`` fills in chunks of 16.
FILL_CHUNK, SMALL_FILL_CHUNK = 8192, 16
CPU_REPS = 5


def layer_module(hidden, heads_q, heads_kv, head_dim, target, rope: str, dtype: str = "float16", window: int = 0):
    """The exported Relax module of the layer (its cache's RoPE mode ``rope``: "normal",
    "inline" or "none"; a sliding layer of ``window`` keys where given) and its
    parameters ``[(name, shape)]`` in the order the functions take them (after the input
    and the cache)."""
    from tvm import tirx
    from tvm.relax import ShapeExpr, prim_value
    from tvm.relax.frontend import nn
    from tvm.relax.frontend.nn.llm.kv_cache import PagedKVCache, RopeMode, TIRPagedKVCache

    class AttentionLayer(nn.Module):
        def __init__(self):
            self.qkv_proj = nn.Linear(hidden, (heads_q + 2 * heads_kv) * head_dim, bias=False, dtype=dtype)
            self.o_proj = nn.Linear(heads_q * head_dim, hidden, bias=False, dtype=dtype)

        def _forward(self, x: nn.Tensor, paged_kv_cache: PagedKVCache):
            b, s, _ = x.shape
            qkv = nn.reshape(self.qkv_proj(x), (b, s, heads_q + 2 * heads_kv, head_dim))
            out = paged_kv_cache.attention_with_fused_qkv(0, qkv, heads_q, sm_scale=head_dim ** -0.5)
            return self.o_proj(nn.reshape(out, (b, s, heads_q * head_dim))), paged_kv_cache

        def prefill(self, x: nn.Tensor, paged_kv_cache: PagedKVCache):
            return self._forward(x, paged_kv_cache)

        def batch_decode(self, x: nn.Tensor, paged_kv_cache: PagedKVCache):
            return self._forward(x, paged_kv_cache)

        def create_paged_kv_cache(  # pylint: disable=too-many-arguments
            self,
            max_batch_size: tirx.Var,
            max_total_seq_len: tirx.Var,
            prefill_chunk_size: tirx.Var,
            page_size: tirx.Var,
            support_sliding_window: tirx.Var,
        ) -> PagedKVCache:
            # A sliding layer's cache holds a layer of every key too, as Gemma-2's (TVM's
            # runtime fails on a cache of sliding layers only); the layer is the first.
            sliding = {"layer_sliding_window_size": window} if window else {}
            layers = 2 if window else 1
            return TIRPagedKVCache(
                attn_kind=["mha_sliding", "mha"] if window else "mha",
                max_batch_size=max_batch_size,
                max_total_seq_len=max_total_seq_len,
                prefill_chunk_size=prefill_chunk_size,
                page_size=page_size,
                support_sliding_window=support_sliding_window,
                layer_partition=ShapeExpr([0, layers]),
                num_hidden_layers=layers,
                num_attention_heads=heads_q,
                num_key_value_heads=heads_kv,
                qk_head_dim=head_dim,
                v_head_dim=head_dim,
                mla_original_qk_head_dim=0,
                mla_original_v_head_dim=0,
                rope_mode={"normal": RopeMode.NORMAL, "inline": RopeMode.INLINE, "none": RopeMode.NONE}[rope],
                rope_scale=1,
                rope_theta=ROPE_THETA,
                rope_scaling={},
                rope_ext_factors=prim_value(0),  # the runtime's "no long-RoPE factors"
                rotary_dim=head_dim,
                enable_disaggregation=False,
                dtype=dtype,
                target=target,
                **sliding,
            )

    forward = {"paged_kv_cache": nn.spec.Object(object_type=PagedKVCache),
               "$": {"param_mode": "plain", "effect_mode": "none"}}
    spec = {
        "prefill": {"x": nn.spec.Tensor([1, "seq_len", hidden], dtype), **forward},
        "batch_decode": {"x": nn.spec.Tensor(["batch_size", 1, hidden], dtype), **forward},
        "create_paged_kv_cache": {
            **{name: int for name in ("max_batch_size", "max_total_seq_len", "prefill_chunk_size", "page_size",
                                      "support_sliding_window")},
            "$": {"param_mode": "none", "effect_mode": "none"},
        },
    }
    mod, params = AttentionLayer().export_tvm(spec=spec)
    return mod, [(name, tuple(int(n) for n in p.shape)) for name, p in params]


def pipeline_pass(pipeline: str, target):
    """What ``relax_pipeline`` gets for ``pipeline``: on CPUs the "cascade" pipeline leaves
    the cache's kernels to TVM (it fuses attention instead), so there the cache pass runs
    before the default pipeline as the "cascade" pipeline runs it on GPUs."""
    from tvm import relax, transform

    if pipeline == "cascade" and "gpu" not in target.keys:
        from tvm_cascade.relax.kv_cache import KVCacheAttention

        return transform.Sequential([KVCacheAttention(), relax.get_pipeline("default")])
    return pipeline


def tokens(seed: int, rows: int, hidden: int, device: str, dtype: str = "float16"):
    """Seeded N(0, 1) activations ``[rows, hidden]`` of ``dtype`` (the same for both
    pipelines and the reference)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(rows, hidden, generator=gen, device=device, dtype=getattr(torch, dtype))


def weights(params, device: str, dtype: str = "float16") -> dict:
    """Weights of ``dtype`` scaled by ``in_features ** -0.5``, so that q, k, v and the
    output keep unit-order magnitudes."""
    import torch

    gen = torch.Generator(device=device).manual_seed(SEED)
    return {name: (torch.randn(shape, generator=gen, device=device) * shape[-1] ** -0.5).to(getattr(torch, dtype))
            for name, shape in params}


def _rope(x, positions):
    """Rotate-half RoPE of ``x`` ``[tokens, heads, d]`` (float32) at ``positions``,
    angles in float64."""
    import torch

    half = x.shape[-1] // 2
    inv_freq = ROPE_THETA ** (-2.0 * torch.arange(half, dtype=torch.float64, device=x.device) / x.shape[-1])
    angle = torch.cat([positions.double()[:, None] * inv_freq[None]] * 2, dim=-1)[:, None, :]
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * angle.cos().float() + rotated * angle.sin().float()


def reference(seq_tokens, queries: int, w: dict, heads_q, heads_kv, head_dim, rope: bool, window: int = 0):
    """float32 output ``[queries, hidden]`` of the layer for the last ``queries`` of one
    sequence's tokens ``seq_tokens`` ``[n, hidden]`` (16-bit), the earlier ones cached;
    each token sees the keys up to its own, the last ``window`` of them where given."""
    import torch

    n = seq_tokens.shape[0]
    qkv = (seq_tokens.float() @ w["qkv_proj.weight"].float().T).view(n, heads_q + 2 * heads_kv, head_dim)
    q, k, v = qkv.split([heads_q, heads_kv, heads_kv], dim=1)
    if rope:
        positions = torch.arange(n, device=seq_tokens.device)
        q, k = _rope(q, positions), _rope(k, positions)
    group = heads_q // heads_kv
    # [1, heads, tokens, d] with K/V heads repeated: SDPA's fused float32 kernels take
    # only that, and the math fallback would hold all 8192 x 8192 scores of every head.
    q = q[n - queries:].transpose(0, 1)[None]
    k, v = (t.repeat_interleave(group, dim=1).transpose(0, 1)[None] for t in (k, v))
    position = torch.arange(n - queries, n, device=seq_tokens.device)[:, None]
    keys = torch.arange(n, device=seq_tokens.device)[None]
    seen = (keys <= position) & ((keys > position - window) if window else True)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=seen, scale=head_dim ** -0.5)
    return out[0].transpose(0, 1).reshape(queries, heads_q * head_dim) @ w["o_proj.weight"].float().T


class Builtins:  # pylint: disable=too-few-public-methods
    """The runtime's KV-state functions."""

    def __init__(self):
        import tvm

        for name in ("add_sequence", "begin_forward", "end_forward"):
            setattr(self, name, tvm.get_global_func(f"vm.builtin.kv_state_{name}"))


def _shape(*values):
    import tvm_ffi

    return tvm_ffi.Shape([int(v) for v in values])


def run_pipeline(vm, dev, shape, w_args, x_tvm, fill_args, chunk, timer):
    """One pipeline on one shape in a cache of its own: ``(output, ms)``."""
    import torch

    fn = Builtins()
    name, kind, batch, n, hidden, *_ = shape
    new = x_tvm.shape[1] if kind != "decode" else 1
    cached = n - new
    cache = vm["create_paged_kv_cache"](
        *(_shape(v) for v in (batch, batch * (n + PAGE), chunk, PAGE, 0)))
    prefill, decode = vm["prefill"], vm["batch_decode"]
    for seq in range(batch):
        fn.add_sequence(cache, seq)
        for start in range(0, cached, chunk):
            part = fill_args(seq, start, min(cached, start + chunk))
            fn.begin_forward(cache, _shape(seq), _shape(part.shape[1]), None)
            prefill(part, cache, *w_args)
            fn.end_forward(cache)
            # The next fill's tokens may take this one's memory: the prefill must be done with it.
            dev.sync()
    if kind != "decode":
        fn.begin_forward(cache, _shape(0), _shape(new), None)
        step = prefill
    else:
        fn.begin_forward(cache, _shape(*range(batch)), _shape(*[1] * batch), None)
        step = decode
    out = step(x_tvm, cache, *w_args)[0]
    dev.sync()  # torch reads it on its own stream
    out = torch.from_dlpack(out).float().reshape(-1, hidden)
    ms = timer(lambda: step(x_tvm, cache, *w_args))
    fn.end_forward(cache)
    return out, ms


def step_tokens(shape, new_tokens: int) -> int:
    """The tokens a sequence of ``shape`` takes in its timed step (a chunk shape's
    ``new_tokens``)."""
    _, kind, _, n, *_ = shape
    return {"prefill": n, "chunk": new_tokens, "decode": 1}[kind]


def cpu_median(fn) -> float:
    """Median milliseconds of ``CPU_REPS`` calls of ``fn`` after one warm-up call."""
    fn()
    times = []
    for _ in range(CPU_REPS):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run_config(config, shapes, target, device: str, rope: str, chunk_limit: int, dtype: str = "float16",
               window: int = 0, new_tokens: int = CHUNK) -> list:
    """Every shape of one model configuration (hidden, heads, head dim): both pipelines
    compiled once (lengths and batch are symbolic), then run shape by shape; a chunk
    shape's step is ``new_tokens`` tokens."""
    import torch
    import tvm
    from tvm import relax

    import tvm_cascade  # noqa: F401  (the "cascade" pipeline)

    hidden, heads_q, heads_kv, head_dim = config
    mod, params = layer_module(hidden, heads_q, heads_kv, head_dim, target, rope, dtype, window)
    rotated = rope != "none"  # (inside attention or before it, the same positions)
    dev = tvm.device(target.get_target_device_type(), 0)
    vms = {p: relax.VirtualMachine(tvm.compile(mod, target, relax_pipeline=pipeline_pass(p, target)), dev)
           for p in PIPELINES}
    w = weights(params, device, dtype)
    w_args = [tvm.runtime.from_dlpack(w[name]) for name, _ in params]
    timer = bench if device == "cuda" else cpu_median
    rows = []
    for shape in shapes:
        name, kind, batch, n, *_ = shape
        step = step_tokens(shape, new_tokens)
        chunk = max(step if kind != "decode" else batch, chunk_limit)
        # The step's input: one sequence's new tokens (prefill, chunk) or one token a sequence.
        x = tokens(SEED + 1, step if kind != "decode" else batch, hidden, device, dtype)
        x_tvm = tvm.runtime.from_dlpack(x.reshape(1, step, hidden) if kind != "decode" else x.reshape(batch, 1, hidden))
        fills = {}

        def fill(seq, start, end):
            if seq not in fills:  # one sequence's cached tokens at a time
                fills.clear()
                fills[seq] = tokens(SEED + 2 + seq, n - step, hidden, device, dtype)
            return tvm.runtime.from_dlpack(fills[seq][start:end].reshape(1, end - start, hidden))

        outs, times = {}, {}
        for pipeline in PIPELINES:
            outs[pipeline], times[pipeline] = run_pipeline(vms[pipeline], dev, shape, w_args, x_tvm, fill, chunk, timer)
        if kind == "prefill":
            ref = reference(x, n, w, heads_q, heads_kv, head_dim, rotated, window)
        elif kind == "chunk":
            ref = reference(torch.cat([tokens(SEED + 2, n - step, hidden, device, dtype), x]), step, w, heads_q,
                            heads_kv, head_dim, rotated, window)
        else:
            ref = torch.cat([reference(torch.cat([tokens(SEED + 2 + seq, n - 1, hidden, device, dtype), x[seq: seq + 1]]),
                                       1, w, heads_q, heads_kv, head_dim, rotated, window)
                             for seq in range(batch)])
        scale = ref.abs().max().item()
        base = outs["default"].abs().max().item()
        diff = (outs["cascade"] - outs["default"]).abs().max().item() / base
        errors = {pipeline: (outs[pipeline] - ref).abs().max().item() / scale for pipeline in PIPELINES}
        for pipeline in PIPELINES:
            row = {"shape": name, "kind": kind, "batch": batch, "tokens": n, "hidden": hidden, "heads_q": heads_q,
                   "heads_kv": heads_kv, "head_dim": head_dim, "pipeline": pipeline, "ms": times[pipeline],
                   "error": errors[pipeline]}
            if pipeline == "cascade":
                row.update(speedup=times["default"] / times[pipeline], vs_default=diff,
                           agree=errors["cascade"] <= ERROR_RATIO * errors["default"])
            rows.append(row)
            print(f"{name:28s} {pipeline:8s} {times[pipeline]:9.4f} ms  (err {row['error']:.1e})", flush=True)
        del outs, ref
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def table(results) -> str:
    """The side-by-side table of ``results`` (rows of both pipelines)."""
    head = (f"{'shape':28s} {'default ms':>11s} {'cascade ms':>11s} {'speed-up':>9s} {'|c-d|/|d|':>10s}"
            f" {'err default':>12s} {'err cascade':>12s}")
    lines = [head, "-" * len(head)]
    by_shape = {}
    for row in results:
        by_shape.setdefault(row["shape"], {})[row["pipeline"]] = row
    for name, rows in by_shape.items():
        d, c = rows["default"], rows["cascade"]
        flag = "" if c["agree"] else "  MISMATCH"
        lines.append(f"{name:28s} {d['ms']:11.4f} {c['ms']:11.4f} {c['speedup']:8.2f}x {c['vs_default']:10.1e}"
                     f" {d['error']:12.1e} {c['error']:12.1e}{flag}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = shapes_parser("benchmarks.kv_cache_layer", __doc__, "kv_cache_layer.json")
    p.add_argument("--target", choices=("cuda", "llvm"), default="cuda",
                   help="llvm: run on the CPU (with --small), timing with time.perf_counter")
    p.add_argument("--small", action="store_true",
                   help="tiny shapes (hidden 256, heads 4/2, head dim 64, at most 64 tokens)")
    p.add_argument("--rope", choices=("normal", "inline", "none"), default="normal",
                   help="RoPE before attention (RopeMode.NORMAL, theta 500000), inside it (RopeMode.INLINE: the "
                        "cache keeps keys as appended) or none")
    p.add_argument("--dtype", choices=DTYPES, default="float16", help="the layer's dtype")
    p.add_argument("--layer-window", type=int, default=0, metavar="W",
                   help="a sliding layer of W keys (AttnKind.MHA_SLIDING); default: every key")
    args = p.parse_args(argv)
    on_gpu = args.target == "cuda"
    if on_gpu and skip_without_gpu("benchmarks.kv_cache_layer"):
        return 0
    import tvm

    target = tvm.target.Target.from_device(tvm.cuda(0)) if on_gpu else tvm.target.Target("llvm")
    env = run_environment("benchmarks.kv_cache_layer", args.out, argv)
    env["target"] = str(target)
    shapes = named(SMALL_SHAPES if args.small else SHAPES, args.only)
    new_tokens = SMALL_CHUNK if args.small else CHUNK
    if args.layer_window:
        left = [s[0] for s in shapes if step_tokens(s, new_tokens) >= args.layer_window]
        if left:
            print(f"left out (steps of {args.layer_window} tokens or more): {', '.join(left)}", flush=True)
        shapes = [s for s in shapes if s[0] not in left]
    configs = list(dict.fromkeys(s[4:] for s in shapes))
    results = []
    for config in configs:
        results += run_config(config, [s for s in shapes if s[4:] == config], target, "cuda" if on_gpu else "cpu",
                              args.rope, SMALL_FILL_CHUNK if args.small else FILL_CHUNK, args.dtype,
                              args.layer_window, new_tokens)
        (args.out / "kv_cache_layer.json").write_text(json.dumps(
            {"environment": env, "rope": args.rope, "dtype": args.dtype, "layer_window": args.layer_window,
             "error_ratio": ERROR_RATIO, "results": results}, indent=1))
    print("\n" + table(results), flush=True)
    print(f"wrote {args.out / 'kv_cache_layer.json'}", flush=True)
    return 0 if all(r["agree"] for r in results if r["pipeline"] == "cascade") else 1


if __name__ == "__main__":
    sys.exit(main())
