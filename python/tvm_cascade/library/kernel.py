"""A compiled attention kernel of the library, callable on TVM and DLPack tensors."""
from __future__ import annotations

import tvm

from .arguments import ARGUMENTS, KernelArgumentError, aligned, as_tensor, check_call, is_aligned
from .spec import AttentionSpec


class AttentionKernel:
    """One compiled kernel for an :class:`~tvm_cascade.library.spec.AttentionSpec`:
    batch size and lengths are runtime values.

    Call it with the layout's tensors (:data:`~tvm_cascade.library.arguments.ARGUMENTS`)
    and, optionally, ``out``:

    - ``bhsd``: ``kernel(q, k, v)``
    - ``ragged``: ``kernel(q, k, v, q_indptr, kv_indptr)``
    - ``paged``: ``kernel(q, pages, q_indptr, page_indptr, page_ids, last_page_len)``

    Tensors are TVM tensors or any DLPack tensors (torch, numpy) on the kernel's device;
    index arrays are int32; tensors whose data is not aligned to 64 bytes are copied.
    It returns ``out``: the one given, else a new tensor of the
    kind ``q`` is (a TVM tensor, or, through DLPack, torch or numpy). Every argument is
    checked first (:mod:`~tvm_cascade.library.arguments`): a wrong one raises
    :class:`~tvm_cascade.library.arguments.KernelArgumentError`.

    Attributes: ``spec``; ``family``, the name of the family that built it; ``mod``, the
    scheduled ``IRModule`` that was compiled; ``module``, the runtime module.
    """

    def __init__(self, spec: AttentionSpec, family: str, mod: tvm.IRModule, module):
        self.spec, self.family, self.mod, self.module = spec, family, mod, module
        kind = tvm.target.Target(spec.target).kind.name
        self.device = tvm.cuda(0) if kind == "cuda" else tvm.cpu(0)
        self._main = module["main"]

    def __call__(self, *tensors, out=None):
        names = ARGUMENTS[self.spec.layout]
        if len(tensors) != len(names):
            raise KernelArgumentError(
                f"a {self.spec.layout} kernel takes ({', '.join(names)}[, out]); got {len(tensors)} tensors"
            )
        given = {name: as_tensor(name, t) for name, t in zip(names, tensors)}
        if out is not None:
            given["out"] = as_tensor("out", out)
        scalars = check_call(self.spec, self.device, given)
        shape = given["q"].shape
        result = out if out is not None else tvm.runtime.empty(shape, self.spec.dtype, self.device)
        target = given.get("out", result)
        into = target if is_aligned(target) else tvm.runtime.empty(shape, self.spec.dtype, self.device)
        self._main(*(aligned(given[n]) for n in names), *scalars, into)
        if into is not target:
            target.copyfrom(into)
        if out is not None or isinstance(tensors[0], tvm.runtime.Tensor):
            return result
        return _like(tensors[0], result)

    def __repr__(self):
        return f"AttentionKernel({self.spec.describe()}, family={self.family!r}, target={self.spec.target!r})"


def _like(example, tensor):
    """``tensor`` as the kind of tensor ``example`` is, through DLPack."""
    kind = type(example).__module__.split(".")[0]
    if kind == "torch":
        import torch  # pylint: disable=import-outside-toplevel

        return torch.from_dlpack(tensor)
    if kind == "numpy":
        import numpy as np  # pylint: disable=import-outside-toplevel

        return np.from_dlpack(tensor)
    return tensor
