"""Trace recording, replay, JSON loading and the MetaSchedule database for cascade kinds."""

import json
import re

import pytest
import tvm
import tvm_ffi
from tvm.s_tir import Schedule
from tvm.s_tir import meta_schedule as ms
from tvm.s_tir.schedule import Trace
from tvm.s_tir.stmt import SBlock
from tvm.script import tirx as T

from tvm_cascade import trace as ctrace

TAG = "cascade_test_update"


@T.prim_func(s_tir=True)
def matmul(a: T.handle, b: T.handle, c: T.handle) -> None:
    A = T.match_buffer(a, (64, 64), "float32")
    B = T.match_buffer(b, (64, 64), "float32")
    C = T.match_buffer(c, (64, 64), "float32")
    for i, j, k in T.grid(64, 64, 64):
        with T.sblock("C"):
            vi, vj, vk = T.axis.remap("SSR", [i, j, k])
            with T.init():
                C[vi, vj] = T.float32(0)
            C[vi, vj] = C[vi, vj] + A[vi, vk] * B[vk, vj]


def _mod():
    return tvm.IRModule({"main": matmul})


def _tagging_primitive(kind_name):
    """A tiny test-only primitive: really rewrites the block, then records itself."""

    def primitive(self, block, loop):
        block_sref = self.get_sref(block)
        old = block_sref.stmt
        loop_stmt = self.get(loop)
        annotations = dict(old.annotations)
        previous = annotations.get(TAG)
        entry = f"{kind_name}:{loop_stmt.loop_var.name}:{int(loop_stmt.extent)}"
        annotations[TAG] = entry if previous is None else f"{previous}|{entry}"
        new = SBlock(old.iter_vars, old.reads, old.writes, old.name_hint, old.body, old.init,
                     old.alloc_buffers, old.match_buffers, annotations)
        self.state.replace(block_sref, new, {old: new})
        ctrace.append_instruction(self, kind_name, [block, loop])

    return primitive


@pytest.fixture
def cascade_primitives():
    saved = {name: Schedule.__dict__.get(name) for name in ("rolling_update", "split_k_update")}
    Schedule.rolling_update = _tagging_primitive("RollingUpdate")
    Schedule.split_k_update = _tagging_primitive("SplitKUpdate")
    yield
    for name, value in saved.items():
        if value is None:
            delattr(Schedule, name)
        else:
            setattr(Schedule, name, value)


def _native_schedule(sch):
    """A trace exercising many native instructions (with a sampling decision)."""
    b0 = sch.get_sblock("C")
    i, j, k = sch.get_loops(b0)
    i_tiles = sch.sample_perfect_tile(i, n=2, max_innermost_factor=16)
    i0, i1 = sch.split(i, i_tiles)
    j0, j1 = sch.split(j, [None, 8])
    sch.reorder(i0, j0, i1, j1)
    sch.parallel(i0)
    sch.annotate(b0, "pragma_test", 1)
    cb = sch.cache_read(b0, 1, "global")
    sch.compute_at(cb, j0)
    sch.decompose_reduction(b0, i1)
    return b0, (i0, j0, i1, j1, k)


def _mixed_schedule(sch):
    b0, (i0, j0, i1, j1, k) = _native_schedule(sch)
    sch.rolling_update(b0, k)
    sch.split_k_update(b0, j1)
    # native instructions that use RVs defined before the cascade instructions
    sch.unroll(j1)
    sch.annotate(k, "pragma_after_cascade", 2)
    return b0


def _roundtrip_json(obj):
    return json.loads(json.dumps(ctrace.to_plain_json(obj)))


