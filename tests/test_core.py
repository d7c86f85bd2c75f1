"""Tests of the C++ core: InstructionKind objects created and read through tvm-ffi only."""

import pytest
import tvm
import tvm_ffi
from tvm.s_tir.schedule import Instruction, InstructionKind

from tvm_cascade import _core

# Native kinds with their expected purity (from TVM's instruction traits).  The core reads
# them through its mirrored layout; the test fails loudly if TVM's layout differs.
NATIVE_KINDS = {
    "Split": False,
    "Fuse": False,
    "Reorder": False,
    "GetSBlock": True,
    "GetLoops": True,
    "SamplePerfectTile": True,
    "SampleCategorical": True,
    "ComputeAt": False,
    "CacheRead": False,
    "Annotate": False,
    "Parallel": False,
    "Bind": False,
    "DecomposeReduction": False,
    "EnterPostproc": False,
}


def test_library_loaded_and_functions_registered():
    assert _core.LIB_PATH.is_file()
    assert _core.LIB_PATH.name == "libtvm_cascade_core.so"
    for name in (
        "InstructionKindTypeIndex", "RegisterInstructionKind", "GetInstructionKind",
        "HasInstructionKind", "ListInstructionKinds", "InspectInstructionKind",
        "GetInstructionKindFunctor",
    ):
        assert tvm_ffi.get_global_func("tvm_cascade.core." + name, allow_missing=True) is not None


def test_type_index_is_tvms():
    split = InstructionKind.get("Split")
    info = _core.inspect_instruction_kind(split)
    assert info["type_key"] == "s_tir.InstructionKind"
    assert info["type_index"] == _core.instruction_kind_type_index()
    assert _core.instruction_kind_type_index() == split.__tvm_ffi_type_info__.type_index


@pytest.mark.parametrize("name,is_pure", sorted(NATIVE_KINDS.items()))
def test_read_back_native_kinds(name, is_pure):
    kind = InstructionKind.get(name)
    info = _core.inspect_instruction_kind(kind)
    # Fields read through the mirror agree with TVM's own reflection ...
    assert info["name"] == name == str(kind.name)
    assert info["is_pure"] is bool(kind._is_pure)
    # ... and with the known traits.
    assert info["is_pure"] is is_pure
    assert info["has_apply_to_schedule"] is True
    assert info["has_as_python"] is True


def test_native_functors_are_real_functions():
    """Call TVM's own f_as_python through the mirrored layout."""
    get_sblock = InstructionKind.get("GetSBlock")
    f_as_python = _core.get_instruction_kind_functor(get_sblock, "as_python")
    assert isinstance(f_as_python, tvm_ffi.Function)
    text = f_as_python([], ['"C"', '"main"'], None, ["b0"])
    assert text == 'b0 = sch.get_sblock(name="C", func_name="main")'

    split = InstructionKind.get("Split")
    text = _core.get_instruction_kind_functor(split, "as_python")(
        ["l1", "None", 8], [True, False], None, ["l2", "l3"]
    )
    assert text.startswith("l2, l3 = sch.split(loop=l1, factors=[None, 8]")
    assert _core.get_instruction_kind_functor(split, "apply_to_schedule") is not None


def test_native_attrs_json_functors_readable():
    # Whatever TVM set, the reported flags and the extracted functors must agree.
    for name in NATIVE_KINDS:
        kind = InstructionKind.get(name)
        info = _core.inspect_instruction_kind(kind)
        for which in _core.FUNCTOR_NAMES:
            f = _core.get_instruction_kind_functor(kind, which)
            assert (f is not None) is info["has_" + which], (name, which)


@pytest.mark.parametrize("name,method", [("RollingUpdate", "rolling_update"),
                                         ("SplitKUpdate", "split_k_update")])
