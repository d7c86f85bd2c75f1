"""``tvm_cascade.kernels``: which schedule serves a configuration, padding to whole tiles,
the tuning records shipped with the package, and (on a machine with a CUDA GPU) the
compiled kernels against the numpy reference."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tvm
import tvm_ffi
import tvm_cascade  # noqa: F401

from tvm_cascade import kernels, ops
from tvm_cascade.library import specialise
from tvm_cascade.bench import VARIANTS
from tvm_cascade.ops.reference import attention_ref
from tvm_cascade.ops.testing import random_attention_inputs
from runs_ahead import runs

CUDA = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
GPU = tvm.cuda(0).exist

# (variant, batch, heads_q, heads_kv, seq_q, seq_kv): decode and prefill, lengths that are
# whole tiles and lengths that are not.
CONFIGS = [
    ("causal", 2, 4, 4, 1, 4096),
    ("gqa", 2, 16, 2, 1, 1000),
    ("softcap", 1, 4, 2, 3, 37),
    ("alibi", 1, 4, 4, 8, 300),
    ("causal", 2, 4, 4, 3, 700),
    ("gqa", 1, 16, 2, 4, 500),
    ("softcap", 2, 8, 4, 4, 300),
    ("gqa", 1, 32, 2, 2, 500),
    ("causal", 1, 4, 4, 256, 256),
    # A causal mask's inner and boundary tiles in one pipelined loop (one head a block).
    ("causal", 2, 4, 4, 1024, 1024),
    ("alibi", 1, 4, 4, 512, 512),
    ("gqa", 1, 8, 2, 1280, 1280),
    ("window", 1, 4, 4, 200, 300),
    ("gqa", 1, 8, 2, 130, 195),
    ("gqa", 1, 8, 1, 384, 384),
    ("global", 1, 2, 1, 130, 200),
    ("softcap", 1, 4, 2, 256, 512),
    ("softcap", 1, 2, 2, 129, 1000),
    ("causal", 1, 2, 2, 64, 64),
    ("global", 1, 2, 2, 20, 30),
]


def test_kind_follows_the_query_length():
    assert [kernels.kind_of(n) for n in (1, kernels.DECODE_QUERIES, kernels.DECODE_QUERIES + 1)] == [
        "decode",
        "decode",
        "prefill",
    ]


def test_schedules_of_static_lengths_come_from_the_family_list(monkeypatch, caplog):
    """``compile_attention``'s schedules are those of ``library.families.FAMILIES``: the
    first family whose schedule serves and is preferred (passed-over families logged);
    a family that stops serving is passed over; a module is built by the family whose
    schedule it is; a config picks its family."""
    import logging

    from tvm_cascade.library import families
    from tvm_cascade.library.spec import AttentionSpec
    from tvm_cascade.library.warp_specialized_prefill import WarpSpecializedPrefill
    from tvm_cascade.schedules import warp_specialized as ws
    from tvm_cascade.schedules.decode import DecodeConfig
    from tvm_cascade.schedules.prefill import PrefillConfig

    ampere = tvm.target.Target({"kind": "cuda", "arch": "sm_80"})

    def served(target, seq_q, variant="causal", head_dim=128, dtype="float16", with_variant=True):
        spec = AttentionSpec.make(8, 2, head_dim, variant=VARIANTS[variant], dtype=dtype, target=target)
        chosen = families.schedule_families(spec, kernels.kind_of(seq_q), seq_q, 512, with_variant)
        return [family.name for family in chosen]

    with caplog.at_level(logging.INFO, logger="tvm_cascade.library"):
        assert served(CUDA, 256) == ["warp_specialized_prefill", "tensor_core_prefill"]
        assert served(CUDA, 256, with_variant=False) == ["tensor_core_prefill"]
        assert served(CUDA, 256, head_dim=64) == ["tensor_core_prefill"]
        assert served(ampere, 256) == ["tensor_core_prefill"]
        assert served(CUDA, 1) == ["split_k_decode"]
        assert served("llvm", 1) == [] and served("llvm", 256) == []
    assert "not the warp_specialized_prefill schedule: the warp-specialised kernel needs sm_90a" in caplog.text
    assert families.config_family("prefill", PrefillConfig()).name == "tensor_core_prefill"
    assert families.config_family("prefill", ws.WarpSpecializedConfig()).name == "warp_specialized_prefill"
    assert families.config_family("decode", DecodeConfig()).name == "split_k_decode"
    with pytest.raises(ValueError, match="config must be a DecodeConfig for the decode schedules, not a Prefill"):
        families.config_family("decode", PrefillConfig())

    func = ops.attention(1, 8, 2, 256, 256, 128, dtype="float16", variant=VARIANTS["causal"],
                         pad_to=kernels.PAD_TO["prefill"])
    hopper = kernels.schedule(func, CUDA, [], VARIANTS["causal"])
    assert families.scheduled_by(hopper.mod, "prefill").name == "warp_specialized_prefill"
    assert tvm_ffi.structural_equal(hopper.mod, ws.schedule(func, VARIANTS["causal"]).mod)
    monkeypatch.setattr(WarpSpecializedPrefill, "schedule_supports", lambda self, spec, q, kv: "withdrawn")
    passed_over = kernels.schedule(func, CUDA, [], VARIANTS["causal"])
    assert families.scheduled_by(passed_over.mod, "prefill").name == "tensor_core_prefill"
    with pytest.raises(ValueError, match="no schedule serves .* on llvm"):
        kernels.schedule(func, "llvm", [], VARIANTS["causal"])


def test_records_default_to_the_package_and_follow_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("TVM_CASCADE_TUNED_PREFILL", raising=False)
    assert kernels.default_records("prefill").parts[-3:] == ("tvm_cascade", "tuned", "prefill")
    assert (kernels.default_records("prefill") / "database_tuning_record.json").is_file()
    monkeypatch.setenv("TVM_CASCADE_CACHE", str(tmp_path / "cache"))
    assert kernels.user_records("decode") == tmp_path / "cache" / "tuned" / "decode"
    monkeypatch.setenv("TVM_CASCADE_TUNED_PREFILL", str(tmp_path))
    assert kernels.default_records("prefill") == tmp_path


def test_config_sets_the_heuristic_schedule_and_must_match_the_kind(tmp_path):
    """``compile_attention(config=...)`` compiles the heuristic schedule with those choices
    (not a tuned record); a prefill config for a decode configuration is refused."""
    from tvm_cascade.cuda import tensor_cores
    from tvm_cascade.library.split_k import sm_count
    from tvm_cascade.schedules.decode import DecodeConfig, schedule_decode
    from tvm_cascade.schedules.prefill import PrefillConfig

    config = DecodeConfig(pv_keys=4)
    compiled = kernels.compile_attention(
        1, 8, 2, 1, 512, 128, variant=VARIANTS["gqa"], target=CUDA, records=tmp_path, config=config
    )
    func = ops.attention(1, 8, 2, 1, 512, 128, dtype="float16", variant=VARIANTS["gqa"], pad_to=kernels.PAD_TO["decode"])
    expected = tensor_cores.build(schedule_decode(func, 8, 2, 128, sm_count(tvm.cuda(0)), config).mod, CUDA)
    default = tensor_cores.build(schedule_decode(func, 8, 2, 128, sm_count(tvm.cuda(0))).mod, CUDA)
    source = compiled.mod.imports[0].inspect_source()
    assert source == expected.mod.imports[0].inspect_source() != default.mod.imports[0].inspect_source()
    with pytest.raises(ValueError, match="config must be a DecodeConfig"):
        kernels.compile_attention(1, 8, 2, 1, 512, 128, target=CUDA, config=PrefillConfig())


def _check_against_the_reference(
    variant, batch, heads_q, heads_kv, seq_q, seq_kv, head_dim, dtype, tolerance, config=None
):
    dev = tvm.cuda(0)
    q, k, v = random_attention_inputs(batch, heads_q, heads_kv, seq_q, seq_kv, head_dim, dtype=dtype, seed=3)
    exe = kernels.compile_attention(
        batch, heads_q, heads_kv, seq_q, seq_kv, head_dim, variant=VARIANTS[variant], dtype=dtype, records="/none",
        config=config,
    )
    args = [tvm.runtime.tensor(a, dev) for a in (q, k, v, np.zeros_like(q))]
    exe["main"](*args)
    expected = attention_ref(q.astype("float32"), k.astype("float32"), v.astype("float32"), variant=VARIANTS[variant])
    np.testing.assert_allclose(args[3].numpy().astype("float32"), expected, **tolerance)


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant, heads_q, heads_kv, seq_q, seq_kv", [
    ("causal", 4, 4, 1, 8192), ("gqa", 8, 1, 1, 8195), ("softcap", 4, 2, 4, 33000), ("alibi", 4, 4, 1, 40000),
])
def test_long_decode_takes_the_runtime_kernel_and_matches_the_reference(monkeypatch, tmp_path, variant, heads_q,
                                                                        heads_kv, seq_q, seq_kv):
    """Decode over ``RUNTIME_DECODE_KEYS`` keys, compiled without records or a config,
    is the runtime-length tensor-core kernel fixed to its shapes (key counts no multiple
    of its steps, several query rows)."""
    monkeypatch.setenv("TVM_CASCADE_CACHE", str(tmp_path))  # no user records
    taken = []
    monkeypatch.setattr(kernels, "compile_specialised",
                        lambda *a, **kw: taken.append(a) or specialise.compile_specialised(*a, **kw))
    dev = tvm.cuda(0)
    q, k, v = random_attention_inputs(2, heads_q, heads_kv, seq_q, seq_kv, 128, dtype="float16", seed=3)
    exe = kernels.compile_attention(2, heads_q, heads_kv, seq_q, seq_kv, 128, variant=VARIANTS[variant])
    assert len(taken) == 1
    args = [tvm.runtime.tensor(a, dev) for a in (q, k, v, np.zeros_like(q))]
    exe["main"](*args)
    expected = attention_ref(q.astype("float32"), k.astype("float32"), v.astype("float32"), variant=VARIANTS[variant])
    np.testing.assert_allclose(args[3].numpy().astype("float32"), expected, rtol=2e-2, atol=5e-3)


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant, batch, heads_q, heads_kv, seq_q, seq_kv", CONFIGS)
def test_compiled_kernels_match_the_reference(variant, batch, heads_q, heads_kv, seq_q, seq_kv):
    """Decode, and prefill on the mma.sync schedule (on an H100/H200 whole tiles would
    otherwise take the warp-specialised kernel, tested below)."""
    from tvm_cascade.schedules.prefill import PrefillConfig

    config = PrefillConfig() if kernels.kind_of(seq_q) == "prefill" else None
    _check_against_the_reference(
        variant, batch, heads_q, heads_kv, seq_q, seq_kv, 128, "float16", {"rtol": 2e-2, "atol": 5e-3}, config=config
    )


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "variant, batch, heads_q, heads_kv, seq_q, seq_kv, choices",
    [
        ("global", 1, 4, 4, 256, 256, {}),
        ("causal", 2, 4, 4, 512, 512, {}),
        ("alibi", 1, 4, 4, 384, 384, {}),
        ("softcap", 1, 4, 2, 256, 512, {}),
        ("window", 1, 4, 4, 768, 768, {}),
        ("gqa", 1, 8, 2, 384, 640, {}),  # the causal diagonal offset by 256 keys
        ("causal", 1, 2, 2, 128, 384, {}),
        ("causal", 1, 4, 4, 512, 512, {"overlap": False, "pingpong": False, "stages": 2}),
        ("global", 1, 4, 4, 512, 512, {"pingpong": False}),
        ("alibi", 1, 4, 4, 512, 512, {"pingpong": False}),
        # Part tiles: rows past seq_q and keys past seq_kv (the next head's, or TMA's zeros).
        ("global", 2, 4, 4, 200, 200, {}),
        ("causal", 1, 4, 4, 300, 456, {}),
        ("alibi", 2, 4, 4, 136, 136, {}),
        ("softcap", 1, 4, 2, 1000, 1000, {}),
        ("window", 1, 4, 4, 520, 520, {}),
        ("gqa", 1, 8, 2, 72, 1000, {}),
        ("global", 1, 2, 2, 128, 8, {}),
        # Clusters of two blocks sharing K/V tiles by TMA multicast.
        ("gqa", 2, 8, 2, 384, 640, {"cluster": 2}),
        ("alibi", 1, 8, 4, 200, 328, {"cluster": 2}),
        ("global", 2, 4, 4, 512, 512, {"cluster": 2}),
        ("softcap", 1, 4, 2, 1000, 1000, {"cluster": 2}),
    ],
)
def test_warp_specialized_prefill_kernels_match_the_reference(variant, batch, heads_q, heads_kv, seq_q, seq_kv, choices):
    """The warp-specialised Hopper kernel (TMA, wgmma, mbarriers; needs an sm_90 GPU)."""
    from tvm_cascade.schedules.warp_specialized import WarpSpecializedConfig

    if tvm.cuda(0).compute_version != "9.0":
        pytest.skip("the warp-specialised kernel needs an sm_90 GPU")
    _check_against_the_reference(
        variant, batch, heads_q, heads_kv, seq_q, seq_kv, 128, "float16", {"rtol": 2e-2, "atol": 5e-3},
        config=WarpSpecializedConfig(**choices),
    )


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "variant, batch, heads_q, heads_kv, seq_q, seq_kv",
    [("causal", 2, 4, 4, 512, 512), ("gqa", 1, 8, 2, 384, 640), ("alibi", 2, 4, 4, 136, 136), ("causal", 1, 4, 4, 300, 456)],
)
def test_warp_specialized_prefill_in_folds_matches_the_reference(monkeypatch, variant, batch, heads_q, heads_kv, seq_q, seq_kv):
    """Where a causal mask's K/V heads overflow the kernel's share of L2, the blocks take a
    span of heads' row tiles in folds (an odd count of row tiles, part tiles, a GQA
    group): with the share made 256 KB, these short sequences' spans are fewer heads."""
    from tvm_cascade.schedules import warp_specialized as ws

    if tvm.cuda(0).compute_version != "9.0":
        pytest.skip("the warp-specialised kernel needs an sm_90 GPU")
    monkeypatch.setattr(ws, "L2_SHARE", 256 << 10)
    assert ws.causal_span(heads_q, heads_kv, 128, seq_kv) < batch * heads_q
    _check_against_the_reference(
        variant, batch, heads_q, heads_kv, seq_q, seq_kv, 128, "float16", {"rtol": 2e-2, "atol": 5e-3},
        config=ws.WarpSpecializedConfig(),
    )


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "variant, heads_q, heads_kv, seq_q, seq_kv, head_dim",
    # Decode on tensor cores (GQA groups of 8 and 16, head dims 128 and 64; 8 query rows
    # of one head) and without.
    [
        ("gqa", 16, 2, 1, 1000, 128),
        ("gqa", 32, 2, 3, 700, 64),
        ("causal", 4, 4, 8, 700, 64),
        ("alibi", 4, 4, 2, 500, 64),
    ],
)
def test_bfloat16_decode_kernels_match_the_reference(variant, heads_q, heads_kv, seq_q, seq_kv, head_dim):
    _check_against_the_reference(
        variant, 2, heads_q, heads_kv, seq_q, seq_kv, head_dim, "bfloat16", {"rtol": 5e-2, "atol": 2e-2}
    )


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant", ["global", "causal", "window", "softcap"])
def test_head_dim_64_prefill_kernels_match_the_reference(variant):
    """The prefill schedule at head dim 64 (64-key tiles, or 32 under a causal mask), with
    lengths that are not whole tiles."""
    _check_against_the_reference(variant, 1, 4, 2, 300, 333, 64, "float16", {"rtol": 2e-2, "atol": 5e-3})


