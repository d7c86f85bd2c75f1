"""Inputs, references and runs shared by the CPU and GPU tests of
``tvm_cascade.relax.dispatch``."""
import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from tvm_cascade.ops import testing as tt
from tvm_cascade.ops.reference import sequence_attention_ref

SM90A = {"kind": "cuda", "arch": "sm_90a"}


def random_inputs(batch, seq_q, seq_kv, heads_q, heads_kv, head_dim, dtype, seed=0):
    """Standard-normal ``(q, k, v)`` in the bshd layout (numpy, ``dtype``)."""
    sequences = tt.random_sequences([seq_q] * batch, [seq_kv] * batch, heads_q, heads_kv, head_dim, dtype,
                                    np.random.default_rng(seed))
    return tuple(np.stack([s[n] for s in sequences]) for n in range(3))


def reference(q, k, v, variant, scale=None):
    """Float64 attention of bshd numpy ``q, k, v`` (``variant``: a name or an
    ``AttentionVariant``; queries aligned to the end of the keys)."""
    return np.stack([sequence_attention_ref(q[b], k[b], v[b], variant, scale) for b in range(q.shape[0])])


def run(executable, device, *arrays):
    """``main`` of the compiled Relax ``executable`` on ``device`` (numpy in and out)."""
    vm = relax.VirtualMachine(executable, device)
    return vm["main"](*(tvm.runtime.tensor(a, device) for a in arrays)).numpy()


def exported_sdpa(batch, seq, heads_q, heads_kv, head_dim, dtype="float16", decompose=False, dynamic=False):
    """The Relax module of ``torch.export`` of ``F.scaled_dot_product_attention(q, k, v,
    is_causal=True, enable_gqa=...)`` over bhsd tensors: decomposed (the importer's
    default: a float32 chain) or kept whole (``R.nn.attention``), the sequence length
    ``seq`` or (``dynamic``) a symbolic one; needs torch."""
    import torch
    from tvm.relax.frontend.torch import from_exported_program

    class SDPA(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                    enable_gqa=heads_q != heads_kv)

    example = tuple(torch.zeros(batch, h, seq, head_dim, dtype=getattr(torch, dtype))
                    for h in (heads_q, heads_kv, heads_kv))
    shapes = None
    if dynamic:
        length = torch.export.Dim("seq", min=2, max=1 << 16)
        shapes = tuple({2: length} for _ in example)
    exported = torch.export.export(SDPA(), example, dynamic_shapes=shapes)
    return from_exported_program(exported, run_ep_decomposition=decompose)


def row_kernels_else_default(cascade, default) -> list:
    """The names of ``cascade``'s row kernels (``schedule_rows``' split partials), after
    checking that ``cascade`` holds the functions of ``default`` (a module lowered by the
    default pipeline) and that every other one equals its namesake there."""
    functions = {gv.name_hint: f for gv, f in default.functions_items()}
    assert {gv.name_hint for gv, _ in cascade.functions_items()} == set(functions)
    rows = []
    for gv, func in cascade.functions_items():
        blocks = []
        if isinstance(func, tvm.tirx.PrimFunc):
            tvm_ffi.structural_walk(func.body, lambda n: blocks.append(n.name_hint) if isinstance(n, tvm.s_tir.stmt.SBlock) else None)
        if any(b.endswith("_partial") for b in blocks):
            rows.append(gv.name_hint)
        else:
            tvm.ir.assert_structural_equal(func, functions[gv.name_hint], map_free_vars=True)
    return rows

