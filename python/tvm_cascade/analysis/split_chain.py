"""The chain behind one split-k fusion: chunk-local partials and their global combines.

After ``split_k_update(X, chunk_loop)`` a reduction ``X`` is two blocks: ``X_partial``
under the chunk loop, reducing one chunk into ``X_partial[c, ...]``, and ``X`` itself,
outside, combining the chunks. For a later target the *incomplete* values are those
global results: inside a chunk it must read the chunk's partial instead, and the global
combine repairs each chunk's contribution from the partial to the global value.
"""
import tvm
import tvm_ffi
from tvm.ir import expr as ir_expr

from .chain import Chain, _name, substitute
from .scope import REDUCE, dtype_of, extent_product, uses_var


class SplitKChain(Chain):
    """A :class:`Chain` whose producers are global combines of chunk partials."""

    def _check_target(self):
        super()._check_target_update()
        self.target_is_under = self.target.under(self.loop)

    def _find_producers(self):
        self.producers = []
        self.partial_of = {}
        for site in self.sites:
            partial = self._partial_behind(site)
            if partial is None:
                continue
            if site is self.target:
                self._fail(
                    f"it is already split: it combines the chunk partials of block "
                    f"'{partial.name}' under loop '{_name(self.loop)}'"
                )
            self.producers.append(site)
            self.partial_of[site] = partial
        if self.target_is_under:
            template = self.target
            axis = self._driven_reduce_var(template)
            if axis is None:
                self._fail(
                    f"it runs under loop '{_name(self.loop)}', which does not drive its "
                    "reduction iterator"
                )
            self.template = template
            self.inner_loops = template.loops_below(self.loop)
            axis_value = template.binding(axis)
        elif self.producers:
            self.template = self.partial_of[self.producers[0]]
            self.inner_loops = self.template.loops_below(self.loop)
            chunk_iv, inner_iv = self.template.block.iter_vars[0], self.template.block.iter_vars[-1]
            axis_value = (
                self.template.binding(chunk_iv) * self._chunk_size_of(self.template)
                + self.template.binding(inner_iv)
            )
        else:
            self._fail(
                f"loop '{_name(self.loop)}' holds no chunk partial of a reduction it reads; "
                "apply split_k_update to the first reduction of the chain first"
            )
        self.axis_value = axis_value
        self.chunks = self.loop.extent
        # Loops below the chunk loop that walk other axes do not make the chunk longer:
        # row loops there (e.g. the query heads of a GQA group, so that one thread holds
        # them all) are copied for each block placed under the chunk loop.
        below = self.inner_loops
        self.inner_loops = [l for l in below if uses_var(axis_value, l.loop_var)]
        self.row_loops = [
            l
            for l in below
            if not uses_var(axis_value, l.loop_var)
            and any(
                uses_var(self.template.binding(iv), l.loop_var)
                for iv in self.template.block.iter_vars
                if iv.iter_type != REDUCE
            )
        ]
        self.chunk = extent_product(self.inner_loops, dtype_of(self.loop.loop_var))
        self.row_vars = [
            iv
            for iv in self.template.block.iter_vars
            if iv.iter_type != REDUCE and not uses_var(self.template.binding(iv), self.loop.loop_var)
        ]

    def _chunk_size_of(self, partial):
        return partial.block.iter_vars[-1].dom.extent

    def _partial_behind(self, site):
        """The chunk partial under the loop that ``site`` combines, or None.

        A global combine reduces over its last iterator ``c`` and folds ``P[c, idx]``,
        where ``P`` is written, under the loop, by a block whose first iterator is the
        chunk (bound to the loop)."""
        if site.under(self.loop) or not site.is_reduction:
            return None
        chunk_iv = site.block.iter_vars[-1]
        if chunk_iv.iter_type != REDUCE:
            return None
        for buf in site.read_buffers():
            writer = next((s for s in self.under if any(b.same_as(buf) for b in s.write_buffers())), None)
            if writer is None or not writer.is_reduction:
                continue
            first = writer.block.iter_vars[0]
            if first.iter_type != REDUCE and writer.binding(first).same_as(self.loop.loop_var):
                return writer
        return None

    def _target_axis(self):
        reduce = [iv for iv in self.target.block.iter_vars if iv.iter_type == REDUCE]
        if len(reduce) != 1:
            self._fail("it must reduce over exactly one axis")
        return reduce[0]

    def axis_binding(self, fresh):
        return substitute(self.axis_value, fresh)

    def axis_predicate(self, fresh):
        """The template's predicate, and where the template is a chunk partial of a ragged
        last chunk that runs past the axis (its reads clamped: ``split_k_update``), the
        axis kept in range."""
        predicate = super().axis_predicate(fresh)
        dom = self.target_axis.dom
        kept = uses_var(self.template.realize.predicate, self.loop.loop_var)
        if kept or tvm.sym.Analyzer().can_prove(self.chunks * self.chunk <= dom.extent):
            return predicate
        in_range = substitute(self.axis_value, fresh) < dom.min + dom.extent
        return tvm.sym.Analyzer().simplify(tvm.tirx.And(predicate, in_range))

    def incomplete_key(self, load):
        writer = self.writer.get(load.source)
        if writer in self.producers:
            return writer.index
        for producer, partial in self.partial_of.items():
            if partial is writer:
                return producer.index
        return None

    def localize(self, node, chunk):
        """``node`` with loads of global results replaced by loads of the partial result of
        chunk ``chunk``."""
        partial_buf = {
            producer.write_buffers()[0]: self.partial_of[producer].write_buffers()[0]
            for producer in self.producers
        }

        def visit(load):
            buf = next((p for g, p in partial_buf.items() if g.same_as(load.source)), None)
            if buf is None:
                return load
            return tvm.tirx.BufferLoad(buf, [chunk] + list(load.indices))

        return tvm_ffi.structural_map(node, (ir_expr.TensorLoad, visit))

    def _twin_under_loop(self, outside):
        from ..primitives.ir import copy_block, same_computation

        axis = [iv for iv in outside.block.iter_vars if self.axes.same(iv.var, self.target_axis.var)]
        if len(axis) != 1:
            return None
        chunk = tvm.tirx.floordiv(axis[0].var, self.chunk)
        local = copy_block(outside.block, body=self.localize(outside.block.body, chunk))
        for site in self.under:
            if not site.is_reduction and same_computation(local, site.block):
                return site
        return None
