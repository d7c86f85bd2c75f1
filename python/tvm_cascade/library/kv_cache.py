"""Kernels with the calling convention of TVM's paged KV cache (``relax.frontend.nn.llm``'s
``TIRPagedKVCache``): the runtime's ``vm.builtin.paged_attention_kv_cache_create`` calls
them as it calls TVM's own ``tir_attention_prefill_ragged``, ``tir_attention_prefill``,
``tir_attention_prefill_sliding_window``, ``tir_attention_decode`` and
``tir_attention_decode_sliding_window``.

=====================  ==============  ===============================================
the cache's kernel     kind            arguments
=====================  ==============  ===============================================
ragged prefill         ``"ragged"``    ``q, qo_indptr, k, v, kv_indptr, q_rope_position,
                                       k_rope_pos_offset, o, lse, causal, rotary_mode,
                                       rope_scale, rope_theta, sm_scale``
paged prefill          ``"prefill"``   ``q, qo_indptr, pages, page_indptr, page_indices,
                                       length_info, k_rope_pos_offset, q_rope_position,
                                       o, lse, causal, rotary_mode, rope_scale,
                                       rope_theta, sm_scale``
sliding-window         ``"prefill_     as ``"prefill"``, ``length_info[3, batch]`` (the
paged prefill          window"``       window's start and sinks: :mod:`.layouts`)
paged decode           ``"decode"``    ``q, pages, page_indptr, page_indices,
                                       length_info, k_rope_pos_offset, q_rope_position,
                                       o, lse, rotary_mode, rope_scale, rope_theta,
                                       sm_scale``
sliding-window decode  ``"decode_      as ``"decode"``, ``length_info[3, batch]`` (the
                       window"``       window's start and sinks: :mod:`.layouts`)
=====================  ==============  ===============================================

``lse`` is each row's base-2 log-sum-exp of its scaled scores (``-5e4`` for a row that
sees no key), which the cache's merge of attention states reads. The runtime calls the
ragged kernel with ``causal=1`` (the new tokens among themselves) and the paged prefill
kernel with ``causal=0`` (the new tokens over the cached ones); a kernel is built for
that mask and refuses the other. The sliding-window paged prefill is called with
``causal=0`` in a cache with sliding windows and attention sinks (every cached key
seen), and with ``causal=1`` for the layers of a cache's sliding layers
(``AttnKind.MHA_SLIDING``: new token ``i`` sees the last ``W - 1 - i`` cached keys of
the layers' window of ``W``); its kernel serves both where it is given ``W``. RoPE
inside attention (``rotary_mode`` 1, what the runtime passes for the cache's
``RopeMode.INLINE``, and for RoPE in a cache whose sliding-window support is on; else
keys are rotated before they enter the pages) is computed by a kernel built for it
(``rotate_inside``: :mod:`.rope_inside`), which refuses the calls without unless built
for both (``unrotated_too``); other kernels refuse it. The index arrays may be views into
the runtime's workspace (any element offset).

The kernel is the first family of :data:`KIND_FAMILIES` that serves the spec; its
scalars are planned from the tensors' shapes: the longest sequence is bounded by every
query token and every key (or every page's keys), and the families' per-sequence
bounds keep the work to each sequence's own lengths.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Optional

import tvm
import tvm_ffi
from tvm import tirx
from tvm.ir import expr as ir_expr

from ..analysis.chain import substitute
from ..analysis.scope import buffer_params
from ..ops.variants import AttentionVariant
from ..primitives.ir import prepend_in_root, replace_buffers
from .families import planned_body, runtime_families
from .layouts import INDEX_DTYPE, views
from .rope_inside import SCALARS, Rotation, key_rotation, rotated_body, rotation_of
from .spec import AttentionSpec

logger = logging.getLogger("tvm_cascade.library")

#: The cache's kernels this module builds: kind -> (layout, causal).
KINDS = {"ragged": ("kv_ragged", True), "prefill": ("kv_paged", False), "prefill_window": ("kv_paged_window", False),
         "decode": ("kv_decode", False), "decode_window": ("kv_decode_window", False)}
#: Those of :func:`~.families.runtime_families` that serve any number
#: of query rows, and the decode families (a few rows) before the last, which serves
#: every spec.
_RUNTIME = runtime_families()
_PREFILL_FAMILIES = tuple(family for family in _RUNTIME if family.queries is None)
_DECODE_FAMILIES = tuple(family for family in _RUNTIME[:-1] if family.queries is not None) + _RUNTIME[-1:]
#: The families asked, in order, for each kind.
KIND_FAMILIES = {"ragged": _PREFILL_FAMILIES, "prefill": _PREFILL_FAMILIES, "prefill_window": _PREFILL_FAMILIES,
                 "decode": _DECODE_FAMILIES, "decode_window": _DECODE_FAMILIES}
#: Kinds that only a fast family serves on GPUs: the generic kernel there is not
#: measured against TVM's (which stays where no fast family serves).
_FAST_ON_GPUS = ("prefill_window",)
#: The kernels' ``rotary_mode`` that rotates Q and K inside attention: the runtime passes
#: 1 where the cache's RoPE mode is ``RopeMode.INLINE``, else 0.
ROTATE_INSIDE = 1
#: The targets whose kernels rotate Q and K inside attention (:mod:`.rope_inside`).
ROTATES_ON = ("llvm", "cuda")
#: The scalars of the convention after ``o`` and ``lse``, by kind.
_TRAILING = ("causal", "rotary_mode", "rope_scale", "rope_theta")
_SCALAR_DTYPES = {"causal": "int32", "rotary_mode": "int32", "rope_scale": "float32", "rope_theta": "float32"}


@dataclass(frozen=True)
class CacheKernel:
    """A built kernel: its PrimFunc (the convention's parameters; scheduled, with the
    target it compiles for), the family that built it and its spec."""

    func: tvm.tirx.PrimFunc
    family: object
    spec: AttentionSpec


def cache_kernel(kind: str, heads_q: int, heads_kv: int, head_dim: int, dtype: str, target,
                 page_size: int = 16, fallback: Optional[tvm.tirx.PrimFunc] = None, window: int = 0,
                 rotate_inside: bool = False, unrotated_too: bool = False) -> tuple[Optional[CacheKernel], str]:
    """The kernel of ``kind`` (:data:`KINDS`) for the cache's heads, head dim, dtype and
    page size on ``target``: ``(CacheKernel, "")``, or ``(None, why)`` where no family
    serves it (each family passed over is logged with its reason). ``window``
    (``"prefill_window"`` only): the keys of the cache's sliding layers' window, which
    its calls with ``causal=1`` attend within.

    With ``rotate_inside`` (the calls of a cache of ``RopeMode.INLINE``, or of one whose
    sliding-window support is on: :mod:`tvm_cascade.relax.kv_cache`) the kernel serves
    the calls with RoPE inside attention (``rotary_mode`` 1), rotating as ``fallback``, TVM's
    kernel, does (:mod:`.rope_inside`; on :data:`ROTATES_ON`), else those without;
    with ``unrotated_too`` as well those without (the function holds a kernel for each
    and chooses by ``rotary_mode``: a cache whose sliding-window support is decided at
    run time calls its ragged prefill with either).

    A call the kernel does not serve (the other mask, the other ``rotary_mode``) raises
    a ``RuntimeError``, or, with ``fallback`` (a kernel of the same convention: TVM's),
    runs ``fallback``'s body in its place."""
    layout, causal = KINDS[kind]
    if window and kind != "prefill_window":
        raise ValueError(f"a window is the sliding-window prefill's, not the {kind} kernel's")
    if unrotated_too and not rotate_inside:
        raise ValueError("unrotated_too: calls without RoPE inside attention as well as with; rotate_inside is False")
    target = tvm.target.Target(target)
    rotation = None
    if rotate_inside:
        if target.kind.name not in ROTATES_ON:
            return None, f"RoPE inside attention: no rotation pass for {target.kind.name} targets"
        if fallback is None:
            return None, "RoPE inside attention rotates as TVM's kernel does: none given"
        rotation, why = rotation_of(fallback)
        if rotation is None:
            return None, why
    try:
        def make(variant):
            return AttentionSpec.make(heads_q, heads_kv, head_dim, variant=variant, dtype=dtype, layout=layout,
                                      target=target, page_size=None if layout == "kv_ragged" else page_size)

        spec = make("causal" if causal else None)
        windowed = make(AttentionVariant("sliding_window", causal=True, window=window)) if window else None
    except ValueError as err:
        return None, str(err)
    reasons = []
    for family in KIND_FAMILIES[kind]:
        reason = family.supports(spec) or (windowed and family.supports(windowed))
        generic = family is _RUNTIME[-1]
        if reason is None and kind in _FAST_ON_GPUS and generic and target.kind.name == "cuda":
            reason = "its GPU kernel is not measured against TVM's sliding-window prefill"
        if reason is None:
            other = None if windowed is None else _with_convention(family, windowed, True, None, rotation=rotation)
            if rotation is not None and unrotated_too:
                # (the calls without RoPE inside attention: the kernel built for them, as
                # its fallback)
                plain = None if windowed is None else _with_convention(family, windowed, True, None)
                fallback = _with_convention(family, spec, causal, fallback, plain)
            func = _with_convention(family, spec, causal, fallback, other, rotation).with_attrs(
                {"tirx.is_scheduled": True, "target": family.compile_target(target)})
            return CacheKernel(func, family, spec), ""
        logger.info("%s: not the %s kernel: %s", spec.describe(), family.name, reason)
        reasons.append(f"{family.name}: {reason}")
    return None, "; ".join(reasons)


def _with_convention(family, spec: AttentionSpec, causal: bool, fallback, other=None,
                     rotation: Optional[Rotation] = None) -> tvm.tirx.PrimFunc:
    """``family``'s function for ``spec`` with the cache's parameters: its scalars planned
    from the shapes, the trailing scalars added (a call with the other ``causal`` given
    to ``other``, a function of the same convention, where there is one; such a call,
    or one of the other ``rotary_mode``, refused, or given to ``fallback``), the index
    arrays given element offsets, and, with ``rotation``, Q and K rotated before it."""
    trailing = {name: tirx.Var(name, _SCALAR_DTYPES[name]) for name in _TRAILING}
    scales = {name: trailing[name] for name in SCALARS}
    # A family that rotates keys as they enter its products (in registers) needs no
    # rotated copy of them.
    rotates_keys = rotation is not None and hasattr(family, "rotates_keys") and family.rotates_keys(spec, rotation)
    func = family.build(spec, key_rotation(rotation, scales)) if rotates_keys else family.build(spec)
    buffers = {b.name: b for b in buffer_params(func)}
    offsets = {b: _with_offset(b) for b in buffers.values() if b.dtype == INDEX_DTYPE}
    # (the tensors at their element offsets: those the returned function takes)
    final = {name: offsets.get(b, b) for name, b in buffers.items()}
    view = views(spec, lambda shape, dtype, name: final[name])
    names = [p.name for p in func.params]
    inputs = list(func.params[: names.index("sm_scale")])
    sm_scale = func.params[names.index("sm_scale")]
    scalars = func.params[names.index("sm_scale") + 1: names.index("out")]
    body = planned_body(func, family, spec, scalars, view.batch, view.rows, view.keys, tvm.cuda(0))
    if spec.layout in ("kv_decode", "kv_decode_window"):  # one query a sequence: no mask
        del trailing["causal"]
    if rotation is None:
        served = [(tirx.NE(trailing["rotary_mode"], ROTATE_INSIDE),
                   f"{spec.describe()}: RoPE inside attention (rotary_mode {ROTATE_INSIDE}) is not computed")]
    else:
        served = [(tirx.EQ(trailing["rotary_mode"], ROTATE_INSIDE),
                   f"{spec.describe()}: built for RoPE inside attention (rotary_mode {ROTATE_INSIDE})")]
    body = _redirect(body, offsets)
    if rotation is not None:
        body = rotated_body(body, view, final, rotation, scales, spec.layout,
                            gpu=tvm.target.Target(spec.target).kind.name == "cuda", keys=not rotates_keys)
    params = [offsets.get(p, p) for p in inputs] + [buffers["out"], buffers["lse"], *trailing.values(), sm_scale]
    if "causal" in trailing:
        matches = tirx.EQ(trailing["causal"], int(causal))
        if other is None:
            served.append((matches, f"{spec.describe()}: built for causal={int(causal)}"))
        else:
            body = tirx.IfThenElse(tirx.op.tvm_thread_invariant(matches), body, _bound(other, params))
    if fallback is None:
        body = prepend_in_root(body, [_check(condition, message) for condition, message in served])
    else:
        # A host branch around the kernels (the thread-sync pass takes an unmarked
        # condition for a branch inside a kernel).
        condition = tirx.op.tvm_thread_invariant(functools.reduce(tirx.And, [c for c, _ in served]))
        body = tirx.IfThenElse(condition, body, _bound(fallback, params))
    return tirx.PrimFunc(params, body, attrs=func.attrs).with_attr("global_symbol", f"{family.name}_{spec.layout}")


def _bound(func, params):
    """``func``'s body over ``params`` (of the same convention, in the same order): its
    parameters, and the shape and offset variables of its buffers, those of ``params``."""
    if len(func.params) != len(params):
        raise ValueError(f"the fallback takes {len(func.params)} parameters, the convention {len(params)}")
    vmap = {}
    for theirs, ours in zip(func.params, params):
        if isinstance(theirs.ty, tirx.BufferType) != isinstance(ours.ty, tirx.BufferType):
            raise ValueError(f"the fallback's {theirs.name} and the convention's {ours.name} differ in kind")
        vmap[theirs] = ours
        if isinstance(theirs.ty, tirx.BufferType):
            pairs = list(zip(theirs.shape, ours.shape)) + [(theirs.elem_offset, ours.elem_offset)]
            vmap.update((t, o) for t, o in pairs if isinstance(t, tirx.Var) and t not in vmap)
    return substitute(func.body, vmap)


def _check(condition, message):
    # The constructor's own argument order (tirx.AssertStmt's Python one differs).
    return tirx._ffi_api.AssertStmt(  # pylint: disable=protected-access
        condition, tvm.ir.StringImm("RuntimeError"), [tvm.ir.StringImm(message)], None)


def _with_offset(buffer):
    """``buffer`` at any element offset (a view into a workspace)."""
    return tirx.decl_buffer(buffer.shape, buffer.dtype, buffer.name, data=buffer.data,
                            elem_offset=tirx.Var(f"{buffer.name}_elem_offset", "int32"))


def _redirect(body, bmap: dict):
    """``body`` with the buffers of ``bmap`` replaced: loads, stores and blocks' regions."""
    def region(r):
        new = bmap.get(r.source)
        return r if new is None else tirx.BufferRegion(new, r.region)

    return tvm_ffi.structural_map(replace_buffers(body, bmap), [(ir_expr.TensorRegion, region)])

