"""The unfused attention chain of a spec over its layout's view, lengths at run time."""
from __future__ import annotations

import tvm
from tvm import te, tirx

from ..ops.flex_attention import ATTENTION_BLOCKS, NO_KEYS_LSE, variant_te_mods
from ..root_order import reorder_root_blocks
from .layouts import views
from .spec import AttentionSpec
from .split_k import LOG2E

#: The blocks that read the layout's tensors into the view (ragged and paged layouts).
VIEW_BLOCKS = ("Q_view", "K_view", "V_view")
#: The block that computes a row's log-sum-exp, in base 2 (``log2 Σ_j 2^(log2(e) s_j)``
#: of the scaled scores ``s_j``), where the layout has an ``lse`` output.
LSE_BLOCK = "lse"


def attention_chain(spec: AttentionSpec) -> tvm.tirx.PrimFunc:
    """``ops.attention``'s chain (blocks :data:`~tvm_cascade.ops.ATTENTION_BLOCKS`) for
    ``spec``, over the sequence view of its layout (:mod:`.layouts`): its parameters are
    the layout's tensors, its lengths the layout's variables.

    Keys a sequence does not have are masked like the variant's masked keys; a row that
    sees no key at all (none of its keys visible) gives zeros, as FlashAttention's do.
    The output is the view's ``out[b, h, i, x]``, and, where the layout has one, its
    ``lse[b, h, i]`` (:data:`LSE_BLOCK`): :func:`.layouts.scatter_output` moves their
    stores to the layout's tensors once the function is scheduled.
    """
    view = views(spec)
    acc = "float32"
    group, d = spec.group, spec.head_dim
    shape_q = (view.batch, spec.heads_q, view.rows)
    shape_kv = (view.batch, spec.heads_kv, view.keys, d)
    zero = tirx.const(0, acc)

    def guarded(read, length):
        def value(b, h, n, x):
            loaded = read(b, h, n, x).astype(acc)
            return loaded if length is None else tirx.if_then_else(n < length(b), loaded, zero)

        return value

    if view.q_len is None and view.kv_len is None:
        query, key, value = view.query, view.key, view.value
    else:
        query = te.compute(shape_q + (d,), guarded(view.query, view.q_len), name="Q_view")
        key = te.compute(shape_kv, guarded(view.key, view.kv_len), name="K_view")
        value = te.compute(shape_kv, guarded(view.value, view.kv_len), name="V_view")
        query, key, value = (_indexer(t) for t in (query, key, value))

    score_mod, mask_mod = variant_te_mods(spec.variant, spec.heads_q, view.query_length, view.key_length, acc,
                                          query_start=view.query_start)
    lowest = tirx.min_value(acc)
    scale = view.scale

    rd = te.reduce_axis((0, d), name="rd")
    scores = shape_q + (view.keys,)
    qk = te.compute(
        scores,
        lambda b, h, i, j: te.sum(query(b, h, i, rd).astype(acc) * key(b, h // group, j, rd).astype(acc), axis=rd),
        name="qk",
    )

    def visible(b, h, i, j):
        conds = [] if view.kv_len is None else [j < view.kv_len(b)]
        if mask_mod is not None:
            conds.append(mask_mod(b, h, i, j))
        return te.all(*conds) if conds else None

    def masked_score(b, h, i, j):
        s = qk[b, h, i, j] * scale
        if score_mod is not None:
            s = score_mod(s, b, h, i, j).astype(acc)
        if view.mask is not None:
            # (no lower than the masked value: a row the mask hides entirely gives zeros)
            s = tirx.max(s + view.mask(b, h, i, j), lowest)
        cond = visible(b, h, i, j)
        return s if cond is None else tirx.Select(cond, s, lowest)

    score = te.compute(scores, masked_score, name="score")
    rj = te.reduce_axis((0, view.keys), name="rj")
    m = te.compute(shape_q, lambda b, h, i: te.max(score[b, h, i, rj], axis=rj), name="max")
    e = te.compute(scores, lambda b, h, i, j: te.exp(score[b, h, i, j] - m[b, h, i]), name="exp")
    rj = te.reduce_axis((0, view.keys), name="rj")
    l = te.compute(shape_q, lambda b, h, i: te.sum(e[b, h, i, rj], axis=rj), name="sum")
    rj = te.reduce_axis((0, view.keys), name="rj")
    o = te.compute(
        shape_q + (d,),
        lambda b, h, i, x: te.sum(e[b, h, i, rj] * value(b, h // group, rj, x).astype(acc), axis=rj),
        name="pv",
    )

    masked = view.kv_len is not None or mask_mod is not None or view.mask is not None

    def normalised(b, h, i, x):
        out = (o[b, h, i, x] / l[b, h, i]).astype(spec.dtype)
        if not masked:
            return out
        # A row whose every score is masked has the masked value as its maximum.
        return tirx.Select(m[b, h, i] == lowest, tirx.const(0, spec.dtype), out)

    out = te.compute(shape_q + (d,), normalised, name="out")
    outputs, order = [out], (VIEW_BLOCKS if view.kv_len is not None else ()) + ATTENTION_BLOCKS
    if view.lse_index is not None:
        def log_sum_exp(b, h, i):
            lse = m[b, h, i] * tirx.const(LOG2E, acc) + tirx.log2(l[b, h, i])
            return tirx.Select(m[b, h, i] == lowest, tirx.const(NO_KEYS_LSE, acc), lse) if masked else lse

        outputs.append(te.compute(shape_q, log_sum_exp, name=LSE_BLOCK))
        order += (LSE_BLOCK,)
    func = te.create_prim_func(view.inputs + outputs)
    return reorder_root_blocks(func, order).with_attr("global_symbol", "main")


def _indexer(tensor):
    return lambda *index: tensor[index]
