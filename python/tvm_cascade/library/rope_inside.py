"""RoPE inside attention for the KV cache's kernels (``rotary_mode`` 1, the runtime's
``RopeMode.INLINE``): the pages hold keys as they were appended, and each call rotates
query ``t`` by ``q_rope_position[t]`` and key ``j`` of sequence ``b`` by
``k_rope_pos_offset[b] + j`` (``j`` counts the keys the call sees: a sliding window's
sink, then its window) before the dot products.

The rotation is TVM's own, read from TVM's kernel for the same slot (the runtime's
fallback): its query load under ``rotary_mode == 1`` is an expression of the row's
elements, the row's position, the element index and the ``rope_theta`` and
``rope_scale`` scalars (whatever RoPE scaling the model built its cache with), which
:func:`rotation_of` takes as a template. A library kernel with RoPE inside attention is
its body on rotated copies: a pass before it writes the rotated queries and the keys of
the pages the table lists (rotated where a position holds a key the call sees, as they
are elsewhere) into buffers of the call, and the body reads those. A body that reads
the pages element by element reads its keys from a buffer of the pool's keys (written
at the listed pages' ids) and its values where they are (not under sliding windows);
one that copies whole boxes of pages (the warp-specialised prefill's TMA), or under
sliding windows, reads a copy of the listed pages, keys and values, in the table's
order (page ``e`` of the table is page ``e`` of the copy).
The copies cost a read and a write of the keys (and values) the call attends to; the
kernel is unchanged. A family that rotates keys itself as they enter its products
(``rotates_keys(spec, rotation)`` true: the tensor-core decode, in registers, through
:func:`key_rotation`) reads the pages as they are: only the queries are copied. It takes
the rotation's part that no key changes (TVM's frequencies) from a table it fills once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import tvm
import tvm_ffi
from tvm import tirx
from tvm.ir import expr as ir_expr

from ..analysis.chain import substitute
from ..analysis.scope import buffer_params
from ..primitives.ir import nest, prepend_in_root, seq
from .spec import WINDOW_LAYOUTS

#: The scalars of the cache's convention the rotation reads.
SCALARS = ("rope_theta", "rope_scale")


@dataclass(frozen=True)
class Rotation:
    """TVM's rotation of element ``x`` of a row: ``expr`` of ``row`` (a placeholder
    1-D buffer, the row's elements), ``position``, ``x`` and the scalars ``rope_theta``
    and ``rope_scale`` (variables named so)."""

    expr: tirx.PrimExpr
    row: tirx.Buffer
    position: tirx.Var
    x: tirx.Var
    scalars: dict

    def __call__(self, load: Callable, position, x, scalars: dict):
        """The rotated element ``x`` of the row whose element ``i`` is ``load(i)``, at
        ``position``, with the convention's ``scalars`` (by name)."""
        def element(node):
            return load(node.indices[0]) if node.source.same_as(self.row) else node

        expr = tvm_ffi.structural_map(self.expr, (ir_expr.TensorLoad, element))
        vmap = {self.position: position, self.x: x}
        vmap.update((var, scalars[name]) for name, var in self.scalars.items())
        # The template's bindings inlined: TVM's LLVM code generator failed to bind its
        # float variable in the passes over pages (its analyzer made a float32 IntImm).
        expr = tvm_ffi.structural_map(expr, (tirx.Let, lambda n: substitute(n.body, {n.var: n.value})))
        return substitute(expr, vmap)

    def reads(self, x: int) -> Optional[list]:
        """The elements of the row that rotating its element ``x`` reads (``None`` where
        they depend on more than ``x``)."""
        expr = tvm.sym.Analyzer().simplify(substitute(self.expr, {self.x: tirx.IntImm(self.x.ty.dtype, x)}))
        read = []
        tvm_ffi.structural_walk(expr, lambda n: read.append(n.indices[0]) if isinstance(n, ir_expr.TensorLoad)
                                and n.source.same_as(self.row) else None)
        return [i.value for i in read] if all(isinstance(i, tirx.IntImm) for i in read) else None