# --------------------------------------------------------------------------- kinds / dispatch
def test_get_kind_and_registry():
    kind = ctrace.get_kind("RollingUpdate")
    assert str(kind.name) == "RollingUpdate"
    assert ctrace.lookup_kind("RollingUpdate").same_as(kind)
    assert str(ctrace.lookup_kind("Split").name) == "Split"
    assert ctrace.kind_info("SplitKUpdate").method == "split_k_update"
    with pytest.raises(KeyError):
        ctrace.get_kind("Split")  # native kinds are not cascade kinds
    with pytest.raises(ValueError):
        ctrace.lookup_kind("NoSuchKindAnywhere")
    assert tvm.get_global_func(ctrace.APPLY_INSTRUCTION_FUNC) is not None


def test_append_instruction_untraced_is_noop():
    class Untraced:
        trace = None

    assert ctrace.append_instruction(Untraced(), "RollingUpdate", [None, None]) is None


def test_append_instruction_validates_arity(cascade_primitives):
    sch = Schedule(_mod())
    b0 = sch.get_sblock("C")
    with pytest.raises(ValueError):
        ctrace.append_instruction(sch, "RollingUpdate", [b0])


def test_missing_method_reports_clearly(monkeypatch):
    monkeypatch.delattr(Schedule, "split_k_update", raising=False)
    sch = Schedule(_mod())
    with pytest.raises(Exception, match="split_k_update"):
        ctrace.apply_instruction("SplitKUpdate", sch, [], [], None)


# --------------------------------------------------------------------------- printing / replay
def test_trace_prints_cascade_instruction(cascade_primitives):
    sch = Schedule(_mod())
    b0 = sch.get_sblock("C")
    _, _, k = sch.get_loops(b0)
    sch.rolling_update(b0, k)
    text = str(sch.trace)
    assert "sch.rolling_update(block=b0, loop=l3)" in text
    lines = sch.trace.as_python()
    assert lines[-1] == "sch.rolling_update(block=b0, loop=l3)"
    assert str(sch.get(b0).annotations[TAG]) == "RollingUpdate:k:64"
    assert not tvm_ffi.structural_equal(sch.mod, _mod())


def test_apply_to_schedule_replays_cascade(cascade_primitives):
    sch = Schedule(_mod())
    _mixed_schedule(sch)
    assert any(re.search(r"sch\.split_k_update\(block=b\d+, loop=l\d+\)", x)
               for x in sch.trace.as_python())
    fresh = Schedule(_mod())
    sch.trace.apply_to_schedule(fresh, remove_postproc=False)
    tvm.ir.assert_structural_equal(fresh.mod, sch.mod)
    # replay recorded the cascade instructions again (through tvm_cascade.apply_instruction)
    assert list(fresh.trace.as_python()) == list(sch.trace.as_python())
    kinds = [str(inst.kind.name) for inst in fresh.trace.insts]
    assert kinds.count("RollingUpdate") == 1 and kinds.count("SplitKUpdate") == 1


# --------------------------------------------------------------------------- JSON
def test_json_loader_matches_native_on_native_traces():
    sch = Schedule(_mod(), seed=7)
    _native_schedule(sch)
    json_obj = _roundtrip_json(sch.trace.as_json())

    native = Schedule(_mod())
    Trace.apply_json_to_schedule(json_obj, native)
    ours = Schedule(_mod())
    ctrace.apply_json_to_schedule(json_obj, ours)
    tvm.ir.assert_structural_equal(ours.mod, native.mod)
    tvm.ir.assert_structural_equal(ours.mod, sch.mod)
    assert list(ours.trace.as_python()) == list(native.trace.as_python())
    assert ctrace.trace_to_json(ours.trace) == ctrace.trace_to_json(native.trace)


def test_json_loader_matches_native_with_bind():
    sch = Schedule(_mod())
    b0 = sch.get_sblock("C")
    i, j, _ = sch.get_loops(b0)
    fused = sch.fuse(i, j)
    bx, tx = sch.split(fused, [None, 128])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    sch.unroll(sch.get_loops(b0)[-1])
    json_obj = _roundtrip_json(sch.trace.as_json())
    native = Schedule(_mod())
    Trace.apply_json_to_schedule(json_obj, native)
    ours = Schedule(_mod())
    ctrace.apply_json_to_schedule(json_obj, ours)
    tvm.ir.assert_structural_equal(ours.mod, native.mod)


