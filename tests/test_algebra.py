"""The repair derivation: each method, its proof, the cache and the refusals."""
import pytest
import sympy

from tvm_cascade.algebra.reducers import MAX, MIN, PROD, SUM
from tvm_cascade.algebra.repair import COUNT, RUNNING, NoRepair, derive_repair

r0, r1, c0, c1 = sympy.symbols("r0 r1 c0 c1", real=True)


def _new(sym):
    return sympy.Symbol(f"{sym.name}_new", real=True)


def _check_numerically(reducer, g, incomplete, repair, seed=0):
    """Fold random elements with old r, repair to new r, compare with folding under new r."""
    import random

    rnd = random.Random(seed)
    old = {r: rnd.uniform(-2, 2) for r in incomplete}
    new = {_new(r): old[r] + rnd.uniform(-1, 1) for r in incomplete}
    new_plain = {r: new[_new(r)] for r in incomplete}
    opaque = sorted(g.free_symbols - set(incomplete), key=str)
    elements = [{c: rnd.uniform(0.5, 2) for c in opaque} for _ in range(5)]

    def fold(rvals):
        acc = None
        for el in elements:
            term = float(g.subs({**rvals, **el}))
            acc = term if acc is None else float(reducer.combine(sympy.Float(acc), sympy.Float(term)))
        return acc

    repaired = repair.h.subs({RUNNING: fold(old), COUNT: len(elements), **old, **new})
    assert float(repaired) == pytest.approx(fold(new_plain), rel=1e-9)


@pytest.mark.parametrize(
    "reducer, g, incomplete, method, expected",
    [
        (SUM, sympy.exp(c0 - r0), (r0,), "ratio", RUNNING * sympy.exp(r0 - _new(r0))),
        (SUM, sympy.exp(c0 - r0) * c1, (r0,), "ratio", RUNNING * sympy.exp(r0 - _new(r0))),
        (
            SUM,
            sympy.exp(c0 - r0) * c1 / r1,
            (r0, r1),
            "ratio",
            RUNNING * r1 * sympy.exp(r0 - _new(r0)) / _new(r1),
        ),
        (SUM, sympy.Rational(1, 2) * sympy.exp(c0 - r0), (r0,), "ratio", RUNNING * sympy.exp(r0 - _new(r0))),
        (SUM, c0 - r0, (r0,), "difference", RUNNING + COUNT * (r0 - _new(r0))),
        (MAX, c0 - r0, (r0,), "difference", RUNNING + r0 - _new(r0)),
        (MIN, c0 + r0, (r0,), "difference", RUNNING - r0 + _new(r0)),
        (MAX, sympy.exp(c0 - r0), (r0,), "ratio", RUNNING * sympy.exp(r0 - _new(r0))),
        (PROD, sympy.exp(c0 - r0), (r0,), "ratio", RUNNING * sympy.exp(COUNT * (r0 - _new(r0)))),
    ],
)
def test_derived_repairs(reducer, g, incomplete, method, expected):
    repair = derive_repair(reducer, g, incomplete)
    assert repair.method == method
    assert sympy.simplify(repair.h - expected) == 0
    assert len(repair.proofs) == 3
    _check_numerically(reducer, g, incomplete, repair)


def test_inverse_repair_for_a_combiner_only_invertible_in_its_argument():
    g = sympy.sinh(c0 - r0)  # neither ratio nor difference is free of c0
    repair = derive_repair(MAX, g, (r0,))
    assert repair.method == "inverse"
    _check_numerically(MAX, g, (r0,), repair)


def test_refuses_quadratic_combiner_and_names_the_blocking_term():
    with pytest.raises(NoRepair) as info:
        derive_repair(SUM, (c0 - r0) ** 2 * c1, (r0,))
    assert info.value.blocking == (c0 - r0) ** 2


def test_refuses_a_repair_that_cannot_be_proven_monotone():
    # t * r'/r repairs each element of max_j c*r, but flips the order when r'/r < 0.
    with pytest.raises(NoRepair, match="is not proven"):
        derive_repair(MAX, c0 * r0, (r0,))


def test_refuses_inverse_that_does_not_distribute():
    with pytest.raises(NoRepair, match="inverse candidate"):
        derive_repair(SUM, sympy.sinh(c0 - r0), (r0,))


def test_derivations_are_cached():
    derive_repair.cache_clear()
    first = derive_repair(SUM, sympy.exp(c0 - r0), (r0,))
    second = derive_repair(SUM, sympy.exp(c0 - r0), (r0,))
    assert first is second
    assert derive_repair.cache_info().hits == 1
