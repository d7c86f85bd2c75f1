"""``KVCacheAttention``: TVM's paged KV cache (``relax.frontend.nn.llm``'s
``TIRPagedKVCache``) runs the kernel library's attention.

The cache is made by one ``vm.builtin.paged_attention_kv_cache_create`` call whose
arguments hold its configuration and its kernels, ``("tirx", GlobalVar)`` pairs. The
pass puts :mod:`tvm_cascade.library.kv_cache`'s kernels (the same calling convention),
under the names of TVM's, in the slots of the ragged prefill, paged prefill,
sliding-window paged prefill (given the window of the cache's sliding layers), paged
decode and sliding-window decode kernels; the runtime calls them unchanged. It leaves
TVM's kernel in a slot, and logs why on ``tvm_cascade.relax``, where the library does
not serve the cache: MLA, or a configuration no family builds. The tree-attention
kernels stay TVM's (logged).

Kernels that rotate Q and K inside attention as TVM's do
(:mod:`tvm_cascade.library.rope_inside`) serve the calls the runtime makes with RoPE
inside attention: every call of a cache of ``RopeMode.INLINE``, and, in a cache with
RoPE whose sliding-window support is not the constant 0 (a ``relax.frontend.nn.llm``
model takes it as an argument: the runtime decides) and that has no sliding layers,
the calls where that support is on: the runtime then turns RoPE before attention into
RoPE inside it and attends through the sliding-window kernels (those kernels rotate)
and the ragged prefill (built for both). Each replacement keeps TVM's kernel as its
fallback (``cache_kernel``'s) for a call it does not serve.
"""
from __future__ import annotations

import logging

import tvm
from tvm import relax

from ..library.kv_cache import cache_kernel
from .dispatch import LIBRARY_ATTR, OPAQUE

logger = logging.getLogger("tvm_cascade.relax")

CREATE = "vm.builtin.paged_attention_kv_cache_create"
#: The create call's arguments that the pass reads, by position (after the function's name).
CONFIG, HEADS_Q, HEADS_KV, QK_HEAD_DIM, V_HEAD_DIM, ATTN_KINDS, ROPE_MODE, DTYPE_OF = 0, 2, 3, 4, 5, 6, 8, 12
#: Where the cache's sliding-window support and the window of its sliding layers lie in
#: its configuration (``CONFIG``).
SLIDING_WINDOW_SUPPORT, LAYER_WINDOW = 4, 5
#: The slots of the kernels replaced: position -> kind of :mod:`tvm_cascade.library.kv_cache`.
SLOTS = {15: "ragged", 16: "prefill", 17: "decode", 18: "prefill_window", 19: "decode_window"}
#: ``AttnKind.MHA`` and ``AttnKind.MHA_SLIDING`` (its layers attend through the
#: sliding-window kernels, within the configuration's window), the attention kinds
#: served, and the cache's ``RopeMode.NONE`` and ``RopeMode.INLINE``.
_MHA, _SLIDING, _NO_ROPE, _INLINE = 0, 3, 0, 2
_SERVED_KINDS = (_MHA, _SLIDING)
#: The kernels a cache with sliding-window support on calls (with RoPE inside attention,
#: where it has RoPE); of them, the ragged prefill is called where it is off too.
_CALLED_WITH_WINDOWS = ("ragged", "prefill_window", "decode_window")
_CALL_PACKED = tvm.ir.Op.get("relax.call_pure_packed")


@tvm.transform.module_pass(opt_level=0, name="KVCacheAttention")
class KVCacheAttention:
    """Put the kernel library's kernels in every paged KV cache the module creates, for
    the current target (a module without one is returned as it is)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        target = tvm.target.Target.current(allow_none=True)
        if target is None:
            return mod
        creates = [call for func in mod.functions.values() if isinstance(func, relax.Function)
                   for call in _create_calls(func)]
        if not creates:
            return mod
        kernels = {}  # a slot's GlobalVar -> the PrimFunc that takes its place
        for call in creates:
            kernels.update(_replacements(mod, call.args[1:], target))
        if not kernels:
            return mod
        mod = mod.clone()
        for gvar, func in kernels.items():
            mod.update_func(gvar, func)
        return mod


def _create_calls(func) -> list:
    calls = []

    def visit(expr):
        if (isinstance(expr, relax.Call) and expr.op.same_as(_CALL_PACKED)
                and isinstance(expr.args[0], relax.ExternFunc) and expr.args[0].global_symbol == CREATE):
            calls.append(expr)

    relax.analysis.post_order_visit(func.body, visit)
    return calls


def _replacements(mod, args, target) -> dict:
    """The slots' GlobalVars of one create call's arguments ``args`` -> the library's
    PrimFunc under the same name (the runtime's symbol), for the slots the library
    serves (the others logged)."""
    reason = _unserved(args)
    if reason is not None:
        logger.info("paged KV cache left on TVM's kernels: %s", reason)
        return {}
    heads_q, heads_kv, head_dim = (_int(args[i]) for i in (HEADS_Q, HEADS_KV, QK_HEAD_DIM))
    dtype = str(args[DTYPE_OF].ty.dtype)
    window = _layer_window(args)
    rope_mode = _int(args[ROPE_MODE])
    window_support = args[CONFIG].values[SLIDING_WINDOW_SUPPORT]
    # The runtime's rule: sliding-window support (where no layer slides) turns RoPE
    # into RoPE inside attention, every call then attending through the sliding-window
    # kernels but the ragged prefill.
    maybe_inside = (rope_mode != _NO_ROPE and not window
                    and not (isinstance(window_support, tvm.tirx.IntImm) and window_support.value == 0))
    always_inside = rope_mode == _INLINE or (maybe_inside and isinstance(window_support, tvm.tirx.IntImm))
    logger.info("paged KV cache: the tree-attention kernels stay TVM's")
    out = {}
    for slot, kind in SLOTS.items():
        pair = args[slot]
        if not (isinstance(pair, relax.Tuple) and len(pair.fields) == 2):
            continue
        old = pair.fields[1]
        inside = always_inside or (maybe_inside and kind in _CALLED_WITH_WINDOWS)
        kernel, why = cache_kernel(kind, heads_q, heads_kv, head_dim, dtype, target, fallback=mod[old],
                                   window=window if kind == "prefill_window" else 0, rotate_inside=inside,
                                   unrotated_too=inside and not always_inside and kind == "ragged")
        if kernel is None:
            logger.info("paged KV cache's %s kernel left to TVM's (%s): %s", kind, old.name_hint, why)
            continue
        out[old] = kernel.func.with_attrs(
            {"global_symbol": old.name_hint, "op_pattern": OPAQUE, LIBRARY_ATTR: kernel.family.name})
    return out


def _unserved(args):
    """Why the library serves none of a cache's kernels, or None."""
    kinds = [int(k) for k in args[ATTN_KINDS].values]
    if any(k not in _SERVED_KINDS for k in kinds):
        return f"attention kinds {kinds}: multi-head attention (AttnKind.MHA, MHA_SLIDING) only"
    if _int(args[QK_HEAD_DIM]) != _int(args[V_HEAD_DIM]):
        return "Q·K and V head dims differ"
    return None


def _layer_window(args) -> int:
    """The window of the cache's sliding layers (a constant, as TVM's kernel is built
    for it), 0 where it has none."""
    if _SLIDING not in [int(k) for k in args[ATTN_KINDS].values]:
        return 0
    return int(args[CONFIG].values[LAYER_WINDOW])


def _int(value) -> int:
    """A create argument's int (a ``relax.prim_value``, an ``IntImm``)."""
    return int(value.value)
