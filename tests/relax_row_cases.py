"""Relax models with row chains (softmax, log-softmax, cross-entropy) shared by the CPU
and GPU tests of ``tvm_cascade.relax.row_kernels``."""
import numpy as np
from tvm import relax
from tvm.relax import op as R


def row_model(kind: str, rows, n: int, dtype: str):
    """``main(x[rows, n]: dtype)`` (and ``labels[rows]`` for ``"cross_entropy"``): the
    float32 softmax, log-softmax or per-row cross-entropy of ``x``, as a Relax user
    writes them."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((rows, n), dtype))
    params = [x]
    if kind == "cross_entropy":
        params.append(relax.Var("labels", relax.TensorType((rows,), "int64")))
    with bb.function("main", params):
        with bb.dataflow():
            xf = bb.emit(R.astype(x, "float32"))
            if kind == "softmax":
                y = bb.emit(R.nn.softmax(xf, axis=-1))
            elif kind == "log_softmax":
                y = bb.emit(R.nn.log_softmax(xf, axis=-1))
            else:
                logp = bb.emit(R.nn.log_softmax(xf, axis=-1))
                y = bb.emit(R.nn.nll_loss(logp, params[1], reduction="none"))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def row_reference(kind: str, x, labels=None):
    """Float64 numpy of :func:`row_model`."""
    x = x.astype("float64")
    shifted = x - x.max(axis=-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    if kind == "softmax":
        return np.exp(logp)
    if kind == "log_softmax":
        return logp
    return -np.take_along_axis(logp, labels[:, None], axis=1)[:, 0]
