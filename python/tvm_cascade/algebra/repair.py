"""Derivation and proof of the repair term of a cascaded reduction.

A reduction ``X = f_j g(r, c_j)`` whose combiner g reads results ``r`` of earlier
reductions over the same loop sees those results while they are still *incomplete*. A
repair ``h`` brings a running value computed with old ``r`` up to date with new ``r'``:
``h(f_j g(r, c_j), r, r') = f_j g(r', c_j)``. It is derived in three ways, tried in turn:

* ratio: ``g(r', c) / g(r, c)`` does not depend on c, so ``h = t * ratio`` (``ratio**n``
  for products, where n counts the folded elements);
* difference: ``g(r', c) - g(r, c)`` does not depend on c, so ``h = t + delta``
  (``t + n * delta`` for sums);
* inverse: g is invertible in its single opaque argument, so ``h = g(r', g^-1(r, t))``.

A candidate is accepted only once SymPy proves that it repairs one element exactly, that
it distributes over f (``h(f(a, b)) = f(h(a), h(b))``, with counts adding up; for max and
min, that h is non-decreasing in t), and that it maps f's identity to itself.
"""
import functools
from dataclasses import dataclass

import sympy

from .reducers import Reducer

RUNNING = sympy.Symbol("t", real=True)
COUNT = sympy.Symbol("n", integer=True, nonnegative=True)


class NoRepair(Exception):
    """No proven repair exists; ``blocking`` is the sub-expression of g that prevents it."""

    def __init__(self, reason: str, blocking: sympy.Expr):
        super().__init__(reason)
        self.reason = reason
        self.blocking = blocking


@dataclass(frozen=True)
class Repair:
    """A proven repair ``h(t, old, new[, n])`` of a running value ``t``."""

    reducer: Reducer
    combiner: sympy.Expr
    old: tuple
    new: tuple
    h: sympy.Expr
    method: str
    proofs: tuple

    @property
    def uses_count(self) -> bool:
        return COUNT in self.h.free_symbols


def new_symbol(old: sympy.Symbol) -> sympy.Symbol:
    return sympy.Symbol(f"{old.name}_new", real=True)


def _is_zero(expr: sympy.Expr) -> bool:
    if expr == 0:
        return True
    for simplify in (sympy.expand, sympy.simplify):
        if simplify(expr) == 0:
            return True
    return sympy.simplify(sympy.expand_log(sympy.powsimp(expr, force=True), force=True)) == 0


def _opaque(expr: sympy.Expr, incomplete) -> set:
    return expr.free_symbols - set(incomplete)


def _candidates(reducer: Reducer, g: sympy.Expr, old, new):
    to_new = dict(zip(old, new))
    g_new = g.subs(to_new, simultaneous=True)
    ratio = sympy.simplify(g_new / g)
    if ratio.is_finite is not False and not ratio.has(sympy.nan, sympy.zoo) and not (
        _opaque(ratio, old + new)
    ):
        if reducer.name == "prod":
            yield "ratio", RUNNING * ratio**COUNT
        else:
            yield "ratio", RUNNING * ratio
    delta = sympy.simplify(g_new - g)
    if not _opaque(delta, old + new):
        if reducer.name == "sum":
            yield "difference", RUNNING + COUNT * delta
        elif reducer.name != "prod":
            yield "difference", RUNNING + delta
    opaque = _opaque(g, old)
    if len(opaque) == 1:
        inverse = _real_inverse(g, opaque.pop())
        if inverse is not None:
            c, solution = inverse
            yield "inverse", g_new.subs(c, solution)


def _real_inverse(g, c):
    """(c, g^-1(t)) when ``g = t`` has exactly one real solution for c, else None."""
    solutions = sympy.solveset(sympy.Eq(g, RUNNING), c, domain=sympy.S.Reals)
    if isinstance(solutions, sympy.Intersection):
        finite = [s for s in solutions.args if isinstance(s, sympy.FiniteSet)]
        solutions = finite[0] if len(finite) == 1 else solutions
    if isinstance(solutions, sympy.FiniteSet) and len(solutions) == 1:
        return c, next(iter(solutions))
    return None


