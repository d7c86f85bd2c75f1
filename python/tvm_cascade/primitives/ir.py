"""Small IR-building helpers shared by the fusion primitives."""
import functools

import tvm
import tvm_ffi
from tvm.ir import expr as ir_expr
from tvm.s_tir.analysis import get_sblock_read_write_region
from tvm.s_tir.stmt import SBlock, SBlockRealize

from .._core import refresh_sblock_flags
from ..analysis.chain import substitute
from ..analysis.scope import dtype_of


def copy_block(block: SBlock, **changes) -> SBlock:
    fields = dict(
        iter_vars=block.iter_vars,
        reads=block.reads,
        writes=block.writes,
        name_hint=block.name_hint,
        body=block.body,
        init=block.init,
        alloc_buffers=block.alloc_buffers,
        match_buffers=block.match_buffers,
        annotations=block.annotations,
    )
    fields.update(changes)
    return SBlock(**fields)


def copy_loop(loop: tvm.tirx.For, **changes) -> tvm.tirx.For:
    fields = dict(
        loop_var=loop.loop_var,
        min=loop.min,
        extent=loop.extent,
        kind=loop.kind,
        body=loop.body,
        thread_binding=loop.thread_binding,
        annotations=loop.annotations,
        step=loop.step,
    )
    fields.update(changes)
    return tvm.tirx.For(**fields)


def replace_root(sch, root_sref, new_root, reuse):
    """Replace the root block at ``root_sref`` by ``new_root``; ``reuse`` maps the old
    blocks that keep their random variables to their new versions."""
    sch.state.replace(root_sref, new_root, {**reuse, root_sref.stmt: new_root})
    refresh_sblock_flags(sch.state)


def blocks_in(root: SBlock) -> list:
    """Every block below ``root``."""
    return nodes(root.body, SBlock)


def annotated_blocks(mod, key) -> list:
    """``(global var, function, block)`` of every block of ``mod``'s PrimFuncs annotated
    ``key``."""
    return [
        (gvar, func, block)
        for gvar, func in mod.functions_items()
        if isinstance(func, tvm.tirx.PrimFunc)
        for block in blocks_in(func.body.block)
        if key in block.annotations
    ]


def nodes(node, kind) -> list:
    """Every node of type ``kind`` in ``node`` (itself included), in walk order."""
    found = []
    tvm_ffi.structural_walk(node, lambda n: found.append(n) if isinstance(n, kind) else None)
    return found


def body_and_init(block: SBlock):
    """``block``'s body and init, as one statement."""
    return block.body if block.init is None else tvm.tirx.SeqStmt([block.init, block.body])


def with_regions(block: SBlock, buffers) -> SBlock:
    """``block`` with read/write regions detected from its body, as TVMScript would."""
    reads, writes = get_sblock_read_write_region(block, {b: b for b in buffers})
    return copy_block(block, reads=reads, writes=writes)


def replace_buffers(node, bmap: dict):
    """``node`` with loads and stores of the buffers in ``bmap`` redirected."""
    if not bmap:
        return node

    def load(l):
        new = bmap.get(l.source)
        return l if new is None else tvm.tirx.BufferLoad(new, l.indices)

    def store(s):
        new = bmap.get(s.buffer)
        return s if new is None else tvm.tirx.BufferStore(new, s.value, s.indices)

    return tvm_ffi.structural_map(
        node, [(ir_expr.TensorLoad, load), (tvm.tirx.BufferStore, store)]
    )


def same_computation(a: SBlock, b: SBlock) -> bool:
    """Whether spatial blocks ``a`` and ``b`` compute the same values into their one buffer."""
    if a.init is not None or b.init is not None or len(a.writes) != 1 or len(b.writes) != 1:
        return False
    if len(a.iter_vars) != len(b.iter_vars):
        return False
    if str(a.writes[0].source.dtype) != str(b.writes[0].source.dtype):
        return False  # e.g. a cast back to float16 beside the float32 softmax it reads
    vmap = {}
    for x, y in zip(a.iter_vars, b.iter_vars):
        if not tvm_ffi.structural_equal(x.dom, y.dom) or x.iter_type != y.iter_type:
            return False
        vmap[x.var] = y.var
    body = replace_buffers(substitute(a.body, vmap), {a.writes[0].source: b.writes[0].source})
    return tvm_ffi.structural_equal(body, b.body)


