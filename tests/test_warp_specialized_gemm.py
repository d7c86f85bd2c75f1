"""The warp-specialised RMSNorm + GEMM (``schedules/warp_specialized_gemm.py``) on the CPU:
its schedule of ``ops.rmsnorm_gemm`` (the traced deferral and the annotated choices,
replayed from JSON), the CUDA kernel its build makes for sm_90a, and its refusals. The
kernel runs only on an H100 or H200: numerics in test_scaled_gemm_gpu.py."""
import json
import re

import pytest
import tvm

import tvm_cascade  # noqa: F401  (schedule primitives)
from tvm_cascade.analysis.chain import substitute
from tvm_cascade.errors import FusionError
from tvm_cascade.cuda import sm_count
from tvm_cascade.ops import cascades
from tvm_cascade.schedules import scaled_gemm
from tvm_cascade.schedules import warp_specialized_gemm as ws
from tvm_cascade.schedules.warp_specialized_gemm import WarpSpecializedGemmConfig
from launches import grid as launched
from ptxas import assembled, assembly
from tvm_cascade import trace as cascade_trace

SM90A = {"kind": "cuda", "arch": "sm_90a"}


def _source(sch):
    return ws.build(sch.mod, SM90A).mod.imports[0].inspect_source()


def test_schedule_defers_the_row_scale_and_annotates_the_choices():
    func = cascades.rmsnorm_gemm(256, 512, 1024, eps=1e-5, dtype="float16", weight_layout="nk")
    config = WarpSpecializedGemmConfig(cols=128, stages=5, group=8)
    sch = ws.schedule(func, config)
    expected = tvm.s_tir.Schedule(func)
    expected.defer_row_scales(expected.get_sblock("gemm"))
    gemm = expected.get_sblock("gemm")
    expected.annotate(gemm, ws.PROBLEM, [1e-5, "nk"])
    for key, value in ((ws.COLS, 128), (ws.STAGES, 5), (ws.GROUP, 8), (ws.REGISTERS, [40, 232])):
        expected.annotate(gemm, key, value)
    tvm.ir.assert_structural_equal(sch.mod, expected.mod)
    assert [str(i.kind.name) for i in sch.trace.insts][-5:] == ["Annotate"] * 5
    assert ws.rmsnorm_gemm_of(func) == ws.RmsNormGemm(256, 512, 1024, 1e-5, "nk", "float16")


def test_the_trace_replays_from_json_to_the_same_kernel():
    rows = tvm.tirx.Var("m", "int32")
    func = cascades.rmsnorm_gemm(rows, 512, 1024, dtype="float16", out_dtype="float32")
    sch = ws.schedule(func)
    assert "DeferRowScales" in [inst.kind.name for inst in sch.trace.insts]
    replayed = tvm.s_tir.Schedule(func)
    cascade_trace.apply_json_to_schedule(json.loads(json.dumps(cascade_trace.to_plain_json(sch.trace.as_json()))), replayed)
    tvm.ir.assert_structural_equal(replayed.mod, sch.mod)
    assert _source(replayed) == _source(sch)


@pytest.mark.parametrize("layout", ["kn", "nk"])
def test_build_makes_one_tma_and_wgmma_kernel(layout):
    """One kernel: TMA copies, setmaxnreg, wgmma with the A operand in registers (made
    by fp16 pair products), W read MN-major as [K, N] (transpose flag 1), K-major as
    [N, K] (0); eps and K in the epilogue, which stores four columns a thread at a time
    (N a multiple of the tile's columns); rows checked against M, a variable (the
    function also holds the kernel for few rows: below)."""
    rows = tvm.tirx.Var("m", "int32")
    both = _source(ws.schedule(cascades.rmsnorm_gemm(rows, 1024, 4096, eps=1e-5, dtype="float16", weight_layout=layout)))
    # three kernels, each declared and defined: this one, the few rows' and its splits' sum
    assert both.count("__global__") == 6
    (source,) = [kernel for kernel in both.split('extern "C" __global__')[1:] if "setmaxnreg" in kernel]
    for mark in ("cp.async.bulk.tensor.2d", "setmaxnreg.inc", "setmaxnreg.dec", "mul.rn.f16x2", "/*1.000000e-05*/", "/*4.096000e+03*/"):
        assert mark in both, mark
    flag = "1" if layout == "kn" else "0"
    assert f"wgmma_f16_rs_mma_async_sync_aligned_m64n256k16_f32_f16_f16_1_1_{flag}(" in source
    assert re.search(r"< \(?m\b", source)
    assert "*(half4*)(out_ptr" in source and "out_ptr[" not in source


