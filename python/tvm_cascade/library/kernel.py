"""A compiled attention kernel of the library, callable on TVM and DLPack tensors."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm

from .arguments import (
    KernelArgumentError, aligned, as_tensor, check_call, check_out, check_types, is_aligned, is_index, names,
)
from .spec import UNIFORM_LAYOUTS, AttentionSpec


@dataclass(frozen=True)
class Plan:
    """What :meth:`AttentionKernel.plan` learnt of a call's tensors: the family that runs
    it (None where no kernel runs: a call without query rows, or without keys, whose
    rows all see none), the scalars it takes, and what a later call must match to reuse
    them (the tensors' shapes and the index arrays' memory)."""

    family: object
    scalars: tuple
    shapes: tuple
    index_data: tuple


class AttentionKernel:
    """One compiled kernel for an :class:`~tvm_cascade.library.spec.AttentionSpec`:
    batch size and lengths are runtime values.

    Call it with the layout's tensors (:data:`~tvm_cascade.library.arguments.ARGUMENTS`)
    and, optionally, ``out``:

    - ``bhsd``: ``kernel(q, k, v)``; ``kernel(q, k, v, mask)`` where the spec has a mask
      tensor (:class:`~tvm_cascade.library.spec.MaskTensor`; bshd alike)
    - ``ragged``: ``kernel(q, k, v, q_indptr, kv_indptr)``
    - ``paged``: ``kernel(q, pages, q_indptr, page_indptr, page_ids, last_page_len)``

    Tensors are TVM tensors or any DLPack tensors (torch, numpy) on the kernel's device;
    index arrays are int32; tensors whose data is not aligned to 64 bytes are copied.
    It returns ``out``: the one given, else a new tensor of the
    kind ``q`` is (a TVM tensor, or, through DLPack, torch or numpy). Every argument is
    checked first (:mod:`~tvm_cascade.library.arguments`): a wrong one raises
    :class:`~tvm_cascade.library.arguments.KernelArgumentError`.

    A call without query rows returns ``out`` as it is; one whose sequences have no keys
    returns zeros (a row that sees no key gives zeros, as in every kernel); neither
    launches a kernel.

    Checking the index arrays copies them to the host. A model whose layers share a
    step's batch checks it once: ``plan = kernel.plan(q, pages, ...)``, then
    ``kernel(q, pages, ..., plan=plan)`` for every layer, which checks only that the
    tensors have the planned shapes and the index arrays are the planned ones (their
    contents must not change in between).

    A kernel holds one function per range of query rows
    (:func:`~tvm_cascade.library.families.choose`); a call runs the first family whose
    range holds its longest sequence's query rows, with the scalars that family plans
    for the call's lengths.

    Attributes: ``spec``; ``families``, those whose functions it holds, narrowest range
    first; ``mod``, the ``IRModule`` that was compiled (one PrimFunc per family, named
    after it); ``module``, the runtime module.
    """

    def __init__(self, spec: AttentionSpec, families, mod: tvm.IRModule, module):
        self.spec, self.families, self.mod, self.module = spec, tuple(families), mod, module
        self.device = tvm.cuda(0) if spec.target_kind == "cuda" else tvm.cpu(0)
        self._functions = [module[family.name] for family in self.families]

    def family_for(self, max_q: int):
        """The family that serves a call whose longest sequence has ``max_q`` query rows."""
        return next(f for f in self.families if f.queries is None or max_q <= f.queries)

    def plan(self, *tensors) -> Plan:
        """Check a call's tensors (as the call would, ``out`` aside) and plan it: the
        family that serves its lengths and the scalars it takes."""
        return self._plan(self._tensors(tensors))

    def _plan(self, given: dict) -> Plan:
        batch, max_q, max_kv = check_call(self.spec, self.device, given)
        if min(batch, max_q, max_kv) == 0:
            return Plan(None, (), _shapes(given), _index_data(given))
        family = self.family_for(max_q)
        scalars = [] if self.spec.layout in UNIFORM_LAYOUTS else [max_q, max_kv]
        scalars += family.plan(self.spec, batch, max_q, max_kv, self.device)
        return Plan(family, tuple(scalars), _shapes(given), _index_data(given))

    def __call__(self, *tensors, out=None, plan=None):
        given = self._tensors(tensors)
        if plan is None:
            plan = self._plan(given)
        else:
            check_types(self.spec, self.device, given)
            if _shapes(given) != plan.shapes or _index_data(given) != plan.index_data:
                raise KernelArgumentError("the tensors are not those the plan was made for (shapes or index arrays differ)")
        shape = given["q"].shape
        if out is None:
            # A new output comes from q's framework: torch's caching allocator, not a
            # device allocation (and its synchronising release) per call.
            out = _empty_like(tensors[0], shape, self.spec.dtype, self.device)
        given["out"] = as_tensor("out", out)
        check_out(self.spec, self.device, given["q"], given["out"])
        target = given["out"]
        if plan.family is None:
            if int(np.prod(shape)):
                target.copyfrom(np.zeros(tuple(shape), dtype=np.dtype(tvm.runtime.DataType(self.spec.dtype))))
            return out
        into = target if is_aligned(target) else tvm.runtime.empty(shape, self.spec.dtype, self.device)
        function = self._functions[self.families.index(plan.family)]
        function(*(aligned(given[n]) for n in names(self.spec)), *plan.scalars, into)
        if into is not target:
            target.copyfrom(into)
        return out

    def _tensors(self, tensors) -> dict:
        taken = names(self.spec)
        if len(tensors) != len(taken):
            raise KernelArgumentError(
                f"a {self.spec.layout} kernel takes ({', '.join(taken)}[, out]); got {len(tensors)} tensors"
            )
        return {name: as_tensor(name, t) for name, t in zip(taken, tensors)}

    def __repr__(self):
        names = [f.name for f in self.families]
        return f"AttentionKernel({self.spec.describe()}, families={names}, target={self.spec.target!r})"


def _shapes(given) -> tuple:
    return tuple(tuple(t.shape) for t in given.values())


def _index_data(given) -> tuple:
    return tuple(t.data_ptr() for name, t in given.items() if is_index(name))


def _empty_like(example, shape, dtype, device):
    """A new tensor of ``shape`` on ``device``, of the kind and dtype of ``example`` (torch
    or numpy, else a TVM tensor of ``dtype``)."""
    kind = type(example).__module__.split(".")[0]
    if kind == "torch":
        import torch  # pylint: disable=import-outside-toplevel

        return torch.empty(tuple(shape), dtype=example.dtype, device=example.device)
    if kind == "numpy":
        import numpy as np  # pylint: disable=import-outside-toplevel

        return np.empty(tuple(shape), dtype=example.dtype)
    return tvm.runtime.empty(shape, dtype, device)
