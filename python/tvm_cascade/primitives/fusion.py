"""From a chain to a proven repair, and from the repair back to TIR."""
from dataclasses import dataclass

import sympy
import tvm
import tvm_ffi

from ..analysis.scope import accumulator_store, dtype_of
from ..algebra.convert import Symbolic, UnsupportedExpr, to_tir
from ..algebra.masks import strip_zero_masks
from ..algebra.reducers import SUM, match_reducer
from ..algebra.repair import COUNT, RUNNING, NoRepair, Repair, derive_repair
from ..errors import FusionError


@dataclass
class Fusion:
    """A proven repair and, for each incomplete symbol, the producer and the load it reads."""

    repair: Repair
    producers: list
    loads: list
    target_buffer: str
    # Indices of producers whose old value multiplies the repair: a sum that was 0 then
    # (every term masked to 0) weights the running value by 0, and that value may be 0/0.
    zero_weight: tuple = ()

    def describe(self) -> str:
        """The repair with symbols named after buffers: the running ``sum``, the producers'
        current ``max`` and ``max_prev`` from before the tile, ``n`` elements folded."""
        subs = {RUNNING: sympy.Symbol(self.target_buffer)}
        for old, new, producer in zip(self.repair.old, self.repair.new, self.producers):
            buf = producer.write_buffers()[0].name
            subs[old] = sympy.Symbol(f"{buf}_prev")
            subs[new] = sympy.Symbol(buf)
        return sympy.sstr(self.repair.h.subs(subs, simultaneous=True))

    def single_factor(self, needs: str):
        """The repair as one factor of one running value's move, ``h = factor · running``:
        ``(factor, old, new)`` with ``old``, ``new`` that value's symbols before and after;
        FusionError starting with ``needs`` (what the caller's kernel requires) otherwise."""
        factor = sympy.simplify(self.repair.h / RUNNING)
        if len(self.repair.old) != 1 or RUNNING in factor.free_symbols:
            raise FusionError(f"{needs}; the repair of '{self.target_buffer}' is {self.describe()}")
        return factor, self.repair.old[0], self.repair.new[0]


def derive(chain, required: bool = True):
    """Translate the target's combiner, derive its repair and prove it; FusionError if none.

    Returns None when the combiner reads no incomplete value and ``required`` is false."""
    combiner = chain.inline(chain.combiner)
    seen = {}

    def classify(load):
        index = chain.incomplete_key(load)
        if index is None:
            return None
        known = seen.setdefault(index, load)
        if not tvm_ffi.structural_equal(known.indices, load.indices):
            chain._fail(
                f"it reads the incomplete result '{load.source.name}' at two different places"
            )
        return index

    symbolic = Symbolic(classify)
    analysed = combiner
    if chain.reducer is SUM:
        analysed = strip_zero_masks(combiner, symbolic.holds_incomplete)
    try:
        g = symbolic.convert(analysed)
    except UnsupportedExpr as err:
        chain._fail(
            f"reducer '{chain.reducer}' has combiner '{combiner}', whose sub-expression "
            f"'{err.expr}' holds incomplete values in a form the algebra cannot analyse"
        )
    if not symbolic.incomplete:
        if not required:
            return None
        chain._fail(
            f"it reads no result of a reduction that loop '{chain.loop.loop_var.name}' drives "
            f"(its combiner is '{combiner}')"
        )
    names = {sym: sympy.Symbol(load.source.name) for sym, _, load in symbolic.incomplete}
    names.update({sym: sympy.Symbol(f"[{expr}]") for sym, expr in symbolic.opaque})
    try:
        repair = derive_repair(chain.reducer, g, tuple(s for s, _, _ in symbolic.incomplete))
    except NoRepair as err:
        pretty = sympy.sstr(g.subs(names, simultaneous=True))
        blocking = sympy.sstr(err.blocking.subs(names, simultaneous=True))
        chain._fail(
            f"reducer '{chain.reducer}' with combiner {pretty} has no repair: {err.reason}. "
            f"The sub-expression {blocking} blocks it"
        )
    if COUNT in repair.h.free_symbols and not analysed.same_as(combiner):
        chain._fail(
            f"its combiner '{combiner}' masks terms to 0, and its repair "
            f"{sympy.sstr(repair.h)} counts the folded elements, masked ones included"
        )
    placeholders = {sym: tvm.tirx.Var(sym.name, "float32") for sym in repair.h.free_symbols}
    try:
        to_tir(repair.h, placeholders, "float32")
    except NotImplementedError as err:
        chain._fail(f"its proven repair h = {sympy.sstr(repair.h)} has no TIR form ({err})")
    producers = [chain.sites[key] for _, key, _ in symbolic.incomplete]
    loads = [load for _, _, load in symbolic.incomplete]
    zero_weight = ()
    if chain.reducer is SUM:
        zero_weight = tuple(
            k
            for k, (old, producer) in enumerate(zip(repair.old, producers))
            if _reduces_by_sum(producer) and _vanishes_with(repair.h, old)
        )
    return Fusion(repair, producers, loads, chain.target.write_buffers()[0].name, zero_weight)


def _reduces_by_sum(site) -> bool:
    matched = match_reducer(accumulator_store(site.block))
    return matched is not None and matched[0] is SUM


def _vanishes_with(h, old) -> bool:
    """Whether ``h`` is 0 whenever ``old`` is, whatever the running value."""
    return sympy.simplify(h.subs(old, 0)) == 0 and h.has(RUNNING)


def repair_to_tir(fusion: Fusion, running, prev_loads, cur_loads, count, dtype: str):
    """The repair as TIR: ``running`` is the value to repair, ``prev_loads`` the producers'
    values it was computed with, ``cur_loads`` their current ones, ``count`` the number of
    elements folded into it."""

    def as_dtype(expr):
        return expr if dtype_of(expr) == dtype else tvm.tirx.Cast(dtype, expr)

    env = {RUNNING: running, COUNT: as_dtype(count)}
    for old, new, prev, cur in zip(fusion.repair.old, fusion.repair.new, prev_loads, cur_loads):
        env[old] = as_dtype(prev)
        env[new] = as_dtype(cur)
    repaired = to_tir(fusion.repair.h, env, dtype)
    for k in fusion.zero_weight:
        # A running value normalised by a sum of 0 is 0/0; its weight is 0, so is its share.
        old = env[fusion.repair.old[k]]
        repaired = tvm.tirx.Select(old == tvm.tirx.const(0, dtype), tvm.tirx.const(0, dtype), repaired)
    return repaired
