"""Attention kernels whose batch size and lengths are runtime values: one compiled
kernel per (heads, head dim, variant, dtype, layout, target), cached on disk.

.. code-block:: python

    from tvm_cascade.kernels import attention_kernel

    kernel = attention_kernel(32, 8, 128, variant="causal", layout="ragged")
    out = kernel(q, k, v, q_indptr, kv_indptr)   # any lengths, any batch

Modules: :mod:`.spec` (what a kernel computes), :mod:`.layouts` (bhsd, ragged and paged
tensors and their common view), :mod:`.compute` (the unfused chain over that view),
:mod:`.families` (the kernel families and the choice among them), :mod:`.arguments`
(the checks of a call), :mod:`.kernel` (the callable), :mod:`.cache` (built kernels on
disk), :mod:`.kv_cache` (kernels with the calling convention of TVM's paged KV cache).
"""
from __future__ import annotations

import tvm

from . import cache
from .arguments import ARGUMENTS, KernelArgumentError
from .families import FAMILIES, choose
from .kernel import AttentionKernel
from .spec import CACHE_LAYOUTS, LAYOUTS, AttentionSpec, MaskTensor

def attention_kernel(heads_q, heads_kv, head_dim, *, variant=None, dtype="float16", target=None,
                     layout="bhsd", scale=None, page_size=None, mask=None, use_cache=True) -> AttentionKernel:
    """A compiled attention kernel for ``heads_q`` query heads over ``heads_kv`` K/V heads
    (GQA when fewer; MQA with one) of ``head_dim``; its batch size and lengths are
    runtime values.

    ``variant``: a name of :data:`~tvm_cascade.ops.VARIANTS` or an
    :class:`~tvm_cascade.ops.AttentionVariant` (causal, sliding window, ALiBi, softcap
    and their combinations; queries aligned to the end of their keys). ``dtype``:
    ``float16``, ``bfloat16`` or ``float32``. ``layout``: ``"bhsd"``, ``"bshd"``,
    ``"ragged"`` or ``"paged"`` (:mod:`tvm_cascade.library.layouts`). ``target``: a TVM target (default:
    this machine's CUDA GPU, else ``llvm``). ``scale`` multiplies Q·Kᵀ (default
    ``1/sqrt(head_dim)``). ``page_size``: the keys a page of the paged layout holds
    (default 16). ``mask``: a :class:`~tvm_cascade.library.spec.MaskTensor` (bhsd and
    bshd layouts), the kernel then taking ``mask[b|1, hq|1, sq|1, skv]`` after the
    layout's tensors (boolean, True where a key is seen, or added to the scaled
    scores; SDPA's ``attn_mask``). With ``use_cache`` the kernel is loaded from the on-disk cache
    (:mod:`tvm_cascade.library.cache`) where an entry for it exists, and stored there
    once built.

    The families of :data:`~tvm_cascade.library.families.FAMILIES` that serve the spec
    (:func:`~tvm_cascade.library.families.choose`: those passed over are logged with
    their reasons on the ``tvm_cascade.library`` logger) build one function each.
    Returns an :class:`~tvm_cascade.library.kernel.AttentionKernel`.
    """
    if layout in CACHE_LAYOUTS:
        raise ValueError(f"the {layout} layout is TVM's paged KV cache's calling convention: "
                         "its kernels are built by tvm_cascade.library.kv_cache.cache_kernel")
    if target is None:
        target = "cuda" if tvm.cuda(0).exist else "llvm"
    target = tvm.target.Target(target)
    spec = AttentionSpec.make(heads_q, heads_kv, head_dim, variant=variant, dtype=dtype, layout=layout,
                              target=target, scale=scale, page_size=page_size, mask=mask)
    families = choose(spec)
    names = [family.name for family in families]
    root = cache.directory()
    if use_cache:
        entry = cache.load(spec, names, root)
        if entry is not None:
            return AttentionKernel(spec, families, *entry)
    mod = tvm.IRModule({family.name: family.build(spec) for family in families})
    for family in families:
        target = family.compile_target(target)
    executable = tvm.compile(mod, target=target)
    if use_cache:
        cache.store(spec, names, mod, executable, root)
    return AttentionKernel(spec, families, mod, executable.mod)


__all__ = ["ARGUMENTS", "FAMILIES", "LAYOUTS", "AttentionKernel", "AttentionSpec", "KernelArgumentError", "MaskTensor",
           "attention_kernel"]
