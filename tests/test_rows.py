"""``tvm_cascade.schedules.rows``: the one-block-per-row GPU schedule of chains that fold
each row to values of their own (log-sum-exp, cross-entropy, MoE routing): its plans,
the kernel it builds (one launch, loads of 16 bytes where the chunks divide the row), its
refusals, and MetaSchedule's proposal of it. Numerics on a GPU: test_rows_gpu.py."""
import re
import shutil

import pytest
import tvm
import tvm_cascade  # noqa: F401
from tvm.s_tir import meta_schedule as ms

from tvm_cascade import ops
from tvm_cascade.meta_schedule import ROWS_PER_BLOCK, CascadeFusion
from tvm_cascade.ops import cascades
from tvm_cascade.relax.gpu_schedule import UnsupportedOnGpu
from tvm_cascade.schedules.rows import plan_chain, plan_chunks, plan_rows, row_chains, schedule_rows

TARGET = tvm.target.Target("nvidia/nvidia-h100")
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")


@pytest.mark.parametrize(
    "length, tile, chunks",
    [(128256, 64, 167), (32000, 64, 250), (4096, 64, 64), (64, 8, 8), (151936, 64, 238), (1000, 16, 63), (1001, 16, 63)],
)
def test_plan_chunks(length, tile, chunks):
    """Whole tiles that divide the row where that gives a warp or more of threads; else
    the fewest chunks of equally many tiles on at most 256 threads (151936 = 2^7 * 1187
    has no such split: 238 chunks of 10 tiles)."""
    assert plan_chunks(length, tile) == chunks


def test_plan_rows_fills_blocks_of_short_rows():
    assert plan_rows(64, "float16") == {"chunks": 8, "tile": 8, "rows_per_block": 16}
    assert plan_rows(128256, "bfloat16") == {"chunks": 167, "tile": 64, "rows_per_block": 1}


def test_a_chain_is_planned_for_the_type_its_root_reads():
    """``plan_chain``: the row length of the chain and the element type of the input its
    root reads (the bf16 logits, not the int32 labels or a float32 output)."""
    func = cascades.cross_entropy(4, 200, "bfloat16")
    (chain,) = row_chains(func)
    assert plan_chain(func, chain) == plan_rows(200, "bfloat16") != plan_rows(200, "float32")


def test_row_chains_leave_out_chains_with_spatial_work():
    """Softmax statistics fold a row to values; attention's P·V keeps a head dimension."""
    assert [c.root for c in row_chains(cascades.cross_entropy(4, 64))] == ["max"]
    assert row_chains(ops.attention(1, 2, 1, 3, 40, 8, variant="causal")) == []
    with pytest.raises(UnsupportedOnGpu, match="expected one chain folding each row, found 0"):
        schedule_rows(tvm.s_tir.Schedule(ops.attention(1, 2, 1, 3, 40, 8, variant="causal")))