@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "variant, keys, rows, warp_rows, overlap",
    [(v, 64, 128, 32, False) for v in ("global", "causal", "alibi", "softcap", "window", "gqa")]
    + [(v, 32, 128, 32, False) for v in ("global", "causal", "alibi", "softcap", "gqa")]
    + [(v, 64, 128, 16, False) for v in ("global", "causal", "alibi", "gqa")]
    + [("causal", 64, 256, 32, False), ("softcap", 64, 256, 16, False)]
    + [("global", 64, 128, 16, True), ("softcap", 64, 128, 16, True), ("global", 32, 256, 32, True)],
)
def test_wgmma_prefill_kernels_match_the_reference(variant, keys, rows, warp_rows, overlap):
    """The prefill schedule with both GEMMs on warpgroup MMAs (sm_90a), lengths that are
    not whole tiles (under a sliding window 64-key tiles only, which the schedule
    requires), a warpgroup per 128 or 64 rows, one or two warpgroups per block, and the
    overlapped key loop (P·V in one pass)."""
    from tvm_cascade.schedules.prefill import PrefillConfig

    config = PrefillConfig(
        rows=rows, keys=keys, wgmma=True, pv_split=1 if overlap else 2, warp_rows=warp_rows, overlap=overlap
    )
    _check_against_the_reference(
        variant, 1, 4, 2, 300, 333, 128, "float16", {"rtol": 2e-2, "atol": 5e-3}, config=config
    )


