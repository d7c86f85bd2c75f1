"""Relax models with row chains (softmax, log-softmax, cross-entropy) shared by the CPU
and GPU tests of ``tvm_cascade.relax.row_kernels``."""
import numpy as np
from tvm import relax
from tvm.relax import op as R


def row_model(kind: str, rows, n: int, dtype: str, top_k: int = 2, reduction: str = "none"):
    """``main(x[rows, n]: dtype)`` (and ``labels[rows]`` for the cross-entropies): the
    float32 softmax, log-softmax, log-sum-exp (``"log_sum_exp"``: max, exp, sum, log by
    hand), per-row cross-entropy (``"cross_entropy"`` by
    ``nll_loss`` with ``reduction``, labels of -100 ignored; ``"exported_cross_entropy"``
    by ``gather_elements``, as
    ``torch.export`` gives ``F.cross_entropy``) or MoE router (``"router"``: the softmax
    and its ``top_k`` probabilities and int64 indices) of ``x``."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((rows, n), dtype))
    params = [x]
    if "cross_entropy" in kind:
        params.append(relax.Var("labels", relax.TensorType((rows,), "int64")))
    with bb.function("main", params):
        with bb.dataflow():
            xf = bb.emit(R.astype(x, "float32"))
            if kind == "softmax":
                y = bb.emit(R.nn.softmax(xf, axis=-1))
            elif kind == "log_softmax":
                y = bb.emit(R.nn.log_softmax(xf, axis=-1))
            elif kind == "exported_cross_entropy":
                logp = bb.emit(R.nn.log_softmax(xf, axis=1))
                picked = bb.emit(R.gather_elements(logp, bb.emit(R.expand_dims(params[1], axis=[1])), axis=1))
                y = bb.emit(R.negative(bb.emit(R.squeeze(picked, axis=[1]))))
            elif kind == "log_sum_exp":
                m = bb.emit(R.max(xf, axis=-1, keepdims=True))
                total = bb.emit(R.sum(bb.emit(R.exp(bb.emit(R.subtract(xf, m)))), axis=-1))
                y = bb.emit(R.add(bb.emit(R.log(total)), bb.emit(R.squeeze(m, axis=[1]))))
            elif kind == "router":
                prob = bb.emit(R.nn.softmax(xf, axis=-1))
                top = bb.emit(R.topk(prob, top_k, axis=-1, ret_type="both", largest=True, dtype="int64"))
                y = bb.emit(relax.Tuple([prob, bb.emit(relax.TupleGetItem(top, 0)), bb.emit(relax.TupleGetItem(top, 1))]))
            else:
                logp = bb.emit(R.nn.log_softmax(xf, axis=-1))
                y = bb.emit(R.nn.nll_loss(logp, params[1], reduction=reduction))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def row_reference(kind: str, x, labels=None, top_k: int = 2, reduction: str = "none"):
    """Float64 numpy of :func:`row_model` (a list of arrays for ``"router"``)."""
    x = x.astype("float64")
    shifted = x - x.max(axis=-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    if kind == "softmax":
        return np.exp(logp)
    if kind == "router":
        index = np.argsort(-x, axis=-1, kind="stable")[:, :top_k]
        return [np.exp(logp), np.take_along_axis(np.exp(logp), index, axis=-1), index]
    if kind == "log_softmax":
        return logp
    if kind == "log_sum_exp":
        return x.max(axis=-1) + np.log(np.exp(shifted).sum(axis=-1))
    kept = labels != -100
    loss = np.where(kept, -np.take_along_axis(logp, np.where(kept, labels, 0)[:, None], axis=1)[:, 0], 0.0)
    return {"none": loss, "sum": loss.sum(), "mean": loss.sum() / kept.sum()}[reduction]
