"""CPU tests of the attention benchmark harness (benchmarks/): no GPU needed.

torch and matplotlib are optional: the tests that need them skip without them.
"""

import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `benchmarks` is not an installed package

from benchmarks import configs, reference, report  # noqa: E402
from benchmarks.configs import OPERATORS, Config, suite  # noqa: E402
from benchmarks.report import NA, OK, WRONG, Cell  # noqa: E402
from ahead import in_a_process_ahead  # noqa: E402
from runs_ahead import runs  # noqa: E402


def _op(kind, name):
    return next(o for o in OPERATORS if o.kind == kind and o.name == name)


@pytest.fixture
def small_window(monkeypatch):
    monkeypatch.setattr(configs, "WINDOW", 3)


# --------------------------------------------------------------------------- configurations


def test_ten_operators_and_head_counts():
    heads = {(o.kind, o.name): (o.heads_q, o.heads_kv) for o in OPERATORS}
    assert heads == {
        ("prefill", "global"): (32, 32),
        ("prefill", "causal"): (32, 32),
        ("prefill", "alibi"): (32, 32),
        ("prefill", "gqa"): (32, 8),
        ("prefill", "softcap"): (32, 32),
        ("prefill", "window"): (32, 32),
        ("decode", "causal"): (32, 32),
        ("decode", "alibi"): (32, 32),
        ("decode", "gqa"): (64, 8),
        ("decode", "softcap"): (32, 16),
    }
    assert _op("prefill", "softcap").softcap == 50.0 and not _op("prefill", "softcap").causal
    assert _op("prefill", "window").window == 256 and _op("prefill", "window").causal
    assert _op("prefill", "alibi").alibi and _op("prefill", "alibi").causal


def test_suite_shapes_and_filters():
    full = suite("all")
    assert len(full) == 6 * 3 + 4 * 2
    assert len({c.name for c in full}) == len(full)
    shapes = {(c.op.kind, c.batch, c.seq_q, c.seq_kv) for c in full}
    assert shapes == {
        ("prefill", 8, 1024, 1024),
        ("prefill", 8, 4096, 4096),
        ("prefill", 1, 16384, 16384),
        ("decode", 8, 1, 4096),
        ("decode", 8, 1, 32768),
    }
    assert all(c.head_dim == 128 and c.dtype == "float16" for c in full)
    quick = suite("all", quick=True)
    assert len(quick) == 10 and {c.seq_kv for c in quick} == {1024, 4096}
    assert all(c.op.kind == "decode" for c in suite("decode"))
    assert [c.name for c in suite("all", only=["prefill-gqa-b1"])] == ["prefill-gqa-b1-s16384"]
    with pytest.raises(ValueError):
        suite("train")


def test_suite_options_name_the_configurations():
    configs = suite("all", quick=True, head_dim=64, dtype="bfloat16", decode_queries=4)
    assert all(c.head_dim == 64 and c.dtype == "bfloat16" for c in configs)
    names = {c.name for c in configs}
    assert "decode-gqa-b8-kv4096-q4-d64-bfloat16" in names
    assert "prefill-causal-b8-s1024-d64-bfloat16" in names  # prefill keeps its query length
    decode = [c for c in configs if c.op.kind == "decode"]
    assert all(c.seq_q == 4 and c.masked == c.op.causal for c in decode)


def test_suite_trims_every_sequence():
    configs = suite("all", quick=True, trim=1)
    names = {c.name for c in configs}
    assert "prefill-window-b8-s1023" in names and "decode-gqa-b8-kv4095" in names
    assert all(c.seq_kv % 2 == 1 for c in configs)
    assert all(c.seq_q == (1023 if c.op.kind == "prefill" else 1) for c in configs)


def test_masked_and_scale():
    assert Config(_op("prefill", "causal"), 1, 8, 8).masked
    assert not Config(_op("prefill", "global"), 1, 8, 8).masked
    assert not Config(_op("prefill", "softcap"), 1, 8, 8).masked
    assert not Config(_op("decode", "causal"), 1, 1, 64).masked  # the last query sees every key
    assert Config(_op("decode", "causal"), 1, 1, 64).offset == 63
    assert Config(_op("prefill", "global"), 1, 8, 8).scale == pytest.approx(1 / np.sqrt(128))


def test_flop_and_byte_formulas(small_window):
    b, s, d = 2, 8, 4
    full = 4 * b * 32 * s * s * d
    assert Config(_op("prefill", "global"), b, s, s, head_dim=d).flops() == full
    assert Config(_op("prefill", "softcap"), b, s, s, head_dim=d).flops() == full
    for name in ("causal", "alibi"):
        assert Config(_op("prefill", name), b, s, s, head_dim=d).flops() == full / 2
    # the window counts visible (query, key) pairs: 1 + 2 + 3 * 6
    assert Config(_op("prefill", "window"), b, s, s, head_dim=d).flops() == 4 * b * 32 * d * 21
    decode = Config(_op("decode", "gqa"), b, 1, 64, head_dim=d)
    assert decode.flops() == 4 * b * 64 * 1 * 64 * d  # causal decode is not halved
    assert decode.kv_bytes() == 2 * b * 8 * 64 * d * 2
    real = suite("decode", only=["decode-gqa-b8-kv4096"])[0]
    assert real.kv_bytes() == 2 * 8 * 8 * 4096 * 128 * 2