def rotation_of(fallback: tirx.PrimFunc) -> tuple[Optional[Rotation], str]:
    """TVM's rotation as ``fallback`` (TVM's kernel of the slot) computes it for ``q``
    (its first parameter): ``(Rotation, "")``, or ``(None, why)`` where its query load
    is not of that form."""
    params = {p.name: p for p in fallback.params}
    buffers = {b.name: b for b in buffer_params(fallback)}
    if "q_rope_position" not in buffers or any(name not in params for name in SCALARS):
        return None, "TVM's kernel takes no q_rope_position, rope_theta and rope_scale"
    q, positions = buffer_params(fallback)[0], buffers["q_rope_position"]  # (the convention's first: q)
    loads = []

    def visit(node):
        if (isinstance(node, ir_expr.Call) and node.op.name.endswith("if_then_else")
                and isinstance(node.args[0], tirx.EQ) and isinstance(node.args[0].a, tirx.Var)
                and node.args[0].a.name == "rotary_mode" and isinstance(node.args[2], ir_expr.TensorLoad)
                and node.args[2].source.same_as(q)):
            loads.append(node)

    tvm_ffi.structural_walk(fallback.body, visit)
    if not loads:
        return None, "TVM's kernel has no load of q rotated under rotary_mode == 1"
    rotated, plain = loads[0].args[1], loads[0].args[2]
    at = plain.indices[-1]  # (a loop variable, or an expression of a vector's lanes)
    row = tirx.decl_buffer((q.shape[-1],), q.dtype, "row")
    position, x = tirx.Var("position", "int32"), tirx.Var("x", "int32")
    prefix = list(plain.indices[:-1])
    foreign = []

    def element(node):
        if node.source.same_as(q):
            if not tvm_ffi.structural_equal(list(node.indices[:-1]), prefix):
                foreign.append(node)
            return tirx.BufferLoad(row, [node.indices[-1]])
        if node.source.same_as(positions):
            return position
        return node

    expr = tvm_ffi.structural_map(rotated, (ir_expr.TensorLoad, element))
    expr = tvm_ffi.structural_map(expr, (type(at), lambda n: x if tvm_ffi.structural_equal(n, at) else n))
    tvm_ffi.structural_walk(expr, lambda n: foreign.append(n) if isinstance(n, ir_expr.TensorLoad)
                            and not n.source.same_as(row) else None)
    scalars = {name: params[name] for name in SCALARS}
    known = [position, x, *scalars.values(), *tirx.analysis.undefined_vars(tirx.BufferLoad(row, [0]))]
    free = tirx.analysis.undefined_vars(expr, known)
    if foreign or free:
        return None, f"TVM's rotation reads more than its row and position ({foreign or free})"
    return Rotation(expr, row, position, x, scalars), ""


def _inlined(expr):
    """``expr`` with its bindings inlined (see :meth:`Rotation.__call__`)."""
    return tvm_ffi.structural_map(expr, (tirx.Let, lambda n: substitute(n.body, {n.var: n.value})))


def _per_element(rotation: Rotation, expr) -> Optional[tirx.PrimExpr]:
    """The one call in ``expr`` (the rotation's, its bindings inlined) of the element
    index and scalars only, with no other such call around it (TVM's: the angle's
    frequency, ``pow(rope_theta, 2 (x mod d/2) / d)``), or None where there is none, or
    more than one."""
    found = []

    def varying(node) -> bool:
        seen = []
        tvm_ffi.structural_walk(node, lambda n: seen.append(n) if (
            isinstance(n, ir_expr.TensorLoad) or (isinstance(n, tirx.Var) and n.same_as(rotation.position))) else None)
        return bool(seen)

    def visit(node):
        if isinstance(node, ir_expr.Call) and not node.op.name.endswith("if_then_else") and not varying(node):
            found.append(node)

    tvm_ffi.structural_walk(expr, visit)
    outermost = [c for c in found if not any(o is not c and _holds(o, c) for o in found)]
    distinct = []
    for call in outermost:
        if not any(tvm_ffi.structural_equal(call, d) for d in distinct):
            distinct.append(call)
    return distinct[0] if len(distinct) == 1 else None


def _holds(outer, inner) -> bool:
    held = []
    tvm_ffi.structural_walk(outer.args, lambda n: held.append(n) if n.same_as(inner) else None)
    return bool(held)


