"""The end-to-end examples run on the CPU: both pipelines agree with the reference."""

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _run(script, *args):
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_llama_block_fuses_attention_and_matches_numpy():
    out = _run("llama_block.py", "--shapes", "1x31,8x40")
    assert "attention kernels: 1" in out
    assert out.count("|default - cascade|") == 2


@pytest.mark.parametrize("attention", ["sdpa", "manual"])
def test_torch_export_fuses_attention_and_matches_pytorch(attention):
    pytest.importorskip("torch")
    out = _run("torch_export.py", "--seq", "32", "--attention", attention)
    assert "attention kernels: 1" in out
    assert "|cascade - ref|" in out
