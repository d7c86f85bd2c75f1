"""Cascade instruction kinds: registration, trace recording and replay dispatch.

The C++ core creates the InstructionKind objects (so they are genuine
``tvm.s_tir.schedule.InstructionKind`` instances that TVM's Trace machinery accepts).
Their ``f_apply_to_schedule`` calls back into the global function
``tvm_cascade.apply_instruction`` registered here, which dispatches by kind name to a
``tvm.s_tir.Schedule`` method.  Adding a kind is one call to :func:`register_kind`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import tvm_ffi
from tvm.s_tir.schedule import Instruction, InstructionKind, Schedule

from .. import _core

APPLY_INSTRUCTION_FUNC = "tvm_cascade.apply_instruction"


@dataclass(frozen=True)
class KindInfo:
    """Python-side description of a cascade instruction kind."""

    name: str
    method: str
    input_names: Tuple[str, ...]
    attr_names: Tuple[str, ...] = ()
    is_pure: bool = False
    single_output: bool = False


_LOCK = threading.Lock()
#: kind name -> description; the single place that maps kinds to Schedule methods.
_KINDS: Dict[str, KindInfo] = {}


def register_kind(
    name: str,
    method: str,
    input_names: Iterable[str],
    attr_names: Iterable[str] = (),
    is_pure: bool = False,
    single_output: bool = False,
) -> InstructionKind:
    """Register a cascade instruction kind that replays as ``sch.<method>(*inputs, *attrs)``.

    Creates the kind in the C++ core (cached: one object per name) and records the
    name -> method mapping used by ``tvm_cascade.apply_instruction``.
    """
    info = KindInfo(
        str(name), str(method), tuple(str(x) for x in input_names),
        tuple(str(x) for x in attr_names), bool(is_pure), bool(single_output),
    )
    with _LOCK:
        kind = _core.register_instruction_kind(
            info.name, info.method, info.input_names, info.attr_names,
            info.is_pure, info.single_output,
        )
        _KINDS[info.name] = info
    return kind


# Built-in kinds (the core pre-registers the same definitions; registering here is
# idempotent and fills the Python dispatch table).
register_kind("RollingUpdate", "rolling_update", ("block", "loop"))
register_kind("SplitKUpdate", "split_k_update", ("block", "loop"))
register_kind("HoistIndependent", "hoist_independent", ("block",))


def kind_info(name: str) -> KindInfo:
    """Python-side description of cascade kind ``name`` (``KeyError`` if unknown)."""
    try:
        return _KINDS[str(name)]
    except KeyError:
        raise KeyError(f"Unknown cascade instruction kind: {name!r}") from None


def cascade_kind_names() -> List[str]:
    """Names of the registered cascade instruction kinds."""
    return sorted(_KINDS)


def is_cascade_kind(name: str) -> bool:
    """Whether ``name`` is a cascade (non-TVM) instruction kind."""
    return str(name) in _KINDS


def get_kind(name: str) -> InstructionKind:
    """The core's (cached) InstructionKind object for cascade kind ``name``."""
    kind_info(name)  # clear error for unknown names
    return _core.get_instruction_kind(str(name))


def lookup_kind(name: str) -> InstructionKind:
    """Resolve an instruction kind by name: cascade kinds first, then TVM's registry."""
    name = str(name)
    if name in _KINDS:
        return _core.get_instruction_kind(name)
    try:
        return InstructionKind.get(name)
    except Exception as err:  # TVM raises AttributeError for unknown kinds
        raise ValueError(f"Unknown instruction kind: {name!r}") from err


def append_instruction(
    sch: Schedule,
    kind_name: str,
    inputs: Sequence[Any],
    attrs: Sequence[Any] = (),
    outputs: Sequence[Any] = (),
    decision: Any = None,
) -> Optional[Instruction]:
    """Record a cascade instruction on ``sch``'s trace (no-op for untraced schedules).

    Schedule primitives call this after they rewrote the IR, exactly like TVM's traced
    primitives record themselves.  Returns the appended Instruction, or None when
    ``sch.trace`` is None.
    """
    trace = sch.trace
    if trace is None:
        return None
    info = kind_info(kind_name)
    if len(inputs) != len(info.input_names):
        raise ValueError(
            f"{info.name} expects {len(info.input_names)} inputs {info.input_names}, "
            f"got {len(inputs)}"
        )
    if len(attrs) != len(info.attr_names):
        raise ValueError(
            f"{info.name} expects {len(info.attr_names)} attrs {info.attr_names}, got {len(attrs)}"
        )
    inst = Instruction(get_kind(info.name), list(inputs), list(attrs), list(outputs))
    trace.append(inst, decision)
    return inst


def _as_output_list(result: Any) -> List[Any]:
    if result is None:
        return []
    if isinstance(result, (list, tuple, tvm_ffi.Array)):
        return list(result)
    return [result]


@tvm_ffi.register_global_func(APPLY_INSTRUCTION_FUNC, override=True)
def apply_instruction(kind_name: str, sch: Schedule, inputs, attrs, decision) -> List[Any]:
    """Replay one cascade instruction: ``sch.<method>(*inputs, *attrs)``.

    Called by the core's ``f_apply_to_schedule`` (i.e. from ``Trace.apply_to_schedule``,
    MetaSchedule replay, and :func:`tvm_cascade.trace.apply_json_to_schedule`).  The method
    records its own instruction on ``sch``'s trace.  Returns the output random variables.
    """
    info = kind_info(str(kind_name))
    method = getattr(sch, info.method, None)
    if method is None:
        raise AttributeError(
            f"Cannot replay {info.name}: tvm.s_tir.Schedule has no method {info.method!r} "
            "(import the tvm_cascade module that defines it)"
        )
    args = list(inputs) + list(attrs)
    if decision is not None:
        result = method(*args, decision=decision)
    else:
        result = method(*args)
    return _as_output_list(result)
