"""Where blocks moved under a fusion loop go, and how their iterators are bound."""
import tvm
from tvm.s_tir.stmt import SBlock

from ..analysis.chain import substitute
from ..analysis.scope import dtype_of, uses_var
from . import ir


class Placement:
    """Binds the iterators of blocks moved under the loop the way the template block's are."""

    def __init__(self, chain):
        self.chain = chain

    def place(self, block: SBlock):
        """A loop nest, to go under the chain's loop, that runs ``block`` for one tile."""
        bindings, predicate, loops = self.bind(block)
        return ir.nest(loops, ir.realize(bindings, predicate, block))

    def bind(self, block: SBlock):
        """(bindings, predicate, loops as (var, extent) outermost first) that run ``block``
        under the chain's loop: rows as the template binds them, the reduced axis over a
        fresh copy of the template's loops below the loop, one new loop per other iterator."""
        chain = self.chain
        tmpl = chain.template
        bindings, free, reduced = [], [], False
        fresh = {
            l.loop_var: tvm.tirx.Var(l.loop_var.name, dtype_of(l.loop_var))
            for l in chain.row_loops + chain.inner_loops
        }
        for iv in block.iter_vars:
            if chain.axes.same(iv.var, chain.target_axis.var):
                bindings.append(chain.axis_binding(fresh))
                reduced = True
                continue
            row = [r for r in chain.row_vars if chain.axes.same(iv.var, r.var)]
            if row:
                bindings.append(substitute(tmpl.binding(row[0]), fresh))
                continue
            var = tvm.tirx.Var(f"ax{len(free)}", dtype_of(iv.var))
            free.append((var, iv.dom.extent))
            bindings.append(iv.dom.min + var if not _is_zero(iv.dom.min) else var)
        rows = [
            (fresh[l.loop_var], l.extent)
            for l in chain.row_loops
            if any(uses_var(b, fresh[l.loop_var]) for b in bindings)
        ]
        if not reduced:
            return bindings, tvm.tirx.const(True, "bool"), rows + free
        predicate = chain.axis_predicate(fresh)
        inner = [(fresh[l.loop_var], l.extent) for l in chain.inner_loops]
        return bindings, predicate, rows + free + inner


def _is_zero(expr) -> bool:
    return isinstance(expr, tvm.tirx.IntImm) and expr.value == 0
