"""The on-disk cache of tvm_cascade.library's kernels: reuse across processes, corrupt
and foreign entries rebuilt, concurrent builders and readers."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import tvm_cascade  # noqa: F401
from tvm_cascade.library import attention_kernel, families
from tvm_cascade.ops import testing as tt
from tvm_cascade.ops.reference import sequence_attention_ref

ARGS = dict(heads_q=4, heads_kv=2, head_dim=16, variant="causal", dtype="float32", layout="ragged", target="llvm")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("TVM_CASCADE_CACHE", str(root))
    return root


def _make(**kwargs):
    args = dict(ARGS)
    args.update(kwargs)
    return attention_kernel(args.pop("heads_q"), args.pop("heads_kv"), args.pop("head_dim"), **args)


def _check(kernel):
    sequences = tt.random_sequences([3, 1], [6, 9], 4, 2, 16, rng=np.random.default_rng(0))
    out = kernel(*tt.pack_ragged(sequences))
    ref = np.concatenate([sequence_attention_ref(q, k, v, "causal") for q, k, v in sequences])
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)


def _entry(root):
    (meta,) = root.glob("*.json")
    data = json.loads(meta.read_text())
    return meta, root / data["library"]


def _refuse(self, spec):
    raise AssertionError("built, not loaded from the cache")


def test_second_call_loads_the_entry(cache_dir, monkeypatch):
    built = _make()
    monkeypatch.setattr(families.GenericFused, "build", _refuse)
    loaded = _make()
    assert [f.name for f in loaded.families] == [f.name for f in built.families] == ["generic"]
    assert loaded.mod.script() == built.mod.script()
    _check(loaded)
    assert len(list(cache_dir.glob("*.json"))) == 1


def test_specs_key_entries(cache_dir):
    _make()
    _make(variant="global")
    _make(dtype="float16")
    assert len(list(cache_dir.glob("*.json"))) == 3


def test_corrupt_library_is_rebuilt(cache_dir, caplog):
    _make()
    meta, lib = _entry(cache_dir)
    data = bytearray(lib.read_bytes())
    data[len(data) // 2] ^= 0xFF
    lib.write_bytes(bytes(data))
    with caplog.at_level("WARNING", logger="tvm_cascade.library"):
        kernel = _make()
    assert "corrupt" in caplog.text
    _check(kernel)
    _, lib = _entry(cache_dir)
    assert lib.read_bytes() != bytes(data)


@pytest.mark.parametrize("damage", ["truncated description", "missing library", "other TVM", "other source"])
def test_unusable_entries_are_rebuilt(cache_dir, monkeypatch, damage):
    _make()
    meta, lib = _entry(cache_dir)
    data = json.loads(meta.read_text())
    if damage == "truncated description":
        meta.write_text(meta.read_text()[:100])
    elif damage == "missing library":
        lib.unlink()
    else:
        field = "tvm" if damage == "other TVM" else "source"
        data["versions"][field] = "0" * 8
        meta.write_text(json.dumps(data))
    built = []
    original = families.GenericFused.build
    monkeypatch.setattr(families.GenericFused, "build", lambda self, spec: built.append(1) or original(self, spec))
    _check(_make())
    assert built == [1]
    _check(_make())  # the rebuilt entry is loaded
    assert built == [1]


_WORKER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import numpy as np
    import tvm_cascade
    from tvm_cascade.library import attention_kernel
    from tvm_cascade.ops import testing as tt
    from tvm_cascade.ops.reference import sequence_attention_ref
    ready, workers = Path(sys.argv[1]), int(sys.argv[2])
    (ready / str(os.getpid())).touch()
    deadline = time.time() + 120
    while len(list(ready.iterdir())) < workers:
        assert time.time() < deadline, "the other workers did not get past their imports"
        time.sleep(0.005)
    for _ in range(3):
        kernel = attention_kernel(4, 2, 16, variant="causal", dtype="float32", layout="ragged", target="llvm")
        sequences = tt.random_sequences([3, 1], [6, 9], 4, 2, 16)
        out = kernel(*tt.pack_ragged(sequences))
        ref = np.concatenate([sequence_attention_ref(q, k, v, "causal") for q, k, v in sequences])
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
    print("ok")
    """
)


def test_concurrent_processes(cache_dir, tmp_path):
    """Processes that build and read the same entry at once all get a correct kernel,
    and the entry left behind loads."""
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    # Each worker starts building once all are past their imports.
    ready = tmp_path / "ready"
    ready.mkdir()
    workers = [
        subprocess.Popen([sys.executable, str(script), str(ready), "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
        for _ in range(3)
    ]
    for worker in workers:
        stdout, stderr = worker.communicate(timeout=300)
        assert worker.returncode == 0, stderr
        assert stdout.strip() == "ok"
    assert not list(cache_dir.glob(".build-*"))
    meta, lib = _entry(cache_dir)
    assert lib.exists()


def test_a_new_process_loads_the_entry(cache_dir, tmp_path):
    _make()
    probe = tmp_path / "probe.py"
    probe.write_text(textwrap.dedent(
        """
        import tvm_cascade
        from tvm_cascade.library import attention_kernel, families
        families.GenericFused.build = lambda self, spec: (_ for _ in ()).throw(AssertionError("rebuilt"))
        kernel = attention_kernel(4, 2, 16, variant="causal", dtype="float32", layout="ragged", target="llvm")
        print(*[f.name for f in kernel.families])
        """
    ))
    result = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "generic"
