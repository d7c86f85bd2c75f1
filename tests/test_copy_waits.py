"""``copy_waits.defer_copy_waits``: a pipelined loop that commits several ``cp.async``
groups an iteration waits for each where its shared memory is first read, at the barrier
before the reader, with the depth that leaves later groups in flight. The prefill kernel
this serves: ``test_prefill_schedule.test_unmasked_key_loop_prefetches_the_next_tile_asynchronously``;
its numerics on the GPU: ``tests/test_kernels.py``."""
import tvm
import tvm_ffi
from tvm.script import tirx as T

from tvm_cascade.cuda.copy_waits import defer_copy_waits


def _loop_of_two_groups(prologue_order="kv", barrier_before_v=True, constant_depth=True):
    """TVM's pipeline of a loop that reads K, copies the next K, reads V, copies the next
    V (the prefill kernel's interleaved key loop, in small): one wait of depth 0 before
    the K reader."""
    k_first = prologue_order == "kv"

    @T.prim_func(private=True)
    def func(k: T.Buffer((4, 8), "float16"), v: T.Buffer((4, 8), "float16"), out: T.Buffer((4, 8), "float16")):
        k_shared = T.alloc_buffer((8,), "float16", scope="shared")
        v_shared = T.alloc_buffer((8,), "float16", scope="shared")
        with T.attr(0, "async_commit_queue_scope", 0):
            if k_first:
                T.s_tir.cp_async_raw("float16", k_shared.data, 0, k.data, 0, 16)
                T.s_tir.cp_async_raw("float16", v_shared.data, 0, v.data, 0, 16)
            else:
                T.s_tir.cp_async_raw("float16", v_shared.data, 0, v.data, 0, 16)
                T.s_tir.cp_async_raw("float16", k_shared.data, 0, k.data, 0, 16)
        for j in range(3):
            with T.attr(0, "async_wait_queue_scope", 0):
                with T.attr(0, "async_wait_inflight_count", 0 if constant_depth else T.if_then_else(j < 2, 0, 1)):
                    T.tvm_storage_sync("shared")
                    out[j, 0] = k_shared[0]
            with T.attr(0, "async_commit_queue_scope", 0):
                T.tvm_storage_sync("shared")
                T.s_tir.cp_async_raw("float16", k_shared.data, 0, k.data, j * 8 + 8, 16)
            if barrier_before_v:
                T.tvm_storage_sync("shared")
            out[j, 1] = v_shared[0]
            with T.attr(0, "async_commit_queue_scope", 0):
                T.tvm_storage_sync("shared")
                T.s_tir.cp_async_raw("float16", v_shared.data, 0, v.data, j * 8 + 8, 16)

    return func


@T.prim_func(private=True)
def _deferred(k: T.Buffer((4, 8), "float16"), v: T.Buffer((4, 8), "float16"), out: T.Buffer((4, 8), "float16")):
    k_shared = T.alloc_buffer((8,), "float16", scope="shared")
    v_shared = T.alloc_buffer((8,), "float16", scope="shared")
    # The prologue's group split in the loop's order: the first iteration finds K's and
    # V's groups as the later ones find the previous iteration's.
    with T.attr(0, "async_commit_queue_scope", 0):
        T.s_tir.cp_async_raw("float16", k_shared.data, 0, k.data, 0, 16)
    with T.attr(0, "async_commit_queue_scope", 0):
        T.s_tir.cp_async_raw("float16", v_shared.data, 0, v.data, 0, 16)
    for j in range(3):
        # K complete, V in flight.
        with T.attr(0, "async_wait_queue_scope", 0):
            with T.attr(0, "async_wait_inflight_count", 1):
                T.tvm_storage_sync("shared")
        out[j, 0] = k_shared[0]
        with T.attr(0, "async_commit_queue_scope", 0):
            T.tvm_storage_sync("shared")
            T.s_tir.cp_async_raw("float16", k_shared.data, 0, k.data, j * 8 + 8, 16)
        # V complete, the next K in flight.
        with T.attr(0, "async_wait_queue_scope", 0):
            with T.attr(0, "async_wait_inflight_count", 1):
                T.tvm_storage_sync("shared")
        out[j, 1] = v_shared[0]
        with T.attr(0, "async_commit_queue_scope", 0):
            T.tvm_storage_sync("shared")
            T.s_tir.cp_async_raw("float16", v_shared.data, 0, v.data, j * 8 + 8, 16)


def _deferred_copy_waits(func):
    return defer_copy_waits(tvm.IRModule({"main": func}))["main"]


def test_each_group_is_waited_for_at_the_barrier_before_its_first_reader():
    assert tvm_ffi.structural_equal(_deferred_copy_waits(_loop_of_two_groups()), _deferred)


def test_waits_stay_where_the_first_iteration_would_need_others():
    # The prologue commits V's copy before K's: in the first iteration K's group is
    # not the older one, so depth 1 before the K reader would not cover it.
    func = _loop_of_two_groups(prologue_order="vk")
    assert tvm_ffi.structural_equal(_deferred_copy_waits(func), func)


def test_waits_stay_where_a_reader_has_no_barrier_before_it():
    # Without a barrier between them, the wait would cover this thread's V copies only.
    func = _loop_of_two_groups(barrier_before_v=False)
    assert tvm_ffi.structural_equal(_deferred_copy_waits(func), func)


def test_waits_stay_where_a_depth_is_not_a_constant():
    # (TVM's pipeline over a loop of a run-time trip count writes depths as expressions.)
    func = _loop_of_two_groups(constant_depth=False)
    assert tvm_ffi.structural_equal(_deferred_copy_waits(func), func)


def test_depths_written_as_expressions_of_constants_become_constants():
    """TVM's pipeline over a loop of a run-time trip count writes its epilogue's depths as
    ``if_then_else(True & True, d, d')`` (d = d' in the interleaved pipeline, not in the
    double-buffered one of wgmma's merged causal loop); PTX wants the constant."""

    def wait(depth):
        @T.prim_func(private=True)
        def func(k: T.Buffer((8,), "float16"), out: T.Buffer((1,), "float16")):
            k_shared = T.alloc_buffer((8,), "float16", scope="shared")
            with T.attr(0, "async_commit_queue_scope", 0):
                T.s_tir.cp_async_raw("float16", k_shared.data, 0, k.data, 0, 16)
            with T.attr(0, "async_wait_queue_scope", 0):
                with T.attr(0, "async_wait_inflight_count", depth):
                    T.tvm_storage_sync("shared")
                    out[0] = k_shared[0]

        return tvm.IRModule({"main": func})

    after = defer_copy_waits(wait(T.if_then_else(T.bool(True) & T.bool(True), 0, 0)))
    tvm.ir.assert_structural_equal(after, wait(0))
    after = defer_copy_waits(wait(T.if_then_else(T.bool(True) & T.bool(True), 1, 0)))
    tvm.ir.assert_structural_equal(after, wait(1))
    after = defer_copy_waits(wait(T.if_then_else(T.bool(True) | T.bool(False), 0, 1) + T.if_then_else(T.bool(False) | T.bool(False), 1, 0)))
    tvm.ir.assert_structural_equal(after, wait(0))