def test_few_rows_take_the_kernel_for_few_rows_and_a_variable_count_picks_at_run_time():
    """Up to 16 rows :func:`build` makes the kernel for few rows (wgmma m64n16k16, W as
    A; 4096 x 14336 in three splits of K: two kernels), from 17 the 128-row kernel; for a
    variable row count one function holding both, the rows choosing at run time."""
    from tvm_cascade.schedules import rmsnorm_gemm_skinny as skinny

    def built(rows):
        return _source(ws.schedule(cascades.rmsnorm_gemm(rows, 14336, 4096, dtype="float16")))

    few, many = built(16), built(17)
    assert "m64n16k16_f32_f16_f16" in few and "setmaxnreg" not in few
    assert few.count("__global__") == 4 and skinny.default_config(14336, 4096, sms=132) == (3, 3)
    assert "m64n256k16_f32_f16_f16" in many and many.count("__global__") == 2
    rows = tvm.tirx.Var("m", "int32")
    func = ws.kernel_for(ws.RmsNormGemm(rows, 14336, 4096, 1e-6, "kn", "float16"))
    assert isinstance(func.body, tvm.tirx.IfThenElse)
    tvm.ir.assert_structural_equal(func.body.condition, rows <= ws.SKINNY_ROWS, map_free_vars=True)
    both = built(rows)
    assert "m64n16k16_f32_f16_f16" in both and "m64n256k16_f32_f16_f16" in both and both.count("__global__") == 6


def _schedule_source(layout, dtype, rows, k, cluster):
    rows = tvm.tirx.Var("m", "int32") if rows is None else rows
    return _source(ws.schedule(cascades.rmsnorm_gemm(rows, 328 if layout == "nk" else 1024, k, dtype=dtype,
                                                     weight_layout=layout), WarpSpecializedGemmConfig(cluster=cluster)))


@pytest.mark.parametrize("layout, dtype, rows, k, cluster", [
    ("kn", "float16", 2048, 4096, 1), ("nk", "bfloat16", None, 520, 1),
    ("kn", "float16", 2048, 4096, 2), ("nk", "bfloat16", None, 520, 2),
])
@assembled(_schedule_source)
def test_ptxas_honours_setmaxnreg_and_keeps_wgmma_asynchronous(layout, dtype, rows, k, cluster, runs_ahead, request):
    """Through nvcc (no GPU needed): no register spills in any kernel, setmaxnreg
    honoured, the wgmma instructions asynchronous (not serialised, no warpgroup waits
    injected); in clusters of two blocks too."""
    _, report = assembly(runs_ahead, request)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills and all(count == "0" for pair in spills for count in pair), report
    # C7508: setmaxnreg ignored; C7511/C7514/C7519: wgmma serialised, warpgroup arrive/wait injected.
    for remark in ("C7508", "C7511", "C7514", "C7519", "is injected"):
        assert remark not in report, report


@pytest.mark.parametrize("k, shared", [(4096, True), (40000, False)])
def test_gamma_is_read_from_shared_memory_where_it_fits(k, shared):
    """γ goes to shared memory (16-byte pieces, once per block) beside the stages where
    it fits; past that (80 KB of γ beside 192 KB of stages) each pair is read from
    global memory."""
    source = _source(ws.schedule(cascades.rmsnorm_gemm(256, 1024, k, dtype="float16"), WarpSpecializedGemmConfig()))
    assert WarpSpecializedGemmConfig().gamma_in_shared(k) == shared
    assert ("= *(uint4*)(gamma_ptr" in source) == shared
    assert ("= *(half2*)(gamma_ptr" in source) == (not shared)


