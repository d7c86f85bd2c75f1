"""The implementations compared by the harness (torch and TVM imported lazily).

A peer is a ``build(cfg, q, k, v) -> (fn, note)`` function: ``fn(q, k, v) -> out``
works on CUDA torch tensors ``q[b, hq, sq, d]``, ``k/v[b, hkv, skv, d]`` and ``note``
remarks on how the variant was expressed.  A peer that cannot express a
configuration raises :class:`Unsupported`; the harness reports that (or any other
exception) as "n/a" with the reason.  Everything a peer precomputes (masks,
compiled modules) is built here, outside the timed call.
"""

from __future__ import annotations

from typing import Callable, Dict, Tuple

from .configs import Config

TVM_CASCADE = "tvm-cascade"
TVM_CASCADE_RUNTIME = "tvm-cascade-runtime"
#: Dynamo's recompile limits: at the default (8) every further shape (FlexAttention's
#: score_mod too) silently falls back to an unfused eager path.
DYNAMO_RECOMPILE_LIMIT = 256
#: SDPA backends that are given ``attn_mask`` for ALiBi and the sliding window.
MASK_BACKENDS = {"EFFICIENT_ATTENTION"}


class Unsupported(Exception):
    """The peer cannot express this configuration (reported as n/a)."""


Built = Tuple[Callable, str]


def tvm_cascade(cfg: Config, q, k, v, config=None) -> Built:
    """tvm-cascade's kernel (``config``: its heuristic schedule's choices instead of the
    best known schedule)."""
    try:
        from tvm_cascade.bench import build_attention
    except ImportError as err:
        raise Unsupported(f"tvm_cascade.bench.build_attention unavailable ({err})") from err
    o = cfg.op
    try:
        fn = build_attention(
            o.kind,
            o.variant,
            cfg.batch,
            o.heads_q,
            o.heads_kv,
            cfg.seq_q,
            cfg.seq_kv,
            cfg.head_dim,
            cfg.dtype,
            config=config,
        )
    except NotImplementedError as err:
        raise Unsupported(str(err) or "NotImplementedError") from err
    return fn, ""


def tvm_cascade_runtime(cfg: Config, q, k, v) -> Built:
    """tvm-cascade's kernel of runtime lengths (``kernels.attention_kernel``: one kernel for
    the operator's heads, head dim, variant and dtype, lengths given at the call), planned
    once for the configuration's shapes; the note names the family that runs them."""
    try:
        from tvm_cascade.bench import build_runtime_attention
    except ImportError as err:
        raise Unsupported(f"tvm_cascade.bench.build_runtime_attention unavailable ({err})") from err
    o = cfg.op
    return build_runtime_attention(o.variant, o.heads_q, o.heads_kv, cfg.head_dim, cfg.dtype, q, k, v)


def _join(*notes: str) -> str:
    return ", ".join(n for n in notes if n)


def _sdpa_bias(cfg: Config, q):
    """Additive fp16 mask ``[1, hq, sq, skv]``: ALiBi bias, ``-inf`` where masked (built per head)."""
    import torch

    o = cfg.op
    q_pos = torch.arange(cfg.seq_q, device=q.device).view(-1, 1) + cfg.offset
    kv_pos = torch.arange(cfg.seq_kv, device=q.device).view(1, -1)
    rel = (kv_pos - q_pos).float()
    bias = torch.empty(1, o.heads_q, cfg.seq_q, cfg.seq_kv, dtype=q.dtype, device=q.device)
    for h in range(o.heads_q):
        bias[0, h] = rel * 2.0 ** (-8.0 * (h + 1) / o.heads_q)
    if cfg.masked:
        bias.masked_fill_(kv_pos > q_pos, float("-inf"))
    return bias


def _sdpa_window(cfg: Config, q):
    """Boolean mask ``[sq, skv]`` (True = attend) of the causal sliding window."""
    import torch

    q_pos = torch.arange(cfg.seq_q, device=q.device).view(-1, 1) + cfg.offset
    kv_pos = torch.arange(cfg.seq_kv, device=q.device).view(1, -1)
    return (kv_pos <= q_pos) & (q_pos - kv_pos < cfg.op.window)


