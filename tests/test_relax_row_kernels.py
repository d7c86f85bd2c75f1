"""The ``"cascade"`` pipeline on GPU targets schedules a Relax model's row chains
(softmax, log-softmax) as one block per row (``tvm_cascade.relax.row_kernels``); what
the schedule does not serve is left to dlight, logged. Numerics: test_relax_row_kernels_gpu.py."""
import logging
import re
import shutil

import pytest
import tvm
from relax_attention_cases import SM90A, row_kernels_else_default
from relax_row_cases import row_model
from tvm import relax

import tvm_cascade  # noqa: F401  (registers the "cascade" pipeline)
from tvm_cascade.relax.row_kernels import LONGEST_ROW, row_kernel

CUDA = tvm.target.Target(SM90A)


def _lower(mod, target=CUDA):
    with target:
        return relax.get_pipeline("cascade")(mod), relax.get_default_pipeline(target)(mod)


@pytest.mark.parametrize("kind, expected", [("softmax", ["softmax"]), ("log_softmax", ["log_softmax"])])
def test_row_chains_become_row_kernels(kind, expected):
    """The legalised softmax and log-softmax are the row kernels, scheduled for dlight to
    leave; the cast before them is the default pipeline's."""
    cascade, default = _lower(row_model(kind, 64, 4096, "float16"))
    assert row_kernels_else_default(cascade, default) == expected
    assert bool(cascade[expected[0]].attrs["tirx.is_scheduled"])


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_a_symbolic_number_of_rows_is_one_kernel_for_any_count():
    """Tokens as a symbolic extent: the softmax is one kernel of 128-thread blocks
    (rows of 4096: one warp each, four rows a block)."""
    executable = tvm.compile(row_model("softmax", tvm.tirx.Var("tokens", "int64"), 4096, "float16"), CUDA,
                             relax_pipeline="cascade")
    source = executable.mod.imports[0].imports[0].inspect_source()
    kernels = re.findall(r"__global__ void (?:__launch_bounds__\((\d+)\) )?(\w+)\(", source)
    assert ("128", "softmax_kernel") in kernels


def test_what_the_schedule_does_not_serve_is_left_to_dlight(caplog):
    """Rows whose length is known only at run time: the default schedule, and why."""
    mod = row_model("softmax", 64, tvm.tirx.Var("n", "int64"), "float16")
    with caplog.at_level(logging.INFO, logger="tvm_cascade.relax"):
        cascade, default = _lower(mod)
    assert row_kernels_else_default(cascade, default) == []
    assert "'softmax' left to the default schedules: its rows' length is known only at run time" in caplog.text


def test_a_function_without_a_row_chain_is_not_touched():
    from tvm import te

    x = te.placeholder((4, 8), "float32", name="x")
    k = te.reduce_axis((0, 8), name="k")
    assert row_kernel(te.create_prim_func([x, te.compute((4,), lambda i: te.sum(x[i, k], axis=k), name="total")])) is None


def test_rows_longer_than_the_measured_limit_stay_with_dlight(caplog):
    """A log-softmax over a vocabulary (128256 > LONGEST_ROW): dlight's, and why."""
    with caplog.at_level(logging.INFO, logger="tvm_cascade.relax"):
        cascade, default = _lower(row_model("log_softmax", 8, 128256, "bfloat16"))
    assert row_kernels_else_default(cascade, default) == []
    assert f"'log_softmax' left to the default schedules: rows of 128256 elements, longer than {LONGEST_ROW}" in caplog.text
