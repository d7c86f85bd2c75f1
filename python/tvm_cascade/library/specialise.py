"""A runtime-length kernel's function fixed to one configuration: the batch size and
lengths of a ``bhsd`` call made its buffers' static shapes and the family's scalars
planned for them, as ``main(q, k, v, out)``. :func:`tvm_cascade.kernels.compile_attention`
compiles it where the runtime-length family is faster than the static schedule.
"""
from __future__ import annotations

import tvm
from tvm import tirx

from ..analysis.chain import substitute
from ..analysis.scope import buffer_params
from .families import choose, planned_body
from .spec import AttentionSpec


def specialised(spec: AttentionSpec, batch: int, seq_q: int, seq_kv: int, device) -> tuple:
    """``(family, main)``: the family of :func:`~.families.choose` that serves ``seq_q``
    query rows of a ``bhsd`` ``spec`` (no mask tensor), and its function with ``batch``
    sequences of ``seq_q`` queries over ``seq_kv`` keys as static shapes and its scalars
    planned for them and ``device`` (its SMs: an H100/H200's where it is absent), named
    ``main``. ``ValueError`` for another layout or a mask tensor."""
    if spec.layout != "bhsd" or spec.mask is not None:
        raise ValueError(f"a specialised kernel takes q, k, v, out in bhsd and no mask; {spec.describe()} does not")
    family = next(f for f in choose(spec) if f.queries is None or seq_q <= f.queries)
    func = family.build(spec)
    buffers = {b.name: b for b in buffer_params(func)}
    # bhsd: q[batch, hq, seq_q, d] and k[batch, hkv, seq_kv, d] name the variables;
    # replaced everywhere, buffers' types within the body too.
    lengths = {buffers["q"].shape[0]: batch, buffers["q"].shape[2]: seq_q, buffers["k"].shape[2]: seq_kv}
    func = substitute(func, {var: tirx.IntImm(var.ty.dtype, value) for var, value in lengths.items()})
    scalars = [p for p in func.params if p.name not in buffers]
    body = planned_body(func, family, spec, scalars, batch, seq_q, seq_kv, device)
    params = [p for p in func.params if p.name in buffers]
    return family, tirx.PrimFunc(params, body, func.ret_type, func.attrs).with_attr("global_symbol", "main")


def compile_specialised(spec: AttentionSpec, batch: int, seq_q: int, seq_kv: int, target):
    """:func:`specialised`'s ``main`` compiled for ``target`` as its family compiles
    (:meth:`compile_target`), planned for this machine's GPU."""
    family, main = specialised(spec, batch, seq_q, seq_kv, tvm.cuda(0))
    return tvm.compile(tvm.IRModule({"main": main}), target=family.compile_target(tvm.target.Target(target)))