def rebuild_scope(stmt, replaced: dict, loop, appended: list, after: dict):
    """Rebuild a scope body: realizes in ``replaced`` become their value (None drops them,
    and loops left empty go too); ``appended`` statements are added at the end of ``loop``;
    ``after`` maps root-level statements to statements that follow them."""

    def go(node):
        if isinstance(node, SBlockRealize):
            return replaced.get(node, node)
        if isinstance(node, tvm.tirx.For):
            body = go(node.body)
            if node.same_as(loop):
                body = seq([body] + appended)
            if body is None:
                return None
            if body.same_as(node.body):
                return node
            return copy_loop(node, body=body)
        if isinstance(node, tvm.tirx.SeqStmt):
            items = [go(item) for item in node]
            if all(x is not None and x.same_as(y) for x, y in zip(items, node)):
                return node
            return seq(items)
        raise TypeError(f"unexpected statement in a schedulable scope: {type(node).__name__}")

    top = statements(stmt)
    items = []
    for item in top:
        items.append(go(item))
        items.extend(after.get(item, []))
    if all(x is not None and x.same_as(y) for x, y in zip(items, top)) and len(items) == len(top):
        return stmt
    return seq(items)


def seq(items):
    flat = []
    for item in items:
        if item is None:
            continue
        if isinstance(item, tvm.tirx.SeqStmt):
            flat.extend(item)
        else:
            flat.append(item)
    if not flat:
        return None
    return flat[0] if len(flat) == 1 else tvm.tirx.SeqStmt(flat)


def prepend_in_root(body, items, buffers=()):
    """``items`` (statements) before ``body``'s, inside its s_tir root block where it has
    one, and ``buffers`` allocated around both (as that block's own where it has one)."""
    if isinstance(body, SBlockRealize):
        block = body.block
        return SBlockRealize(body.iter_values, body.predicate, copy_block(
            block, body=seq(list(items) + [block.body]), alloc_buffers=list(block.alloc_buffers) + list(buffers)))
    body = seq(list(items) + [body])
    for buffer in reversed(list(buffers)):
        body = tvm.tirx.AllocBuffer(buffer, body)
    return body


def statements(stmt) -> list:
    """The statements of a sequence ``stmt``, or ``[stmt]``."""
    return list(stmt.seq) if isinstance(stmt, tvm.tirx.SeqStmt) else [stmt]


def contains(stmt, predicate) -> bool:
    """Whether some node of ``stmt`` satisfies ``predicate``."""
    found = []
    tvm_ffi.structural_walk(stmt, lambda node: found.append(node) if not found and predicate(node) else None)
    return bool(found)


def is_block_barrier(node) -> bool:
    """Whether ``node`` is a thread-block barrier (``tvm_storage_sync`` of shared memory)."""
    return (
        isinstance(node, ir_expr.Call)
        and getattr(node.op, "name", "") == "tirx.tvm_storage_sync"
        and str(node.args[0].value).startswith("shared")
    )


def nest(loops, body):
    """Wrap ``body`` in serial loops given as (var, extent), outermost first."""
    for var, extent in reversed(loops):
        body = tvm.tirx.For(var, tvm.tirx.const(0, dtype_of(var)), extent, tvm.tirx.ForKind.SERIAL, body)
    return body


def realize(bindings, predicate, block):
    return SBlockRealize(bindings, predicate, block)


def like_buffer(buf, name: str, shape=None):
    """A new buffer with ``buf``'s type, scope and layout (and shape, unless given),
    named ``name``."""
    shape = buf.shape if shape is None else shape
    return tvm.tirx.decl_buffer(shape, buf.dtype, name=name, scope=buf.scope(), layout=buf.layout)


def with_fresh_iter_vars(block: SBlock) -> SBlock:
    """``block`` with new iterator variables, so that it can stand beside the original."""
    vmap, iter_vars = {}, []
    for iv in block.iter_vars:
        var = tvm.tirx.Var(iv.var.name, dtype_of(iv.var))
        vmap[iv.var] = var
        iter_vars.append(tvm.tirx.IterVar(iv.dom, var, iv.iter_type))
    init = None if block.init is None else substitute(block.init, vmap)
    return copy_block(block, iter_vars=iter_vars, body=substitute(block.body, vmap), init=init)


def maximum(*values):
    """The largest of ``values``: ints (a call's plan) or PrimExprs (a plan in a
    compiled graph, over its symbolic shapes)."""
    if all(isinstance(v, int) for v in values):
        return max(values)
    return functools.reduce(tvm.tirx.max, values)


def minimum(*values):
    """The smallest of ``values`` (as :func:`maximum`)."""
    if all(isinstance(v, int) for v in values):
        return min(values)
    return functools.reduce(tvm.tirx.min, values)