def test_schedule_for_target_picks_the_kernel():
    func = cascades.rmsnorm_gemm(256, 256, 256, dtype="float16")
    assert ws.lowers(scaled_gemm.schedule_for_target(func, SM90A).mod)
    assert not ws.lowers(scaled_gemm.schedule_for_target(func, {"kind": "cuda", "arch": "sm_80"}).mod)
    absmax = cascades.absmax_quant_gemm(256, 256, 256, dtype="float16")
    assert not ws.lowers(scaled_gemm.schedule_for_target(absmax, SM90A).mod)


@pytest.mark.parametrize("func, error, message", [
    (cascades.absmax_quant_gemm(256, 256, 256, dtype="float16"), FusionError, "ops.rmsnorm_gemm"),
    (cascades.rmsnorm_gemm(256, 256, 256, dtype="float32"), ValueError, "float16 or bfloat16, not float32"),
    (cascades.rmsnorm_gemm(256, 256, 100, dtype="float16"), ValueError, "K = 100"),
])
def test_schedule_refuses(func, error, message):
    with pytest.raises(error, match=message):
        ws.schedule(func)


def test_config_and_target_refusals():
    func = cascades.rmsnorm_gemm(256, 256, 256, dtype="float16")
    with pytest.raises(ValueError, match="320 columns"):
        ws.schedule(func, WarpSpecializedGemmConfig(cols=320))
    with pytest.raises(ValueError, match="bytes of shared memory"):
        ws.schedule(func, WarpSpecializedGemmConfig(stages=6))
    with pytest.raises(ValueError, match="sm_90a"):
        ws.build(ws.schedule(func).mod, {"kind": "cuda", "arch": "sm_80"})


def test_build_refuses_parameters_that_are_not_the_functions():
    """The annotations ask for the kernel of ``ops.rmsnorm_gemm``: a function whose
    parameters are not its X, gamma, W and out is refused, named."""
    func = cascades.absmax_quant_gemm(256, 256, 256, dtype="float16")
    sch = tvm.s_tir.Schedule(func)
    ws.apply_schedule(sch, ws.RmsNormGemm(256, 256, 256, 1e-6, "kn", "float16"), 256, 4, 16)
    with pytest.raises(ValueError, match="'main': its parameters are not ops.rmsnorm_gemm's"):
        ws.build(sch.mod, SM90A)


def test_metaschedule_proposes_the_kernel_and_its_builder_lowers_it():
    """On an H100 target ``cascade_space`` proposes the kernel for an unfused
    ``ops.rmsnorm_gemm`` (the deferral traced, columns, stages and grouping sampled);
    after the target's postprocessors (which bind and decompose the unscheduled blocks)
    the candidate builder's build function makes the kernel of the sampled choices."""
    from tvm.s_tir import meta_schedule as ms

    from tvm_cascade.meta_schedule import BUILD_FUNC, cascade_space

    target = tvm.target.Target("nvidia/nvidia-h100")
    func = cascades.rmsnorm_gemm(256, 512, 1024, dtype="float16")
    context = ms.TuneContext(mod=tvm.IRModule({"main": func}), target=target, space_generator=cascade_space(), task_name="t")
    (sample,) = [s for s in context.generate_design_space() if ws.lowers(s.mod)]
    kinds = [inst.kind.name for inst in sample.trace.insts]
    assert kinds.count("SampleCategorical") >= 3 and "DeferRowScales" in kinds
    for postproc in context.space_generator.postprocs:
        assert postproc.apply(sample), type(postproc).__name__
    config = ws.chosen_config(sample.mod)
    assert (config.cols, config.stages, config.group) in [
        (c, s, g) for c in ws.COLS_CHOICES for s in ws.STAGE_CHOICES for g in ws.GROUP_CHOICES
    ]
    source = tvm.get_global_func(BUILD_FUNC)(sample.mod, target, None).imports[0].inspect_source()
    assert f"m64n{config.cols}k16_f32_f16_f16" in source