class KeyRotation:
    """For a kernel that rotates its keys itself: ``rotate(view, load, b, j, x, table)``,
    element ``x`` of key ``j`` of sequence ``b`` (as the call counts the keys it sees)
    rotated, ``load(delta)`` the key's element ``x + delta``.

    A kernel short of registers computes the rotation's part that depends on the element
    only (:attr:`table_dtype` not None: TVM's frequency, a ``pow`` per element that no key
    changes) once per element into ``table`` (a buffer of :attr:`period` elements of that
    dtype, element ``x`` ``per_element(x)``) and passes the table to every rotation."""

    def __init__(self, rotation: Rotation, scalars: dict):
        self.rotation, self.scalars = rotation, scalars
        self.inlined = _inlined(rotation.expr)
        self.call = _per_element(rotation, self.inlined)
        self.table_dtype = None if self.call is None else str(self.call.ty.dtype)
        self.period = None if self.call is None else self._period()

    def _period(self) -> int:
        """The table's elements: half the row's where element ``x + d / 2`` has the part
        of ``x`` (TVM's frequencies, ``x mod d/2``: then both of a rotation's pairs read
        one entry, and their angles are one expression, computed once), else the row's."""
        size = int(self.rotation.row.shape[0])
        x, half = self.rotation.x, size // 2
        analyzer = tvm.sym.Analyzer()
        analyzer.bind(x, tvm.ir.Range(0, half))
        shifted = analyzer.simplify(substitute(self.call, {x: x + half}))
        return half if tvm_ffi.structural_equal(shifted, analyzer.simplify(self.call)) else size

    def per_element(self, x):
        """The rotation's part of element ``x`` that no key changes."""
        vmap = {self.rotation.x: x}
        vmap.update((var, self.scalars[name]) for name, var in self.rotation.scalars.items())
        return substitute(self.call, vmap)

    def __call__(self, view, load, b, j, x, table=None):
        offset = next(t for t in view.inputs if t.name == "k_rope_pos_offset")
        rotation = self.rotation
        if table is not None:
            looked_up = tvm_ffi.structural_map(
                self.inlined,
                (ir_expr.Call, lambda n: table[rotation.x % self.period] if tvm_ffi.structural_equal(n, self.call)
                 else n),
            )
            rotation = Rotation(looked_up, rotation.row, rotation.position, rotation.x, rotation.scalars)
        return rotation(lambda i: load(i - self.rotation.x), offset[b] + j, x, self.scalars)


def key_rotation(rotation: Rotation, scalars: dict) -> KeyRotation:
    """The :class:`KeyRotation` of ``rotation`` with the convention's ``scalars``."""
    return KeyRotation(rotation, scalars)