def test_cascade_kinds(name, method):
    assert _core.has_instruction_kind(name)
    assert name in _core.list_instruction_kinds()
    kind = _core.get_instruction_kind(name)
    assert isinstance(kind, InstructionKind)
    assert str(kind.name) == name
    assert kind.is_pure is False
    # cached: one object per name
    assert kind.same_as(_core.get_instruction_kind(name))
    info = _core.inspect_instruction_kind(kind)
    assert info == {
        "type_key": "s_tir.InstructionKind",
        "type_index": _core.instruction_kind_type_index(),
        "name": name,
        "is_pure": False,
        "has_apply_to_schedule": True,
        "has_as_python": True,
        "has_attrs_as_json": False,
        "has_attrs_from_json": False,
    }
    f = _core.get_instruction_kind_functor(kind, "as_python")
    assert f(["b1", "l3"], [], None, []) == f"sch.{method}(block=b1, loop=l3)"
    with pytest.raises(ValueError):
        f(["b1"], [], None, [])
    # TVM's Instruction constructor accepts the kind.
    inst = Instruction(kind, [], [], [])
    assert inst.kind.same_as(kind)


def test_generic_kind_creator():
    kind = _core.register_instruction_kind(
        "CascadeCoreTestKind", "cascade_core_test", ["block"], ["factor", "tag"],
        is_pure=True, single_output=True,
    )
    assert str(kind.name) == "CascadeCoreTestKind"
    assert kind.is_pure is True
    assert _core.inspect_instruction_kind(kind)["is_pure"] is True
    f = _core.get_instruction_kind_functor(kind, "as_python")
    assert (f(["b0"], [4, '"x"'], None, ["b1"])
            == 'b1 = sch.cascade_core_test(block=b0, factor=4, tag="x")')
    assert (f(["b0"], [2.5, True], [1, 2], ["b1"])
            == "b1 = sch.cascade_core_test(block=b0, factor=2.5, tag=True, decision=[1, 2])")
    # same definition -> the cached object; different definition -> error
    again = _core.register_instruction_kind(
        "CascadeCoreTestKind", "cascade_core_test", ["block"], ["factor", "tag"],
        is_pure=True, single_output=True,
    )
    assert again.same_as(kind)
    with pytest.raises(ValueError, match="different definition"):
        _core.register_instruction_kind("CascadeCoreTestKind", "other", ["block"])


def test_errors():
    with pytest.raises(KeyError):
        _core.get_instruction_kind("NoSuchCascadeKind")
    assert not _core.has_instruction_kind("NoSuchCascadeKind")
    with pytest.raises(TypeError):
        _core.inspect_instruction_kind(tvm.tirx.IntImm("int32", 1))
    with pytest.raises(ValueError):
        _core.get_instruction_kind_functor(InstructionKind.get("Split"), "bogus")
    with pytest.raises(ValueError):
        _core.register_instruction_kind("", "m", [])


def test_schedule_state_mirror_matches_tvm_layout():
    """The core reads ScheduleState fields behind two std::unordered_maps: debug_mask and
    enable_check must come out as TVM's reflection reports them."""
    from tvm_cascade import _core, ops

    for debug_mask in ("all", 0):
        sch = tvm.s_tir.Schedule(ops.logsumexp(4, 8), debug_mask=debug_mask)
        seen = _core.inspect_schedule_state(sch.state)
        assert seen["debug_mask"] == sch.state.debug_mask
        assert seen["enable_check"] == bool(sch.state.enable_check)
        assert seen["blocks"] == 5  # root, max, exp, sum, out
        assert seen["srefs"] > seen["blocks"]


def test_refresh_sblock_flags_matches_a_fresh_state():
    from tvm_cascade import _core, ops

    get_flags = tvm_ffi.get_global_func("s_tir.schedule.ScheduleStateGetCachedFlags")
    sch = tvm.s_tir.Schedule(ops.logsumexp(4, 8))
    j0, _ = sch.split(sch.get_loops(sch.get_sblock("max"))[-1], [2, None])
    sch.split_k_update(sch.get_sblock("max"), j0)
    fresh = tvm.s_tir.Schedule(sch.mod)
    for name in ("max_partial", "max", "exp", "sum", "out"):
        ours = [bool(x) for x in get_flags(sch.state, sch.get_sref(sch.get_sblock(name)))]
        truth = [bool(x) for x in get_flags(fresh.state, fresh.get_sref(fresh.get_sblock(name)))]
        assert ours == truth, name
    assert _core.refresh_sblock_flags(sch.state) == 6
