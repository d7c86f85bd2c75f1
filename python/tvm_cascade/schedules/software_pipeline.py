"""Software pipelines of the prefill kernel's key loops, in TVM's annotations.

A key loop whose first statements copy the K and V tiles to shared memory is pipelined
in two stages: the copies of the next tile (``cp.async`` into double-buffered shared
memory) while the rest computes this one. Whether a loop is pipelined can be a choice of
the schedule (a MetaSchedule sample): the schedule then annotates the loop with
:data:`CHOSEN`, whose value may be a sampled ``ExprRV``, and :func:`apply_chosen_pipelines`
turns a chosen loop's annotation into TVM's at build time (a trace cannot write TVM's
list-valued annotations from a sampled decision).
"""
import tvm_ffi
from tvm import tirx
from tvm.s_tir.stmt import SBlockRealize

from ..primitives import ir


STAGES = "software_pipeline_stage"
ORDER = "software_pipeline_order"
ASYNC_STAGES = "software_pipeline_async_stages"
#: A loop annotation: 1 to pipeline the loop (:func:`apply_chosen_pipelines`), 0 not to.
CHOSEN = "tvm_cascade.software_pipeline"


def pipeline_statements(loop):
    """The statements of ``loop`` that a software pipeline's stage annotation numbers:
    TVM's lowering lifts thread-bound loops before it pipelines, so a thread-bound child
    loop's statements count one by one."""
    body = loop.body.block.body if isinstance(loop.body, SBlockRealize) else loop.body
    stmts = []
    for child in body.seq if isinstance(body, tirx.SeqStmt) else [body]:
        lifted = (
            isinstance(child, tirx.For) and child.thread_binding is not None and isinstance(child.body, tirx.SeqStmt)
        )
        stmts.extend(child.body.seq if lifted else [child])
    return stmts


def pipeline_annotations(loop):
    """TVM's annotations that pipeline ``loop`` (a ``For``) whose first two statements
    copy the next tile's K and V asynchronously while the rest computes this one."""
    count = len(pipeline_statements(loop))
    return {STAGES: [0, 0] + [1] * (count - 2), ORDER: list(range(count)), ASYNC_STAGES: [0]}


def _apply_choice(loop):
    if CHOSEN not in loop.annotations:
        return loop
    annotations = {k: v for k, v in loop.annotations.items() if k != CHOSEN}
    if int(loop.annotations[CHOSEN]):
        annotations.update(pipeline_annotations(loop))
    return ir.copy_loop(loop, annotations=annotations)


@tirx.transform.prim_func_pass(opt_level=0, name="tvm_cascade.ApplyChosenPipelines")
def apply_chosen_pipelines(func, _mod, _ctx):
    """Loops annotated :data:`CHOSEN` 1 get TVM's software pipeline annotations
    (:func:`pipeline_annotations`), those annotated 0 none; the choice's annotation goes.
    For scheduled functions, before lowering."""
    return func.with_body(tvm_ffi.structural_map(func.body, (tirx.For, _apply_choice)))
