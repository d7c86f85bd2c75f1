"""What one attention kernel of the library computes: :class:`AttentionSpec`."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import tvm

from ..ops.variants import AttentionVariant, get_variant

#: Memory layouts of a kernel's tensors (see :mod:`tvm_cascade.library.layouts`).
LAYOUTS = ("bhsd", "bshd", "ragged", "paged")
#: The layouts of TVM's paged KV cache's kernels (:mod:`tvm_cascade.library.kv_cache`):
#: their calling convention, not :class:`~tvm_cascade.library.kernel.AttentionKernel`'s.
CACHE_LAYOUTS = ("kv_ragged", "kv_paged", "kv_paged_window", "kv_decode", "kv_decode_window")
#: Layouts whose keys lie in pages.
PAGED_LAYOUTS = ("paged", "kv_paged", "kv_paged_window", "kv_decode", "kv_decode_window")
#: Cache layouts of a sliding-window cache (its sinks and window in ``length_info``).
WINDOW_LAYOUTS = ("kv_paged_window", "kv_decode_window")
#: Layouts whose sequences are all as long (the tensors' shapes say how long).
UNIFORM_LAYOUTS = ("bhsd", "bshd")
DTYPES = ("float16", "bfloat16", "float32")
#: The largest head dimension a kernel serves.
MAX_HEAD_DIM = 256
#: Keys a page holds, by default (that of TVM's paged KV cache in its LLM examples).
PAGE_SIZE = 16
#: The dtypes of a mask tensor: boolean (True where a key is seen), or added to the scores.
MASK_DTYPES = ("bool",) + DTYPES


def kernel_head_dim(head_dim: int, kernels) -> int:
    """The head dim of the kernel of a family's ``kernels`` (head dims, ascending) that
    serves ``head_dim``: the least that holds it (a head dim between two runs the next
    one's kernel, the tensors' columns past theirs read as zeros)."""
    return next(d for d in kernels if d >= head_dim)


def head_dim_unsupported(head_dim: int, kernels) -> Optional[str]:
    """Why no kernel of ``kernels`` (head dims, ascending) serves ``head_dim``, or None:
    it must lie between the least and the largest and be a multiple of 8 (16-byte loads
    and TMA strides)."""
    if kernels[0] <= head_dim <= kernels[-1] and head_dim % 8 == 0:
        return None
    return f"head dim {head_dim}: a multiple of 8 from {kernels[0]} to {kernels[-1]}"


@dataclass(frozen=True)
class MaskTensor:
    """A mask the kernel takes as an input after its layout's tensors: ``mask[b, h, i,
    j]`` for query row ``i`` and key ``j`` of query head ``h`` of sequence ``b`` (this
    order whatever the layout, as SDPA's ``attn_mask``), of size 1 along the batch, the
    heads or the queries where ``batch``, ``heads`` or ``queries`` is False (the mask is
    the same along it). ``dtype`` ``"bool"`` hides the keys where it is False; a float
    mask is added to the scaled (and soft-capped) scores, ``-inf`` or a large negative
    value hiding a key. The kernel reads it tile by tile beside the scores."""

    dtype: str = "bool"
    batch: bool = True
    heads: bool = False
    queries: bool = True

    def describe(self) -> str:
        """E.g. ``maskbool_b1qk``: the dtype, then each dimension's letter or 1."""
        dims = "".join(c if kept else "1" for c, kept in zip("bhq", (self.batch, self.heads, self.queries)))
        return f"mask{self.dtype}_{dims}k"


@dataclass(frozen=True)
class AttentionSpec:
    """One attention kernel: everything about it but the lengths and the batch size,
    which are runtime values.

    ``scale`` multiplies Q·Kᵀ (default ``1/sqrt(head_dim)``; a kernel of
    :data:`CACHE_LAYOUTS` takes it at run time instead); ``target`` is the
    target's string form (``str(tvm.target.Target(...))``), part of what a cached kernel
    is keyed by; ``page_size``, the keys a page holds (the paged layout's, None for the
    others); ``mask``, a :class:`MaskTensor` the kernel reads (bhsd and bshd layouts), or
    None.
    """

    heads_q: int
    heads_kv: int
    head_dim: int
    variant: AttentionVariant
    dtype: str
    layout: str
    target: str
    scale: float
    page_size: Optional[int] = None
    mask: Optional[MaskTensor] = None

    @staticmethod
    def make(heads_q, heads_kv, head_dim, *, variant=None, dtype="float16", layout="bhsd",
             target="llvm", scale: Optional[float] = None, page_size: Optional[int] = None,
             mask: Optional[MaskTensor] = None) -> "AttentionSpec":
        """A checked spec; ``variant`` is a name of :data:`~tvm_cascade.ops.VARIANTS` or
        an :class:`~tvm_cascade.ops.AttentionVariant`; ``page_size`` (paged layout only)
        defaults to :data:`PAGE_SIZE`; ``mask`` (bhsd and bshd layouts only) a
        :class:`MaskTensor`. Raises ``ValueError`` naming the argument that is out of
        range."""
        for name, value in (("heads_q", heads_q), ("heads_kv", heads_kv), ("head_dim", head_dim)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if heads_q % heads_kv:
            raise ValueError(f"heads_q={heads_q} must be a multiple of heads_kv={heads_kv}")
        if head_dim > MAX_HEAD_DIM:
            raise ValueError(f"head_dim={head_dim} is larger than the {MAX_HEAD_DIM} the kernels serve")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        if layout not in LAYOUTS + CACHE_LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS + CACHE_LAYOUTS}, got {layout!r}")
        variant = get_variant(variant)
        if variant.window is not None and variant.window < 1:
            raise ValueError(f"a sliding window must hold at least one key, got window={variant.window}")
        if variant.softcap is not None and not variant.softcap > 0:
            raise ValueError(f"softcap must be positive, got {variant.softcap}")
        if layout in PAGED_LAYOUTS:
            page_size = PAGE_SIZE if page_size is None else page_size
            if not isinstance(page_size, int) or page_size < 1:
                raise ValueError(f"page_size must be a positive int, got {page_size!r}")
        elif page_size is not None:
            raise ValueError(f"page_size is the paged layouts'; the {layout} layout has none")
        if mask is not None:
            if not isinstance(mask, MaskTensor):
                raise ValueError(f"mask must be a MaskTensor, got {type(mask).__name__}")
            if mask.dtype not in MASK_DTYPES:
                raise ValueError(f"a mask tensor's dtype must be one of {MASK_DTYPES}, got {mask.dtype!r}")
            if layout not in UNIFORM_LAYOUTS:
                raise ValueError(f"a mask tensor is read by the {UNIFORM_LAYOUTS} layouts' kernels, not {layout}'s")
        scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
        return AttentionSpec(heads_q, heads_kv, head_dim, variant, dtype, layout, str(target), scale, page_size, mask)

    @property
    def target_kind(self) -> str:
        """The target's kind: ``"cuda"``, ``"llvm"``, ..."""
        return tvm.target.Target(self.target).kind.name

    @property
    def group(self) -> int:
        """Query heads per K/V head."""
        return self.heads_q // self.heads_kv

    def describe(self) -> str:
        """A short name, e.g. ``ragged-h32x8-d128-float16-causal``."""
        v = self.variant
        parts = ["causal" if v.causal and v.window is None else None,
                 f"window{v.window}" if v.window is not None else None,
                 "alibi" if v.alibi else None,
                 f"softcap{v.softcap:g}" if v.softcap is not None else None]
        mods = "-".join(p for p in parts if p) or "global"
        layout = self.layout if self.page_size is None else f"{self.layout}{self.page_size}"
        mask = "" if self.mask is None else f"-{self.mask.describe()}"
        return f"{layout}-h{self.heads_q}x{self.heads_kv}-d{self.head_dim}-{self.dtype}-{mods}{mask}"
