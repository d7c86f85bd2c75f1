"""``cp.async`` waits of a pipelined loop placed at the first reader of each group.

TVM's software pipeline waits for every copy of a stage before the stage's first reader
(``async_wait_inflight_count`` 0). A loop that commits several groups an iteration, as
the prefill kernel's interleaved pipeline does (:func:`.software_pipeline.
interleaved_annotations`: the next tile's K after Q·Kᵀ, its V after P·V), then waits for
the V copy at the next Q·Kᵀ, which does not read V, so the copy overlaps nothing.
:func:`defer_copy_waits` waits for each group where its shared memory is first touched,
with the depth that leaves the groups committed after it in flight
(FlashAttention-2's ``wait_group 1`` before Q·Kᵀ with V in flight, and before P·V with
the next K in flight), at the thread-block barrier before that statement: a wait covers
the calling thread's copies only, the barrier the other threads'.

The depth of a wait is the number of groups committed after the one it waits for, in
program order; for that the loop's first iteration must find the groups committed
before the loop in the order the loop commits them, so a prologue group holding several
of the loop's groups is split into one group each. A loop where that does not hold, or
where a group's first reader has no barrier before it, keeps TVM's waits.
"""
import tvm
import tvm_ffi
from tvm.ir import expr as ir_expr
from tvm.ir.prim import expr as prim

from ..analysis.scope import dtype_of
from ..primitives import ir

WAIT = "async_wait_queue_scope"
IN_FLIGHT = "async_wait_inflight_count"
COMMIT = "async_commit_queue_scope"


def _constant_depth(attr):
    """A wait's depth simplified: TVM's pipeline over a loop of a run-time trip count (a
    causal mask's merged tiles) writes its epilogue's as ``if_then_else(True & True, d,
    d')``, and PTX wants constants."""
    if attr.attr_key != IN_FLIGHT or isinstance(attr.value, tvm.tirx.IntImm):
        return attr
    # The analyzer decides logical and/or of constants, not the bitwise ones of bools.
    logical = tvm_ffi.structural_map(attr.value, [(prim.BitwiseAnd, _logical), (prim.BitwiseOr, _logical)])
    return tvm.tirx.AttrStmt(attr.node, IN_FLIGHT, tvm.sym.Analyzer().simplify(logical), attr.body)


def _logical(op):
    if dtype_of(op.a) != "bool":
        return op
    return (prim.And if isinstance(op, prim.BitwiseAnd) else prim.Or)(op.a, op.b)


@tvm.tirx.transform.prim_func_pass(opt_level=0, name="tvm_cascade.DeferCopyWaits")
def defer_copy_waits(func, _mod, _ctx):
    """Each software-pipelined loop that commits several ``cp.async`` groups an iteration
    waits for each group before the barrier ahead of the first statement that touches
    its shared memory (see the module's docstring); other loops are left as they are."""
    func = func.with_body(tvm_ffi.structural_map(func.body, (tvm.tirx.AttrStmt, _constant_depth)))
    commits = _count(func.body, _is_commit)

    def rewrite(seq):
        # (Only where every commit of the function is in this sequence: then the groups
        # in flight at the loop's start are those of the statements before it.)
        return _rewrite_sequence(seq) if _count(seq, _is_commit) == commits else seq

    return func.with_body(tvm_ffi.structural_map(func.body, (tvm.tirx.SeqStmt, rewrite)))


def _rewrite_sequence(seq):
    stmts = list(seq.seq)
    for index, loop in enumerate(stmts):
        if not isinstance(loop, tvm.tirx.For):
            continue
        before = stmts[:index]
        if sum(_count(stmt, _is_commit) for stmt in before) != sum(map(_is_commit, before)):
            continue
        rewritten = _rewrite_loop(loop, before)
        if rewritten is not None:
            prologue, loop = rewritten
            return tvm.tirx.SeqStmt(prologue + [loop] + stmts[index + 1 :])
    return seq


def _rewrite_loop(loop, before):
    """(the statements before ``loop``, ``loop``) with the waits deferred, or None."""
    body = _without_waits(loop.body)
    if body is None:
        return None
    groups = [_copied(stmt) for stmt in body if _is_commit(stmt)]
    if len(groups) < 2 or _count(loop.body, _is_commit) != len(groups):
        return None
    prologue = _split_commits(before, groups)
    # Groups outstanding when the loop starts: those of the statements before it, and
    # in later iterations the previous iteration's. Both must give the same waits.
    first = _waits(body, [_copied(stmt) for stmt in prologue if _is_commit(stmt)])
    if first is None or first != _waits(body, groups):
        return None
    stmts = [
        tvm.tirx.AttrStmt(0, WAIT, 0, tvm.tirx.AttrStmt(0, IN_FLIGHT, first[k], stmt)) if k in first else stmt
        for k, stmt in enumerate(body)
    ]
    return prologue, ir.copy_loop(loop, body=tvm.tirx.SeqStmt(stmts))


