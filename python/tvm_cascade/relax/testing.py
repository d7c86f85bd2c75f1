"""Relax modules of attention for tests and benchmarks: ``R.nn.attention`` and the
hand-written chain (``matmul -> scale -> softcap -> mask -> softmax -> matmul``)."""
import numpy as np
from tvm import relax


def attention_module(batch, seq_q, seq_kv, heads_q, heads_kv, head_dim, dtype="float16", causal_mask="BottomRight",
                     scale=None, window_size=None):
    """``main(q[b, sq, hq, d], k/v[b, skv, hkv, d]) = R.nn.attention(q, k, v)``; lengths
    may be ``tirx.Var``s."""
    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType((batch, seq_q, heads_q, head_dim), dtype))
    k = relax.Var("k", relax.TensorType((batch, seq_kv, heads_kv, head_dim), dtype))
    v = relax.Var("v", relax.TensorType((batch, seq_kv, heads_kv, head_dim), dtype))
    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.attention(q, k, v, scale=scale, causal_mask=causal_mask,
                                                       window_size=window_size))
        bb.emit_func_output(out)
    return bb.get()


def chain_module(batch, seq_q, seq_kv, heads_q, heads_kv, head_dim, dtype="float16", mask="causal", scale=None,
                 softcap=None, gqa="repeat", mask_input=False, alibi=None):
    """A hand-written attention over bhsd ``q, k, v``: ``q @ kᵀ * scale`` (a softcap
    ``c * tanh(s / c)``), a mask (``"causal"`` or ``("window", w)``: an additive constant
    of 0 and -inf aligned to the end of the keys; ``"bias"``: random constant values; or
    a tensor parameter where ``mask_input``: True, a float32 ``[sq, skv]`` one added, or a
    :class:`~tvm_cascade.library.spec.MaskTensor`'s form of ``[b, h, sq, skv]``, added
    or, boolean, a ``where(mask, s, -inf)``), a float32 softmax, ``@ v``, K/V repeated
    over GQA groups (``"repeat"`` or ``"broadcast"``: ``expand_dims -> broadcast_to ->
    reshape``); ``alibi``: slopes of an ALiBi bias ``slope_h * j`` (BLOOM's form, float32
    ``[1, h, 1, skv]``) added after the scale."""
    group = heads_q // heads_kv
    scale = 1.0 / head_dim ** 0.5 if scale is None else scale
    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType((batch, heads_q, seq_q, head_dim), dtype))
    k = relax.Var("k", relax.TensorType((batch, heads_kv, seq_kv, head_dim), dtype))
    v = relax.Var("v", relax.TensorType((batch, heads_kv, seq_kv, head_dim), dtype))
    params = [q, k, v]
    if mask_input is True:
        params.append(relax.Var("mask", relax.TensorType((seq_q, seq_kv), "float32")))
    elif mask_input:
        m = mask_input
        shape = (batch if m.batch else 1, heads_q if m.heads else 1, seq_q if m.queries else 1, seq_kv)
        params.append(relax.Var("mask", relax.TensorType(shape, m.dtype)))
    with bb.function("main", params):
        with bb.dataflow():
            def grouped(x):
                if group == 1:
                    return x
                if gqa == "repeat":
                    return bb.emit(relax.op.repeat(x, group, axis=1))
                wide = bb.emit(relax.op.broadcast_to(bb.emit(relax.op.expand_dims(x, axis=[2])),
                                                     (batch, heads_kv, group, seq_kv, head_dim)))
                return bb.emit(relax.op.reshape(wide, (batch, heads_q, seq_kv, head_dim)))

            kt = bb.emit(relax.op.permute_dims(grouped(k), [0, 1, 3, 2]))
            s = bb.emit(relax.op.multiply(bb.emit(relax.op.matmul(q, kt)), relax.const(scale, dtype)))
            s = bb.emit(relax.op.astype(s, "float32"))
            if alibi is not None:
                bias = np.asarray(alibi, "float32")[None, :, None, None] * np.arange(seq_kv, dtype="float32")
                s = bb.emit(relax.op.add(s, relax.const(bias, "float32")))
            if softcap is not None:
                s = bb.emit(relax.op.divide(s, relax.const(softcap, "float32")))
                s = bb.emit(relax.op.multiply(bb.emit(relax.op.tanh(s)), relax.const(softcap, "float32")))
            if mask_input is True or (mask_input and mask_input.dtype != "bool"):
                m = params[3] if params[3].ty.dtype == "float32" else bb.emit(relax.op.astype(params[3], "float32"))
                s = bb.emit(relax.op.add(s, m))
            elif mask_input:
                s = bb.emit(relax.op.where(params[3], s, relax.const(float("-inf"), "float32")))
            elif mask is not None:
                s = bb.emit(relax.op.add(s, relax.const(mask_values(mask, seq_q, seq_kv), "float32")))
            p = bb.emit(relax.op.astype(bb.emit(relax.op.nn.softmax(s, axis=-1)), dtype))
            out = bb.emit_output(relax.op.matmul(p, grouped(v)))
        bb.emit_func_output(out)
    return bb.get()


def mask_values(mask, seq_q, seq_kv):
    """The additive [sq, skv] float32 mask ``chain_module`` adds."""
    rows = np.arange(seq_q)[:, None] + seq_kv - seq_q
    keys = np.arange(seq_kv)[None, :]
    if mask == "bias":
        return np.random.default_rng(0).standard_normal((seq_q, seq_kv)).astype("float32")
    seen = keys <= rows
    if mask != "causal":
        seen &= keys > rows - mask[1]
    return np.where(seen, 0.0, -np.inf).astype("float32")


def bshd_projection_chain(batch, seq, heads_q, heads_kv, head_dim, accumulate="float16"):
    """An attention chain over float16 ``q, k, v`` parameters of ``[batch, seq, heads,
    head_dim]`` (a model's projections) transposed to bhsd, K/V repeated over GQA
    groups, ``q @ kᵀ * head_dim^-0.5``, softmax, ``@ v`` (both matmuls into
    ``accumulate``, then cast to float16 as ``torch.export``'s float16 matmuls are) and
    the output transposed back to bshd."""
    bb = relax.BlockBuilder()
    swap, f16 = [0, 2, 1, 3], "float16"
    params = [relax.Var(n, relax.TensorType((batch, seq, h, head_dim), f16))
              for n, h in (("q", heads_q), ("k", heads_kv), ("v", heads_kv))]
    with bb.function("main", params):
        with bb.dataflow():
            q, k, v = (bb.emit(relax.op.permute_dims(p, swap)) for p in params)
            k, v = (bb.emit(relax.op.repeat(x, heads_q // heads_kv, axis=1)) for x in (k, v))
            s = bb.emit(relax.op.matmul(q, bb.emit(relax.op.permute_dims(k, [0, 1, 3, 2])), out_dtype=accumulate))
            s = bb.emit(relax.op.multiply(s, relax.const(head_dim ** -0.5, accumulate)))
            p = bb.emit(relax.op.astype(bb.emit(relax.op.nn.softmax(s, axis=-1)), f16))
            o = bb.emit(relax.op.matmul(p, v, out_dtype=accumulate))
            o = bb.emit(relax.op.astype(bb.emit(relax.op.astype(o, accumulate)), f16))
            out = bb.emit_output(relax.op.permute_dims(o, swap))
        bb.emit_func_output(out)
    return bb.get()
