"""JSON (de)serialisation of traces that mix TVM-native and cascade instructions.

``Trace.as_json()`` already works for cascade kinds (their attrs need no conversion), but
TVM's loader (``Trace.apply_json_to_schedule`` / ``TuningRecord.from_json``) resolves kind
names in a C++ registry the cascade core cannot extend.  :func:`apply_json_to_schedule`
re-implements TVM's ``Trace::ApplyJSONToSchedule`` step by step:

* kinds are resolved by name, cascade kinds first, then TVM's registry;
* inputs are translated exactly like TVM's ``TranslateInputRVs`` (named random
  variables, ``"None"``, quoted string literals, IndexMap JSON graphs, nested arrays);
* attrs go through the kind's own ``f_attrs_from_json`` functor when it has one (read
  out of the InstructionKind object by the C++ core), otherwise integers are normalised
  the way TVM's ``NormalizeJSONIntegers`` does;
* each instruction is applied through the kind's own ``f_apply_to_schedule`` with its
  decision from the JSON, so native instructions behave exactly as under TVM's loader
  (including recording themselves, with their decisions, on a traced schedule).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List

import tvm
import tvm_ffi
from tvm.s_tir.schedule import Schedule, Trace
from tvm.tirx import FloatImm, IndexMap, IntImm, Var

from .. import _core
from .kinds import lookup_kind

JSONType = Any

_POD = (bool, int, float)


def _is_array(obj: Any) -> bool:
    return isinstance(obj, (list, tuple, tvm_ffi.Array))


def _is_map(obj: Any) -> bool:
    return isinstance(obj, (dict, tvm_ffi.Map))


def normalize_json_integers(value: Any) -> Any:
    """Replace IntImm by int, recursing into arrays only (TVM's NormalizeJSONIntegers)."""
    if isinstance(value, IntImm):
        return int(value.value)
    if _is_array(value):
        return [normalize_json_integers(v) for v in value]
    return value


def _substitute_index_map(index_map: IndexMap, named_rvs: Dict[str, Any]) -> IndexMap:
    """Rebind free variables of an IndexMap's final indices to named random variables.

    Mirrors TVM's ``Substitute(IndexMap, f)`` in ``TranslateInputRVs``: a variable that is
    not one of the map's initial indices and whose name is a defined random variable is
    replaced by that variable; nothing is simplified.
    """
    initial_vars = list(index_map.initial_indices)
    changed = False

    def _rebind(var: Var):
        nonlocal changed
        if any(var.same_as(v) for v in initial_vars):
            return var
        new = named_rvs.get(str(var.name))
        if new is None or not isinstance(new, Var) or new.same_as(var):
            return var
        changed = True
        return new

    new_final = [tvm_ffi.structural_map(e, (Var, _rebind)) for e in index_map.final_indices]
    if not changed:
        return index_map
    return IndexMap(initial_vars, new_final, index_map.inverse_index_map)


def translate_json_inputs(inputs: Any, named_rvs: Dict[str, Any]) -> List[Any]:
    """Turn the JSON form of an instruction's inputs back into values / random variables."""
    results: List[Any] = []
    for item in inputs:
        if item is None or isinstance(item, _POD):
            results.append(item)
        elif isinstance(item, (IntImm, FloatImm)):
            results.append(item)
        elif _is_array(item):
            results.append(translate_json_inputs(item, named_rvs))
        elif _is_map(item):
            results.append(item)
        elif isinstance(item, str):
            name = str(item)
            if not name:
                raise ValueError("Empty string is not allowed in input names")
            if name[0] == "{" and name[-1] == "}":
                obj = tvm.ir.load_json(name)
                if not isinstance(obj, IndexMap):
                    raise TypeError(f"Unexpected object in trace inputs: {type(obj).__name__}")
                results.append(_substitute_index_map(obj, named_rvs))
            elif len(name) >= 2 and name[0] == '"' and name[-1] == '"':
                results.append(name[1:-1])
            elif name in named_rvs:
                results.append(named_rvs[name])
            else:
                raise ValueError(f"The random variable is not defined: {name}")
        else:
            raise TypeError(f"Expect String, but gets: {type(item).__name__}")
    return results


def _split_trace_json(json_obj: JSONType):
    try:
        if not _is_array(json_obj) or len(json_obj) != 2:
            raise ValueError
        insts, decisions = json_obj[0], json_obj[1]
        if not _is_array(insts) or not _is_array(decisions):
            raise ValueError
    except ValueError:
        raise ValueError(
            "The json entry of a trace should contain two arrays, an array of instructions "
            f"and an array of decisions, but gets: {json_obj!r}"
        ) from None
    return list(insts), list(decisions)


def apply_json_to_schedule(json_obj: JSONType, sch: Schedule) -> None:
    """Replay a JSON trace (``Trace.as_json()`` format) onto ``sch``.

    Handles TVM-native and cascade instructions alike and honours the recorded
    decisions.  For native-only traces the result equals
    ``tvm.s_tir.schedule.Trace.apply_json_to_schedule``.
    """
    json_insts, json_decisions = _split_trace_json(json_obj)
    decisions: List[Any] = [None] * len(json_insts)
    for entry in json_decisions:
        if not _is_array(entry) or len(entry) != 2:
            raise ValueError(
                "Each entry of a json decision should be a tuple [index, decision], "
                f"but gets: {entry!r}"
            )
        index = entry[0]
        if isinstance(index, IntImm):
            index = index.value
        if isinstance(index, bool) or not isinstance(index, int):
            raise ValueError(f"Decision index must be an integer, but gets: {entry!r}")
        if not 0 <= index < len(json_insts):
            raise ValueError(f"Decision index {index} out of range ({len(json_insts)} insts)")
        decisions[index] = normalize_json_integers(entry[1])

    named_rvs: Dict[str, Any] = {"None": None}
    for i, entry in enumerate(json_insts):
        if not _is_array(entry) or len(entry) != 4:
            raise ValueError(
                "Each entry of a json instruction should be a tuple [inst_name, inputs, attrs, "
                f"outputs], but gets: {entry!r}"
            )
        name, inputs, attrs, outputs = entry
        kind = lookup_kind(str(name))
        if not _is_array(inputs) or not _is_array(attrs) or not _is_array(outputs):
            raise ValueError(f"Malformed json instruction: {entry!r}")
        inputs = translate_json_inputs(inputs, named_rvs)
        f_from_json = _core.get_instruction_kind_functor(kind, "attrs_from_json")
        if f_from_json is not None:
            attrs = f_from_json(list(attrs))
        else:
            attrs = [normalize_json_integers(a) for a in attrs]
        f_apply = _core.get_instruction_kind_functor(kind, "apply_to_schedule")
        if f_apply is None:
            raise ValueError(f"Instruction kind {name!r} cannot be applied to a schedule")
        new_outputs = list(f_apply(sch, inputs, attrs, decisions[i]))
        if len(new_outputs) != len(outputs):
            raise ValueError(
                f"Instruction {name!r} produced {len(new_outputs)} outputs, "
                f"but the trace records {len(outputs)}"
            )
        for old, new in zip(outputs, new_outputs):
            named_rvs[str(old)] = new


def load_trace_json(json_obj: JSONType) -> Callable[[Schedule], None]:
    """A function ``apply(sch)`` that replays ``json_obj`` onto a schedule."""
    _split_trace_json(json_obj)  # validate eagerly

    def apply(sch: Schedule) -> None:
        apply_json_to_schedule(json_obj, sch)

    return apply


def trace_from_json(json_obj: JSONType, mod) -> Trace:
    """Replay ``json_obj`` on a fresh traced schedule of ``mod`` and return its trace."""
    sch = Schedule(mod, seed=None, debug_mask=0, error_render_level="none")
    apply_json_to_schedule(json_obj, sch)
    trace = sch.trace
    assert trace is not None
    return trace


def to_plain_json(obj: Any) -> Any:
    """Convert TVM JSON-ish values (Array/Map/IntImm/FloatImm/IndexMap) to plain Python.

    The result can be passed to ``json.dumps``; IndexMap becomes its JSON graph string,
    exactly what TVM's MetaSchedule JSON writer stores.
    """
    if obj is None or isinstance(obj, (bool, str)):
        return obj if not isinstance(obj, str) else str(obj)
    if isinstance(obj, (int, float)):
        return obj
    if isinstance(obj, IntImm):
        dtype = getattr(obj, "dtype", None) or getattr(obj, "ty", None)
        if str(dtype) == "bool":
            return bool(obj.value)
        return int(obj.value)
    if isinstance(obj, FloatImm):
        return float(obj.value)
    if _is_array(obj):
        return [to_plain_json(x) for x in obj]
    if _is_map(obj):
        return {str(k): to_plain_json(v) for k, v in obj.items()}
    if isinstance(obj, IndexMap):
        return tvm.ir.save_json(obj)
    raise TypeError(f"Not supported type in trace JSON: {type(obj).__name__}")


def trace_to_json(trace: Trace, remove_postproc: bool = False) -> JSONType:
    """``trace`` as plain, ``json.dumps``-able Python objects."""
    return to_plain_json(tvm_ffi.get_global_func("s_tir.schedule.TraceAsJSON")(
        trace, remove_postproc))
