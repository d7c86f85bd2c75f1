"""The chain behind one cascaded reduction: producers, intermediates, incomplete loads."""
import tvm
import tvm_ffi
from tvm.ir import expr as ir_expr

from ..algebra.reducers import match_reducer
from ..errors import FusionError
from .axes import AxisClasses
from .scope import (
    REDUCE,
    accumulator_store,
    collect_sites,
    dtype_of,
    extent_product,
    snapshot_buffer,
    uses_var,
    vars_in,
)


def _name(loop) -> str:
    return loop.loop_var.name


class Chain:
    """Everything a fusion primitive needs to know about ``target`` reduced across ``loop``.

    * producers: reduction blocks under ``loop`` whose reduction iterator the loop drives;
      their results are *incomplete* inside the loop.
    * template: the first producer; its loop nest says how a block placed under ``loop``
      binds the row axes (outer loops) and the reduced axis (the loops below ``loop``).
    * movers: spatial blocks outside the loop that sit between the producers and
      ``target``, in program order, then ``target`` itself.
    * redirects: buffers of outside blocks whose equal twin already runs under the loop.
    """

    def __init__(self, scope_block, params, target_block, loop, primitive: str):
        self.primitive = primitive
        self.params = params
        self.loop = loop
        self.sites = collect_sites(scope_block)
        self.target = self._site_of(target_block)
        self._check_target()
        self.under = [s for s in self.sites if s.under(loop)]
        self.axes = AxisClasses(self.sites)
        self._find_producers()
        self.writer = {}
        self.readers = {}
        for site in self.sites:
            for buf in site.write_buffers():
                self.writer[buf] = site
            for buf in site.read_buffers():
                self.readers.setdefault(buf, []).append(site)
        self.tainted = set()
        for site in self.sites:
            if site in self.producers or any(
                self.writer.get(buf) in self.tainted for buf in site.read_buffers()
            ):
                self.tainted.add(site)
        self.target_axis = self._target_axis()
        self.redirects = {}
        self.intermediates = []
        self._walk_inputs(self.target)
        self.movers = sorted(self.intermediates, key=lambda s: s.index) + [self.target]
        self.complete_copies = self._with_inputs(
            [s for s in self.intermediates if self._outside_consumers(s)]
        )

    def _with_inputs(self, sites):
        """``sites`` and the intermediates they read, transitively: a complete copy must
        read complete values, not those its inputs compute under the loop."""
        needed = set(sites)
        for site in sorted(self.intermediates, key=lambda s: -s.index):
            if site in needed:
                needed.update(
                    w for w in map(self.writer.get, site.read_buffers()) if w in self.intermediates
                )
        return [s for s in sorted(self.intermediates, key=lambda s: s.index) if s in needed]

    # ----- failures -----------------------------------------------------------------
    def _fail(self, why: str):
        raise FusionError(f"{self.primitive}: block '{self.target.name}': {why}")

    # ----- target ---------------------------------------------------------------------
    def _site_of(self, block):
        for site in self.sites:
            if site.block.same_as(block):
                return site
        raise FusionError(
            f"block '{block.name_hint}' is not a direct child of the scope being fused"
        )

    def _find_producers(self):
        self.producers = []
        self.axis_var = {}
        for site in self.under:
            axis = self._driven_reduce_var(site)
            if axis is not None:
                self.producers.append(site)
                self.axis_var[site] = axis
        if not self.producers:
            self._fail(
                f"loop '{_name(self.loop)}' does not drive the reduction iterator of any "
                "reduction block under it, so nothing is incomplete there to repair"
            )
        self.template = self.producers[0]
        self._check_template()

    def _check_target(self):
        if self.target.under(self.loop):
            self._fail(f"it already runs under loop '{_name(self.loop)}'")
        self._check_target_update()

    def _check_target_update(self):
        block = self.target.block
        if not self.target.is_reduction:
            self._fail("it is not a reduction block (it has no init), so there is nothing to fuse")
        store = accumulator_store(block)
        if not isinstance(store, tvm.tirx.BufferStore) or snapshot_buffer(block) is None and len(block.writes) != 1:
            self._fail("its body must be a single store to the one buffer it reduces into")
        matched = match_reducer(store)
        if matched is None:
            self._fail(
                f"its update '{store.value}' is not sum, product, max or min of its "
                "accumulator and one more term"
            )
        self.reducer, self.combiner = matched

    def _driven_reduce_var(self, site):
        if not site.is_reduction:
            return None
        driven = [
            iv
            for iv in site.block.iter_vars
            if iv.iter_type == REDUCE and uses_var(site.binding(iv), self.loop.loop_var)
        ]
        if len(driven) > 1:
            self._fail(
                f"loop '{_name(self.loop)}' drives several reduction iterators of "
                f"block '{site.name}'"
            )
        return driven[0] if driven else None

    def _check_template(self):
        tmpl = self.template
        self.inner_loops = tmpl.loops_below(self.loop)
        axis_value = tmpl.binding(self.axis_var[tmpl])
        for inner in self.inner_loops:
            if not uses_var(axis_value, inner.loop_var):
                self._fail(
                    f"loop '{inner.loop_var.name}' between loop '{_name(self.loop)}' and block "
                    f"'{tmpl.name}' does not iterate the reduced axis"
                )
        for iv in tmpl.block.iter_vars:
            if iv.iter_type == REDUCE:
                continue
            if any(uses_var(tmpl.binding(iv), inner.loop_var) for inner in self.inner_loops):
                self._fail(
                    f"spatial iterator '{iv.var.name}' of block '{tmpl.name}' is bound to a "
                    f"loop below '{_name(self.loop)}'"
                )
        axis_iv = self.axis_var[tmpl]
        if not (isinstance(axis_iv.dom.min, tvm.tirx.IntImm) and axis_iv.dom.min.value == 0):
            self._fail(f"the reduced axis of block '{tmpl.name}' must start at 0")
        self.tile = extent_product(self.inner_loops, dtype_of(axis_iv.var))
        self.row_vars = [iv for iv in tmpl.block.iter_vars if iv.iter_type != REDUCE]
        self.row_loops = []  # rows are bound above the loop (checked above)

    def axis_predicate(self, fresh):
        """The template's predicate (it keeps the reduced axis in range), with ``fresh``
        loops below the loop."""
        return substitute(self.template.realize.predicate, fresh)

    def axis_binding(self, fresh):
        """The reduced axis as the template binds it, with ``fresh`` loops below the loop."""
        return substitute(self.template.binding(self.axis_var[self.template]), fresh)

    def _target_axis(self):
        tmpl_axis = self.axis_var[self.template].var
        for iv in self.template.block.iter_vars:
            if iv.iter_type != REDUCE and self.axes.same(iv.var, tmpl_axis):
                self._fail(
                    f"block '{self.template.name}' indexes one buffer dimension with both a "
                    "row iterator and the reduced iterator"
                )
        matching = [
            iv
            for iv in self.target.block.iter_vars
            if iv.iter_type == REDUCE and self.axes.same(iv.var, tmpl_axis)
        ]
        others = [
            iv
            for iv in self.target.block.iter_vars
            if iv.iter_type == REDUCE and not self.axes.same(iv.var, tmpl_axis)
        ]
        if len(matching) != 1:
            self._fail(
                f"it does not reduce over the axis that loop '{_name(self.loop)}' walks in block "
                f"'{self.template.name}'"
            )
        if others:
            self._fail(f"it also reduces over '{others[0].var.name}', another axis")
        return matching[0]

    # ----- inputs ---------------------------------------------------------------------
    def _walk_inputs(self, site):
        first_under = min(s.index for s in self.under)
        for buf in site.read_buffers():
            buf = self.redirects.get(buf, buf)
            writer = self.writer.get(buf)
            if writer is None or writer is site or writer in self.producers:
                continue
            if writer in self.under or writer in self.intermediates:
                if writer in self.under and writer.is_reduction and writer not in self.producers:
                    if writer in self.tainted:
                        self._fail(
                            f"it reads block '{writer.name}', which reduces over another axis "
                            "values that are incomplete under the loop"
                        )
                elif writer not in self.producers and writer in self.under:
                    self._walk_inputs(writer)
                continue
            if writer not in self.tainted:
                if writer.index > first_under:
                    self._fail(
                        f"its input block '{writer.name}' comes after loop '{_name(self.loop)}'; "
                        "it must be computed before the loop"
                    )
                continue
            if writer.is_reduction:
                if any(
                    iv.iter_type == REDUCE and self.axes.same(iv.var, self.target_axis.var)
                    for iv in writer.block.iter_vars
                ):
                    self._fail(
                        f"it reads block '{writer.name}', a reduction over the same axis that "
                        f"is not yet under loop '{_name(self.loop)}': apply "
                        f"{self.primitive} to '{writer.name}' first"
                    )
                self._fail(
                    f"it reads block '{writer.name}', which reduces over another axis values "
                    "that depend on incomplete results"
                )
            twin = self._twin_under_loop(writer)
            if twin is not None:
                self.redirects[buf] = twin.write_buffers()[0]
                continue
            if any(p.same_as(buf) for p in self.params):
                self._fail(f"intermediate block '{writer.name}' writes a function output")
            self.intermediates.append(writer)
            self._walk_inputs(writer)

    def _twin_under_loop(self, outside):
        from ..primitives.ir import same_computation

        for site in self.under:
            if not site.is_reduction and same_computation(outside.block, site.block):
                return site
        return None

    def _outside_consumers(self, site):
        movers = set(self.movers)
        out = []
        for buf in site.write_buffers():
            for reader in self.readers.get(buf, []):
                if reader not in movers and not reader.under(self.loop):
                    out.append(reader)
        return out

    # ----- symbolic view ------------------------------------------------------------------
    def inline(self, expr):
        """``expr`` with loads of spatial chain blocks replaced by what those blocks compute."""
        chain_spatial = [s for s in self.under + self.intermediates if not s.is_reduction]

        def visit(load):
            buf = self.redirects.get(load.source, load.source)
            if not buf.same_as(load.source):
                load = tvm.tirx.BufferLoad(buf, load.indices)
            writer = self.writer.get(buf)
            if writer not in chain_spatial:
                return load
            store = writer.block.body
            if not isinstance(store, tvm.tirx.BufferStore) or len(store.indices) != len(
                writer.block.iter_vars
            ):
                return load
            vmap = {}
            for idx, iv, value in zip(store.indices, writer.block.iter_vars, load.indices):
                # TVM's layout rewrites simplify the iterator of a unit axis to 0.
                unit = _is_zero(idx) and _is_zero(iv.dom.extent - 1)
                if not (unit or isinstance(idx, ir_expr.Var) and idx.same_as(iv.var)):
                    return load
                vmap[iv.var] = idx if unit else value
            return self.inline(substitute(store.value, vmap))

        return tvm_ffi.structural_map(expr, (ir_expr.TensorLoad, visit))

    def incomplete_key(self, load):
        """The producer whose partial result ``load`` reads, or None."""
        writer = self.writer.get(load.source)
        return writer.index if writer in self.producers else None


def _is_zero(expr):
    return isinstance(expr, tvm.tirx.IntImm) and expr.value == 0


def substitute(node, vmap: dict):
    """``node`` with variables replaced as ``vmap`` says."""
    if not vmap:
        return node
    return tvm_ffi.structural_map(node, (ir_expr.Var, lambda v: vmap.get(v, v)))


__all__ = ["Chain", "substitute", "vars_in"]
