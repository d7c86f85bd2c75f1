"""``DispatchRowChains`` (the cascade pipeline's loss and router pass): the forms
``torch.export`` gives a cross-entropy and an MoE router's top-k, and a log-sum-exp
written by hand, become one fused kernel call each, the one-block-per-row kernel on CUDA; through the pipeline on the CPU they
match float64 numpy with static and symbolic row counts; what no kernel serves is left.
GPU numerics: test_relax_row_kernels_gpu.py."""
import numpy as np
import pytest
import tvm
import tvm_ffi
from relax_attention_cases import SM90A
from relax_row_cases import row_model, row_reference
from tvm import relax

import tvm_cascade  # noqa: F401  (registers the "cascade" pipeline)
from tvm_cascade.relax.row_dispatch import DispatchRowChains


def _dispatch(mod, target, cpu=False):
    with tvm.target.Target(target):
        return DispatchRowChains(cpu)(mod)


def _run_on_cpu(mod, args):
    """``mod`` with ``DispatchRowChains(cpu=True)``'s kernels, built by the default
    pipeline and run on the CPU."""
    executable = tvm.compile(_dispatch(mod, "llvm", cpu=True), target="llvm", relax_pipeline="default")
    return relax.VirtualMachine(executable, tvm.cpu())["main"](*(tvm.runtime.tensor(a) for a in args))


def _kernels(mod):
    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}


def _ops(mod):
    return [b.value.op.name for blk in mod["main"].body.blocks for b in blk.bindings
            if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op)]


def _blocks(func):
    names = []
    tvm_ffi.structural_walk(func.body, lambda n: names.append(n.name_hint) if isinstance(n, tvm.s_tir.stmt.SBlock) else None)
    return names


@pytest.mark.parametrize("kind, name, ops", [
    ("exported_cross_entropy", "cross_entropy_4096_float16_int64", ["relax.call_tir"]),
    ("router", "moe_routing_4096_2_float16_int64", ["relax.astype", "relax.nn.softmax", "relax.call_tir"]),
    ("log_sum_exp", "logsumexp_4096_float16", ["relax.call_tir"]),
])
def test_a_loss_and_a_router_become_one_row_kernel_call(kind, name, ops):
    """On CUDA: one call of the one-block-per-row kernel, reading the float16 logits as
    they are (the cast goes where nothing else reads it; the router's softmax, an
    output, stays)."""
    out = _dispatch(row_model(kind, 64, 4096, "float16"), SM90A)
    (kernel,) = _kernels(out).values()
    assert list(_kernels(out)) == [name] and _ops(out) == ops
    assert bool(kernel.attrs["tirx.is_scheduled"]) and any(b.endswith("_partial") for b in _blocks(kernel))
    assert str(kernel.params[0].ty.dtype) == "float16"


def test_the_cascade_pipeline_dispatches_a_router_before_tvm_sorts_its_top_k():
    """Through the whole pipeline on CUDA the router's top-k is the row kernel, not the
    sort kernel TVM's library dispatch makes of ``topk``."""
    from tvm_cascade.relax.pipeline import cascade_pipeline

    with tvm.target.Target(SM90A):
        out = cascade_pipeline()(row_model("router", 64, 256, "float16", top_k=8))
    names = [gv.name_hint for gv in out.get_global_vars()]
    assert "moe_routing_256_8_float16_int64" in names and not any("topk" in n or "sort" in n for n in names)


@pytest.mark.parametrize("rows", [37, "symbolic"])
@pytest.mark.parametrize("kind", ["exported_cross_entropy", "router", "log_sum_exp"])
def test_the_rewrite_computes_the_chain(kind, rows):
    """The rewritten module against float64 numpy, run on the CPU with ``cpu=True``'s
    kernels (rolled over the row, rows in parallel): 1000 classes (no whole number of
    tiles), static and symbolic rows."""
    extent = tvm.tirx.Var("tokens", "int64") if rows == "symbolic" else 37
    mod = row_model(kind, extent, 1000, "float16", top_k=4)
    prefix = {"exported_cross_entropy": "cross_entropy_1000_", "router": "moe_routing_1000_4_",
              "log_sum_exp": "logsumexp_1000_"}[kind]
    assert [name[:len(prefix)] for name in _kernels(_dispatch(mod, "llvm", cpu=True))] == [prefix]
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((37, 1000)) * 4).astype("float16")
    args = [x] + ([rng.integers(0, 1000, 37).astype("int64")] if "cross_entropy" in kind else [])
    got = _run_on_cpu(mod, args)
    expected = row_reference(kind, x, *args[1:], top_k=4)
    if kind == "router":
        for out, ref in zip(got, expected):
            np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-6)
    else:
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_nll_loss_of_log_softmax_with_ignored_labels(reduction):
    """``nll_loss(log_softmax(x), labels)`` with every reduction: the fused kernel (an
    ignored label read as class 0), the ignored rows' loss zeroed around it; run on the
    CPU against float64 numpy."""
    mod = row_model("cross_entropy", 37, 1000, "bfloat16", reduction=reduction)
    assert list(_kernels(_dispatch(mod, SM90A))) == ["cross_entropy_1000_bfloat16_int64"]
    rng = np.random.default_rng(1)
    x = rng.standard_normal((37, 1000)) * 4
    labels = rng.integers(0, 1000, 37).astype("int64")
    labels[::5] = -100
    import ml_dtypes

    x = x.astype(ml_dtypes.bfloat16)
    got = _run_on_cpu(mod, [x, labels])
    expected = row_reference("cross_entropy", x.astype("float64"), labels, reduction=reduction)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-5)


def test_what_no_kernel_serves_is_left():
    """Rows of a symbolic length, the smallest k, a GPU whose kernels no schedule here
    binds (Metal), a CPU unless asked: no kernel, the module as it was."""
    for mod, target in ((row_model("exported_cross_entropy", 8, tvm.tirx.Var("n", "int64"), "float16"), SM90A),
                        (_smallest_k(row_model("router", 8, 64, "float16")), SM90A),
                        (row_model("log_sum_exp", 8, 64, "float16"), {"kind": "metal"}),
                        (row_model("log_sum_exp", 8, 64, "float16"), "llvm")):
        tvm.ir.assert_structural_equal(_dispatch(mod, target), mod)


def _smallest_k(mod):
    """``mod`` with its top-k taking the smallest."""
    def flip(call):
        if isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.topk":
            attrs = call.attrs
            return relax.op.topk(call.args[0], int(attrs.k), int(attrs.axis), attrs.ret_type, False, attrs.dtype)
        return call

    return tvm.IRModule({"main": tvm_ffi.structural_map(mod["main"], (relax.Call, flip))})
