"""A kernel call's arguments, checked on the host before the kernel runs.

Shapes, dtypes and devices are checked on every tensor; the index arrays of the ragged
and paged layouts are copied to the host and checked too (monotone offsets that stay
inside the tensors, page ids inside the pool, last-page lengths inside a page), since a
kernel that trusted them would read or write out of bounds. The call's batch size and
longest query and key lengths come out of the checks.
"""
from __future__ import annotations

import numpy as np
import tvm
import tvm_ffi

from .layouts import INDEX_DTYPE
from .spec import AttentionSpec

#: The tensors a kernel of each layout takes, in order (``out`` follows, optional).
ARGUMENTS = {
    "bhsd": ("q", "k", "v"),
    "bshd": ("q", "k", "v"),
    "ragged": ("q", "k", "v", "q_indptr", "kv_indptr"),
    "paged": ("q", "pages", "q_indptr", "page_indptr", "page_ids", "last_page_len"),
}


def names(spec: AttentionSpec) -> tuple:
    """The tensors a kernel of ``spec`` takes, in order: its layout's
    (:data:`ARGUMENTS`), then ``mask`` where it reads a mask tensor."""
    return ARGUMENTS[spec.layout] + (("mask",) if spec.mask is not None else ())


class KernelArgumentError(ValueError):
    """An argument of an attention kernel's call does not fit the kernel or the other
    arguments; raised before the kernel runs."""


#: Bytes to which TVM's compiled functions assume their buffers' data is aligned.
ALIGNMENT = 64


def as_tensor(name: str, value):
    """``value`` (a TVM tensor, or any DLPack tensor: torch, numpy, ...) as a TVM tensor
    sharing its memory, which may not be aligned (:func:`aligned`)."""
    if isinstance(value, tvm.runtime.Tensor):
        return value
    if not hasattr(value, "__dlpack__"):
        raise KernelArgumentError(f"{name}: expected a tensor (TVM, or any with __dlpack__), got {type(value).__name__}")
    contiguous = getattr(value, "is_contiguous", None)
    flags = getattr(value, "flags", None)
    if (contiguous is not None and not contiguous()) or (flags is not None and not flags["C_CONTIGUOUS"]):
        raise KernelArgumentError(f"{name}: the kernel reads row-major contiguous tensors; this one is strided")
    return tvm_ffi.from_dlpack(value, require_alignment=0, require_contiguous=True)


def is_aligned(tensor) -> bool:
    return tensor.data_ptr() % ALIGNMENT == 0


def aligned(tensor):
    """``tensor``, or an aligned copy of it where its data is not aligned (a slice of a
    larger tensor, say) so that the kernel may read it."""
    if is_aligned(tensor):
        return tensor
    copy = tvm.runtime.empty(tensor.shape, tensor.dtype, tensor.device)
    copy.copyfrom(tensor)
    return copy


def check_call(spec: AttentionSpec, device, tensors: dict) -> tuple:
    """Check ``tensors`` (name -> TVM tensor, :data:`ARGUMENTS` of the layout) for a
    kernel of ``spec`` on ``device``; returns ``(batch, max_q, max_kv)``: the batch size
    and the longest sequence's query rows and keys."""
    check_types(spec, device, tensors)
    batch, max_q, max_kv = _LAYOUT_CHECKS[spec.layout](spec, tensors)
    if spec.mask is not None:
        m = spec.mask
        _shape(tensors, "mask", (batch if m.batch else 1, spec.heads_q if m.heads else 1, max_q if m.queries else 1,
                                 max_kv))
    return batch, max_q, max_kv


def check_types(spec: AttentionSpec, device, tensors: dict) -> None:
    """Check the dtypes and devices of ``tensors`` (as :func:`check_call`), on the host
    alone."""
    for name, tensor in tensors.items():
        want = INDEX_DTYPE if is_index(name) else spec.mask.dtype if name == "mask" else spec.dtype
        if str(tensor.dtype) != want:
            raise KernelArgumentError(f"{name}: expected dtype {want}, got {tensor.dtype}")
        if (tensor.device.dlpack_device_type(), tensor.device.index) != (device.dlpack_device_type(), device.index):
            raise KernelArgumentError(f"{name}: on {tensor.device}, but the kernel runs on {device}")


def check_out(spec: AttentionSpec, device, q, out) -> None:
    """Check ``out``: ``q``'s shape, the kernel's dtype and device."""
    check_types(spec, device, {"out": out})
    if tuple(out.shape) != tuple(q.shape):
        raise KernelArgumentError(f"out: expected shape {list(q.shape)}, got {list(out.shape)}")


def is_index(name: str) -> bool:
    """Whether argument ``name`` is one of the int32 index arrays."""
    return "indptr" in name or name in ("page_ids", "last_page_len")


