"""A MetaSchedule database, file-compatible with TVM's JSONDatabase, that understands
traces containing cascade instructions.

File format (identical to ``tvm.s_tir.meta_schedule.database.JSONDatabase``):

* workload table: one JSON line per workload, ``[shash_string, base64(json graph of mod)]``
  (``Workload.as_json()``); the line number is the workload index;
* tuning-record table: one JSON line per record,
  ``[workload_index, [trace_json, run_secs, target_config, args_info]]``.

A table may instead be stored xz-compressed beside where it would be
(``database_workload.json.xz``: how the package ships its records), read only.
Files written by TVM's own JSONDatabase load here (and vice versa for native-only
traces).  Traces are replayed with :func:`tvm_cascade.trace.apply_json_to_schedule`, so
records containing ``RollingUpdate`` / ``SplitKUpdate`` load where TVM's loader fails.
``query_tuning_record`` / ``query_schedule`` / ``query_ir_module`` use MetaSchedule's
default implementation on top of this database (best valid record by mean run time,
trace applied with ``Trace.apply_to_schedule``).
"""

from __future__ import annotations

import json
import lzma
import os
import threading
from typing import List, Optional, Tuple

import tvm_ffi
from tvm.ir import IRModule
from tvm.ir.utils import derived_object
from tvm.s_tir.meta_schedule.database import PyDatabase, TuningRecord, Workload

from .json_io import to_plain_json, trace_from_json

#: Stub run time TVM uses for unmeasured candidates (SortTuningRecordByMeanRunSecs).
MAX_MEAN_TIME = 1e10


#: The suffix of a table stored compressed (read-only): a database shipped as package data.
COMPRESSED = ".xz"


def holds_records(directory) -> bool:
    """Whether ``directory`` holds a tuning-record table, plain or compressed."""
    path = os.path.join(str(directory), "database_tuning_record.json")
    return os.path.exists(path) or _compressed(path)


def _compressed(path: str) -> bool:
    """Whether the table at ``path`` is stored compressed beside it (and not plain)."""
    return not os.path.exists(path) and os.path.exists(path + COMPRESSED)


def _read_json_lines(path: str, allow_missing: bool) -> List[object]:
    compressed = _compressed(path)
    if not os.path.exists(path) and not compressed:
        if not allow_missing:
            raise ValueError(f"File doesn't exist: {path}")
        with open(path, "w", encoding="utf-8"):
            pass
        return []
    out = []
    with (lzma.open(path + COMPRESSED, "rt", encoding="utf-8") if compressed else open(path, "r", encoding="utf-8")) as f:
        for line in f:
            line = line.strip()
            if line:
                out.append(json.loads(line))
    return out


def _dumps(obj: object) -> str:
    # Compact, sorted keys, no \\u escapes and no NaN/Infinity: readable by TVM's JSONLoads.
    return json.dumps(obj, separators=(",", ":"), sort_keys=True, ensure_ascii=False,
                      allow_nan=False)


def _mean_run_secs(record: TuningRecord) -> float:
    run_secs = record.run_secs
    if run_secs is None or len(run_secs) == 0:
        return MAX_MEAN_TIME
    values = [float(x.value if hasattr(x, "value") else x) for x in run_secs]
    return sum(values) / len(values)


def _is_valid(record: TuningRecord) -> bool:
    """TVM's TuningRecordNode::IsValid."""
    n_valid = 0
    for inst in record.trace.insts:
        if str(inst.kind.name) == "EnterPostproc":
            break
        n_valid += 1
    if n_valid == 0:
        return False
    if record.run_secs is None:
        return False
    for x in record.run_secs:
        if float(x.value if hasattr(x, "value") else x) != MAX_MEAN_TIME:
            return True
    return False


