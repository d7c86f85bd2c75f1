"""Built kernels on disk, so that a process gets a kernel another one built without
compiling it.

An entry is named by its key (a digest of the spec, the families, the target, the
versions of TVM and tvm-cascade and of tvm-cascade's source): ``<key>.json`` describes
it (the versions, the scheduled IRModule, the name and SHA-256 of its library) and
``<key>.<digest>.so`` is the exported runtime module. Each file is written under a
temporary name and renamed into place, the library first, so a reader sees whole files
only; it loads an entry only if the description names the current versions and the
library has the digest it names, else (a corrupt, partial or foreign entry) the kernel
is rebuilt and the entry replaced. Processes that build the same kernel at once each
write a whole entry; the last description renamed wins, and names a library of its own.

The directory is ``TVM_CASCADE_CACHE``, else ``$XDG_CACHE_HOME/tvm_cascade``, else
``~/.cache/tvm_cascade``.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
from dataclasses import asdict
from pathlib import Path

import tvm

from .spec import AttentionSpec

logger = logging.getLogger("tvm_cascade.library")
FORMAT = 1


def directory() -> Path:
    """The cache directory (see the module docstring)."""
    named = os.environ.get("TVM_CASCADE_CACHE")
    if named:
        return Path(named)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tvm_cascade"


@functools.lru_cache(maxsize=None)
def versions() -> dict:
    """What an entry must have been built with to be loaded."""
    from .. import __version__  # pylint: disable=import-outside-toplevel

    package = Path(__file__).resolve().parents[1]
    source = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        source.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    return {"format": FORMAT, "tvm": tvm.__version__, "tvm_cascade": __version__, "source": source.hexdigest()}


def key(spec: AttentionSpec, families: list) -> str:
    described = {"spec": _spec_fields(spec), "families": list(families), "versions": versions()}
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:32]


def load(spec: AttentionSpec, families: list, root: Path):
    """``(mod, runtime module)`` of the valid entry for ``spec`` built by ``families``
    (their names) under ``root``, or None."""
    name = key(spec, families)
    try:
        meta = json.loads((root / f"{name}.json").read_text())
        lib_path = root / Path(str(meta.get("library"))).name
        lib = lib_path.read_bytes()
    except (OSError, ValueError, AttributeError):
        return None
    if meta.get("versions") != versions() or meta.get("spec") != _spec_fields(spec) or meta.get("families") != list(families):
        logger.info("%s: cache entry %s was built otherwise; rebuilding", spec.describe(), name)
        return None
    if meta.get("library_sha256") != hashlib.sha256(lib).hexdigest():
        logger.warning("%s: cache entry %s is corrupt; rebuilding", spec.describe(), name)
        return None
    # Loaded from a private copy: the digest checked is that of the bytes loaded, even
    # if another process renames a new entry into place meanwhile.
    with tempfile.TemporaryDirectory() as tmp:
        private = Path(tmp) / lib_path.name
        private.write_bytes(lib)
        module = tvm.runtime.load_module(str(private))
    return tvm.ir.load_json(meta["mod"]), module


def store(spec: AttentionSpec, families: list, mod: tvm.IRModule, executable, root: Path) -> None:
    """Write the entry of a kernel built for ``spec`` by ``families`` (their names)."""
    root.mkdir(parents=True, exist_ok=True)
    name = key(spec, families)
    with tempfile.TemporaryDirectory(dir=root, prefix=".build-") as tmp:
        lib_tmp = Path(tmp) / "kernel.so"
        executable.export_library(str(lib_tmp))
        digest = hashlib.sha256(lib_tmp.read_bytes()).hexdigest()
        library = f"{name}.{digest[:16]}.so"
        meta = {"versions": versions(), "spec": _spec_fields(spec), "families": list(families),
                "library": library, "library_sha256": digest, "mod": tvm.ir.save_json(mod)}
        meta_tmp = Path(tmp) / f"{name}.json"
        meta_tmp.write_text(json.dumps(meta))
        os.replace(lib_tmp, root / library)
        os.replace(meta_tmp, root / meta_tmp.name)


def _spec_fields(spec: AttentionSpec) -> dict:
    return json.loads(json.dumps(asdict(spec)))
