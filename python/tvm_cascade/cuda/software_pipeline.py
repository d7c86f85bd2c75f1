"""Software pipelines of the prefill kernel's key loops, in TVM's annotations.

A key loop whose first statements copy the K and V tiles to shared memory is pipelined
in two stages: the copies of the next tile (``cp.async``) while the rest computes this
one, either double-buffered (:func:`pipeline_annotations`) or, FlashAttention-2's way,
in single buffers, each copy issued once the tile it overwrites is read
(:func:`interleaved_annotations`). Whether a loop is pipelined can be a choice of
the schedule (a MetaSchedule sample): the schedule then annotates the loop with
:data:`CHOSEN`, whose value may be a sampled ``ExprRV``, and :func:`apply_chosen_pipelines`
turns a chosen loop's annotation into TVM's at build time (a trace cannot write TVM's
list-valued annotations from a sampled decision).
"""
import tvm_ffi
from tvm import tirx
from tvm.s_tir.stmt import SBlock, SBlockRealize

from ..primitives import ir


STAGES = "software_pipeline_stage"
ORDER = "software_pipeline_order"
ASYNC_STAGES = "software_pipeline_async_stages"
#: A loop annotation: 1 to pipeline the loop (:func:`apply_chosen_pipelines`), 0 not to,
#: :data:`OVERLAPPED` for :func:`overlap_annotations`, :data:`INTERLEAVED` for
#: :func:`interleaved_annotations`.
CHOSEN = "tvm_cascade.software_pipeline"
OVERLAPPED = 2
#: A :data:`CHOSEN` value: :func:`interleaved_annotations`.
INTERLEAVED = 3


def pipeline_statements(loop):
    """The statements of ``loop`` that a software pipeline's stage annotation numbers:
    TVM's lowering lifts thread-bound loops before it pipelines, so a thread-bound child
    loop's statements count one by one."""
    body = loop.body.block.body if isinstance(loop.body, SBlockRealize) else loop.body
    stmts = []
    for child in ir.statements(body):
        lifted = (
            isinstance(child, tirx.For) and child.thread_binding is not None and isinstance(child.body, tirx.SeqStmt)
        )
        stmts.extend(child.body.seq if lifted else [child])
    return stmts


def statement_blocks(loop):
    """The names of the blocks of each of ``loop``'s :func:`pipeline_statements` (a
    statement is a loop nest, or a branch between two)."""
    return [[block.name_hint for block in ir.nodes(stmt, SBlock)] for stmt in pipeline_statements(loop)]


def _positions(order):
    """TVM's ORDER for statements listed in their new ``order``: each statement's
    position in the new body."""
    return [order.index(k) for k in range(len(order))]


def pipeline_annotations(loop):
    """TVM's annotations that pipeline ``loop`` (a ``For``) whose first two statements
    copy the next tiles (the prefill's K and V, a GEMM's operands) asynchronously while
    the rest computes this one."""
    count = len(pipeline_statements(loop))
    return {STAGES: [0, 0] + [1] * (count - 2), ORDER: list(range(count)), ASYNC_STAGES: [0]}


def interleaved_annotations(loop):
    """TVM's annotations that pipeline the prefill kernel's key loop ``loop`` whose first
    statements copy the K and V tiles, FlashAttention-2's way: the next tile's K copy
    issued right after Q·Kᵀ (statement of a ``qk_update`` block) has read this tile's,
    its V copy last, after P·V; both copies asynchronous (TVM waits for both before
    Q·Kᵀ; :func:`.copy_waits.defer_copy_waits` waits for V before P·V instead). Each is
    issued after the last read of the buffer it overwrites, so TVM keeps one buffer of
    each (a third less shared memory than :func:`pipeline_annotations`); the K copy runs
    while the softmax and P·V do, the V copy while the next Q·Kᵀ and softmax do."""
    names = statement_blocks(loop)
    scores = [k for k, blocks in enumerate(names) if any(name.startswith("qk_update") for name in blocks)]
    # (The copies' blocks are named after the buffers they copy: K_shared..., V_shared....)
    copies = {names[k][0][:2]: k for k in (0, 1) if len(names) > 2 and len(names[k]) == 1}
    if len(scores) != 1 or sorted(copies) != ["K_", "V_"]:
        raise ValueError("the interleaved key loop needs its K and V tile copies first and one Q·Kᵀ statement")
    rest = range(2, len(names))
    order = [k for k in rest if k <= scores[0]] + [copies["K_"]] + [k for k in rest if k > scores[0]] + [copies["V_"]]
    return {STAGES: [0, 0] + [1] * (len(names) - 2), ORDER: _positions(order), ASYNC_STAGES: [0]}


def overlap_annotations(loop):
    """TVM's annotations that pipeline the prefill kernel's key loop ``loop`` on warpgroup
    MMAs in FlashAttention-3's order, three stages: the copies of tile j+2 (asynchronous),
    Q·Kᵀ and the softmax of tile j+1, P·V of tile j; tile j+1's Q·Kᵀ and tile j's P·V are
    issued back to back, so tile j+1's softmax runs while P·V does (the waits:
    :func:`.wgmma_batches.sync_batches`), and the fold of P·V into the output comes last.
    Statements by their blocks' names: the copies before ``qk_init``, Q·Kᵀ
    (``qk_update``), the P·V statements (``pv_tile_init``, ``pv_tile_update``) and the
    fold (``pv_update``), each its own statement (the schedule leaves them so)."""
    names = statement_blocks(loop)

    def index(prefix):
        found = [k for k, blocks in enumerate(names) if any(name.startswith(prefix) for name in blocks)]
        if len(found) != 1:
            raise ValueError(f"the overlapped key loop needs one statement of a {prefix!r} block; found {len(found)}")
        return found[0]

    scores_init, scores, output_init, output, fold = (
        index(prefix) for prefix in ("qk_init", "qk_update", "pv_tile_init", "pv_tile_update", "pv_update")
    )
    if not scores_init < scores < output_init == output - 1 == fold - 2 == len(names) - 3:
        raise ValueError("the overlapped key loop needs the copies, Q·Kᵀ, the softmax, P·V and its fold in that order")
    softmax = [k for k in range(scores + 1, output_init)]
    order = list(range(scores + 1)) + [output_init, output] + softmax + [fold]
    stages = [0] * scores_init + [1] * (output_init - scores_init) + [2] * 3
    return {STAGES: stages, ORDER: _positions(order), ASYNC_STAGES: [0]}


def _apply_choice(loop):
    if CHOSEN not in loop.annotations:
        return loop
    annotations = {k: v for k, v in loop.annotations.items() if k != CHOSEN}
    choice = int(loop.annotations[CHOSEN])
    if choice == OVERLAPPED:
        annotations.update(overlap_annotations(loop))
    elif choice == INTERLEAVED:
        annotations.update(interleaved_annotations(loop))
    elif choice:
        annotations.update(pipeline_annotations(loop))
    return ir.copy_loop(loop, annotations=annotations)


@tirx.transform.prim_func_pass(opt_level=0, name="tvm_cascade.ApplyChosenPipelines")
def apply_chosen_pipelines(func, _mod, _ctx):
    """Loops annotated :data:`CHOSEN` get TVM's software pipeline annotations: 1
    :func:`pipeline_annotations`, :data:`INTERLEAVED` :func:`interleaved_annotations`,
    :data:`OVERLAPPED` :func:`overlap_annotations`, 0 none; the choice's annotation goes.
    For scheduled functions, before lowering."""
    return func.with_body(tvm_ffi.structural_map(func.body, (tirx.For, _apply_choice)))
