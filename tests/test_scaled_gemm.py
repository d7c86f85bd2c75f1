"""``tvm_cascade.schedules.scaled_gemm`` on the CPU: the per-row scale moved out of the
GEMM's sum (``Schedule.defer_row_scales``: the IR and float64 numerics, the statistic
still on the unscaled rows), a statistic folded from a tile copy under the GEMM's k loop
(``Schedule.fold_from_copy``, numerics on LLVM), the output over padded rows
(``Schedule.over_padded_rows``), what is refused, the schedule's trace replayed from
JSON, and the CUDA kernel's source (one kernel: tensor cores, asynchronous copies, the
statistic inside). GPU numerics: test_scaled_gemm_gpu.py."""
import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import te

import tvm_cascade  # noqa: F401
from tvm_cascade.cuda import tensor_cores
from tvm_cascade.errors import FusionError
from tvm_cascade.ops import cascades
from tvm_cascade.ops import reference as R
from tvm_cascade.primitives import ir
from tvm_cascade import trace as cascade_trace
from tvm_cascade.schedules.scaled_gemm import apply_scaled_gemm_schedule, schedule_scaled_gemm


def _deferred(func):
    sch = tvm.s_tir.Schedule(func)
    sch.defer_row_scales(sch.get_sblock("gemm"))
    return sch.mod["main"]


def _blocks(func):
    return {b.name_hint: b for b in ir.blocks_in(func.body.block)}


def _read_names(block):
    return sorted(r.source.name for r in block.reads)


def _run(func, inputs, shape):
    lib = tvm.compile(func, target="llvm")
    dev = tvm.cpu()
    args = [tvm.runtime.tensor(a, dev) for a in inputs] + [tvm.runtime.tensor(np.zeros(shape, "float32"), dev)]
    lib(*args)
    return args[-1].numpy()


def _rmsnorm_inputs(m, n, k, seed=0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10, (m, 1))).astype("float32")
    gamma = (1 + 0.1 * rng.standard_normal(k)).astype("float32")
    w = rng.standard_normal((k, n)).astype("float32")
    return [x, gamma, w]


def test_rmsnorm_scale_moves_after_the_sum_and_gamma_into_a_copy_of_x():
    func = _deferred(cascades.rmsnorm_gemm(8, 16, 32))
    blocks = _blocks(func)
    assert _read_names(blocks["gemm"]) == ["W", "X_global"]
    assert _read_names(blocks["X_global"]) == ["X", "gamma"]
    assert _read_names(blocks["sumsq"]) == ["X"]  # the norm's statistic of X itself, not of X * gamma
    assert _read_names(blocks["out"]) == ["gemm", "rstd"]
    inputs = _rmsnorm_inputs(8, 16, 32)
    np.testing.assert_allclose(_run(func, inputs, (8, 16)), R.rmsnorm_gemm_ref(*inputs), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [48, "symbolic"])
def test_padded_rows_are_computed_and_out_keeps_the_real_ones(rows):
    m = tvm.tirx.Var("m", "int32") if rows == "symbolic" else rows
    func = _deferred(cascades.rmsnorm_gemm(m, 16, 32, pad_rows=32))
    assert "X_pad" in _blocks(func)
    inputs = _rmsnorm_inputs(40 if rows == "symbolic" else rows, 16, 32, seed=3)
    got = _run(func, inputs, (inputs[0].shape[0], 16))
    np.testing.assert_allclose(got, R.rmsnorm_gemm_ref(*inputs), rtol=1e-4, atol=1e-4)


def test_output_runs_over_the_padded_rows_and_stores_its_own():
    func = _deferred(cascades.rmsnorm_gemm(48, 16, 32, pad_rows=32))
    sch = tvm.s_tir.Schedule(func)
    sch.over_padded_rows(sch.get_sblock("out"))
    out = sch.get(sch.get_sblock("out"))
    assert int(out.iter_vars[0].dom.extent) == 64
    assert isinstance(out.body, tvm.tirx.IfThenElse) and str(out.body.condition) == "v_i < 48"
    inputs = _rmsnorm_inputs(48, 16, 32, seed=4)
    np.testing.assert_allclose(_run(sch.mod["main"], inputs, (48, 16)), R.rmsnorm_gemm_ref(*inputs), rtol=1e-4, atol=1e-4)


