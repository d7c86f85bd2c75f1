"""Stock TVM peer: unfused attention as a Relax graph through TVM's default pipeline.

``matmul(q, kᵀ) -> score_mod -> softmax -> matmul(·, v)``, scores and softmax in
float32, GQA by repeating K/V.  ``score_mod`` (scale, ALiBi bias, softcap, mask) is
one elementwise ``te.compute`` over the score indices emitted into the Relax graph
(``BlockBuilder.emit_te``), as TVM users write index-dependent masks; spelled with
``arange``-based Relax ops instead, ``FoldConstant`` turns the mask/bias into
constants of up to ``heads x seq_q x seq_kv`` float32 (34 GB at 16384).  ``tvm.compile`` with a CUDA
target runs the default CUDA Relax pipeline, which legalizes, fuses and then
applies ``dl.ApplyDefaultSchedule(dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(),
dl.gpu.GeneralReduction(), dl.gpu.Fallback())`` inside the target context, i.e. the
usual dlight recipe, to the fused kernels.
"""

from __future__ import annotations

from .configs import Config
from .reference import MASKED_SCORE


def _score_mod(qk, cfg: Config):
    """TE: scale, ALiBi bias, softcap and mask of the float32 ``q . k`` products."""
    from tvm import te, tirx

    o = cfg.op

    def score(b, h, i, j):
        s = qk[b, h, i, j] * tirx.const(cfg.scale, "float32")
        q_pos = i + cfg.offset
        if o.alibi:
            slope = tirx.exp2(tirx.const(-8.0 / o.heads_q, "float32") * (h + 1).astype("float32"))
            s = s + slope * (j - q_pos).astype("float32")
        if o.softcap is not None:
            cap = tirx.const(o.softcap, "float32")
            s = cap * tirx.tanh(s / cap)
        if cfg.masked:
            visible = j <= q_pos
            if o.window is not None:
                visible = tirx.all(visible, q_pos - j < o.window)
            s = tirx.Select(visible, s, tirx.const(MASKED_SCORE, "float32"))
        return s

    return te.compute(qk.shape, score, name="score")


def relax_module(cfg: Config):
    """The Relax ``IRModule`` with ``main(q, k, v) -> out`` for ``cfg``."""
    from tvm import relax
    from tvm.relax import op as R

    o = cfg.op
    group = o.heads_q // o.heads_kv
    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType((cfg.batch, o.heads_q, cfg.seq_q, cfg.head_dim), cfg.dtype))
    kv_shape = (cfg.batch, o.heads_kv, cfg.seq_kv, cfg.head_dim)
    k = relax.Var("k", relax.TensorType(kv_shape, cfg.dtype))
    v = relax.Var("v", relax.TensorType(kv_shape, cfg.dtype))

    with bb.function("main", [q, k, v]):
        with bb.dataflow():
            kk, vv = k, v
            if group > 1:
                kk = bb.emit(R.repeat(k, group, axis=1))
                vv = bb.emit(R.repeat(v, group, axis=1))
            kt = bb.emit(R.permute_dims(kk, [0, 1, 3, 2]))
            s = bb.emit(R.matmul(q, kt, out_dtype="float32"))
            s = bb.emit_te(lambda qk: _score_mod(qk, cfg), s, primfunc_name_hint="score_mod")
            p = bb.emit(R.astype(R.nn.softmax(s, axis=-1), cfg.dtype))
            out = bb.emit(R.astype(R.matmul(p, vv, out_dtype="float32"), cfg.dtype))
            gv = bb.emit_output(out)
        bb.emit_func_output(gv)
    return bb.get()


def compile_vm(cfg: Config, target, device):
    """Compile :func:`relax_module` for ``target`` and load it on ``device``: ``main`` of a VM."""
    import tvm
    from tvm import relax

    executable = tvm.compile(relax_module(cfg), target=target)
    return relax.VirtualMachine(executable, device)["main"]