@derived_object
class JSONDatabase(PyDatabase):
    """JSONDatabase replacement that loads traces containing cascade instructions.

    Parameters
    ----------
    path_workload, path_tuning_record : str, optional
        The two table files (same format as TVM's JSONDatabase).
    work_dir : str, optional
        If given, missing paths default to ``$work_dir/database_workload.json`` and
        ``$work_dir/database_tuning_record.json``.
    allow_missing : bool
        Create missing files instead of raising ``ValueError``.
    module_equality : str
        Only ``"structural"`` is supported.
    """

    def __init__(
        self,
        path_workload: Optional[str] = None,
        path_tuning_record: Optional[str] = None,
        *,
        work_dir: Optional[str] = None,
        allow_missing: bool = True,
        module_equality: str = "structural",
    ) -> None:
        super().__init__()
        if module_equality != "structural":
            raise ValueError(
                f"tvm_cascade.trace.JSONDatabase supports module_equality='structural' only, "
                f"got {module_equality!r}"
            )
        if work_dir is not None:
            if path_workload is None:
                path_workload = os.path.join(work_dir, "database_workload.json")
            if path_tuning_record is None:
                path_tuning_record = os.path.join(work_dir, "database_tuning_record.json")
        if path_workload is None:
            raise ValueError("`path_workload` is not specified.")
        if path_tuning_record is None:
            raise ValueError("`path_tuning_record` is not specified.")
        self.path_workload = str(path_workload)
        self.path_tuning_record = str(path_tuning_record)
        self._lock = threading.RLock()
        self._workloads: List[Workload] = []
        self._by_hash: dict = {}
        # (mean_run_secs, insertion order, record, workload_index), kept sorted.
        self._records: List[Tuple[float, int, TuningRecord, int]] = []
        self._counter = 0

        for i, json_obj in enumerate(_read_json_lines(self.path_workload, allow_missing)):
            try:
                workload = Workload.from_json(json_obj)
            except Exception as err:
                raise ValueError(
                    f"Unable to parse workload on line {i + 1} of {self.path_workload}: {err}"
                ) from err
            self._workloads.append(workload)
            self._by_hash.setdefault(tvm_ffi.structural_hash(workload.mod), []).append(i)

        for i, json_obj in enumerate(_read_json_lines(self.path_tuning_record, allow_missing)):
            try:
                record, index = self._record_from_json(json_obj)
            except Exception as err:
                raise ValueError(
                    f"Unable to parse TuningRecord on line {i + 1} of file "
                    f"{self.path_tuning_record}: {err}"
                ) from err
            self._insert_record(record, index)

    # ---------------------------------------------------------------- helpers
    def _record_from_json(self, json_obj) -> Tuple[TuningRecord, int]:
        if not isinstance(json_obj, list) or len(json_obj) != 2:
            raise ValueError(f"expected [workload_index, record], got {json_obj!r}")
        index, rec = json_obj
        if isinstance(index, bool) or not isinstance(index, int):
            raise ValueError(f"workload index must be an integer, got {index!r}")
        if not 0 <= index < len(self._workloads):
            raise ValueError(f"workload index {index} out of range")
        if not isinstance(rec, list) or len(rec) != 4:
            raise ValueError(f"a tuning record must have 4 fields, got {rec!r}")
        workload = self._workloads[index]
        trace_json, run_secs, target, args_info = rec
        # TVM's own parser handles run_secs / target / args_info; give it an empty trace.
        meta = TuningRecord.from_json([[[], []], run_secs, target, args_info], workload)
        trace = trace_from_json(trace_json, workload.mod)
        record = TuningRecord(
            trace, workload, run_secs=meta.run_secs, target=meta.target,
            args_info=meta.args_info,
        )
        return record, index

    def _insert_record(self, record: TuningRecord, index: int) -> None:
        entry = (_mean_run_secs(record), self._counter, record, index)
        self._counter += 1
        # stable: equal means keep insertion order (like std::multiset::insert)
        lo, hi = 0, len(self._records)
        while lo < hi:
            mid = (lo + hi) // 2
            if self._records[mid][:2] <= entry[:2]:
                lo = mid + 1
            else:
                hi = mid
        self._records.insert(lo, entry)

    def _find_workload(self, mod: IRModule) -> Optional[int]:
        for i in self._by_hash.get(tvm_ffi.structural_hash(mod), ()):
            if tvm_ffi.structural_equal(self._workloads[i].mod, mod):
                return i
        return None

    def _workload_index(self, workload: Workload) -> Optional[int]:
        for i, w in enumerate(self._workloads):
            if w.same_as(workload):
                return i
        return self._find_workload(workload.mod)

    @staticmethod
    def _append_line(path: str, obj: object) -> None:
        if _compressed(path):
            raise ValueError(f"{path + COMPRESSED} is a compressed table, read only: tune into plain JSON files")
        with open(path, "a", encoding="utf-8") as f:
            f.write(_dumps(obj) + "\n")

    # -------------------------------------------------------- PyDatabase API
    def has_workload(self, mod: IRModule) -> bool:
        with self._lock:
            return self._find_workload(mod) is not None

    def commit_workload(self, mod: IRModule) -> Workload:
        with self._lock:
            index = self._find_workload(mod)
            if index is not None:
                return self._workloads[index]
            workload = Workload(mod)
            self._append_line(self.path_workload, to_plain_json(workload.as_json()))
            index = len(self._workloads)
            self._workloads.append(workload)
            self._by_hash.setdefault(tvm_ffi.structural_hash(mod), []).append(index)
            return workload

    def commit_tuning_record(self, record: TuningRecord) -> None:
        with self._lock:
            index = self._workload_index(record.workload)
            if index is None:
                raise ValueError("The workload of the record was not committed to this database")
            json_record = to_plain_json(
                tvm_ffi.get_global_func("s_tir.meta_schedule.TuningRecordAsJSON")(record)
            )
            self._append_line(self.path_tuning_record, [index, json_record])
            self._insert_record(record, index)

    def get_top_k(self, workload: Workload, top_k: int) -> List[TuningRecord]:
        if top_k < 0:
            raise ValueError("top_k must be non-negative")
        if top_k == 0:
            return []
        with self._lock:
            index = self._workload_index(workload)
            if index is None:
                return []
            results = []
            for _, _, record, rec_index in self._records:
                if rec_index != index or not _is_valid(record):
                    continue
                results.append(record)
                if len(results) == top_k:
                    break
            return results

    def get_all_tuning_records(self) -> List[TuningRecord]:
        with self._lock:
            return [entry[2] for entry in self._records]

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)
