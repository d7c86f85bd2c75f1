"""The commutative reducers f that a reduction block may use, and how to read them off TIR."""
from dataclasses import dataclass
from typing import Callable

import sympy
import tvm
import tvm_ffi
from tvm.ir import expr as ir_expr
from tvm.ir.prim import expr as prim


@dataclass(frozen=True)
class Reducer:
    """A reducer f(acc, x) together with what the repair proofs need to know about it.

    ``counted`` reducers (sum, product) need the number of folded elements to repair a
    combiner that changes every element by the same additive (sum) or multiplicative
    (product) amount; max and min absorb such a change whole.
    """

    name: str
    identity: sympy.Expr
    combine: Callable[[sympy.Expr, sympy.Expr], sympy.Expr]
    tir_combine: Callable
    tir_node: type
    is_monotone_order: bool

    def __str__(self) -> str:
        return self.name


SUM = Reducer("sum", sympy.Integer(0), lambda a, b: a + b, lambda a, b: a + b, prim.Add, False)
PROD = Reducer("prod", sympy.Integer(1), lambda a, b: a * b, lambda a, b: a * b, prim.Mul, False)
MAX = Reducer("max", -sympy.oo, sympy.Max, tvm.tirx.max, prim.Max, True)
MIN = Reducer("min", sympy.oo, sympy.Min, tvm.tirx.min, prim.Min, True)
REDUCERS = (SUM, PROD, MAX, MIN)


def tir_identity(reducer: Reducer, dtype: str):
    """``reducer``'s identity as a TIR constant of ``dtype`` (max and min: the type's
    lowest and highest values, which fold into any accumulator unchanged)."""
    if reducer is MAX:
        return tvm.tirx.min_value(dtype)
    if reducer is MIN:
        return tvm.tirx.max_value(dtype)
    return tvm.tirx.const(0 if reducer is SUM else 1, dtype)


def match_reducer(store):
    """Split a reduction update ``X[i] = f(X[i], e)`` into ``(reducer, e)``.

    The accumulator may also stand repaired, as ``rolling_update`` leaves it:
    ``X[i] = f(if_then_else(cond, h(X[i]), X[i]), e)``. Returns None when the stored value
    is not one of the supported reducers applied to the block's own accumulator.
    """
    value = store.value
    for reducer in REDUCERS:
        if not isinstance(value, reducer.tir_node):
            continue
        for acc, rest in ((value.a, value.b), (value.b, value.a)):
            if _is_accumulator(acc, store):
                return reducer, rest
    return None


def _is_accumulator(expr, store) -> bool:
    if (
        isinstance(expr, ir_expr.Call)
        and isinstance(expr.op, tvm.ir.Op)
        and expr.op.name.endswith(".if_then_else")
    ):
        expr = expr.args[2]
    return (
        isinstance(expr, ir_expr.TensorLoad)
        and expr.source.same_as(store.buffer)
        and len(expr.indices) == len(store.indices)
        and all(
            tvm_ffi.structural_equal(a, b) for a, b in zip(expr.indices, store.indices)
        )
    )