def test_the_padded_output_stores_its_own_rows_only_after_reverse_compute_at():
    """Under its producer's 32-row tiles (where reverse-compute-at rebuilds the block's
    predicate from its domain), rows past the output's 40 are still not stored: the
    output is a view of a larger array whose rows after it must keep their values."""
    a = te.placeholder((64, 16), name="A")
    padded = te.compute((64, 16), lambda i, j: a[i, j] + 1, name="padded")
    c = te.compute((40, 16), lambda i, j: padded[i, j] * 2, name="C")
    sch = tvm.s_tir.Schedule(te.create_prim_func([a, c]))
    sch.over_padded_rows(sch.get_sblock("C"))
    tile, _ = sch.split(sch.get_loops(sch.get_sblock("padded"))[0], [None, 32])
    sch.reverse_compute_at(sch.get_sblock("C"), tile)
    lib = tvm.compile(sch.mod, target="llvm")
    x = np.random.default_rng(5).standard_normal((64, 16)).astype("float32")
    whole = tvm.runtime.tensor(np.full((64, 16), 7.0, "float32"))
    lib(tvm.runtime.tensor(x), whole._create_view((40, 16)))
    np.testing.assert_allclose(whole.numpy()[:40], (x[:40] + 1) * 2)
    np.testing.assert_array_equal(whole.numpy()[40:], 7.0)


def test_over_padded_rows_needs_one_row_count_among_what_the_block_reads():
    a, b = te.placeholder((64, 4), name="A"), te.placeholder((48, 4), name="B")
    c = te.compute((48, 4), lambda i, j: a[i, j] + b[i, j], name="C")
    sch = tvm.s_tir.Schedule(te.create_prim_func([a, b, c]))
    with pytest.raises(FusionError, match=r"block 'C' must read buffers of one row count at its row, not \['64', '48'\]"):
        sch.over_padded_rows(sch.get_sblock("C"))


def test_the_schedule_replays_from_its_json_trace():
    """Every step of the scaled-GEMM schedule is a traced instruction, the three
    row-scale primitives among them: the trace's JSON replays to the same module, a
    symbolic row count included."""
    m = tvm.tirx.Var("m", "int32")
    func = cascades.rmsnorm_gemm(m, 256, 512, dtype="float16", pad_rows=128, weight_layout="nk")
    sch = schedule_scaled_gemm(func)
    kinds = [inst.kind.name for inst in sch.trace.insts]
    assert {"DeferRowScales", "FoldFromCopy", "OverPaddedRows"} <= set(kinds)
    replayed = tvm.s_tir.Schedule(func)
    cascade_trace.apply_json_to_schedule(sch.trace.as_json(), replayed)
    assert tvm_ffi.structural_equal(replayed.mod, sch.mod)


def test_absmax_scale_moves_after_the_sum():
    func = _deferred(cascades.absmax_quant_gemm(4, 8, 16))
    blocks = _blocks(func)
    assert _read_names(blocks["gemm"]) == ["W", "X"] and "X_global" not in blocks
    assert _read_names(blocks["out"]) == ["gemm", "scale"]
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((4, 16)).astype("float32"), rng.standard_normal((16, 8)).astype("float32")
    np.testing.assert_allclose(_run(func, [x, w], (4, 8)), R.absmax_quant_gemm_ref(x, w), rtol=1e-4, atol=1e-4)


def test_a_gemm_without_a_row_scale_is_refused():
    a, b = te.placeholder((4, 8), name="A"), te.placeholder((8, 4), name="B")
    k = te.reduce_axis((0, 8), name="k")
    c = te.compute((4, 4), lambda i, j: te.sum(a[i, k] * b[k, j], axis=k), name="C")
    sch = tvm.s_tir.Schedule(te.create_prim_func([a, b, c]))
    before = sch.mod
    with pytest.raises(FusionError, match="block 'C' has no per-row scale"):
        sch.defer_row_scales(sch.get_sblock("C"))
    assert tvm_ffi.structural_equal(sch.mod, before)


def test_defer_row_scales_names_a_block_that_is_not_the_gemm():
    sch = tvm.s_tir.Schedule(cascades.rmsnorm_gemm(8, 16, 32))
    with pytest.raises(FusionError, match="block 'sumsq' does not compute C\\[i, j\\] \\+= A\\[i, k\\]"):
        sch.defer_row_scales(sch.get_sblock("sumsq"))