def test_json_decisions_are_honoured():
    sch = Schedule(_mod(), seed=3)
    _native_schedule(sch)
    json_obj = _roundtrip_json(sch.trace.as_json())
    insts, decisions = json_obj
    idx = [n for n, inst in enumerate(insts) if inst[0] == "SamplePerfectTile"][0]
    for entry in decisions:
        if entry[0] == idx:
            entry[1] = [4, 16] if entry[1] != [4, 16] else [8, 8]
            wanted = entry[1]
    ours = Schedule(_mod())
    ctrace.apply_json_to_schedule(json_obj, ours)
    native = Schedule(_mod())
    Trace.apply_json_to_schedule(json_obj, native)
    tvm.ir.assert_structural_equal(ours.mod, native.mod)
    b0 = ours.get_sblock("C_update")
    extents = [int(ours.get(loop).extent) for loop in ours.get_loops(b0)]
    assert extents[0] == wanted[0] and extents[2] == wanted[1]
    assert [int(x) for x in ours.trace.get_decision(ours.trace.insts[idx])] == wanted


def test_json_roundtrip_with_cascade_instructions(cascade_primitives):
    sch = Schedule(_mod(), seed=11)
    _mixed_schedule(sch)
    json_obj = _roundtrip_json(sch.trace.as_json())
    assert [i[0] for i in json_obj[0]].count("RollingUpdate") == 1

    # TVM's own loader cannot resolve cascade kinds ...
    with pytest.raises(Exception, match="RollingUpdate"):
        Trace.apply_json_to_schedule(json_obj, Schedule(_mod()))
    # ... ours can, and gives the same module and trace.
    ours = Schedule(_mod())
    ctrace.apply_json_to_schedule(json_obj, ours)
    tvm.ir.assert_structural_equal(ours.mod, sch.mod)
    assert list(ours.trace.as_python()) == list(sch.trace.as_python())

    apply = ctrace.load_trace_json(json_obj)
    again = Schedule(_mod())
    apply(again)
    tvm.ir.assert_structural_equal(again.mod, sch.mod)
    tvm.ir.assert_structural_equal(ctrace.trace_from_json(json_obj, _mod()).as_json(),
                                   sch.trace.as_json())


def test_json_loader_rejects_malformed():
    with pytest.raises(ValueError):
        ctrace.apply_json_to_schedule([[]], Schedule(_mod()))
    with pytest.raises(ValueError, match="not defined"):
        ctrace.apply_json_to_schedule(
            [[["GetLoops", ["b9"], [], ["l0"]]], []], Schedule(_mod()))
    with pytest.raises(ValueError, match="Unknown instruction kind"):
        ctrace.apply_json_to_schedule([[["Bogus", [], [], []]], []], Schedule(_mod()))


# --------------------------------------------------------------------------- database
def _record(sch, workload, secs):
    return ms.database.TuningRecord(
        sch.trace, workload, run_secs=[secs], target=tvm.target.Target("llvm"),
        args_info=ms.arg_info.ArgInfo.from_prim_func(matmul),
    )


