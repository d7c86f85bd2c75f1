"""The kernel prologue's copies to shared memory as ``cp.async``, overlapped with what follows.

TVM turns a copy from global to shared memory into ``cp.async`` only inside a
software-pipelined loop: its pipeliner marks the copy ``async_scope``, commits it as a
group and waits for it. The prefill kernel copies its Q tile once, before the key loop,
and that copy stays synchronous: each thread's 128-bit loads return before it stores them
to shared memory and goes on to issue the first K and V tiles' ``cp.async``, so a block
waits for two memory round trips before its first tile computes.

:func:`async_prologue_copies` marks such prologue copies the way the pipeliner marks its
own, as a commit group of their own, where the first statement that reads them is a
software-pipelined loop that waits for its own copies before it reads them: a wait leaves
no group older than the ones it allows in flight, so the pipeline's first wait covers
the prologue's group too, and nothing else has to wait. Elsewhere (a mask's key loops,
whose first one may not be pipelined; a long key loop, which the prefill schedule does
not pipeline) the copies stay as they are: an explicit wait
before a synchronous key loop gains nothing, and measured slower (H200, b8, ms, before
and after: causal s1024 0.302/0.315, s4096 3.71/3.92; global s1024 0.468/0.459 with the
pipeline's wait).
"""
import tvm_ffi
from tvm import tirx
from tvm.ir.expr import TensorLoad
from tvm.s_tir.stmt import SBlock, SBlockRealize

from ..primitives import ir
from .software_pipeline import ASYNC_STAGES, STAGES, pipeline_statements


def _attr(key, value, body):
    return tirx.AttrStmt(tirx.const(0, "int32"), key, tirx.const(value, "int32"), body)


def _seq(stmts):
    return stmts[0] if len(stmts) == 1 else tirx.SeqStmt(stmts)


def _commit(stmts):
    return _attr("async_commit_queue_scope", 0, _seq([_attr("async_scope", 1, s) for s in stmts]))


def _copied_to_shared(stmt):
    """The shared buffer that loop nest ``stmt`` fills from a global buffer in vectors,
    or None."""
    vectorized = False
    while isinstance(stmt, tirx.For):
        vectorized |= stmt.kind == tirx.ForKind.VECTORIZED
        stmt = stmt.body
    if not vectorized or not isinstance(stmt, SBlockRealize):
        return None
    store = stmt.block.body
    if not isinstance(store, tirx.BufferStore) or not store.buffer.scope().startswith("shared"):
        return None
    loads = []
    tvm_ffi.structural_walk(store.value, lambda n: loads.append(n) if isinstance(n, TensorLoad) else None)
    if len(loads) != 1 or loads[0].source.scope() != "global":
        return None
    return store.buffer


def _buffers_read(stmt):
    found = []

    def visit(node):
        if isinstance(node, SBlock):
            found.extend(region.source for region in node.reads)
        elif isinstance(node, TensorLoad):
            found.append(node.source)

    tvm_ffi.structural_walk(stmt, visit)
    return found


def _buffers_written(stmt):
    found = []
    tvm_ffi.structural_walk(stmt, lambda n: found.extend(r.source for r in n.writes) if isinstance(n, SBlock) else None)
    return found


def _reads(stmt, buffers):
    return any(b.same_as(c) for b in _buffers_read(stmt) for c in buffers)


def _pipelined(stmt):
    return isinstance(stmt, tirx.For) and STAGES in stmt.annotations


def _waits_before_reading(loop, buffers):
    """Whether pipelined ``loop`` waits for its asynchronous copies before its first
    statement that reads ``buffers``: that statement reads a buffer its asynchronous
    stages write and is in a later stage."""
    stages = [int(s) for s in loop.annotations[STAGES]]
    async_stages = {int(s) for s in loop.annotations.get(ASYNC_STAGES, [])}
    stmts = pipeline_statements(loop)
    if len(stmts) != len(stages):
        return False
    written = [b for s, stage in zip(stmts, stages) if stage in async_stages for b in _buffers_written(s)]
    for stmt, stage in zip(stmts, stages):
        if _reads(stmt, buffers):
            return stage not in async_stages and _reads(stmt, written)
    return False


def _runs(stmt):
    """Whether a thread that reaches ``stmt`` runs its body at least once."""
    if isinstance(stmt, tirx.For):
        return isinstance(stmt.extent, tirx.IntImm) and stmt.extent.value > 0
    if isinstance(stmt, SBlockRealize):
        return isinstance(stmt.predicate, tirx.IntImm) and stmt.predicate.value == 1 and stmt.block.init is None
    return isinstance(stmt, tirx.SeqStmt)


def _first_reader(stmt, buffers):
    """The first statement under ``stmt`` that reads ``buffers`` (None if none does): a
    pipelined loop, a loop or block that may not run its body (an extent or a predicate
    that depends on the block), or a statement that is no loop, block or sequence."""
    if not _reads(stmt, buffers):
        return None
    if _pipelined(stmt) or not _runs(stmt):
        return stmt
    if isinstance(stmt, tirx.SeqStmt):
        return next(_first_reader(child, buffers) for child in stmt.seq if _reads(child, buffers))
    return _first_reader(stmt.block.body if isinstance(stmt, SBlockRealize) else stmt.body, buffers)


def _kernel(loop):
    if loop.thread_binding is None or loop.thread_binding.thread_tag != "blockIdx.x" or not isinstance(loop.body, tirx.SeqStmt):
        return loop
    stmts = list(loop.body.seq)
    buffers = []
    for stmt in stmts:
        buffer = _copied_to_shared(stmt)
        if buffer is None:
            break
        buffers.append(buffer)
    copies = len(buffers)
    if copies == 0 or copies == len(stmts):
        return loop
    reader = _first_reader(_seq(stmts[copies:]), buffers)
    if reader is None or not (_pipelined(reader) and _runs(reader) and _waits_before_reading(reader, buffers)):
        return loop
    body = tirx.SeqStmt([_commit(stmts[:copies]), *stmts[copies:]])
    return ir.copy_loop(loop, body=body)


@tirx.transform.prim_func_pass(opt_level=0, name="tvm_cascade.AsyncPrologueCopies")
def async_prologue_copies(func, _mod, _ctx):
    """Issue the copies from global to shared memory that open each thread block's body
    (vectorised loop nests) as one ``cp.async`` group where the first reader of them is a
    software-pipelined loop whose first wait covers them (see the module's docstring).
    For scheduled functions, before lowering."""
    return func.with_body(tvm_ffi.structural_map(func.body, (tirx.For, _kernel)))