def _pip_install(tmp_path_factory):
    """The ``pip install`` of :func:`test_installed_package_finds_its_records`, started
    ahead of it (see ``runs_ahead.py``): ten seconds and more of building."""
    root = Path(__file__).resolve().parents[1]
    site = tmp_path_factory.mktemp("installed") / "site"
    return {"args": [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(root)]}


@runs(_pip_install)
def test_installed_package_finds_its_records(tmp_path, runs_ahead, request):
    """``pip install .`` (not editable: a wheel built in an isolated environment, C++ core
    included) into a folder of its own; the package imported from there finds the tuned
    records it ships (the cascades' compressed: a benchmark shape's workload in them)."""
    install = runs_ahead.result(request.node)
    site = Path(install.args[install.args.index("--target") + 1])
    if install.returncode and "satisfies the requirement" in install.stderr:
        pytest.skip("the isolated build's requirements (setuptools, tvm-ffi) cannot be fetched here: no package index")
    assert install.returncode == 0, install.stderr
    probe = (
        "import tvm_cascade, tvm_cascade.kernels as k; "
        "print(tvm_cascade.__file__); "
        "print(*[(k.default_records(kind) / 'database_tuning_record.json').is_file() for kind in ('decode', 'prefill')]); "
        "import tvm; from tvm_cascade.meta_schedule import tuned_database; from tvm_cascade.ops import cascades; "
        "print(tuned_database().has_workload(tvm.IRModule({'main': cascades.logsumexp(1024, 128256, 'bfloat16')})))"
    )
    env = {key: value for key, value in os.environ.items() if not key.startswith("TVM_CASCADE_TUNED")}
    env["PYTHONPATH"] = str(site)
    env["TVM_CASCADE_CACHE"] = str(tmp_path / "cache")
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    where, found, cascades = result.stdout.strip().splitlines()
    assert where.startswith(str(site))
    assert found == "True True"
    assert cascades == "True"
