"""The end-to-end examples run on the CPU: both pipelines agree with the reference."""

import importlib.util
import sys
from pathlib import Path

import pytest
from runs_ahead import runs

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _runs_example(command, needs=None):
    """Marks a test that checks the output of an example run (started ahead of it, see
    ``runs_ahead.py``): ``command(**the test's parameters)``, the script and its
    arguments, run in a folder of its own; ``needs``: a module the script imports,
    without which it is not run (the test skips)."""

    def make(tmp_path_factory, **params):
        if needs is not None and importlib.util.find_spec(needs) is None:
            return None
        script, *args = command(**params)
        return {"args": [sys.executable, str(EXAMPLES / script), *args], "cwd": tmp_path_factory.mktemp("example"),
                "timeout": 300, "forked": True}

    return runs(make)


def _output(runs_ahead, request):
    """The output of the example run of ``request``'s test, which exits 0."""
    result = runs_ahead.result(request.node)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@_runs_example(lambda: ["llama_block.py", "--shapes", "1x31,8x40,3x1x31"])
def test_llama_block_fuses_attention_and_matches_numpy(runs_ahead, request):
    """Single sequences and a batch of three (``BATCHxNEWxPAST``), each step checked
    against numpy."""
    out = _output(runs_ahead, request)
    assert out.count("attention kernels: 1") == 2  # an export for one sequence, one for three
    assert out.count("|default - cascade|") == 3
    assert "batch 3, seq 1, past 31" in out


@_runs_example(lambda: ["llama_block.py", "--tune", "4", "--shapes", "1x63", "--work-dir", "tuning"])
def test_llama_block_attention_tuned_by_metaschedule(runs_ahead, request):
    """``--tune``: ``tune_relax`` over the grouped attention's fused schedules measures
    fusions, the records apply to the block, and the block matches numpy."""
    out = _output(runs_ahead, request)
    assert "attention: 4 schedules measured, 4 of them fused; the best fused" in out
    assert "tuned, seq 1, past 63" in out


@_runs_example(lambda attention: ["torch_export.py", "--seq", "32", "--attention", attention], needs="torch")
@pytest.mark.parametrize("attention", ["sdpa", "manual"])
def test_torch_export_fuses_attention_and_matches_pytorch(attention, runs_ahead, request):
    pytest.importorskip("torch")
    out = _output(runs_ahead, request)
    assert "attention kernels: 1" in out
    assert "|cascade - ref|" in out


@_runs_example(lambda: ["torch_export.py", "--seq", "32,17", "--dynamic"], needs="torch")
def test_torch_export_with_a_dynamic_length_matches_pytorch(runs_ahead, request):
    """``--dynamic``: the exported length is symbolic; both pipelines compile once and
    agree at every length."""
    pytest.importorskip("torch")
    out = _output(runs_ahead, request)
    assert out.count("attention kernels:") == 1
    assert "seq 32 (dynamic)" in out and "seq 17 (dynamic)" in out



@pytest.mark.parametrize("batch, seq, past, family", [
    (1, 16, 48, "warp_specialized_prefill"), (1, 1, "past", "tensor_core_decode"), (32, 1, "past", "tensor_core_decode"),
])
def test_llama_block_mask_input_runs_the_library_kernels_on_cuda(batch, seq, past, family, monkeypatch):
    """``examples/llama_block.py`` in fp16 for an H100/H200: its attention, which adds the
    block's mask tensor input, is dispatched to the kernel library's prefill and decode
    kernels reading that mask (what its ``--target cuda --time`` measures)."""
    import types

    import tvm

    from tvm_cascade.relax.dispatch import LIBRARY_ATTR, DispatchAttention

    monkeypatch.syspath_prepend(str(EXAMPLES))
    import llama_block

    args = types.SimpleNamespace(hidden=1024, heads_q=8, heads_kv=2, intermediate=512, dtype="float16")
    mod, _ = llama_block.build(args, seq, past, batch)
    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        out = DispatchAttention()(mod)
    kernels = [f for _, f in out.functions_items() if isinstance(f, tvm.tirx.PrimFunc) and LIBRARY_ATTR in f.attrs]
    assert [str(f.attrs[LIBRARY_ATTR]) for f in kernels] == [family]
    assert [p.name for p in kernels[0].params][3] == "mask"


@_runs_example(lambda attention, dtype: ["torch_export.py", "--seq", "32", "--attention", attention, "--dtype", dtype],
               needs="torch")
@pytest.mark.parametrize("attention, dtype", [("manual", "float16"), ("sdpa", "bfloat16")])
def test_torch_export_in_16_bits_matches_pytorch(attention, dtype, runs_ahead, request):
    """``--dtype float16`` / ``bfloat16``: the example's converters (matmuls accumulated in
    float32; bfloat16 layer norms in float32) let TVM import and compile the block;
    attention is fused and both pipelines agree with PyTorch in float64."""
    pytest.importorskip("torch")
    out = _output(runs_ahead, request)
    assert "attention kernels: 1" in out and f"seq 32, {attention}, {dtype}" in out


@pytest.mark.parametrize("attention, dynamic, dtype", [("sdpa", False, "float16"), ("manual", True, "bfloat16")])
def test_torch_export_16_bit_attention_runs_the_library_kernels_on_cuda(attention, dynamic, dtype, monkeypatch):
    """``examples/torch_export.py`` exported in a 16-bit type for an H100/H200: its
    attention (a float32-accumulated matmul cast to the model's type, folded back from
    ``torch.export``'s flattened batched matmuls) is the library's prefill kernel."""
    pytest.importorskip("torch")
    import types

    import tvm

    from tvm_cascade.relax.dispatch import LIBRARY_ATTR, DispatchAttention

    monkeypatch.syspath_prepend(str(EXAMPLES))
    import torch_export

    args = types.SimpleNamespace(hidden=512, heads_q=4, heads_kv=2, attention=attention, dynamic=dynamic, max_seq=512, dtype=dtype)
    mod, _, _ = torch_export.export(args, 40)
    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        out = DispatchAttention()(mod)
    kernels = [f for _, f in out.functions_items() if isinstance(f, tvm.tirx.PrimFunc) and LIBRARY_ATTR in f.attrs]
    assert [str(f.attrs[LIBRARY_ATTR]) for f in kernels] == ["warp_specialized_prefill"]
    assert str(kernels[0].attrs["global_symbol"]).endswith(f"_d128_{dtype}_causal")
