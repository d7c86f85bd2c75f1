"""``hoist_cast_offsets``: ``float32(x + c)`` becomes ``float32(x) + c`` where the
analyzer bounds both within float32's exact integers; exact IR and numerics on the CPU."""
import numpy as np
import tvm
import tvm_ffi
from tvm.script import tirx as T

from tvm_cascade.cuda.cast_offsets import hoist_cast_offsets


@T.prim_func
def unrolled(B: T.Buffer((64, 3), "float32")):
    for i in range(64):
        B[i, 0] = T.Cast("float32", i * 4 - 7)
        B[i, 1] = T.Cast("float32", (i * 4 + 9) - i // 2)
        B[i, 2] = T.Cast("float32", i * 4)


@T.prim_func
def hoisted(B: T.Buffer((64, 3), "float32")):
    for i in range(64):
        B[i, 0] = T.Cast("float32", i * 4) + T.float32(-7)
        B[i, 1] = T.Cast("float32", i * 4 - i // 2) + T.float32(9)
        B[i, 2] = T.Cast("float32", i * 4)


@T.prim_func
def unbounded(A: T.Buffer((4,), "int32"), B: T.Buffer((4,), "float32")):
    for i in range(4):
        B[i] = T.Cast("float32", A[i] + 1)
    for i in range((1 << 24) + 1):
        B[0] = T.Cast("float32", i + 1)


def test_offsets_move_after_the_conversion():
    mod = tvm.IRModule({"main": unrolled})
    rewritten = hoist_cast_offsets(mod)["main"]
    assert tvm_ffi.structural_equal(rewritten, hoisted.with_attr("global_symbol", "unrolled"))
    assert tvm_ffi.structural_equal(mod["main"], unrolled)


def test_unbounded_integers_keep_their_conversion():
    # A loaded value has no bound; i + 1 reaches 2**24 + 1, past float32's exact integers.
    mod = tvm.IRModule({"main": unbounded})
    assert tvm_ffi.structural_equal(hoist_cast_offsets(mod)["main"], unbounded)


def test_hoisted_conversions_compute_the_same_values():
    out = tvm.runtime.tensor(np.zeros((64, 3), "float32"), tvm.cpu())
    tvm.compile(hoist_cast_offsets(tvm.IRModule({"main": unrolled})), target="llvm")["main"](out)
    i = np.arange(64)
    expected = np.stack([i * 4 - 7, i * 4 + 9 - i // 2, i * 4], axis=1).astype("float32")
    np.testing.assert_array_equal(out.numpy(), expected)
