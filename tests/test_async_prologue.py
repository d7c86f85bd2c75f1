"""``async_prologue_copies``: the prefill kernel's Q copy becomes a ``cp.async`` group of
its own where the pipelined key loop's first wait covers it, and stays as it is where the
first reader of Q may be a synchronous key loop (a mask's, or one the schedule chose not
to pipeline, ``PrefillConfig(pipeline=False)``). The CUDA it
becomes: ``test_prefill_schedule.test_unmasked_key_loop_prefetches_the_next_tile_asynchronously``;
numerics on the GPU: ``tests/test_kernels.py`` (the unmasked softcap configuration of
whole tiles)."""
import tvm
import tvm_ffi
import tvm_cascade  # noqa: F401

from tvm_cascade import ops
from tvm_cascade.bench import VARIANTS
from tvm_cascade.schedules import prefill
from tvm_cascade.cuda import software_pipeline
from tvm_cascade.cuda.async_prologue import async_prologue_copies


def _kernel_body(func):
    found = []

    def visit(node):
        if isinstance(node, tvm.tirx.For) and node.thread_binding is not None and node.thread_binding.thread_tag == "blockIdx.x":
            found.append(node.body)

    tvm_ffi.structural_walk(func.body, visit)
    (body,) = found
    return list(body.seq)


def _scheduled(variant, config=prefill.PrefillConfig()):
    """The prefill schedule's module as ``prefill.build`` passes it to
    ``async_prologue_copies``: the schedule's pipeline choices applied."""
    func = ops.attention(1, 2, 1, 256, 256, 128, dtype="float16", variant=VARIANTS[variant])
    return software_pipeline.apply_chosen_pipelines(prefill.schedule_prefill(func, config).mod)


def test_q_copy_is_one_commit_group_before_a_pipelined_key_loop():
    mod = _scheduled("global")
    before = _kernel_body(mod["main"])
    after = _kernel_body(async_prologue_copies(mod)["main"])
    # The Q copy, unchanged, inside async_scope inside a commit group; the rest as it was.
    assert len(after) == len(before) == 2
    group = after[0]
    assert (group.attr_key, int(group.value)) == ("async_commit_queue_scope", 0)
    assert (group.body.attr_key, int(group.body.value)) == ("async_scope", 1)
    assert tvm_ffi.structural_equal(group.body.body, before[0])
    assert tvm_ffi.structural_equal(after[1], before[1])


def test_q_copy_stays_where_a_mask_may_read_q_in_a_synchronous_loop():
    mod = _scheduled("causal")
    assert tvm_ffi.structural_equal(async_prologue_copies(mod), mod)


def test_q_copy_stays_before_a_key_loop_that_is_not_pipelined():
    mod = _scheduled("global", prefill.PrefillConfig(pipeline=False))
    assert tvm_ffi.structural_equal(async_prologue_copies(mod), mod)
