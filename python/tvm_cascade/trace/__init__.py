"""Trace support for tvm-cascade schedule primitives.

* :func:`get_kind` / :func:`register_kind` -- cascade InstructionKind objects (created by
  the C++ core, accepted by TVM's Trace/Instruction machinery).
* :func:`append_instruction` -- primitives record themselves on ``sch.trace``.
* ``tvm_cascade.apply_instruction`` -- global function the kinds call on replay; it
  dispatches ``RollingUpdate`` -> ``sch.rolling_update``, ``SplitKUpdate`` ->
  ``sch.split_k_update``.
* :func:`apply_json_to_schedule` / :func:`load_trace_json` / :func:`trace_from_json` /
  :func:`trace_to_json` -- JSON traces mixing native and cascade instructions.
* :class:`JSONDatabase` -- MetaSchedule database in TVM's JSONDatabase file format.
* :func:`sample_uniform` -- the design spaces' categorical decisions.
"""

from .kinds import (
    APPLY_INSTRUCTION_FUNC,
    KindInfo,
    append_instruction,
    apply_instruction,
    cascade_kind_names,
    get_kind,
    is_cascade_kind,
    kind_info,
    lookup_kind,
    register_kind,
)
from .json_io import (
    apply_json_to_schedule,
    load_trace_json,
    normalize_json_integers,
    to_plain_json,
    trace_from_json,
    trace_to_json,
    translate_json_inputs,
)
from .database import JSONDatabase
from .sampling import sample_uniform

__all__ = [
    "APPLY_INSTRUCTION_FUNC",
    "JSONDatabase",
    "KindInfo",
    "append_instruction",
    "apply_instruction",
    "apply_json_to_schedule",
    "cascade_kind_names",
    "get_kind",
    "is_cascade_kind",
    "kind_info",
    "load_trace_json",
    "lookup_kind",
    "normalize_json_integers",
    "register_kind",
    "sample_uniform",
    "to_plain_json",
    "trace_from_json",
    "trace_to_json",
    "translate_json_inputs",
]