def sdpa(backend: str):
    """Peer: ``F.scaled_dot_product_attention`` restricted to ``SDPBackend.<backend>``."""

    def build(cfg: Config, q, k, v) -> Built:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        o = cfg.op
        if o.softcap is not None:
            raise Unsupported("softcap is not expressible in SDPA")
        mask, is_causal = None, False
        if o.alibi or o.window is not None:
            if backend not in MASK_BACKENDS:
                raise Unsupported(
                    f"ALiBi/window need attn_mask; only run with {', '.join(sorted(MASK_BACKENDS))}"
                )
            mask = _sdpa_bias(cfg, q) if o.alibi else _sdpa_window(cfg, q)
        elif cfg.masked:
            if cfg.offset:
                raise Unsupported("SDPA is_causal aligns queries top-left, not to the end of the keys")
            is_causal = True
        kernel = getattr(SDPBackend, backend)
        attention = torch.nn.functional.scaled_dot_product_attention
        note = "attn_mask (precomputed)" if mask is not None else ""

        def run(q, k, v, enable_gqa=False):
            with sdpa_kernel(kernel):
                return attention(
                    q, k, v, attn_mask=mask, is_causal=is_causal, scale=cfg.scale, enable_gqa=enable_gqa
                )

        group = o.heads_q // o.heads_kv
        if group == 1:
            return run, note
        try:
            run(q, k, v, enable_gqa=True)
        except RuntimeError:  # the backend has no GQA kernel: repeat K/V as users do

            def repeated(q, k, v):
                return run(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1))

            return repeated, _join(note, "enable_gqa rejected: K/V repeat_interleave (timed)")
        return (lambda q, k, v: run(q, k, v, enable_gqa=True)), _join(note, "enable_gqa")

    return build


_compiled_flex = None


def compiled_per_shape(fn):
    """``torch.compile`` of ``fn`` specialised to each shape it meets (``dynamic=False``,
    Dynamo's recompile limits raised to :data:`DYNAMO_RECOMPILE_LIMIT`): by default a
    second shape recompiles it for symbolic sizes, and what a peer runs would then
    depend on the shapes run before it in the process."""
    import torch
    import torch._dynamo.config as dynamo_config

    for name in (
        "cache_size_limit",
        "recompile_limit",
        "accumulated_cache_size_limit",
        "accumulated_recompile_limit",
    ):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), DYNAMO_RECOMPILE_LIMIT))
    return torch.compile(fn, dynamic=False)


def _flex_attention():
    global _compiled_flex
    if _compiled_flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled_flex = compiled_per_shape(flex_attention)
    return _compiled_flex


def flex(cfg: Config, q, k, v) -> Built:
    """Peer: compiled FlexAttention with score_mod / block_mask."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    o = cfg.op
    offset = cfg.offset
    score_mod = block_mask = None
    if o.alibi:
        slopes = 2.0 ** (
            -8.0 * torch.arange(1, o.heads_q + 1, device=q.device, dtype=torch.float32) / o.heads_q
        )

        def alibi(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx - offset)

        score_mod = alibi

    elif o.softcap is not None:
        cap = o.softcap

        def softcap(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score / cap)

        score_mod = softcap

    if cfg.masked:
        window = o.window

        def mask_mod(b, h, q_idx, kv_idx):
            visible = kv_idx <= q_idx + offset
            if window is not None:
                visible = visible & (q_idx + offset - kv_idx < window)
            return visible

        block_mask = create_block_mask(mask_mod, None, None, cfg.seq_q, cfg.seq_kv, device=q.device)
    attention = _flex_attention()
    gqa = o.heads_q != o.heads_kv

    def run(q, k, v):
        return attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=cfg.scale, enable_gqa=gqa)

    return run, "block_mask" if block_mask is not None else ""


def stock_tvm(cfg: Config, q, k, v) -> Built:
    """Peer: the unfused Relax graph of :mod:`benchmarks.stock_tvm`, torch <-> TVM through DLPack."""
    import torch
    import tvm

    from .stock_tvm import compile_vm

    free, _ = torch.cuda.mem_get_info(q.device)
    o = cfg.op
    need = 6 * cfg.batch * o.heads_q * cfg.seq_q * cfg.seq_kv  # fp32 scores + fp16 probabilities
    if need > free:
        raise Unsupported(f"needs {need / 1e9:.0f} GB for scores/probabilities, {free / 1e9:.0f} GB free")
    device = tvm.cuda(q.device.index or 0)
    main = compile_vm(cfg, tvm.target.Target.from_device(device), device)
    from_dlpack = tvm.runtime.from_dlpack

    def run(q, k, v):
        return torch.from_dlpack(main(from_dlpack(q), from_dlpack(k), from_dlpack(v)))

    return run, ""


PEERS: Dict[str, Callable[..., Built]] = {
    TVM_CASCADE: tvm_cascade,
    TVM_CASCADE_RUNTIME: tvm_cascade_runtime,
    "sdpa-flash": sdpa("FLASH_ATTENTION"),
    "sdpa-cudnn": sdpa("CUDNN_ATTENTION"),
    "sdpa-efficient": sdpa("EFFICIENT_ATTENTION"),
    "flex": flex,
    "tvm-stock": stock_tvm,
}


def release_memory() -> None:
    """Return cached device memory of torch and of TVM's VM allocator between configurations."""
    import gc
    import sys

    import torch

    gc.collect()
    if "tvm" in sys.modules:
        sys.modules["tvm"].get_global_func("vm.builtin.memory_manager.clear")()
    torch.cuda.empty_cache()