def test_database_roundtrip_with_cascade_records(tmp_path, cascade_primitives):
    path_w = str(tmp_path / "workload.json")
    path_r = str(tmp_path / "records.json")
    mod = _mod()
    db = ctrace.JSONDatabase(path_w, path_r)
    workload = db.commit_workload(mod)
    assert db.has_workload(mod)
    assert db.commit_workload(mod).same_as(workload)

    best = Schedule(mod, seed=5)
    _mixed_schedule(best)
    slow = Schedule(mod, seed=5)
    _native_schedule(slow)
    db.commit_tuning_record(_record(slow, workload, 2.0))
    db.commit_tuning_record(_record(best, workload, 1.0))
    assert len(db) == 2

    # TVM's JSONDatabase cannot read the cascade record ...
    with pytest.raises(Exception):
        ms.database.JSONDatabase(path_w, path_r)

    # ... ours reloads both and answers queries with the best record.
    reloaded = ctrace.JSONDatabase(path_w, path_r, allow_missing=False)
    assert len(reloaded) == 2
    target = tvm.target.Target("llvm")
    top = reloaded.get_top_k(reloaded.commit_workload(mod), 2)
    assert [float(r.run_secs[0]) for r in top] == [1.0, 2.0]
    record = reloaded.query_tuning_record(mod, target, "main")
    assert "RollingUpdate" in [str(i.kind.name) for i in record.trace.insts]
    queried = reloaded.query_ir_module(mod, target, "main")
    tvm.ir.assert_structural_equal(queried, best.mod)
    sch = reloaded.query_schedule(mod, target, "main")
    tvm.ir.assert_structural_equal(sch.mod, best.mod)
    assert list(sch.trace.as_python()) == list(best.trace.as_python())
    with open(path_r) as f:
        assert len([line for line in f if line.strip()]) == 2


def test_database_file_compatible_with_tvm(tmp_path):
    mod = _mod()
    sch = Schedule(mod, seed=9)
    _native_schedule(sch)

    # written by TVM's JSONDatabase -> read by ours
    tvm_db = ms.database.JSONDatabase(str(tmp_path / "w1.json"), str(tmp_path / "r1.json"))
    tvm_db.commit_tuning_record(_record(sch, tvm_db.commit_workload(mod), 0.5))
    ours = ctrace.JSONDatabase(str(tmp_path / "w1.json"), str(tmp_path / "r1.json"))
    assert len(ours) == 1
    tvm.ir.assert_structural_equal(
        ours.query_ir_module(mod, tvm.target.Target("llvm"), "main"), sch.mod)
    rec = ours.get_all_tuning_records()[0]
    assert [float(x) for x in rec.run_secs] == [0.5]
    assert str(rec.target.kind.name) == "llvm"
    assert len(rec.args_info) == 3

    # written by ours -> read by TVM's JSONDatabase
    ours2 = ctrace.JSONDatabase(str(tmp_path / "w2.json"), str(tmp_path / "r2.json"))
    ours2.commit_tuning_record(_record(sch, ours2.commit_workload(mod), 0.25))
    tvm_db2 = ms.database.JSONDatabase(str(tmp_path / "w2.json"), str(tmp_path / "r2.json"))
    assert len(tvm_db2) == 1
    tvm.ir.assert_structural_equal(
        tvm_db2.query_ir_module(mod, tvm.target.Target("llvm"), "main"), sch.mod)


def test_database_missing_files(tmp_path):
    with pytest.raises(ValueError):
        ctrace.JSONDatabase(str(tmp_path / "nope_w.json"), str(tmp_path / "nope_r.json"),
                            allow_missing=False)
    db = ctrace.JSONDatabase(work_dir=str(tmp_path))
    assert len(db) == 0
    assert (tmp_path / "database_workload.json").exists()
    assert db.query_ir_module(_mod(), tvm.target.Target("llvm"), "main") is None


def test_json_loader_matches_native_with_index_map():
    sch = Schedule(_mod())
    b0 = sch.get_sblock("C")
    sch.cache_write(b0, 0, "global")
    sch.transform_layout(b0, ("write", 0), lambda i, j: (j // 8, i, j % 8))
    json_obj = _roundtrip_json(sch.trace.as_json())
    assert any(isinstance(x, str) and x.startswith("{")
               for inst in json_obj[0] for x in inst[1])
    native = Schedule(_mod())
    Trace.apply_json_to_schedule(json_obj, native)
    ours = Schedule(_mod())
    ctrace.apply_json_to_schedule(json_obj, ours)
    tvm.ir.assert_structural_equal(ours.mod, native.mod)
    tvm.ir.assert_structural_equal(ours.mod, sch.mod)
