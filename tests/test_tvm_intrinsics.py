"""TVM's tensor intrinsics imported with a cheap frame capture
(:mod:`tvm_cascade.tvm_intrinsics`): ``prim_func`` gets the frames and the one source
line it reads from ``inspect.stack()``, and the intrinsics it registers are TVM's."""
import importlib
import inspect

import tvm
import tvm_ffi

from tvm_cascade import tvm_intrinsics


def _both():
    return tvm_intrinsics._stack(), inspect.stack()  # pylint: disable=protected-access


def test_the_stack_has_inspects_frames_and_the_line_prim_func_reads():
    cheap, full = _both()
    assert [f.frame for f in cheap] == [f.frame for f in full]
    assert [(f.filename, f.function) for f in cheap] == [(f.filename, f.function) for f in full]
    assert [f.lineno for f in cheap[1:]] == [f.lineno for f in full[1:]]
    read = tvm_intrinsics._READ_FRAME  # pylint: disable=protected-access
    assert cheap[read].code_context == full[read].code_context is not None
    assert all(f.code_context is None for i, f in enumerate(cheap) if i != read)


def test_imported_registers_the_intrinsics_and_restores_the_entry():
    """The CUDA intrinsics a schedule tensorizes with are registered, and the TVMScript
    entry takes ``inspect`` itself again afterwards."""
    cuda = tvm_intrinsics.imported("tvm.s_tir.tensor_intrin.cuda")
    assert tvm.s_tir.TensorIntrin.get(cuda.LDMATRIX_f16_A_INTRIN) is not None
    assert importlib.import_module(tvm_intrinsics._ENTRY).inspect is inspect  # pylint: disable=protected-access
    assert tvm_intrinsics.imported("tvm.s_tir.tensor_intrin.cuda") is cuda


def test_the_intrinsics_are_those_inspects_stack_makes():
    """Intrinsics the schedules tensorize with, registered during the import, are those
    TVM's generators make outside an import (``prim_func`` with ``inspect.stack()``)."""
    cuda = tvm_intrinsics.imported("tvm.s_tir.tensor_intrin.cuda")
    for name, made in [
        (cuda.LDMATRIX_f16_A_INTRIN, cuda.get_ldmatrix_intrin(16, "float16", "A", False)),
        (cuda.LDMATRIX_f16_B_TRANS_INTRIN, cuda.get_ldmatrix_intrin(16, "float16", "B", True)),
        (cuda.MMA_f16f16f32_INTRIN, cuda.get_mma_intrin(16, "float16", "float16", "float32", False, False)),
    ]:
        registered = tvm.s_tir.TensorIntrin.get(name)
        assert tvm_ffi.structural_equal(registered.desc, made[0]) and tvm_ffi.structural_equal(registered.impl, made[1])
