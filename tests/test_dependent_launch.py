"""Programmatic dependent launch: which functions get it, the waits put first in their
kernels (exact IR), and what ``tensor_cores.build`` emits for sm_90a and sm_80."""

import numpy as np
import tvm
import tvm_ffi
from tvm.script import tirx as T

from tvm_cascade.cuda import dependent_launch, tensor_cores

from launches import WAITS, kernel_prologues

HOPPER = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
AMPERE = tvm.target.Target({"kind": "cuda", "arch": "sm_80"})


@T.prim_func(s_tir=True)
def two_kernels(A: T.Buffer((256,), "float32"), C: T.Buffer((256,), "float32")):
    B = T.sblock_alloc_buffer((256,), "float32")
    for i in T.thread_binding(2, "blockIdx.x"):
        for t in T.thread_binding(128, "threadIdx.x"):
            with T.sblock("b"):
                B[i * 128 + t] = A[i * 128 + t] * T.float32(2)
    for i in T.thread_binding(2, "blockIdx.x"):
        for t in T.thread_binding(128, "threadIdx.x"):
            with T.sblock("c"):
                C[i * 128 + t] = B[255 - i * 128 - t] + T.float32(1)


@T.prim_func(s_tir=True)
def one_kernel_2d_grid(A: T.Buffer((4, 256), "float32")):
    for i in T.thread_binding(4, "blockIdx.y"):
        for j in T.thread_binding(2, "blockIdx.x"):
            for t in T.thread_binding(128, "threadIdx.x"):
                with T.sblock("a"):
                    A[i, j * 128 + t] = T.float32(0)


@T.prim_func
def launched_kernels(A: T.Buffer((4, 256), "float32")):
    # kernels written as launches (as the warp-specialised GEMMs are), the second of a 2-d grid
    with T.launch_thread("blockIdx.x", 2) as i:
        t = T.launch_thread("threadIdx.x", 128)
        A[0, i * 128 + t] = T.float32(0)
    with T.launch_thread("blockIdx.y", 4) as i:
        j = T.launch_thread("blockIdx.x", 2)
        t = T.launch_thread("threadIdx.x", 128)
        A[i, j * 128 + t] = T.float32(1)


@T.prim_func
def kernel(A: T.Buffer((128,), "float32")):
    T.func_attr({"tirx.kernel_launch_params": ["threadIdx.x", "tirx.use_programtic_dependent_launch"]})
    for t in range(128):
        A[t] = T.float32(0)


@T.prim_func
def kernel_waiting(A: T.Buffer((128,), "float32")):
    T.func_attr({"tirx.kernel_launch_params": ["threadIdx.x", "tirx.use_programtic_dependent_launch"]})
    T.ptx.griddepcontrol.wait()
    T.ptx.griddepcontrol.launch_dependents()
    for t in range(128):
        A[t] = T.float32(0)


@T.prim_func
def ordinary_kernel(A: T.Buffer((128,), "float32")):
    T.func_attr({"tirx.kernel_launch_params": ["threadIdx.x"]})
    for t in range(128):
        A[t] = T.float32(0)


def test_kernels_are_the_outermost_grid_loops():
    assert dependent_launch.kernel_count(two_kernels) == 2
    assert dependent_launch.kernel_count(one_kernel_2d_grid) == 1
    assert dependent_launch.kernel_count(launched_kernels) == 2


def test_enable_names_the_launch_tag_once():
    enabled = dependent_launch.enable(two_kernels)
    assert list(enabled.attrs[dependent_launch.LAUNCH_PARAMS]) == [dependent_launch.LAUNCH_TAG]
    assert dependent_launch.enable(enabled).same_as(enabled)


def test_dependent_kernels_wait_first_and_others_are_unchanged():
    mod = tvm.IRModule({"kernel": kernel, "ordinary": ordinary_kernel})
    waited = dependent_launch.wait_first(mod)
    assert tvm_ffi.structural_equal(waited["kernel"], kernel_waiting.with_attr("global_symbol", "kernel"))
    assert waited["ordinary"].same_as(mod["ordinary"])


def test_supported_from_sm_90():
    assert dependent_launch.supported(HOPPER)
    assert dependent_launch.supported(tvm.target.Target("nvidia/nvidia-h100"))
    assert dependent_launch.supported(tvm.target.Target({"kind": "cuda", "arch": "sm_100f"}))
    assert not dependent_launch.supported(AMPERE)
    assert not dependent_launch.supported(tvm.target.Target("llvm"))


def test_hopper_builds_of_several_kernels_wait_first_in_each():
    source = tensor_cores.build(tvm.IRModule({"main": two_kernels}), HOPPER).mod.imports[0].inspect_source()
    assert kernel_prologues(source) == [WAITS, WAITS]


def test_single_kernels_and_older_cards_launch_in_order():
    single = tensor_cores.build(tvm.IRModule({"main": one_kernel_2d_grid}), HOPPER).mod.imports[0].inspect_source()
    ampere = tensor_cores.build(tvm.IRModule({"main": two_kernels}), AMPERE).mod.imports[0].inspect_source()
    assert "griddepcontrol" not in single and "griddepcontrol" not in ampere
    assert len(kernel_prologues(ampere)) == 2


@T.prim_func(s_tir=True)
def serial(A: T.Buffer((256,), "float32"), C: T.Buffer((256,), "float32")):
    B = T.sblock_alloc_buffer((256,), "float32")
    for i in range(256):
        with T.sblock("b"):
            B[i] = A[i] * T.float32(2)
    for i in range(256):
        with T.sblock("c"):
            C[i] = B[255 - i] + T.float32(1)


def test_cpu_builds_compute_the_same_values():
    # The default pipeline's path through tensor_cores.build (no warp buffers).
    a = np.random.default_rng(0).standard_normal(256).astype("float32")
    c = tvm.runtime.tensor(np.zeros(256, "float32"), tvm.cpu())
    tensor_cores.build(tvm.IRModule({"main": serial}), "llvm")["main"](tvm.runtime.tensor(a, tvm.cpu()), c)
    np.testing.assert_allclose(c.numpy(), a[::-1] * 2 + 1, rtol=1e-6)
