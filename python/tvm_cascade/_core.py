"""Loader and thin Python bindings for tvm-cascade's C++ core (``libtvm_cascade_core.so``).

Importing this module imports TVM (so TVM's object types, in particular
``s_tir.InstructionKind``, are registered), then loads the core library with
``RTLD_GLOBAL`` so its static initialisers register the ``tvm_cascade.core.*``
global functions.

The library is looked up, in order, at:

1. ``$TVM_CASCADE_CORE_LIB`` (a file path), if set;
2. ``tvm_cascade/lib/libtvm_cascade_core.so`` inside the installed package
   (``pip install .`` / ``pip install -e .`` put it there);
3. ``<source checkout>/build/lib/libtvm_cascade_core.so`` (a standalone
   ``cmake -S . -B build && cmake --build build``).

This module deliberately imports nothing else from ``tvm_cascade`` so that it can be
imported on its own (``python -c "import tvm_cascade._core"``).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

import tvm  # noqa: F401  (registers TVM's object types before the core is used)
import tvm.s_tir  # noqa: F401
import tvm_ffi

LIB_NAME = "libtvm_cascade_core.so"
_PKG_DIR = Path(__file__).resolve().parent


class CoreLibraryNotFoundError(ImportError):
    """Raised when the compiled C++ core cannot be found or loaded."""


def _candidate_paths() -> List[Path]:
    paths: List[Path] = []
    env = os.environ.get("TVM_CASCADE_CORE_LIB")
    if env:
        paths.append(Path(env))
    paths.append(_PKG_DIR / "lib" / LIB_NAME)
    # source checkout: <root>/python/tvm_cascade/_core.py -> <root>/build/lib
    paths.append(_PKG_DIR.parent.parent / "build" / "lib" / LIB_NAME)
    return paths


def _load_library() -> tuple:
    tried = _candidate_paths()
    for path in tried:
        if path.is_file():
            try:
                lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            except OSError as err:
                raise CoreLibraryNotFoundError(
                    f"Found tvm-cascade's core library at {path} but could not load it: {err}"
                ) from err
            return lib, path
    listing = "\n  ".join(str(p) for p in tried)
    raise CoreLibraryNotFoundError(
        "tvm-cascade's C++ core library (" + LIB_NAME + ") was not found. Tried:\n  "
        + listing
        + "\nBuild it with `pip install -e .` (or `pip install .`), or with "
        "`cmake -S . -B build && cmake --build build`, or point TVM_CASCADE_CORE_LIB at it."
    )


_LIB, LIB_PATH = _load_library()


def _get(name: str):
    func = tvm_ffi.get_global_func(name, allow_missing=True)
    if func is None:
        raise CoreLibraryNotFoundError(
            f"{LIB_PATH} was loaded but did not register the global function {name!r}; "
            "the library is stale or corrupt, rebuild it."
        )
    return func


_f_type_index = _get("tvm_cascade.core.InstructionKindTypeIndex")
_f_register = _get("tvm_cascade.core.RegisterInstructionKind")
_f_get = _get("tvm_cascade.core.GetInstructionKind")
_f_has = _get("tvm_cascade.core.HasInstructionKind")
_f_list = _get("tvm_cascade.core.ListInstructionKinds")
_f_inspect = _get("tvm_cascade.core.InspectInstructionKind")
_f_functor = _get("tvm_cascade.core.GetInstructionKindFunctor")
_f_refresh_flags = _get("tvm_cascade.core.RefreshSBlockFlags")
_f_inspect_state = _get("tvm_cascade.core.InspectScheduleState")

#: Names of the four functor slots of an InstructionKind, in layout order.
FUNCTOR_NAMES = ("apply_to_schedule", "as_python", "attrs_as_json", "attrs_from_json")


def instruction_kind_type_index() -> int:
    """Runtime type index of ``s_tir.InstructionKind`` (as registered by TVM)."""
    return int(_f_type_index())


def register_instruction_kind(
    name: str,
    method: str,
    input_names: Iterable[str],
    attr_names: Iterable[str] = (),
    is_pure: bool = False,
    single_output: bool = False,
):
    """Create (once) and return the cascade InstructionKind ``name``.

    ``method`` is the ``tvm.s_tir.Schedule`` method the kind prints as (and that
    ``tvm_cascade.apply_instruction`` dispatches to); ``input_names``/``attr_names`` are the
    keyword names printed for the instruction's inputs/attrs.  Registering the same name
    again with an identical definition returns the cached object; a different definition
    raises ``ValueError``.
    """
    return _f_register(
        str(name), str(method), [str(x) for x in input_names], [str(x) for x in attr_names],
        bool(is_pure), bool(single_output),
    )


def get_instruction_kind(name: str):
    """The cached cascade InstructionKind ``name`` (``KeyError`` if unknown)."""
    return _f_get(str(name))


def has_instruction_kind(name: str) -> bool:
    """Whether ``name`` is a cascade instruction kind known to the core."""
    return bool(_f_has(str(name)))


def list_instruction_kinds() -> List[str]:
    """Names of all cascade instruction kinds known to the core."""
    return [str(x) for x in _f_list()]


def inspect_instruction_kind(kind) -> Dict[str, Any]:
    """Read ANY InstructionKind (TVM's own or ours) through the core's mirrored layout.

    Returns a dict with ``type_key``, ``type_index``, ``name``, ``is_pure`` and
    ``has_apply_to_schedule``/``has_as_python``/``has_attrs_as_json``/``has_attrs_from_json``.
    """
    info = _f_inspect(kind)
    out: Dict[str, Any] = {}
    for key, value in info.items():
        key = str(key)
        if key in ("type_key", "name"):
            out[key] = str(value)
        elif key == "type_index":
            out[key] = int(value)
        else:
            out[key] = bool(value)
    return out


def get_instruction_kind_functor(kind, which: str) -> Optional[tvm_ffi.Function]:
    """One of the four functors of an InstructionKind (``None`` when null).

    ``which`` is one of :data:`FUNCTOR_NAMES`.  Works for TVM's native kinds too, which
    lets Python call e.g. a native kind's ``f_attrs_from_json`` directly.
    """
    return _f_functor(kind, str(which))


def refresh_sblock_flags(state) -> int:
    """Recompute the cached flags (affine binding, region cover, stage pipeline) of every
    block of a ``ScheduleState`` after an IR rewrite through ``ScheduleState.replace``,
    which gives new blocks all-false flags. Returns the number of blocks updated."""
    return int(_f_refresh_flags(state))


def inspect_schedule_state(state) -> Dict[str, int]:
    """What the core reads from a ``ScheduleState`` through its layout mirror (used to
    check that the mirror still matches TVM's class)."""
    debug_mask, enable_check, blocks, srefs = (int(x) for x in _f_inspect_state(state))
    return {
        "debug_mask": debug_mask,
        "enable_check": bool(enable_check),
        "blocks": blocks,
        "srefs": srefs,
    }


__all__ = [
    "CoreLibraryNotFoundError",
    "FUNCTOR_NAMES",
    "LIB_NAME",
    "LIB_PATH",
    "get_instruction_kind",
    "get_instruction_kind_functor",
    "has_instruction_kind",
    "inspect_instruction_kind",
    "instruction_kind_type_index",
    "list_instruction_kinds",
    "inspect_schedule_state",
    "refresh_sblock_flags",
    "register_instruction_kind",
]
