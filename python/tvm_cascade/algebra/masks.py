"""Masks a sum can see through: ``select(cond, e, 0)`` around the terms it folds.

Attention as TOPI legalises it masks the exponentials, ``select(causal, exp(s - m), 0)``,
and divides or multiplies them further on. Where ``cond`` reads no incomplete value, the
term is ``e`` or exactly 0, the identity of the sum; a repair ``h`` proven for ``e`` that
distributes over the sum and maps 0 to 0 repairs the masked sum as well. Repairs that
count the folded elements are the exception: masked elements would be counted too.
"""
import tvm
from tvm.ir import expr as ir_expr
from tvm.ir.prim import expr as prim


def strip_zero_masks(expr, holds_incomplete):
    """``e`` such that ``expr == select(C, e, 0)`` for a condition C free of incomplete
    values (``holds_incomplete(x)`` says whether x reads one); ``expr`` when it has no such
    mask. Masks are lifted through products, numerators and float casts."""
    if isinstance(expr, prim.Select):
        masked = _masked(expr.condition, expr.true_value, expr.false_value, holds_incomplete)
        return expr if masked is None else strip_zero_masks(masked, holds_incomplete)
    if (
        isinstance(expr, ir_expr.Call)
        and isinstance(expr.op, tvm.ir.Op)
        and expr.op.name.endswith("if_then_else")
    ):
        masked = _masked(*expr.args, holds_incomplete)
        return expr if masked is None else strip_zero_masks(masked, holds_incomplete)
    if isinstance(expr, prim.Mul):
        a, b = (strip_zero_masks(x, holds_incomplete) for x in (expr.a, expr.b))
        return expr if a.same_as(expr.a) and b.same_as(expr.b) else a * b
    if isinstance(expr, prim.Div):
        a = strip_zero_masks(expr.a, holds_incomplete)
        return expr if a.same_as(expr.a) else prim.Div(a, expr.b)
    if isinstance(expr, prim.Cast):
        value = strip_zero_masks(expr.value, holds_incomplete)
        return expr if value.same_as(expr.value) else prim.Cast(str(expr.ty.dtype), value)
    return expr


def _masked(condition, then_value, else_value, holds_incomplete):
    zero = isinstance(else_value, (prim.FloatImm, prim.IntImm)) and else_value.value == 0
    return then_value if zero and not holds_incomplete(condition) else None