def _without_waits(body):
    """The loop body's statements with TVM's waits (all of constant depth 0) unwrapped,
    or None for a loop without waits or with others."""
    stmts, found = [], False
    for stmt in ir.statements(body):
        if isinstance(stmt, tvm.tirx.AttrStmt) and stmt.attr_key == WAIT:
            inner = stmt.body
            if not (isinstance(inner, tvm.tirx.AttrStmt) and inner.attr_key == IN_FLIGHT and _is_zero(inner.value)):
                return None
            stmts.extend(ir.statements(inner.body))
            found = True
        else:
            stmts.append(stmt)
    return stmts if found and not any(ir.contains(stmt, _is_wait) for stmt in stmts) else None


def _waits(body, outstanding):
    """{statement index: depth} of the waits ``body`` needs when the groups
    ``outstanding`` (their buffers' names, oldest first) may still be in flight as it
    starts, or None where a group's first reader has no barrier before it."""
    outstanding = list(outstanding)
    waits, earliest = {}, 0
    for index, stmt in enumerate(body):
        touched = _copied(stmt) if _is_commit(stmt) else _names(stmt)
        needed = [k for k, group in enumerate(outstanding) if group & touched]
        if needed:
            newest = max(needed)
            barrier = _barrier_before(body, earliest, index, set().union(*outstanding[: newest + 1]))
            if barrier is None:
                return None
            waits[barrier] = len(outstanding) - 1 - newest
            outstanding = outstanding[newest + 1 :]
            earliest = barrier + 1
        if _is_commit(stmt):
            outstanding.append(_copied(stmt))
    return waits


def _barrier_before(body, earliest, index, names):
    """The index of the last thread-block barrier in ``body[earliest:index]`` after which
    nothing touches ``names`` or commits copies, or None."""
    for k in range(index - 1, earliest - 1, -1):
        if isinstance(body[k], tvm.tirx.Evaluate) and ir.is_block_barrier(body[k].value):
            return k
        if _is_commit(body[k]) or _names(body[k]) & names:
            return None
    return None


def _split_commits(before, groups):
    """``before`` with its last commit split into one commit per group of ``groups``
    (the loop's, in its order) where its copies are those groups' in that order."""
    commits = [k for k, stmt in enumerate(before) if _is_commit(stmt)]
    if not commits:
        return list(before)
    last = before[commits[-1]]
    parts = ir.statements(last.body)
    split, copied = [], []
    for part in parts:
        names = _copied(part)
        if copied and names == copied[-1]:
            split[-1].append(part)
        else:
            split.append([part])
            copied.append(names)
    if len(split) == 1 or copied != groups[-len(copied) :]:
        return list(before)
    committed = [tvm.tirx.AttrStmt(last.node, COMMIT, last.value, ir.seq(part)) for part in split]
    return list(before[: commits[-1]]) + committed + list(before[commits[-1] + 1 :])


def _count(stmt, predicate):
    found = []
    tvm_ffi.structural_walk(stmt, lambda node: found.append(node) if predicate(node) else None)
    return len(found)


def _is_zero(value):
    # (A depth may be an expression, e.g. of a loop's extent.)
    return isinstance(value, (int, tvm.tirx.IntImm)) and int(value) == 0


def _is_commit(stmt):
    return isinstance(stmt, tvm.tirx.AttrStmt) and stmt.attr_key == COMMIT


def _is_wait(node):
    return isinstance(node, tvm.tirx.AttrStmt) and node.attr_key == WAIT


def _copied(stmt):
    """Names of the shared buffers ``stmt``'s ``cp.async`` copies write."""
    names = set()

    def visit(node):
        if isinstance(node, ir_expr.Call) and getattr(node.op, "name", "") == "tirx.s_tir.cp_async_raw":
            destination = node.args[0]  # buffer_data(<the shared buffer>)
            names.add(destination.args[0].name if isinstance(destination, ir_expr.Call) else destination.name)

    tvm_ffi.structural_walk(stmt, visit)
    return frozenset(names)


def _names(stmt):
    """Names of the variables ``stmt`` uses, its buffers' among them (by name, as the
    pipeline's copies of a statement may hold distinct variables of one name)."""
    names = set()
    tvm_ffi.structural_walk(stmt, lambda node: names.add(node.name) if isinstance(node, ir_expr.Var) else None)
    return names