# --------------------------------------------------------------------------- reference semantics


def _inputs(cfg, seed=0):
    rng = np.random.default_rng(seed)
    o = cfg.op
    q = rng.standard_normal((cfg.batch, o.heads_q, cfg.seq_q, cfg.head_dim)).astype(np.float16)
    k = rng.standard_normal((cfg.batch, o.heads_kv, cfg.seq_kv, cfg.head_dim)).astype(np.float16)
    v = rng.standard_normal((cfg.batch, o.heads_kv, cfg.seq_kv, cfg.head_dim)).astype(np.float16)
    return q, k, v


def _tiny_configs():
    for o in OPERATORS:
        shapes = [(1, 9), (1, 16)] if o.kind == "decode" else [(7, 7), (4, 10)]
        for seq_q, seq_kv in shapes:
            yield Config(o, 2, seq_q, seq_kv, head_dim=8)


TINY = list(_tiny_configs())


def _cascade_ref(cfg, q, k, v):
    from tvm_cascade.ops.reference import attention_ref
    from tvm_cascade.ops.variants import AttentionVariant

    o = cfg.op
    variant = AttentionVariant(o.variant, causal=o.causal, window=o.window, alibi=o.alibi, softcap=o.softcap)
    return attention_ref(q, k, v, variant=variant)


@pytest.mark.parametrize("cfg", TINY, ids=lambda c: f"{c.name}-q{c.seq_q}")
def test_reference_matches_tvm_cascade_reference(cfg, small_window, monkeypatch):
    monkeypatch.setattr(reference, "CHUNK_ELEMENTS", 3 * cfg.op.heads_q * cfg.seq_kv)  # several chunks
    q, k, v = _inputs(cfg)
    out = reference.attention_reference(cfg, q, k, v)
    assert out.dtype == np.float32 and out.shape == q.shape
    np.testing.assert_allclose(out, _cascade_ref(cfg, q, k, v), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cfg", TINY, ids=lambda c: f"{c.name}-q{c.seq_q}")
def test_torch_reference_matches_numpy(cfg, small_window):
    torch = pytest.importorskip("torch")
    q, k, v = _inputs(cfg)
    out = reference.attention_reference(cfg, *(torch.from_numpy(x) for x in (q, k, v)))
    np.testing.assert_allclose(out.numpy(), reference.attention_reference(cfg, q, k, v), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- peers on CPU


@pytest.mark.parametrize("cfg", TINY, ids=lambda c: f"{c.name}-q{c.seq_q}")
def test_stock_tvm_relax_graph_on_llvm(cfg, small_window):
    import tvm

    from benchmarks.stock_tvm import compile_vm

    q, k, v = _inputs(cfg)
    main = compile_vm(cfg, tvm.target.Target("llvm"), tvm.cpu())
    out = main(*(tvm.runtime.tensor(x) for x in (q, k, v))).numpy()
    np.testing.assert_allclose(out, reference.attention_reference(cfg, q, k, v), rtol=1e-2, atol=5e-3)


@pytest.mark.parametrize("workload", ["cross_entropy", "logsumexp", "moe_routing"])
def test_cascades_stock_tvm_graph_on_llvm(workload):
    """The Relax graph of the cascades benchmark's stock-TVM peers computes the workload,
    as it is and with its chain rewritten to one fused kernel (``DispatchRowChains``, as
    the cascade pipeline does on GPUs; its CPU kernels here)."""
    import tvm
    from tvm import relax

    import tvm_cascade  # noqa: F401  (registers the "cascade" pipeline)
    from benchmarks.cascades import relax_graph
    from tvm_cascade.ops import reference as R
    from tvm_cascade.relax.row_dispatch import DispatchRowChains

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((6, 40)) * 3).astype("float32")
    labels = rng.integers(0, 40, 6).astype("int32")
    args = [x, labels] if workload == "cross_entropy" else [x]
    graph = relax_graph(workload, 6, 40, 3, "float32")
    with tvm.target.Target("llvm"):
        dispatched = DispatchRowChains(cpu=True)(graph)
    assert [gv.name_hint.split("_40")[0] for gv, f in dispatched.functions_items() if isinstance(f, tvm.tirx.PrimFunc)] == [workload]
    for mod in (graph, dispatched):
        _check_cascade_graph(workload, x, labels, args, tvm.compile(mod, target="llvm"))


def _check_cascade_graph(workload, x, labels, args, executable):
    import tvm
    from tvm import relax

    from tvm_cascade.ops import reference as R

    vm = relax.VirtualMachine(executable, tvm.cpu())
    out = vm["main"](*(tvm.runtime.tensor(a) for a in args))
    if workload == "moe_routing":
        prob, top_prob, top_idx = R.moe_routing_ref(x, 3)
        for k, ref in enumerate((prob, top_prob, top_idx)):
            np.testing.assert_allclose(out[k].numpy(), ref, rtol=1e-5, atol=1e-6)
    else:
        ref = R.cross_entropy_ref(x, labels) if workload == "cross_entropy" else R.logsumexp_ref(x)
        np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5)