def test_statistic_folds_from_the_gemm_tile_copy():
    """On the CPU: the sum of squares under the GEMM's k loop, read from X's tile copy,
    gives float64 numpy's result."""
    func = _deferred(cascades.rmsnorm_gemm(8, 16, 64))
    sch = tvm.s_tir.Schedule(func)
    gemm = sch.get_sblock("gemm")
    i, j, k = sch.get_loops(gemm)
    ko, _ = sch.split(k, [None, 16])
    sch.reorder(i, ko, j)
    sch.compute_at(sch.get_sblock("X_global"), ko)
    copy = sch.cache_read(sch.get_sblock("X_global"), 0, "global", consumer_blocks=[sch.get_sblock("X_global")])
    sch.compute_at(copy, ko, index=0)
    sch.fold_from_copy(sch.get_sblock("sumsq"), copy)
    gemm_loops = [sch.get(l).loop_var.name for l in sch.get_loops(sch.get_sblock("gemm"))]
    assert [sch.get(l).loop_var.name for l in sch.get_loops(sch.get_sblock("sumsq"))][:2] == gemm_loops[:2] == ["i", "rk_0"]
    (read,) = sch.get(sch.get_sblock("sumsq")).reads
    assert read.source.same_as(sch.get(copy).writes[0].source)
    inputs = _rmsnorm_inputs(8, 16, 64, seed=2)
    np.testing.assert_allclose(_run(sch.mod["main"], inputs, (8, 16)), R.rmsnorm_gemm_ref(*inputs), rtol=1e-4, atol=1e-4)


def test_fold_from_copy_needs_rows_for_its_row_loop():
    sch = tvm.s_tir.Schedule(_deferred(cascades.rmsnorm_gemm(8, 16, 64)))
    gemm = sch.get_sblock("gemm")
    i, _, k = sch.get_loops(gemm)
    ko, _ = sch.split(k, [None, 16])
    copy = sch.cache_read(gemm, 0, "global", consumer_blocks=[gemm])
    sch.compute_at(copy, ko, index=0)
    with pytest.raises(ValueError, match="slices of 0 rows; row_loop needs slice_rows > 0"):
        sch.fold_from_copy(sch.get_sblock("sumsq"), copy, i, 0)


def test_one_cuda_kernel_on_tensor_cores():
    sch = schedule_scaled_gemm(cascades.rmsnorm_gemm(128, 256, 128, dtype="float16"))
    source = tensor_cores.build(sch.mod, {"kind": "cuda", "arch": "sm_90a"}).mod.imports[0].inspect_source()
    assert source.count("__global__") == 2  # declaration and definition of one kernel
    assert "mma.sync" in source and "cp.async" in source and "sumsq_shared" in source and "sqrtf" in source


def test_x_tile_is_static_shared_memory_where_the_kernel_opts_into_more_than_48_kb():
    """128-row blocks: X's tile in static shared memory, apart from the merged dynamic
    buffers, so the scaled copy's words need no barrier each (7 barriers, 22 with the
    tile dynamic). 64-row blocks stay under 48 KB of dynamic memory, where TVM's
    launcher would not lift the limit for static and dynamic memory together."""
    def source(m, pad):
        sch = schedule_scaled_gemm(cascades.rmsnorm_gemm(m, 384, 512, dtype="float16", pad_rows=pad))
        return tensor_cores.build(sch.mod, {"kind": "cuda", "arch": "sm_90a"}).mod.imports[0].inspect_source()

    wide, narrow = source(256, None), source(48, 32)
    assert "__shared__ alignas(64) half X_shared_ptr[" in wide and wide.count("__syncthreads") == 7
    assert "half X_pad_shared_ptr[" not in narrow and "half X_shared_ptr[" not in narrow


def test_rows_that_are_not_whole_warps_are_refused():
    with pytest.raises(ValueError, match=r"M = 16 is not a multiple of the tile's 32 \(ops.rmsnorm_gemm\(pad_rows=32\) pads M\)"):
        schedule_scaled_gemm(cascades.rmsnorm_gemm(16, 128, 128, dtype="float16"))


def test_a_refused_schedule_leaves_the_schedule_as_it_was():
    sch = tvm.s_tir.Schedule(cascades.rmsnorm_gemm(128, 128, 96, dtype="float16"))
    before = sch.mod
    with pytest.raises(ValueError, match="K = 96 is not a multiple of the tile's 64"):
        apply_scaled_gemm_schedule(sch)
    assert tvm_ffi.structural_equal(sch.mod, before) and not sch.trace.insts


def test_a_scale_with_no_statistic_in_the_kernel_is_refused():
    """A row scale given as an input defers, but the kernel folds one statistic."""
    x, s, w = te.placeholder((32, 64), "float16", "X"), te.placeholder((32,), "float32", "s"), te.placeholder((64, 128), "float16", "W")
    k = te.reduce_axis((0, 64), name="k")
    y = te.compute((32, 128), lambda i, j: te.sum(x[i, k].astype("float32") * s[i] * w[k, j].astype("float32"), axis=k), name="gemm")
    out = te.compute((32, 128), lambda i, j: y[i, j].astype("float16"), name="out")
    with pytest.raises(FusionError, match="one row statistic besides 'gemm' expected, found none"):
        schedule_scaled_gemm(te.create_prim_func([x, s, w, out]))