def rotated_body(body, view, buffers: dict, rotation: Rotation, scalars: dict, layout: str, gpu: bool,
                 keys: bool = True):
    """``body`` (a kernel over the tensors ``buffers``, by name, that ``view`` views) on
    rotated copies of its queries and, with ``keys`` (a body that does not rotate them
    itself), keys, after the pass that writes them (on GPUs a thread block a token or
    page)."""
    q = buffers["q"]
    copies = {"q": tirx.decl_buffer(q.shape, q.dtype, "q_rotated")}
    vmap = {q: copies["q"]}
    q_position = buffers["q_rope_position"]
    k_offset = buffers["k_rope_pos_offset"]
    passes = [_launch(q.shape[0], q.shape[1:], None, gpu, lambda t, _, h, x: tirx.BufferStore(
        copies["q"], rotation(lambda i: q[t, h, i], q_position[t], x, scalars), [t, h, x]))]
    if not keys:
        return prepend_in_root(substitute(body, vmap), passes, copies.values())
    if layout == "kv_ragged":
        k, indptr = buffers["k"], buffers["kv_indptr"]
        copies["k"] = tirx.decl_buffer(k.shape, k.dtype, "k_rotated")
        vmap[k] = copies["k"]
        passes.append(_launch(k.shape[0], k.shape[1:], (indptr, view.batch), gpu, lambda t, b, h, x: tirx.BufferStore(
            copies["k"], rotation(lambda i: k[t, h, i], k_offset[b] + t - indptr[b], x, scalars), [t, h, x])))
    else:
        pages, indptr, table = buffers["pages"], buffers["page_indptr"], buffers["page_indices"]
        _, _, heads, page_size, dim = pages.shape
        entries = table.shape[0]

        def key(e, b, h, r, x):
            """The page the table lists at ``e`` and its key element ``x`` at position
            ``r``: rotated where the position holds a key the call sees, else as it is."""
            source = table[e]
            j = view.position_key(b, (e - indptr[b]) * page_size + r)
            sees = tirx.And(j >= 0, j < view.key_length(b))
            return source, tirx.Select(sees, rotation(lambda i: pages[source, 0, h, r, i], k_offset[b] + j, x, scalars),
                                       pages[source, 0, h, r, x])

        if layout not in WINDOW_LAYOUTS and _reads_elements(body, pages):
            # The kernel reads the pages element by element: it reads its keys from
            # rotated copies at the pool's page ids (a buffer of the pool's keys, written
            # where the table lists a page) and its values where they are. Not under
            # sliding windows: there a page two sequences list (a fork's) may hold keys at
            # other positions of each (their sinks and windows), which one copy a page
            # cannot hold.
            pool_keys = copies["keys"] = tirx.decl_buffer((pages.shape[0], heads, page_size, dim), pages.dtype,
                                                          "keys_rotated")
            body = tvm_ffi.structural_map(body, [
                (ir_expr.TensorLoad, lambda n: tirx.BufferLoad(pool_keys, [n.indices[0], *n.indices[2:]])
                 if n.source.same_as(pages) and _index(n.indices[1]) == 0 else n),
                (ir_expr.TensorRegion, lambda n: tirx.BufferRegion(pool_keys, [n.region[0], *n.region[2:]])
                 if n.source.same_as(pages) and _index(n.region[1].min) == 0 else n)])

            def store(e, b, h, r, x):
                source, value = key(e, b, h, r, x)
                return tirx.BufferStore(pool_keys, value, [source, h, r, x])
        else:
            copies["pages"] = tirx.decl_buffer((entries, 2, heads, page_size, dim), pages.dtype, "pages_rotated")
            copies["table"] = tirx.decl_buffer((entries,), table.dtype, "page_indices_in_order")
            vmap.update({pages: copies["pages"], pages.shape[0]: entries, table: copies["table"]})
            if isinstance(table.elem_offset, tirx.Var):
                vmap[table.elem_offset] = tirx.IntImm(table.elem_offset.ty.dtype, 0)

            def store(e, b, h, r, x):
                source, value = key(e, b, h, r, x)
                stores = [tirx.BufferStore(copies["pages"], value, [e, 0, h, r, x]),
                          tirx.BufferStore(copies["pages"], pages[source, 1, h, r, x], [e, 1, h, r, x])]
                first = tirx.And(tirx.And(h == 0, r == 0), x == 0)
                return seq(stores + [tirx.IfThenElse(first, tirx.BufferStore(copies["table"], e, [e]), None)])

        passes.append(_launch(entries, (heads, page_size, dim), (indptr, view.batch), gpu, store))
    return prepend_in_root(substitute(body, vmap), passes, copies.values())


def _index(expr):
    return expr.value if isinstance(expr, tirx.IntImm) else None


def _reads_elements(body, pages) -> bool:
    """Whether ``body`` uses ``pages`` only in loads of its keys' or values' elements
    and in regions of one of the two (the page's half a constant): no copies of whole
    boxes, no pointers to it."""
    uses, halves = [], []

    def visit(node):
        if isinstance(node, ir_expr.Var) and node.same_as(pages):
            uses.append(node)
        elif isinstance(node, ir_expr.TensorLoad) and node.source.same_as(pages):
            halves.append(_index(node.indices[1]))
        elif isinstance(node, ir_expr.TensorRegion) and node.source.same_as(pages):
            halves.append(_index(node.region[1].min) if _index(node.region[1].extent) == 1 else None)

    tvm_ffi.structural_walk(body, visit)
    return bool(halves) and len(uses) == len(halves) and all(half in (0, 1) for half in halves)


#: Threads of a block of the rotation pass on GPUs, at most (a page table has few items:
#: its blocks fill the GPU only with many threads each).
THREADS = 1024


