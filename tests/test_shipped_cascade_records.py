"""The cascades' tuning records shipped with the package (``tvm_cascade/tuned/cascades``,
MetaSchedule's best candidates on an H200 for the shapes of ``python -m
benchmarks.cascades`` and some of ``benchmarks.scaled_gemm`` and ``benchmarks.fp8_gemm``):
every such shape has one, it replays as a fusion or as the warp-specialised kernel, and
it builds for CUDA."""
import shutil

import pytest
import tvm

from benchmarks.cascades import SHAPES, unfused
from tvm_cascade.primitives.ir import annotated_blocks
from tvm_cascade.kernels import default_records
from tvm_cascade.meta_schedule import build, tuned_database, tuned_schedule

H200 = tvm.target.Target({"kind": "cuda", "arch": "sm_90", "max_threads_per_block": 1024, "max_shared_memory_per_block": 49152, "thread_warp_size": 32})


@pytest.fixture
def shipped(monkeypatch, tmp_path):
    monkeypatch.delenv("TVM_CASCADE_TUNED_CASCADES", raising=False)
    monkeypatch.setenv("TVM_CASCADE_CACHE", str(tmp_path))  # no user's records
    return tuned_database()


def test_every_benchmark_shape_has_a_fused_record(shipped):
    assert shipped is not None and str(default_records("cascades")).endswith("tuned/cascades")
    for name, workload, rows, n, top_k, dtype in SHAPES:
        sch = tuned_schedule(unfused(workload, rows, n, top_k, dtype), H200, shipped)
        assert sch is not None, name
        kinds = {inst.kind.name for inst in sch.trace.insts}
        assert {"SplitKUpdate", "RollingUpdate"} <= kinds, name


#: The GEMM shapes (M, K, N) with records: RMSNorm + GEMM in float16, fp8 quantisation +
#: GEMM with k tiles of 128 (None: one tile of all of K, the two-pass form).
GEMM_SHAPES = [("rmsnorm", 2048, 4096, 14336, None), ("fp8", 16, 4096, 14336, 128), ("fp8", 16, 4096, 14336, None),
               ("fp8", 2048, 4096, 14336, None)]


def _gemm(kind, m, k, n, tile):
    from benchmarks.scaled_gemm import EPS
    from tvm_cascade.ops import cascades

    if kind == "rmsnorm":
        return cascades.rmsnorm_gemm(m, n, k, eps=EPS, dtype="float16")
    return cascades.fp8_quant_gemm(m, n, k, tile=tile or k)


@pytest.mark.parametrize("shape", GEMM_SHAPES, ids=lambda s: "_".join(str(v) for v in s))
def test_gemm_shapes_have_records_of_the_warp_specialised_kernels(shipped, shape):
    from tvm_cascade.schedules import warp_specialized_fp8_gemm as fp8
    from tvm_cascade.schedules import warp_specialized_gemm as ws

    sch = tuned_schedule(_gemm(*shape), H200, shipped)
    assert sch is not None
    if shape[0] == "rmsnorm":
        assert ws.chosen_config(sch.mod) is not None
    else:
        forms = {fp8.chosen(b.annotations)[0] for _, _, b in annotated_blocks(sch.mod, fp8.FORM)}
        assert forms == ({"two_pass"} if shape[-1] is None else {"skinny"})


@pytest.mark.parametrize("shape", [GEMM_SHAPES[0], GEMM_SHAPES[-1]], ids=["rmsnorm", "fp8_two_pass"])
def test_shipped_gemm_records_build_for_cuda(shipped, shape):
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    source = build(tuned_schedule(_gemm(*shape), H200, shipped).mod, H200).imports[0].inspect_source()
    assert "wgmma" in source


def test_a_shape_without_a_record_has_no_schedule(shipped):
    from tvm_cascade.ops import cascades

    assert tuned_schedule(cascades.logsumexp(1000, 32000, "bfloat16"), H200, shipped) is None


@pytest.mark.parametrize("shape", ["log-sum-exp 1024", "moe routing 16384 x 256"])
def test_shipped_records_build_for_cuda(shipped, shape):
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc")
    (found,) = [s for s in SHAPES if s[0].startswith(shape)]
    _, workload, rows, n, top_k, dtype = found
    sch = tuned_schedule(unfused(workload, rows, n, top_k, dtype), H200, shipped)
    source = build(sch.mod, H200).imports[0].inspect_source()
    assert "__global__" in source and "blockIdx.x" in source


def test_a_compressed_database_is_read_only(shipped):
    from tvm_cascade.ops import cascades

    with pytest.raises(ValueError, match="compressed table, read only"):
        shipped.commit_workload(tvm.IRModule({"main": cascades.logsumexp(1000, 32000, "bfloat16")}))


def test_shipped_records_replay_as_the_search_replays_them(shipped):
    """MetaSchedule's search starts from the database's best records (a user tuning on
    from the package's): each record marks where its postprocessing starts (the search
    replays what comes before and mutates it, then post-processes anew), and replayed
    so, with the target's postprocessors, it is the schedule measured."""
    import tvm_ffi
    from tvm.s_tir import meta_schedule as ms

    from tvm_cascade.meta_schedule import cascade_space

    records = shipped.get_all_tuning_records()
    assert len(records) == 55
    postprocs = None
    for record in records:
        mod = record.workload.mod
        assert any(inst.kind.name == "EnterPostproc" for inst in record.trace.insts)
        if postprocs is None:
            postprocs = ms.TuneContext(mod=mod, target=H200, space_generator=cascade_space(),
                                       task_name="main").space_generator.postprocs
        measured, replayed = tvm.s_tir.Schedule(mod), tvm.s_tir.Schedule(mod)
        record.trace.apply_to_schedule(measured, remove_postproc=False)
        record.trace.apply_to_schedule(replayed, remove_postproc=True)
        assert all(postproc.apply(replayed) for postproc in postprocs)
        assert tvm_ffi.structural_equal(replayed.mod, measured.mod)