def _shape(tensors, name, expected):
    """Check ``tensors[name]``'s shape against ``expected`` (ints, or None for any)."""
    shape = tuple(tensors[name].shape)
    if len(shape) != len(expected) or any(e is not None and s != e for s, e in zip(shape, expected)):
        want = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
        raise KernelArgumentError(f"{name}: expected shape {want}, got {list(shape)}")
    return shape


def _bhsd(spec, t):
    b, _, sq, _ = _shape(t, "q", (None, spec.heads_q, None, spec.head_dim))
    _, _, skv, _ = _shape(t, "k", (b, spec.heads_kv, None, spec.head_dim))
    _shape(t, "v", (b, spec.heads_kv, skv, spec.head_dim))
    return b, sq, skv


def _bshd(spec, t):
    b, sq, _, _ = _shape(t, "q", (None, None, spec.heads_q, spec.head_dim))
    _, skv, _, _ = _shape(t, "k", (b, None, spec.heads_kv, spec.head_dim))
    _shape(t, "v", (b, skv, spec.heads_kv, spec.head_dim))
    return b, sq, skv


def _ragged(spec, t):
    total_q, _, _ = _shape(t, "q", (None, spec.heads_q, spec.head_dim))
    total_kv, _, _ = _shape(t, "k", (None, spec.heads_kv, spec.head_dim))
    _shape(t, "v", (total_kv, spec.heads_kv, spec.head_dim))
    q_host = t["q_indptr"].numpy()
    q_len = _lengths(t, "q_indptr", None, total_q, exact=True, host=q_host)
    # Self-attention passes one indptr for both: one copy to the host (a synchronisation
    # with the device) serves both checks.
    shared = _same_memory(t["kv_indptr"], t["q_indptr"])
    kv_len = _lengths(t, "kv_indptr", len(q_len) + 1, total_kv, exact=False, host=q_host if shared else None)
    return len(q_len), _max(q_len), _max(kv_len)


def _same_memory(a, b) -> bool:
    return (a.data_ptr(), tuple(a.shape), str(a.dtype), a.device) == (b.data_ptr(), tuple(b.shape), str(b.dtype), b.device)


def _paged(spec, t):
    total_q, _, _ = _shape(t, "q", (None, spec.heads_q, spec.head_dim))
    page_size = spec.page_size
    num_pages, _, _, _, _ = _shape(t, "pages", (None, 2, spec.heads_kv, page_size, spec.head_dim))
    q_len = _lengths(t, "q_indptr", None, total_q, exact=True)
    (nnz,) = _shape(t, "page_ids", (None,))
    used = _lengths(t, "page_indptr", len(q_len) + 1, nnz, exact=False)
    _shape(t, "last_page_len", (len(q_len),))
    ids = t["page_ids"].numpy()[: int(used.sum())]
    outside = np.flatnonzero((ids < 0) | (ids >= num_pages))
    if outside.size:
        k = outside[0]
        raise KernelArgumentError(f"page_ids[{k}] = {ids[k]} is not a page of the pool's {num_pages}")
    last = t["last_page_len"].numpy()
    wrong = np.flatnonzero(np.where(used > 0, (last < 1) | (last > page_size), last != 0))
    if wrong.size:
        b = wrong[0]
        raise KernelArgumentError(
            f"last_page_len[{b}] = {last[b]}: a sequence's last page holds 1 to page_size={page_size} keys"
            + (", and one without pages none" if used[b] == 0 else "")
        )
    kv_len = np.where(used > 0, (used - 1) * page_size + last, 0)
    return len(q_len), _max(q_len), _max(kv_len)


def _lengths(t, name, size, total, exact, host=None):
    """The per-sequence counts of indptr ``t[name]`` (``size`` entries, or any; its host
    copy ``host`` where made), which must start at 0, not decrease and end at ``total``
    (``exact``) or at most there."""
    (n,) = _shape(t, name, (size,))
    if n < 2:
        raise KernelArgumentError(f"{name}: expected batch + 1 >= 2 entries, got {n}")
    indptr = (t[name].numpy() if host is None else host).astype(np.int64)
    counts = np.diff(indptr)
    if indptr[0] != 0:
        raise KernelArgumentError(f"{name}[0] = {indptr[0]}: offsets start at 0")
    if (counts < 0).any():
        b = int(np.flatnonzero(counts < 0)[0])
        raise KernelArgumentError(f"{name} decreases at {b}: {indptr[b]} > {indptr[b + 1]}")
    if indptr[-1] > total or (exact and indptr[-1] != total):
        relation = "equal" if exact else "be at most"
        raise KernelArgumentError(f"{name}[-1] = {indptr[-1]} must {relation} the {total} the tensor holds")
    return counts


def _max(lengths) -> int:
    return int(lengths.max(initial=0))


_LAYOUT_CHECKS = {"bhsd": _bhsd, "bshd": _bshd, "ragged": _ragged, "paged": _paged}