def _launch(items, extents, sequences, gpu, store):
    """``store(item, b, *index)`` for every item (a token or a page of the table) and
    every index of ``extents`` (the heads first), ``b`` the sequence the item lies in
    where ``sequences`` (its ``indptr`` and the batch) is given: on CPUs items in
    parallel, on GPUs a thread block an item, its threads (up to :data:`THREADS`) over
    the indices after the heads', each looping over the heads."""
    item = tirx.Var("item", items.ty.dtype)
    index = [tirx.Var(f"i{n}", extent.ty.dtype) for n, extent in enumerate(extents)]
    found = None
    if sequences is not None:
        found = tirx.decl_buffer((1,), "int32", "sequence", scope="local")
    inner = store(item, None if found is None else found[0], *index)
    if gpu:
        # Each thread loops over the heads with the angles' cosines and sines computed
        # once (they depend on the position and the element, not the head); spreading
        # the heads over more threads recomputes them and measured slower for tokens.
        head, rest = index[0], list(zip(index[1:], extents[1:]))
        inner, angles = _hoisted(inner, head)
        inner = seq([tirx.Bind(var, value) for var, value in angles]
                    + [tirx.For(head, tirx.IntImm(head.ty.dtype, 0), extents[0], tirx.ForKind.SERIAL, inner)])
        size = math.prod(int(e) for e in extents[1:])
        threads = min(size, THREADS)
        tx = tirx.Var("threadIdx.x", "int32")
        dtype = extents[-1].ty.dtype
        step = tirx.Var("step", dtype)
        flat = step * threads + tirx.Cast(dtype, tx)
        where = {}
        for var, extent in reversed(rest):
            where[var] = tirx.Cast(var.ty.dtype, tirx.floormod(flat, extent))
            flat = tirx.floordiv(flat, extent)
        inner = substitute(inner, where)
        if size % threads:
            inner = tirx.IfThenElse(step * threads + tirx.Cast(dtype, tx) < size, inner, None)
        body = tirx.For(step, tirx.IntImm(dtype, 0), tirx.IntImm(dtype, -(-size // threads)), tirx.ForKind.SERIAL, inner)
    else:
        body = nest(list(zip(index, extents)), inner)
    if found is not None:
        indptr, batch = sequences
        s = tirx.Var("s", batch.ty.dtype)
        scan = tirx.For(s, tirx.IntImm(s.ty.dtype, 1), batch - 1, tirx.ForKind.SERIAL, tirx.IfThenElse(
            indptr[s] <= item, tirx.BufferStore(found, tirx.Cast("int32", s), [0]), None))
        body = tirx.AllocBuffer(found, seq([tirx.BufferStore(found, 0, [0]), scan, body]))
    if gpu:
        body = tirx.AttrStmt(_thread("threadIdx.x", threads, tx), "thread_extent", threads, body)
        block = tirx.Var("blockIdx.x", item.ty.dtype)
        body = tirx.AttrStmt(_thread("blockIdx.x", items, block), "thread_extent", items, substitute(body, {item: block}))
        return tirx.IfThenElse(items > 0, body, None)
    return tirx.For(item, tirx.IntImm(item.ty.dtype, 0), items, tirx.ForKind.PARALLEL, body)


#: The calls of a rotation that :func:`_hoisted` computes once for every head.
_ANGLE_CALLS = ("tirx.cos", "tirx.sin")


def _hoisted(stmt, head):
    """``stmt`` with its cosines and sines that do not depend on ``head`` replaced by
    variables, and those variables' ``(var, value)`` bindings."""
    angles = {}

    def angle(call):
        if getattr(call.op, "name", "") not in _ANGLE_CALLS or head in tirx.analysis.undefined_vars(call):
            return call
        for var, value in angles.items():
            if tvm_ffi.structural_equal(value, call):
                return var
        var = tirx.Var(call.op.name.split(".")[-1], call.ty.dtype)
        angles[var] = call
        return var

    return tvm_ffi.structural_map(stmt, (ir_expr.Call, angle)), list(angles.items())


def _thread(tag, extent, var):
    return tirx.IterVar(tvm.ir.Range(0, extent), var, tirx.IterVar.ThreadIndex, tag)