@pytest.mark.parametrize("m, n, grid", [(2048, 14336, 132), (16, 14336, 56), (200, 512, 4)])
def test_blocks_are_persistent(m, n, grid):
    """A block per SM (132 without a GPU to ask), or per output tile where there are
    fewer (128 x 256 tiles), each taking output tiles in turn; with a variable row
    count, the grid an expression of it."""
    sms = sm_count(tvm.cuda(0))
    assert launched(ws.kernel(m, n, 4096)) == min(grid, sms)
    rows = tvm.tirx.Var("m", "int32")
    extent = launched(ws.kernel(rows, n, 4096))
    assert int(tvm.sym.Analyzer().simplify(substitute(extent, {rows: tvm.tirx.IntImm("int32", m)}))) == min(grid, sms)



@pytest.mark.parametrize("layout, cols, panels", [("kn", 256, 4), ("kn", 64, 1), ("nk", 256, 1)])
def test_a_cluster_of_two_blocks_shares_each_w_tile(layout, cols, panels):
    """With ``cluster=2`` the blocks go in clusters of two, each taking one row tile of
    a pair over the same columns: each block copies its own X tile and its share of the
    W tile into both blocks (TMA multicast to both: as [K, N] the 64-column panels taken
    in turn, as [N, K] half the rows each), every consumer thread releases a stage in
    both blocks (a remote mbarrier arrival), and the blocks meet at cluster barriers
    after initialisation and before leaving. The annotation carries the cluster size;
    the default (1) is not annotated and builds the kernel without clusters."""
    func = cascades.rmsnorm_gemm(2048, 14336, 4096, dtype="float16", weight_layout=layout)
    sch = ws.schedule(func, WarpSpecializedGemmConfig(cols=cols, cluster=2))
    assert ws.chosen_config(sch.mod).cluster == 2
    assert ws.CLUSTER not in str(ws.schedule(func).mod)
    source = _source(sch)
    producer = source[source.index("setmaxnreg_dec_sync_aligned_u32_40();"):source.index("setmaxnreg_inc_sync_aligned_u32_232();")]
    multicasts = re.findall(r"bytes_multicast__cluster\((.*?)\);\n", producer)
    assert len(multicasts) == panels and all(call.endswith("(ushort)3") for call in multicasts)
    if layout == "nk":  # each block's half of the rows, at its place in the stage
        assert "tvm_builtin_cluster_ctaid_x()) * 8192" in multicasts[0] and "cluster_ctaid_x()) * 128)" in multicasts[0]
    elif panels > 1:  # panel p from block p % 2
        assert producer.count("tvm_builtin_cluster_ctaid_x()) == 0") == producer.count("cluster_ctaid_x()) == 1") == 2
    assert producer.count("bytes(") == 1  # X: the block's own rows, not multicast
    assert "mbarrier.arrive.shared::cluster.b64" in source and "mapa.shared::cluster.u32" in source
    assert source.count("barrier_cluster_arrive_cluster_arrive();") == 2
    assert re.search(r"init_shared_b64\(.*empty_ptr.*\(uint\)512\)", source)
    tiles = 2048 // ws.ROWS // 2 * (14336 // cols)
    assert launched(ws.kernel(2048, 14336, 4096, layout=layout, config=WarpSpecializedGemmConfig(cols=cols, cluster=2))) \
        == 2 * min(tiles, sm_count(tvm.cuda(0)) // 2)
    with pytest.raises(ValueError, match="clusters of 1 or 2 blocks, not 4"):
        ws.schedule(func, WarpSpecializedGemmConfig(cluster=4))
