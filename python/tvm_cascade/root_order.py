"""Reorder the independent top-level loop nests of a PrimFunc.

``te.create_prim_func`` emits stages in a post-order DFS over the tensor graph,
so two independent consumers of the same tensor (e.g. attention's ``pv`` and
``sum``, both reading ``exp``) come out in the order in which their results
are *read* downstream; legalised Relax functions put the layout transform of V
after the softmax. :func:`reorder_root_blocks` moves the root's loop nests
into a requested block order, checking that no read/write dependency between
two swapped nests is violated.
"""

from __future__ import annotations

from typing import List, Sequence

import tvm
from tvm import s_tir, tirx

from .primitives import ir


def _nest_block(stmt) -> "s_tir.SBlock":
    """The single block at the bottom of a perfect loop nest."""
    node = stmt
    while isinstance(node, tirx.For):
        node = node.body
    if isinstance(node, s_tir.SBlockRealize):
        return node.block
    raise ValueError(f"top-level statement is not a loop nest around one block: {type(node)}")


def _buffers(regions) -> List:
    return [r.source for r in regions]


def _conflict(first, second) -> bool:
    """True if ``second`` must stay after ``first`` (RAW, WAR or WAW)."""
    w1, r1 = _buffers(first.writes), _buffers(first.reads)
    w2, r2 = _buffers(second.writes), _buffers(second.reads)

    def meet(xs, ys):
        return any(x.same_as(y) for x in xs for y in ys)

    return meet(w1, r2) or meet(r1, w2) or meet(w1, w2)


def reorder_root_blocks(func: tvm.tirx.PrimFunc, order: Sequence[str]) -> tvm.tirx.PrimFunc:
    """Return ``func`` with its root-level loop nests in the block order ``order``.

    ``order`` must be a permutation of the root's block names.  Raises
    ``ValueError`` if the permutation would move a nest across one it depends on.
    """
    realize = func.body
    root = realize.block
    stmts = ir.statements(root.body)
    blocks = [_nest_block(s) for s in stmts]
    names = [b.name_hint for b in blocks]
    if sorted(names) != sorted(order):
        raise ValueError(f"order {list(order)} is not a permutation of blocks {names}")
    if list(order) == names:
        return func
    pos = {n: i for i, n in enumerate(names)}
    new_idx = [pos[n] for n in order]
    for a in range(len(new_idx)):
        for b in range(a + 1, len(new_idx)):
            old_a, old_b = new_idx[a], new_idx[b]
            if old_a > old_b and _conflict(blocks[old_b], blocks[old_a]):
                raise ValueError(
                    f"cannot move block {names[old_a]!r} before {names[old_b]!r}: dependency"
                )
    new_root = s_tir.SBlock(
        root.iter_vars,
        root.reads,
        root.writes,
        root.name_hint,
        tirx.SeqStmt([stmts[i] for i in new_idx]),
        root.init,
        root.alloc_buffers,
        root.match_buffers,
        root.annotations,
    )
    new_realize = s_tir.SBlockRealize(realize.iter_values, realize.predicate, new_root)
    return func.with_body(new_realize)
