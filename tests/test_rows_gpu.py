"""``tvm_cascade.schedules.rows`` on a CUDA GPU (skipped without one): log-sum-exp,
cross-entropy and MoE routing with top-k against float64 numpy, rows the chunks divide
and rows they do not, every plan's rows per block, and MetaSchedule's proposal of the
schedule replayed with each of its sampled decisions."""
import numpy as np
import pytest
import tvm
import tvm_cascade  # noqa: F401
from tvm.s_tir import meta_schedule as ms

from tvm_cascade.meta_schedule import cascade_space
from tvm_cascade.ops import cascades
from tvm_cascade.ops import reference as R
from tvm_cascade.schedules.rows import plan_rows, schedule_rows

pytestmark = pytest.mark.skipif(not tvm.cuda(0).exist, reason="needs a CUDA GPU")
TOL = {"float32": 1e-5, "float16": 1e-4, "bfloat16": 1e-4}


def _run(sch, inputs, outputs):
    """Run ``sch``'s function on the GPU; the outputs as numpy arrays."""
    target = tvm.target.Target.from_device(tvm.cuda(0))
    kernel = tvm.compile(sch.mod, target=target)["main"]
    dev = tvm.cuda(0)
    args = [tvm.runtime.tensor(a, dev) for a in inputs] + [tvm.runtime.tensor(np.zeros(s, d), dev) for s, d in outputs]
    kernel(*args)
    return [a.numpy() for a in args[len(inputs):]]


def _logits(rows, n, dtype, seed):
    x = np.random.default_rng(seed).standard_normal((rows, n)) * 4
    if dtype == "bfloat16":
        import ml_dtypes

        return x.astype(ml_dtypes.bfloat16)
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("n", [4096, 4000, 1001, 128256])
@pytest.mark.parametrize("workload", ["logsumexp", "cross_entropy"])
def test_row_statistics(workload, n, dtype):
    rows = 6
    x = _logits(rows, n, dtype, n)
    inputs, ref = [x], None
    if workload == "cross_entropy":
        labels = np.random.default_rng(1).integers(0, n, rows).astype("int32")
        inputs.append(labels)
        ref = R.cross_entropy_ref(x.astype("float64"), labels)
    else:
        ref = R.logsumexp_ref(x.astype("float64"))
    sch = tvm.s_tir.Schedule(getattr(cascades, workload)(rows, n, dtype))
    schedule_rows(sch, **plan_rows(n, dtype))
    (out,) = _run(sch, inputs, [((rows,), "float32")])
    np.testing.assert_allclose(out, ref, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("experts, top_k, dtype", [
    (64, 2, "float16"), (128, 8, "float16"), (256, 8, "float16"), (4096, 8, "float16"), (40, 3, "float16"),
    (300, 4, "float32"), (256, 8, "bfloat16"),  # float32: int64 keys; bfloat16: its bits from its float32
])
@pytest.mark.parametrize("tokens", [37, 64])  # 64: whole blocks, whose rows the rounds read from shared memory
def test_moe_routing_with_top_k(experts, top_k, dtype, tokens):
    x = _logits(tokens, experts, dtype, experts)
    x[0, [3, 7]] = x[0].max() + 1  # a tie: the lower expert index first
    sch = tvm.s_tir.Schedule(cascades.moe_routing(tokens, experts, top_k, dtype))
    schedule_rows(sch, **plan_rows(experts, dtype))
    prob, top_prob, top_idx = _run(
        sch, [x], [((tokens, experts), "float32"), ((tokens, top_k), "float32"), ((tokens, top_k), "int32")]
    )
    ref_prob, ref_top, ref_idx = R.moe_routing_ref(x.astype("float64"), top_k)
    np.testing.assert_allclose(prob, ref_prob, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(top_prob, ref_top, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(top_idx, ref_idx)


def test_a_runtime_number_of_tokens():
    """One kernel built for a symbolic token count, run at several counts."""
    tokens = tvm.tirx.Var("tokens", "int32")
    sch = tvm.s_tir.Schedule(cascades.moe_routing(tokens, 128, 8, "float16"))
    schedule_rows(sch, **plan_rows(128, "float16"))
    for count in (1, 37, 300):
        x = _logits(count, 128, "float16", count)
        prob, top_prob, top_idx = _run(
            sch, [x], [((count, 128), "float32"), ((count, 8), "float32"), ((count, 8), "int32")]
        )
        ref_prob, ref_top, ref_idx = R.moe_routing_ref(x.astype("float64"), 8)
        np.testing.assert_allclose(prob, ref_prob, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(top_prob, ref_top, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(top_idx, ref_idx)


@pytest.mark.parametrize("rows_per_block", [1, 4, 16])
def test_rows_per_block(rows_per_block):
    x = _logits(37, 256, "float16", 5)  # 37 rows: the last block runs past them
    sch = tvm.s_tir.Schedule(cascades.logsumexp(37, 256, "float16"))
    schedule_rows(sch, chunks=16, tile=16, rows_per_block=rows_per_block)
    (out,) = _run(sch, [x], [((37,), "float32")])
    np.testing.assert_allclose(out, R.logsumexp_ref(x.astype("float64")), rtol=1e-4)


def test_meta_schedule_proposal_runs():
    """The one-block-per-row proposal of the tuning space, replayed with each tile it
    samples, computes numpy's cross-entropy."""
    rows, n = 5, 3000
    func = cascades.cross_entropy(rows, n, "float16")
    target = tvm.target.Target.from_device(tvm.cuda(0))
    context = ms.TuneContext(mod=tvm.IRModule({"main": func}), target=target, space_generator=cascade_space(), task_name="ce")
    (space,) = [
        s for s in context.generate_design_space()
        if {"RollingUpdate", "SplitKUpdate"} <= {i.kind.name for i in s.trace.insts}
    ]
    x = _logits(rows, n, "float16", 9)
    labels = np.arange(rows, dtype="int32") * 7
    samples = [inst for inst in space.trace.insts if inst.kind.name == "SampleCategorical"]
    at = next(k for k, inst in enumerate(samples) if len(inst.attrs[0]) == 4 and int(inst.attrs[0][0]) == 16)
    for decision in range(4):
        sch = tvm.s_tir.Schedule(tvm.IRModule({"main": func}))
        space.trace.with_decision(samples[at], decision, remove_postproc=True).apply_to_schedule(sch, remove_postproc=True)
        if not all(postproc.apply(sch) for postproc in context.space_generator.postprocs):
            continue
        (out,) = _run(sch, [x, labels], [((rows,), "float32")])
        np.testing.assert_allclose(out, R.cross_entropy_ref(x.astype("float64"), labels), rtol=1e-4)
