"""tvm_cascade.library.specialise: a runtime-length kernel's function fixed to one
configuration, and ``compile_attention``'s long decode, which compiles it."""
import numpy as np
import pytest
import tvm
import tvm_ffi
import tvm_cascade  # noqa: F401

from tvm_cascade import kernels
from tvm_cascade.bench import VARIANTS
from tvm_cascade.library import families, specialise
from tvm_cascade.library.spec import AttentionSpec
from tvm_cascade.ops.reference import attention_ref
from tvm_cascade.ops.testing import random_attention_inputs

HOPPER = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})


def _shape(buf):
    return [int(e) for e in buf.ty.shape]


def test_the_function_takes_static_shapes_and_its_planned_scalars():
    """The tensor-core decode family's function for 2 sequences of one query over 32768
    keys: ``main(q, k, v, out)`` with those shapes, its chunk size the plan's (no
    variable of the runtime-length function left)."""
    spec = AttentionSpec.make(32, 8, 128, variant="causal", dtype="float16", layout="bhsd", target=HOPPER)
    family, main = specialise.specialised(spec, 2, 1, 32768, tvm.cuda(0))
    assert family.name == "tensor_core_decode"
    assert [p.name for p in main.params] == ["q", "k", "v", "out"]
    assert [_shape(p) for p in main.params] == [[2, 32, 1, 128], [2, 8, 32768, 128], [2, 8, 32768, 128], [2, 32, 1, 128]]
    assert str(main.attrs["global_symbol"]) == "main"
    names = set()
    tvm_ffi.structural_walk(main.body, lambda n: names.add(n.name) if isinstance(n, tvm.tirx.Var) else None)
    assert not names & {"batch", "seq_q", "seq_kv", "chunk_keys"}
    (chunk_keys,) = family.plan(spec, 2, 1, 32768, tvm.cuda(0))
    unplanned = family.build(spec)
    assert not tvm_ffi.structural_equal(main.body, unplanned.body)
    assert str(chunk_keys) in main.script()


@pytest.mark.parametrize("variant, heads_q, heads_kv, seq_q, seq_kv", [
    ("causal", 4, 2, 3, 40), ("alibi", 4, 4, 1, 37), ("softcap", 2, 1, 20, 20), ("window", 4, 2, 9, 50),
])
def test_the_function_matches_the_reference_on_the_cpu(variant, heads_q, heads_kv, seq_q, seq_kv):
    """Compiled for llvm (the generic family), the fixed function gives float64 numpy's
    output at its shapes and refuses tensors of others."""
    spec = AttentionSpec.make(heads_q, heads_kv, 16, variant=VARIANTS[variant], dtype="float32", layout="bhsd",
                              target=tvm.target.Target("llvm"))
    _, main = specialise.specialised(spec, 2, seq_q, seq_kv, tvm.cpu(0))
    exe = tvm.compile(tvm.IRModule({"main": main}), target="llvm")
    q, k, v = random_attention_inputs(2, heads_q, heads_kv, seq_q, seq_kv, 16, dtype="float32", seed=5)
    dev = tvm.cpu(0)
    args = [tvm.runtime.tensor(a, dev) for a in (q, k, v, np.zeros_like(q))]
    exe["main"](*args)
    expected = attention_ref(*(x.astype("float64") for x in (q, k, v)), variant=VARIANTS[variant])
    np.testing.assert_allclose(args[3].numpy(), expected, rtol=1e-4, atol=1e-5)
    longer = random_attention_inputs(2, heads_q, heads_kv, seq_q, seq_kv + 1, 16, dtype="float32", seed=5)
    with pytest.raises(Exception, match="Mismatched k"):
        exe["main"](*(tvm.runtime.tensor(a, dev) for a in longer), args[3])


def test_other_layouts_and_masks_are_refused():
    for layout in ("ragged", "paged", "bshd"):
        spec = AttentionSpec.make(4, 2, 16, dtype="float32", layout=layout, target=tvm.target.Target("llvm"))
        with pytest.raises(ValueError, match="bhsd"):
            specialise.specialised(spec, 1, 1, 8, tvm.cpu(0))


def _source(exe):
    return exe.mod.imports[0].inspect_source()


def test_long_decode_compiles_the_runtime_kernel(monkeypatch, tmp_path):
    """``compile_attention`` gives decode over :data:`~tvm_cascade.kernels.RUNTIME_DECODE_KEYS`
    keys the tensor-core family's function fixed to it (the same CUDA source; the
    families chosen once, so each passed over is logged once); shorter decode, a config,
    a records path or tuning keep the static schedule."""
    monkeypatch.setenv("TVM_CASCADE_CACHE", str(tmp_path))  # no user records
    keys = kernels.RUNTIME_DECODE_KEYS
    spec = AttentionSpec.make(8, 1, 128, dtype="float16", layout="bhsd", target=HOPPER)
    fixed = specialise.compile_specialised(spec, 2, 1, keys + 3, HOPPER)
    chosen = []

    def choose(spec):
        chosen.append(spec)
        return families.choose(spec)

    monkeypatch.setattr(specialise, "choose", choose)
    monkeypatch.setattr(kernels, "choose", choose, raising=False)  # (were it asked there too)
    assert _source(kernels.compile_attention(2, 8, 1, 1, keys + 3, 128, target=HOPPER)) == _source(fixed)
    assert chosen == [spec]

    def refused(*args, **kwargs):
        raise AssertionError("the runtime-length kernel was compiled")

    monkeypatch.setattr(kernels, "compile_specialised", refused)
    kernels.compile_attention(2, 8, 1, 1, keys - 1, 128, target=HOPPER)
    kernels.compile_attention(2, 8, 1, 1, keys, 128, target=HOPPER, records=tmp_path / "none")
    from tvm_cascade.schedules.decode import DecodeConfig

    kernels.compile_attention(2, 8, 1, 1, keys, 128, target=HOPPER, config=DecodeConfig())