def test_a_block_after_the_chain_must_read_the_row():
    """A block after the chain that reads none of it would be placed whole in every row's
    block: refused, naming it."""
    from tvm import te

    x = te.placeholder((4, 64), "float32", name="X")
    j = te.reduce_axis((0, 64), name="j")
    m = te.compute((4,), lambda i: te.max(x[i, j], axis=j), name="max")
    k = te.reduce_axis((0, 64), name="k")
    s = te.compute((4,), lambda i: te.sum(te.exp(x[i, k] - m[i]), axis=k), name="sum")
    lse = te.compute((4,), lambda i: m[i] + te.log(s[i]), name="lse")
    c = te.reduce_axis((0, 64), name="c")
    total = te.compute((1,), lambda _: te.sum(x[c // 16, c], axis=c), name="total")
    sch = tvm.s_tir.Schedule(te.create_prim_func([x, lse, total]))
    with pytest.raises(UnsupportedOnGpu, match="'total' reads nothing the row's block computes"):
        schedule_rows(sch, chunks=4, tile=16)


def _kernels(source) -> set:
    """The names of the CUDA kernels ``source`` defines."""
    return set(re.findall(r"__global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(", source))


def _kernel_source(func, **kwargs):
    sch = tvm.s_tir.Schedule(func)
    schedule_rows(sch, **kwargs)
    source = tvm.compile(sch.mod, target=TARGET).mod.imports[0].inspect_source()
    return sch, source


@needs_nvcc
def test_one_kernel_with_whole_loads_where_the_chunks_divide():
    sch, source = _kernel_source(cascades.cross_entropy(8, 4096, "bfloat16"), tile=32)
    assert len(_kernels(source)) == 1
    assert "__launch_bounds__(128)" in source  # 4096 / 32 tiles over 128 threads
    assert "*(uint4*)(X_ptr" in source
    loops = [sch.get(l) for l in sch.get_loops(sch.get_sblock("sum_partial"))]
    assert [l.thread_binding.thread_tag for l in loops[:3]] == ["blockIdx.x", "threadIdx.y", "threadIdx.x"]


@needs_nvcc
def test_rows_that_no_chunk_count_divides():
    """The last chunk reads the tiles that end the row: whole loads still, unless the row
    is no whole number of them."""
    _, source = _kernel_source(cascades.logsumexp(4, 151936, "bfloat16"), tile=64)
    assert len(_kernels(source)) == 1 and "*(uint4*)(X_ptr" in source
    _, source = _kernel_source(cascades.logsumexp(4, 1001, "float16"), tile=16)
    assert len(_kernels(source)) == 1 and "uint4" not in source


@needs_nvcc
def test_a_runtime_number_of_rows():
    """Tokens as a symbolic extent (a model's batch of tokens): one kernel for any count."""
    tokens = tvm.tirx.Var("tokens", "int32")
    sch, source = _kernel_source(cascades.moe_routing(tokens, 64, 2, "float16"), **plan_rows(64, "float16"))
    assert len(_kernels(source)) == 1
    assert any(isinstance(p.ty.shape[0], tvm.tirx.Var) for p in sch.mod["main"].params)


@needs_nvcc
def test_moe_routing_with_top_k_is_one_kernel():
    """The softmax, its normalisation and the top-k rounds (arg-max reductions across the
    row's threads) in one launch; 16 rows of 8 threads per block."""
    _, source = _kernel_source(cascades.moe_routing(64, 64, 4, "float16"), **plan_rows(64, "float16"))
    assert len(_kernels(source)) == 1
    assert "__launch_bounds__(128)" in source


@needs_nvcc
def test_top_k_rounds_read_a_shared_copy_of_the_rows():
    """Where reductions over the row follow the chain (top-k's rounds), the block's rows
    are copied once into shared memory (16-byte loads, then a barrier) and the rounds
    read the copy; with a symbolic token count the rows stay in memory. The softmax
    chain is the row chain, the rounds (no repair) follow it."""
    func = cascades.moe_routing(8, 1024, 4, "float16")
    assert [(c.root, c.dependents) for c in row_chains(func)] == [("max", ("sum",))]
    plan = plan_rows(1024, "float16")
    _, source = _kernel_source(func, **plan)
    copy = f"__shared__ alignas(64) half logits_shared_ptr[{plan['rows_per_block'] * 1024}];"
    assert copy in source and "*(uint4*)(logits_shared_ptr" in source and "__syncthreads();" in source
    assert re.search(r"half v_\w* = logits_shared_ptr\[", source)  # a round reads the copy for its key
    _, source = _kernel_source(cascades.moe_routing(tvm.tirx.Var("tokens", "int32"), 1024, 4, "float16"), **plan)
    assert "logits_shared" not in source and len(_kernels(source)) == 1


@needs_nvcc
def test_meta_schedule_proposes_one_block_per_row_on_gpus():
    """On a CUDA target ``CascadeFusion`` proposes the chain split across a row's threads and
    rolled within each (both fusions in one trace), with its sampled threads, tile and
    rows per block; a decision passes the GPU postprocessors unless its block would
    exceed 1024 threads, and one that passes builds."""
    func = cascades.cross_entropy(16, 4096, "bfloat16")
    # The rule alone (cascade_space()'s default rules take ~30 s to add their spaces).
    space = ms.space_generator.PostOrderApply(sch_rules=[CascadeFusion(unfused=False)], postprocs="from-target", mutator_probs={})
    context = ms.TuneContext(mod=tvm.IRModule({"main": func}), target=TARGET, space_generator=space, task_name="ce")
    rows = [
        s for s in context.generate_design_space()
        if {"RollingUpdate", "SplitKUpdate"} <= {i.kind.name for i in s.trace.insts}
    ]
    assert len(rows) == 1
    samples = [inst for inst in rows[0].trace.insts if inst.kind.name == "SampleCategorical"]
    at = next(k for k, inst in enumerate(samples) if tuple(int(c) for c in inst.attrs[0]) == ROWS_PER_BLOCK)
    chunks, per_block = samples[at - 2], samples[at]  # sampled as (threads, tile, rows)
    threads = int(chunks.attrs[0][int(rows[0].trace.decisions[chunks])])
    built = 0
    for decision, count in enumerate(ROWS_PER_BLOCK):
        sch = tvm.s_tir.Schedule(tvm.IRModule({"main": func}))
        rows[0].trace.with_decision(per_block, decision, remove_postproc=True).apply_to_schedule(sch, remove_postproc=True)
        valid = all(postproc.apply(sch) for postproc in context.space_generator.postprocs)
        assert valid == (threads * count <= 1024), (threads, count)  # VerifyGPUCode: threads per block
        if valid and not built:  # one build: nvcc takes seconds
            assert len(_kernels(tvm.compile(sch.mod, target=TARGET).mod.imports[0].inspect_source())) == 1
            built += 1
    assert built


def _replays_every_rows_per_block(tokens, sampled):
    """MoE routing over ``tokens`` tokens and 256 experts: the rows per block the
    one-block-per-row sample draws from are ``sampled``, and replayed under each a
    sample's block has that many rows of threads and its shared copy that many rows."""
    func = cascades.moe_routing(tokens, 256, 8, "float16")
    space = ms.space_generator.PostOrderApply(sch_rules=[CascadeFusion(unfused=False)], postprocs="from-target", mutator_probs={})
    context = ms.TuneContext(mod=tvm.IRModule({"main": func}), target=TARGET, space_generator=space, task_name="moe")
    (rows,) = [
        s for s in context.generate_design_space()
        if {"RollingUpdate", "SplitKUpdate"} <= {i.kind.name for i in s.trace.insts}
    ]
    (per_block,) = [inst for inst in rows.trace.insts if inst.kind.name == "SampleCategorical"]
    assert tuple(int(c) for c in per_block.attrs[0]) == sampled
    for decision, count in enumerate(sampled):
        sch = tvm.s_tir.Schedule(tvm.IRModule({"main": func}))
        rows.trace.with_decision(per_block, decision, remove_postproc=True).apply_to_schedule(sch, remove_postproc=True)
        assert all(postproc.apply(sch) for postproc in context.space_generator.postprocs)
        source = tvm.compile(sch.mod, target=TARGET).mod.imports[0].inspect_source()
        assert f"__launch_bounds__({16 * count})" in source
        assert f"half logits_shared_ptr[{256 * count}];" in source


@needs_nvcc
def test_meta_schedule_samples_the_plan_and_replays_every_rows_per_block():
    """The tuning space holds the hand plan: MoE routing over 256 experts is planned as
    8 rows of 16 threads a block, and 8 is among the rows per block sampled; every
    sampled value replays into its block."""
    assert plan_rows(256, "float16")["rows_per_block"] == 8
    _replays_every_rows_per_block(64, (1, 4, 8, 16))


@needs_nvcc
def test_meta_schedule_samples_only_rows_per_block_that_divide_the_rows():
    """Over 36 tokens the rows per block sampled are those dividing 36 (1 and 4 of 1, 4,
    8, 16), and each replays with the block's rows copied to shared memory (decided once
    for the trace: a value not dividing 36 failed to build)."""
    _replays_every_rows_per_block(36, (1, 4))