def test_cascades_check_names_what_is_off():
    torch = pytest.importorskip("torch")

    from benchmarks.cascades import check

    x = torch.randn(4, 16)
    lse = torch.logsumexp(x.double(), dim=-1)
    assert check("logsumexp", [lse.float()], [x], 0) is None
    assert check("logsumexp", [lse.float() + 0.1], [x], 0).startswith("out off by 1.00e-01")


def test_cascades_tuning_arguments_keep_labels_in_range():
    """The tuning runner's arguments: zeros of every dtype (labels in range)."""
    import tvm

    from benchmarks.cascades import arguments_in_range

    info = [["TENSOR", "bfloat16", [2, 8]], ["TENSOR", "int32", [2]], ["TENSOR", "float32", [2]]]
    (args,) = arguments_in_range(tvm.cpu(), info, 1)
    assert [a.numpy().shape for a in args] == [(2, 8), (2,), (2,)]
    assert not any(a.numpy().astype("float32").any() for a in args)


def test_the_tuned_peer_reads_the_package_records_or_those_named(tmp_path, monkeypatch):
    """``tvm-cascade (tuned)``: the package's records by default (a benchmark shape's
    kernel built from them), ``--records DIR`` where named, and with ``--tune`` and no
    ``--records`` a database under ``OUT`` (the package's is read only); a shape without
    a record says so."""
    import argparse
    import shutil

    import tvm

    from benchmarks import tuned_peer
    from benchmarks.cascades import unfused
    from tvm_cascade.ops import cascades

    monkeypatch.delenv("TVM_CASCADE_TUNED_CASCADES", raising=False)
    monkeypatch.setenv("TVM_CASCADE_CACHE", str(tmp_path / "cache"))
    parser = argparse.ArgumentParser()
    tuned_peer.add_arguments(parser)

    def records(*argv):
        args = parser.parse_args(argv)
        args.out = tmp_path / "out"
        return tuned_peer.records_of(args)

    assert records() is None and records("--records", "r") == Path("r")
    assert records("--tune", "8") == tmp_path / "out" / "tuning" / "records"
    assert records("--tune", "8", "--records", "r") == Path("r")
    cuda = tvm.target.Target({"kind": "cuda", "arch": "sm_90"})
    with pytest.raises(RuntimeError, match="no record of this shape"):
        tuned_peer.tuned_kernel(cascades.logsumexp(1000, 32000, "bfloat16"), cuda, 0, None, tmp_path)
    with pytest.raises(RuntimeError, match="no record of this shape"):
        tuned_peer.tuned_kernel(cascades.logsumexp(1024, 128256, "bfloat16"), cuda, 0, tmp_path / "empty", tmp_path)
    if shutil.which("nvcc"):
        kernel, sch = tuned_peer.tuned_kernel(unfused("logsumexp", 1024, 128256, 0, "bfloat16"), cuda, 0, None, tmp_path)
        assert "SplitKUpdate" in {inst.kind.name for inst in sch.trace.insts} and kernel is not None


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("cfg", TINY, ids=lambda c: f"{c.name}-q{c.seq_q}")
def test_torch_peers_express_the_variants(cfg, small_window, monkeypatch):
    """SDPA (MATH backend stands in for the CUDA ones) and eager FlexAttention on CPU."""
    torch = pytest.importorskip("torch")
    from torch.nn.attention.flex_attention import flex_attention

    from benchmarks import peers

    monkeypatch.setattr(peers, "MASK_BACKENDS", {"MATH"})
    monkeypatch.setattr(peers, "_compiled_flex", flex_attention)
    q, k, v = (torch.from_numpy(x).float() for x in _inputs(cfg))
    ref = torch.from_numpy(reference.attention_reference(cfg, q.numpy(), k.numpy(), v.numpy()))
    fn, _ = peers.flex(cfg, q, k, v)
    torch.testing.assert_close(fn(q, k, v), ref, rtol=1e-4, atol=1e-4)
    try:
        fn, _ = peers.sdpa("MATH")(cfg, q, k, v)
    except peers.Unsupported:  # softcap, or is_causal with seq_q != seq_kv
        assert cfg.op.softcap is not None or (cfg.masked and cfg.offset and cfg.op.window is None)
        return
    torch.testing.assert_close(fn(q, k, v), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name, seq_q, seq_kv", [("prefill-alibi", 4, 10), ("prefill-gqa", 7, 7), ("decode-softcap", 1, 16)])
def test_the_runtime_length_kernel_takes_the_harness_configurations(name, seq_q, seq_kv):
    """``tvm_cascade.bench.build_runtime_attention`` (the ``tvm-cascade-runtime`` peer's
    kernel) on the llvm target: the harness's variant, planned once for the shapes, the
    output the reference's; the family that runs it named."""
    torch = pytest.importorskip("torch")
    from tvm_cascade.bench import build_runtime_attention

    cfg = next(c for c in TINY if c.name.startswith(name) and (c.seq_q, c.seq_kv) == (seq_q, seq_kv))
    q, k, v = _inputs(cfg)
    o = cfg.op
    fn, family = build_runtime_attention(o.variant, o.heads_q, o.heads_kv, cfg.head_dim, cfg.dtype,
                                         *(torch.from_numpy(x) for x in (q, k, v)), target="llvm")
    assert family == "generic"
    out = fn(*(torch.from_numpy(x) for x in (q, k, v)))
    np.testing.assert_allclose(out.float().numpy(), reference.attention_reference(cfg, q, k, v), rtol=2e-3, atol=2e-3)


def test_the_runtime_length_kernel_is_not_a_peer():
    """The best peer is the fastest of the other implementations: neither tvm-cascade
    kernel is one."""
    cfg = suite("decode", quick=True)[0]
    rows = report.records(cfg, [Cell("tvm-cascade", OK, ms=1.0), Cell("tvm-cascade-runtime", OK, ms=0.5),
                                Cell("flex", OK, ms=2.0)], None)
    assert report.best_peer(rows)["impl"] == "flex"
    assert [r["vs_best_peer"] for r in rows] == [2.0, 4.0, 1.0]


# --------------------------------------------------------------------------- reporting


def _synthetic():
    prefill = suite("prefill", only=["prefill-causal-b8-s1024"])[0]
    decode = suite("decode", only=["decode-gqa-b8-kv4096"])[0]
    prefill_cells = [
        Cell("tvm-cascade", OK, ms=0.5, max_err=1e-3),
        Cell("sdpa-flash", OK, ms=1.0, max_err=1e-3),
        Cell("sdpa-efficient", OK, ms=2.0, max_err=1e-3, note="enable_gqa"),
        Cell("flex", WRONG, max_err=0.5),
        Cell("tvm-stock", NA, note="needs 99 GB"),
    ]
    decode_cells = [
        Cell("tvm-cascade", NA, note="not implemented"),
        Cell("sdpa-flash", OK, ms=0.25),
        Cell("sdpa-efficient", NA, note="needs 99 GB"),
        Cell("flex", OK, ms=0.2),
        Cell("tvm-stock", NA, note="int32 overflow"),
    ]
    bandwidth = 3000.0
    return bandwidth, [
        (prefill, report.records(prefill, prefill_cells, bandwidth)),
        (decode, report.records(decode, decode_cells, bandwidth)),
    ]


def test_records_ratio_to_best_peer():
    _, [(prefill, p_rows), (decode, d_rows)] = _synthetic()
    p = {r["impl"]: r for r in p_rows}
    assert report.best_peer(p_rows)["impl"] == "sdpa-flash"  # tvm-cascade is never the best peer
    assert p["tvm-cascade"]["vs_best_peer"] == pytest.approx(2.0)
    assert p["sdpa-flash"]["vs_best_peer"] == 1.0
    assert p["sdpa-efficient"]["vs_best_peer"] == pytest.approx(0.5)
    assert p["tvm-cascade"]["tflops"] == pytest.approx(prefill.flops() / 0.5e9)
    assert p["tvm-cascade"]["gbps"] is None  # bandwidth only for decode
    for impl in ("flex", "tvm-stock"):
        assert p[impl]["ms"] is None and p[impl]["tflops"] is None and p[impl]["vs_best_peer"] is None
    d = {r["impl"]: r for r in d_rows}
    assert report.best_peer(d_rows)["impl"] == "flex"
    assert d["sdpa-flash"]["vs_best_peer"] == pytest.approx(0.8)
    assert d["flex"]["gbps"] == pytest.approx(decode.kv_bytes() / 0.2e6)
    assert d["flex"]["roofline_pct"] == pytest.approx(100 * d["flex"]["gbps"] / 3000.0)
    assert d["tvm-cascade"]["vs_best_peer"] is None


def test_no_timed_peer_has_no_ratio():
    cfg = suite("decode", quick=True)[0]
    rows = report.records(cfg, [Cell("tvm-cascade", OK, ms=1.0), Cell("flex", NA, note="x")], None)
    assert report.best_peer(rows) is None and rows[0]["vs_best_peer"] is None
    assert rows[0]["roofline_pct"] is None  # no measured bandwidth
    assert "no timed peer" in report.progress_line(1, 1, cfg, rows)


def test_tables_markdown_and_json(tmp_path):
    bandwidth, results = _synthetic()
    (prefill, p_rows), (decode, d_rows) = results
    table = report.console_table(prefill, p_rows)
    assert prefill.name in table and "WRONG (max err 0.5)" in table and "needs 99 GB" in table
    assert "[1/2] prefill-causal-b8-s1024: tvm-cascade 0.5000 ms best peer sdpa-flash 1.0000 ms (2.00x)" == (
        report.progress_line(1, 2, prefill, p_rows)
    )
    md = report.markdown(results, bandwidth)
    lines = md.splitlines()
    header = (
        "| configuration | tvm-cascade | sdpa-flash | sdpa-efficient | flex | tvm-stock | best peer "
        "| tvm-cascade vs best peer | vs sdpa-flash | vs flex |"
    )
    assert lines.count(header) == 2
    prefill_row = next(line for line in lines if line.startswith("| prefill-causal-b8-s1024 |"))
    cells = [c.strip() for c in prefill_row.strip("|").split("|")]
    assert cells[1] == f"0.500 ({prefill.flops() / 0.5e9:.0f})"
    assert cells[4] == "WRONG (max err 0.5)"
    assert cells[5] == "n/a [1]" and cells[6:8] == ["sdpa-flash", "2.00x"]
    assert cells[8:] == ["2.00x", "-"]  # flex is wrong here: not timed
    decode_row = next(line for line in lines if line.startswith("| decode-gqa-b8-kv4096 |"))
    cells = [c.strip() for c in decode_row.strip("|").split("|")]
    assert cells[1] == "n/a [2]" and cells[3] == "n/a [1]" and cells[5] == "n/a [3]"
    assert cells[4].endswith("%)") and cells[6:] == ["flex", "-", "-", "-"]
    assert "1. needs 99 GB" in lines and "2. not implemented" in lines and "3. int32 overflow" in lines
    doc = {"configs": [report.config_json(cfg, rows) for cfg, rows in results]}
    report.write_json(tmp_path / "r.json", doc)
    loaded = json.loads((tmp_path / "r.json").read_text())
    assert loaded["configs"][0]["best_peer"] == "sdpa-flash" and loaded["configs"][1]["best_peer"] == "flex"
    assert loaded["configs"][1]["heads_q"] == 64 and loaded["configs"][1]["kv_bytes"] == decode.kv_bytes()
    assert [r["status"] for r in loaded["configs"][0]["results"]] == [OK, OK, OK, WRONG, NA]


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    _, results = _synthetic()
    assert report.plot(results, tmp_path / "r.png")
    assert (tmp_path / "r.png").stat().st_size > 0


def test_shape_runner_rewrites_its_json_after_each_shape(tmp_path, monkeypatch, capsys):
    """``run_shapes`` (the cascades, scaled-GEMM and KV-cache benchmarks' loop): the
    chosen shapes' rows, a progress line each, the JSON with the environment and the
    document's entries; nothing without a GPU."""
    pytest.importorskip("torch")
    from benchmarks import attention

    def measure(shape):
        return [{"shape": shape[0], "peer": "p", "ms": shape[1] / 4}, {"shape": shape[0], "peer": "q", "error": "wrong"}]

    shapes = attention.named([("wide 4", 4), ("narrow 2", 2)], ["narrow"])
    monkeypatch.setattr(attention, "skip_without_gpu", lambda module: True)
    assert attention.run_shapes("benchmarks.demo", tmp_path, [], shapes, measure) is None
    assert not (tmp_path / "demo.json").exists()
    monkeypatch.setattr(attention, "skip_without_gpu", lambda module: False)
    rows = attention.run_shapes("benchmarks.demo", tmp_path, ["--only", "narrow"], shapes, measure, tolerance=0.5)
    assert rows == measure(("narrow 2", 2))
    document = json.loads((tmp_path / "demo.json").read_text())
    assert document["results"] == rows and document["tolerance"] == 0.5
    assert document["environment"]["command"] == "python -m benchmarks.demo --only narrow"
    assert capsys.readouterr().out.strip() == "[1/1] narrow 2: p 0.5000 ms; q -- (wrong)"


# --------------------------------------------------------------------------- CLI


def _cuda_gpu():
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _cli_run(module, args, **kwargs):
    """The ``python -m module args`` run, from the repository, of a command-line test,
    started ahead of it, forked from the session's preloaded process (see ``runs_ahead.py``)."""
    return {"args": [sys.executable, "-m", module, *args], "cwd": REPO, "timeout": 300, "forked": True, **kwargs}


def _run_without_gpu(_, command):
    """:func:`test_cli_without_gpu_skips`'s run, the repository on ``PYTHONPATH``; none on a
    machine with a CUDA GPU (the test skips)."""
    if _cuda_gpu():
        return None
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return _cli_run(command[0], command[1:], env=env)


@pytest.mark.parametrize(
    "command",
    [
        ["benchmarks.attention", "--quick"],
        ["benchmarks.profile", "decode-gqa-b8-kv4096"],
        ["benchmarks.profile", "decode-gqa-b8-kv4096", "--kernel-times"],
        ["benchmarks.sweep_decode", "decode-gqa-b8-kv4096", "--grid", '{"pv_keys": [4, 8]}'],
        ["benchmarks.decode_floor", "decode-gqa-b8-kv4096"],
        ["benchmarks.decode_crossover", "--keys", "4096"],
        ["benchmarks.tune_decode", "--trials", "1"],
        ["benchmarks.tune_prefill", "--trials", "1"],
        ["benchmarks.compare_trees", "python", "--only", "prefill-global-b8-s1024"],
        ["benchmarks.wgmma_check"],
        ["benchmarks.models", "--only", "mha-b1-kv2048"],
        ["benchmarks.attention", "--suite", "models", "--only", "mha-b1-kv2048"],
        ["benchmarks.cascades", "--only", "moe"],
        ["benchmarks.scaled_gemm", "--only", "16 x"],
        ["benchmarks.fp8_gemm", "--only", "16 x"],
        ["benchmarks.kv_cache"],
        ["benchmarks.attention_cache_state"],
    ],
)
@runs(_run_without_gpu)
def test_cli_without_gpu_skips(command, runs_ahead, request):
    if _cuda_gpu():
        pytest.skip("a CUDA GPU is present: the harness would run")
    proc = runs_ahead.result(request.node)
    assert proc.returncode == 0, proc.stderr
    assert "skipping" in proc.stdout


def test_compare_trees_builds_each_tree_in_its_own_process(tmp_path, monkeypatch):
    """The build half of ``benchmarks.compare_trees`` (the timing needs a GPU): a kernel
    per tree and configuration, exported, and a tree whose build fails left out."""
    import tvm
    from benchmarks import compare_trees

    monkeypatch.chdir(REPO)
    broken = tmp_path / "broken" / "tvm_cascade"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('a broken tree')\n")
    out = tmp_path / "out"
    out.mkdir()
    target = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
    built = compare_trees._build_all(
        [REPO / "python", broken.parent], ["decode-gqa-b8-kv4096"], out, 2, target
    )
    assert list(built) == [(REPO / "python", "decode-gqa-b8-kv4096")]
    assert all(path.stat().st_size > 0 for path in built.values())


@pytest.mark.parametrize(
    "module, args, message",
    [
        ("profile", ["decode-gqa-b8-kv1"], "unknown configurations ['decode-gqa-b8-kv1']"),
        ("sweep_decode", ["decode-gqa-b8-kv1", "--grid", "{}"], "unknown configuration 'decode-gqa-b8-kv1'"),
        (
            "sweep_decode",
            ["decode-gqa-b8-kv4096", "--grid", '{"pv_rows": [4]}'],
            "['pv_rows'] are not DecodeConfig fields",
        ),
        (
            "sweep_decode",
            ["decode-gqa-b8-kv4096", "--grid", '{"pv_keys": 4}'],
            "--grid must map DecodeConfig fields to lists",
        ),
        ("decode_floor", ["prefill-gqa-b8-s1024"], "unknown configuration 'prefill-gqa-b8-s1024'"),
        ("decode_floor", ["decode-alibi-b8-kv4096"], "plain softmax only (no ALiBi, softcap or window)"),
        (
            "compare_trees",
            ["python", "--only", "prefill-global-b8-s1"],
            "unknown configurations ['prefill-global-b8-s1']",
        ),
        (
            "compare_trees",
            ["benchmarks", "--only", "prefill-global-b8-s1024"],
            "no tvm_cascade package in ['benchmarks']",
        ),
    ],
)
@runs(lambda _, module, args, message: _cli_run(f"benchmarks.{module}", args))
def test_cli_rejects_unknown_configurations_and_arguments(module, args, message, runs_ahead, request):
    proc = runs_ahead.result(request.node)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_decode_floor_takes_what_its_triton_kernels_compute():
    """``benchmarks.decode_floor``'s Triton kernels: one query row of plain softmax, at
    most 16 query heads per K/V head, keys in whole chunks of their steps."""
    from benchmarks import decode_floor
    from benchmarks.configs import Operator

    gqa = _op("decode", "gqa")
    assert decode_floor.supported(Config(gqa, 8, 1, 4096)) is None
    assert decode_floor.supported(Config(_op("decode", "causal"), 8, 1, 32768)) is None
    wide = Operator("decode", "gqa", 64, 2, "causal")
    assert "at most 16 query heads per K/V head, got 32" in decode_floor.supported(Config(wide, 8, 1, 4096))
    assert "a multiple of 512" in decode_floor.supported(Config(gqa, 8, 1, 4000))
    assert "one query row" in decode_floor.supported(Config(gqa, 8, 4, 4096))
    assert "plain softmax only" in decode_floor.supported(Config(_op("decode", "softcap"), 8, 1, 4096))


def test_l2_flush_is_named():
    """The harness reads the flush buffer by default (clean L2 lines), zeroes it on
    request (triton's do_bench); other names are refused before any GPU is touched."""
    from benchmarks import attention, timing

    assert attention.parse_args([]).flush == "read" and attention.parse_args(["--flush", "zero"]).flush == "zero"
    with pytest.raises(SystemExit):
        attention.parse_args(["--flush", "none"])  # (host-bound for short calls: not a harness choice)
    with pytest.raises(ValueError, match="no L2 flush 'cold': one of read, zero, none"):
        timing.l2_flush("cold")


def test_speed_against_a_named_peer():
    rows = [
        {"impl": "tvm-cascade", "status": OK, "ms": 0.5},
        {"impl": "flex", "status": OK, "ms": 0.2},
        {"impl": "sdpa-cudnn", "status": NA, "ms": None},
    ]
    assert report.speed_vs(rows, "flex") == pytest.approx(0.4)
    assert report.speed_vs(rows, "sdpa-cudnn") is None
    assert report.speed_vs(rows[1:], "flex") is None


def test_wgmma_check_kernels_compile_to_warpgroup_instructions():
    """The kernels ``benchmarks.wgmma_check`` runs on a GPU compile for sm_90a to one
    m64n64k16 wgmma each: from shared-memory descriptors (the 128-byte swizzled operands
    1024-byte aligned), with A from four registers, and, scheduled, issued per 64-row half
    by each warp's tensorized intrinsic (the prefill schedule's) with the half's A tile
    and 32 accumulators in registers."""
    from benchmarks import wgmma_check

    sources = {name: lib.mod.imports[0].inspect_source() for name, (lib, _, _) in wgmma_check.build_all().items()}
    instruction = "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {" + ", ".join(f"%{i}" for i in range(32)) + "}"
    for name, source in sources.items():
        assert source.count(instruction) == 1, name
    assert "}, %32, %33, ps0, 1, 1, 0, 0;" in sources["ss"]
    assert "__shared__ alignas(1024)" in sources["ss-swizzle128"]
    assert "}, {%32, %33, %34, %35}, %36, ps0, 1, 1, 0;" in sources["rs"]
    scheduled = sources["schedule"]
    assert "float C_warp_ptr[32];" in scheduled
    # The warp's region offset rounded down to its 64-row half (1024 elements; A after
    # B in dynamic shared memory), each half one batch: fenced, committed, waited for.
    assert re.search(r"cvta_generic_to_shared\(\(&\(\(\(half\*\)buf_dyn_shmem_ptr\)\[\(\(\w+ \* 1024\) \+ 1024\)\]\)\)\)", scheduled)
    batch = re.findall(r"tvm_builtin_ptx_wgmma_(fence|f16_ss|commit_group|wait_group)\w*\(", scheduled.split("__global__")[-1])
    assert batch == ["fence", "f16_ss", "commit_group", "wait_group"]


def test_models_paged_layout_holds_the_keys():
    """benchmarks.models's paged tensors (on the CPU here) hold every sequence's
    keys and values in its pages, in order, the last page partly filled."""
    torch = pytest.importorskip("torch")
    from benchmarks.models import paged

    q, k, v = (torch.randn(2, h, n, 8) for h, n in ((4, 1), (2, 37), (2, 37)))
    q_ragged, pool, q_indptr, page_indptr, page_ids, last = paged(q, k, v, page_size=16)
    assert q_ragged.shape == (2, 4, 8) and torch.equal(q_ragged[1], q[1, :, 0])
    assert q_indptr.tolist() == [0, 1, 2] and page_indptr.tolist() == [0, 3, 6] and last.tolist() == [5, 5]
    for b in range(2):
        ids = page_ids[page_indptr[b]:page_indptr[b + 1]].long()
        keys = pool[ids, 0].permute(1, 0, 2, 3).reshape(2, 48, 8)[:, :37]
        values = pool[ids, 1].permute(1, 0, 2, 3).reshape(2, 48, 8)[:, :37]
        assert torch.equal(keys, k[b]) and torch.equal(values, v[b])


def test_models_ragged_layout_and_causal_mask():
    """benchmarks.models's ragged tensors pack each sequence's tokens in order; its
    causal mask (the reference's, whose pairs the prefill FLOPs count) is aligned to
    the end of the keys."""
    torch = pytest.importorskip("torch")
    from benchmarks.models import causal_mask, ragged

    q, k, v = (torch.randn(3, h, n, 8) for h, n in ((4, 5), (2, 7), (2, 7)))
    q_packed, k_packed, v_packed, q_indptr, kv_indptr = ragged(q, k, v)
    assert q_indptr.tolist() == [0, 5, 10, 15] and kv_indptr.tolist() == [0, 7, 14, 21]
    assert torch.equal(q_packed[5:10], q[1].permute(1, 0, 2)) and torch.equal(v_packed[14:21], v[2].permute(1, 0, 2))
    mask = np.tril(np.ones((5, 7), bool), k=2)
    assert np.array_equal(causal_mask(5, 7).numpy(), mask) and int(causal_mask(4, 4).sum()) == 10
    # A window of 2 keys: query i (at key position i + 2) sees keys i + 1 and i + 2.
    assert np.array_equal(causal_mask(5, 7, window=2).numpy(), mask & ~np.tril(np.ones((5, 7), bool), k=0))


def test_models_reference_softcap():
    """benchmarks.models's float32 reference with a softcap against numpy in float64."""
    torch = pytest.importorskip("torch")
    from benchmarks.models import Shape, causal_mask, reference

    shape = Shape("s", 4, 2, 8, 1, 3, 6, softcap=5.0)
    q, k, v = (torch.randn(1, h, n, 8) for h, n in ((4, 3), (2, 6), (2, 6)))
    out = reference(shape, q, k, v, causal_mask(3, 6)).numpy()
    qn, kn, vn = (x.double().numpy()[0] for x in (q, k, v))
    kn, vn = kn.repeat(2, 0), vn.repeat(2, 0)
    scores = 5.0 * np.tanh(qn @ kn.transpose(0, 2, 1) / np.sqrt(8) / 5.0)
    scores = np.where(causal_mask(3, 6).numpy(), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    expected = (weights / weights.sum(-1, keepdims=True)) @ vn
    np.testing.assert_allclose(out[0], expected, rtol=1e-5, atol=1e-5)


def test_mask_benchmark_table():
    """``benchmarks.masks``' table: each peer's time or "fails", and the faster mask's
    ratio to cuDNN's."""
    from benchmarks import masks

    peers = masks.PEERS
    rows = [{"shape": "s", "peer": peers[0], "ms": 0.1}, {"shape": "s", "peer": peers[1], "ms": 0.25},
            {"shape": "s", "peer": peers[2], "ms": 0.2}, {"shape": "s", "peer": peers[3], "ms": 0.18},
            {"shape": "t", "peer": peers[0], "ms": 0.1}, {"shape": "t", "peer": peers[3], "error": "no kernel"}]
    table = masks.markdown(rows)
    assert "| s | 0.1000 | 0.2500 | 0.2000 | 0.1800 | 0.90x |" in table
    assert "| t | 0.1000 | fails | fails | fails | -- |" in table


@in_a_process_ahead
def test_kv_cache_layer_in_bfloat16_on_the_cpu(tmp_path):
    """``benchmarks.kv_cache_layer --dtype bfloat16`` (tiny shapes on the CPU): the layer,
    its cache and inputs in bfloat16; both pipelines agree and are near the float32
    reference."""
    pytest.importorskip("torch")
    from benchmarks import kv_cache_layer

    argv = ["--target", "llvm", "--small", "--dtype", "bfloat16", "--only", "prefill 1x45", "decode 4x40",
            "--out", str(tmp_path)]
    assert kv_cache_layer.main(argv) == 0
    data = json.loads((tmp_path / "kv_cache_layer.json").read_text())
    assert data["dtype"] == "bfloat16"
    cascade = [r for r in data["results"] if r["pipeline"] == "cascade"]
    assert [r["shape"] for r in cascade] == ["prefill 1x45 small", "decode 4x40 small"]
    assert all(r["agree"] and r["error"] < 0.1 for r in cascade)


@in_a_process_ahead
def test_kv_cache_layer_with_rope_inside_attention_on_the_cpu(tmp_path):
    """``benchmarks.kv_cache_layer --rope inline`` (tiny shapes on the CPU): a cache of
    ``RopeMode.INLINE``, the cascade pipeline's kernels rotating inside attention, both
    pipelines near the float32 reference of RoPE at the tokens' positions."""
    pytest.importorskip("torch")
    from benchmarks import kv_cache_layer

    argv = ["--target", "llvm", "--small", "--rope", "inline", "--only", "prefill 1x45", "decode 4x40", "chunk",
            "--out", str(tmp_path)]
    assert kv_cache_layer.main(argv) == 0
    data = json.loads((tmp_path / "kv_cache_layer.json").read_text())
    assert data["rope"] == "inline"
    cascade = [r for r in data["results"] if r["pipeline"] == "cascade"]
    assert len(cascade) == 3 and all(r["agree"] and r["error"] < 1e-2 for r in cascade)


def test_kv_cache_layer_with_a_sliding_layer_on_the_cpu(tmp_path, capsys):
    """``benchmarks.kv_cache_layer --layer-window 20`` (tiny shapes on the CPU): a chunk
    over cached keys and a decode step of a sliding layer, both pipelines near the
    windowed float32 reference; steps as long as the window are left out."""
    pytest.importorskip("torch")
    from benchmarks import kv_cache_layer

    argv = ["--target", "llvm", "--small", "--layer-window", "20", "--rope", "none", "--only", "prefill 1x45", "chunk",
            "decode 4x40", "--out", str(tmp_path)]
    assert kv_cache_layer.main(argv) == 0
    assert "left out (steps of 20 tokens or more): prefill 1x45 small" in capsys.readouterr().out
    data = json.loads((tmp_path / "kv_cache_layer.json").read_text())
    assert data["layer_window"] == 20
    cascade = [r for r in data["results"] if r["pipeline"] == "cascade"]
    assert [r["shape"] for r in cascade] == ["decode 4x40 small", "chunk 16 over 64 small"]
    assert all(r["agree"] and r["error"] < 0.02 for r in cascade)


def test_tile_costs_fit_splits_times_into_key_and_row_tile_costs():
    """``benchmarks.tile_costs``' fit: times made of a known cost per key tile and per
    row tile come back as those costs, and the table shows them beside each shape."""
    from benchmarks import tile_costs

    row_tiles = tile_costs.BATCH * tile_costs.HEADS_Q * tile_costs.QUERIES // tile_costs.ROWS
    per_key, per_row, sms = 13.0, 7.5, 128
    rows = []
    for name, keys in tile_costs.SHAPES:
        ms = (per_key * keys / tile_costs.KEYS + per_row * row_tiles / sms) / 1e3
        rows += [{"shape": name, "peer": "tvm-cascade", "keys": keys, "ms": ms},
                 {"shape": name, "peer": "sdpa cudnn", "keys": keys, "ms": ms / 2}]
    key_cost, row_cost = tile_costs.fit(rows, "tvm-cascade", sms)
    assert key_cost == pytest.approx(per_key) and row_cost == pytest.approx(per_row)
    assert tile_costs.fit(rows[:2], "tvm-cascade", sms) is None
    table = tile_costs.markdown(rows, sms)
    assert "| 4 x 1024 over 128 keys | 0.0730 | 0.0365 | 0.50x |" in table
    assert "| tvm-cascade | 13.0 us | 7.5 us |" in table
    assert "| sdpa cudnn | 6.5 us | 3.8 us |" in table


def test_prebuild_builds_each_kernel_once_into_the_cache(tmp_path, monkeypatch):
    """``benchmarks.prebuild``: a configuration given twice is built once, in a worker
    process, into the kernel cache, from which the caller then loads it."""
    from benchmarks.prebuild import prebuild

    from tvm_cascade.kernels import attention_kernel
    from tvm_cascade.library import cache

    monkeypatch.setenv("TVM_CASCADE_CACHE", str(tmp_path))
    config = dict(heads_q=2, heads_kv=1, head_dim=16, variant="causal", dtype="float32", target="llvm")
    assert prebuild([config, dict(config)], workers=4) == [config]
    assert len(list(tmp_path.glob("*.json"))) == 1
    kernel = attention_kernel(**config)
    assert cache.load(kernel.spec, [f.name for f in kernel.families], tmp_path) is not None