def _prove(reducer: Reducer, g, old, new, h, method):
    """Return the proven identities, or None with the first one that failed."""
    to_new = dict(zip(old, new))
    g_new = g.subs(to_new, simultaneous=True)
    a, b = sympy.symbols("a b", real=True)
    n1, n2 = sympy.symbols("n1 n2", integer=True, nonnegative=True)

    def at(t, n):
        return h.subs({RUNNING: t, COUNT: n}, simultaneous=True)

    proofs = []
    if method == "inverse":
        # The only real solution of g(r, c) = t makes g injective in c, so
        # g^-1(r, g(r, c)) = c and h(g(r, c)) = g(r', c) hold by construction.
        proofs.append("h(g(r, c), r, r') = g(r', g^-1(r, g(r, c))) = g(r', c): unique real inverse")
    else:
        exact = f"h(g(r, c), r, r') = g(r', c): {sympy.sstr(at(g, 1))} = {sympy.sstr(g_new)}"
        if not _is_zero(at(g, 1) - g_new):
            return None, exact
        proofs.append(exact)
    if reducer.is_monotone_order:
        slope = sympy.simplify(sympy.diff(h, RUNNING))
        claim = f"dh/dt = {sympy.sstr(slope)} >= 0, so h commutes with {reducer.name}"
        if slope.is_nonnegative is not True:
            return None, claim
    else:
        lhs = at(reducer.combine(a, b), n1 + n2)
        rhs = reducer.combine(at(a, n1), at(b, n2))
        claim = f"h({reducer.name}(a, b)) = {reducer.name}(h(a), h(b))"
        if not _is_zero(lhs - rhs):
            return None, claim
    proofs.append(claim)
    identity = at(reducer.identity, 0)
    claim = f"h({reducer.identity}) = {reducer.identity}"
    if sympy.simplify(identity - reducer.identity) != 0 and identity != reducer.identity:
        return None, claim
    proofs.append(claim)
    return tuple(proofs), None


def _blocking(g: sympy.Expr, incomplete) -> sympy.Expr:
    """The innermost sub-expression of g that mixes incomplete and opaque values inseparably."""
    new = tuple(new_symbol(r) for r in incomplete)
    to_new = dict(zip(incomplete, new))
    for arg in g.args:
        if not (arg.free_symbols & set(incomplete)) or not _opaque(arg, incomplete):
            continue
        arg_new = arg.subs(to_new, simultaneous=True)
        separable = not _opaque(sympy.simplify(arg_new / arg), incomplete + new) or not _opaque(
            sympy.simplify(arg_new - arg), incomplete + new
        )
        if not separable:
            return _blocking(arg, incomplete)
    return g


@functools.lru_cache(maxsize=4096)
def derive_repair(reducer: Reducer, combiner: sympy.Expr, incomplete: tuple) -> Repair:
    """Derive and prove the repair of ``f_j combiner`` for the given incomplete symbols.

    Cached: MetaSchedule replays the same derivation many times.
    """
    new = tuple(new_symbol(r) for r in incomplete)
    failures = []
    for method, h in _candidates(reducer, combiner, incomplete, new):
        proofs, failed = _prove(reducer, combiner, incomplete, new, h, method)
        if proofs is not None:
            return Repair(reducer, combiner, incomplete, new, sympy.simplify(h) if method != "inverse" else h, method, proofs)
        failures.append(f"{method} candidate h = {sympy.sstr(h)} is not proven: {failed}")
    if not failures:
        reason = (
            "neither g(r', c)/g(r, c) nor g(r', c) - g(r, c) is free of c, "
            "and g is not invertible in a single opaque argument"
        )
    else:
        reason = "; ".join(failures)
    raise NoRepair(reason, _blocking(combiner, incomplete))
