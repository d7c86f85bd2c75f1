"""Translation of TIR expressions to SymPy and back.

Loads of *incomplete* reductions become symbols r0, r1, ...; every other sub-expression
that SymPy need not look into (loads of finished data, casts of integers, conditionals
without incomplete values) becomes an opaque symbol c0, c1, ... Symbols are numbered in
order of first appearance, so equal combiners give equal SymPy expressions and the
derivation cache can hit.
"""
from typing import Callable, Optional

import sympy
import tvm
import tvm_ffi
from tvm.ir import expr as ir_expr
from tvm.ir.prim import expr as prim

from ..analysis.scope import dtype_of

_UNARY = {
    "tirx.exp": sympy.exp,
    "tirx.log": sympy.log,
    "tirx.tanh": sympy.tanh,
    "tirx.sqrt": sympy.sqrt,
    "tirx.rsqrt": lambda x: 1 / sympy.sqrt(x),
    "tirx.fabs": sympy.Abs,
    "tirx.exp2": lambda x: sympy.Integer(2) ** x,
    "tirx.log2": lambda x: sympy.log(x, 2),
    "tirx.sigmoid": lambda x: 1 / (1 + sympy.exp(-x)),
}


class UnsupportedExpr(Exception):
    """A sub-expression that holds an incomplete value but has no SymPy meaning here."""

    def __init__(self, expr):
        super().__init__(str(expr))
        self.expr = expr


class Symbolic:
    """A TIR expression in SymPy form plus the TIR meaning of each of its symbols."""

    def __init__(self, classify: Callable[[object], Optional[object]]):
        self._classify = classify
        self.incomplete = []  # list of (symbol, key, load)
        self.opaque = []  # list of (symbol, PrimExpr)

    def symbol_of_incomplete(self, key, load):
        for sym, known, _ in self.incomplete:
            if known == key:
                return sym
        sym = sympy.Symbol(f"r{len(self.incomplete)}", real=True)
        self.incomplete.append((sym, key, load))
        return sym

    def symbol_of_opaque(self, expr):
        for sym, known in self.opaque:
            if tvm_ffi.structural_equal(known, expr, map_free_vars=False):
                return sym
        sym = sympy.Symbol(f"c{len(self.opaque)}", real=True)
        self.opaque.append((sym, expr))
        return sym

    def holds_incomplete(self, expr) -> bool:
        found = []

        def visit(node):
            if isinstance(node, ir_expr.TensorLoad) and self._classify(node) is not None:
                found.append(node)

        tvm_ffi.structural_walk(expr, visit)
        return bool(found)

    def convert(self, expr) -> sympy.Expr:
        """Translate ``expr``; raise UnsupportedExpr on an incomplete value SymPy cannot see."""
        if isinstance(expr, (prim.FloatImm, prim.IntImm)):
            return sympy.Rational(expr.value) if isinstance(expr, prim.FloatImm) else sympy.Integer(expr.value)
        if isinstance(expr, ir_expr.TensorLoad):
            key = self._classify(expr)
            if key is not None:
                return self.symbol_of_incomplete(key, expr)
            return self.symbol_of_opaque(expr)
        binary = {
            prim.Add: lambda a, b: a + b,
            prim.Sub: lambda a, b: a - b,
            prim.Mul: lambda a, b: a * b,
            prim.Max: sympy.Max,
            prim.Min: sympy.Min,
        }
        for node_type, fn in binary.items():
            if isinstance(expr, node_type):
                return fn(self.convert(expr.a), self.convert(expr.b))
        if isinstance(expr, prim.Div) and dtype_of(expr).startswith(("float", "bfloat")):
            return self.convert(expr.a) / self.convert(expr.b)
        if (
            isinstance(expr, prim.Cast)
            and dtype_of(expr).startswith(("float", "bfloat"))
            and dtype_of(expr.value).startswith(("float", "bfloat"))
        ):
            # Float-to-float casts change rounding, not the algebra of the combiner.
            return self.convert(expr.value)
        if isinstance(expr, ir_expr.Call) and isinstance(expr.op, tvm.ir.Op):
            fn = _UNARY.get(expr.op.name)
            if fn is not None and len(expr.args) == 1:
                return fn(self.convert(expr.args[0]))
        if self.holds_incomplete(expr):
            raise UnsupportedExpr(expr)
        return self.symbol_of_opaque(expr)


def to_tir(expr: sympy.Expr, env: dict, dtype: str):
    """Translate a SymPy expression back to TIR; ``env`` maps each symbol to a PrimExpr."""

    def const(value):
        return tvm.tirx.const(float(value), dtype)

    def go(e):
        if e in env:
            return env[e]
        if e.is_Number:
            return const(e)
        if e.is_Add:
            positive = [a for a in e.args if not a.could_extract_minus_sign()]
            negative = [-a for a in e.args if a.could_extract_minus_sign()]
            out = go(positive[0]) if positive else -go(negative.pop(0))
            for term in positive[1:]:
                out = out + go(term)
            for term in negative:
                out = out - go(term)
            return out
        if e.is_Mul:
            numer, denom = [], []
            for factor in e.args:
                base, exponent = factor.as_base_exp()
                if exponent.is_Number and exponent < 0:
                    denom.append(base if exponent == -1 else base ** (-exponent))
                else:
                    numer.append(factor)
            out = const(1) if not numer else None
            for factor in numer:
                out = go(factor) if out is None else out * go(factor)
            if denom:
                out = out / go(sympy.Mul(*denom))
            return out
        if e.is_Pow:
            base, exponent = e.args
            if exponent == sympy.Rational(1, 2):
                return tvm.tirx.sqrt(go(base))
            if exponent == sympy.Rational(-1, 2):
                return tvm.tirx.rsqrt(go(base))
            if exponent.is_Integer and exponent > 0:
                b = go(base)
                out = b
                for _ in range(int(exponent) - 1):
                    out = out * b
                return out
            if exponent.is_Integer and exponent < 0:
                return const(1) / go(base ** (-exponent))
            if base == 2:
                return tvm.tirx.exp2(go(exponent))
            return tvm.tirx.power(go(base), go(exponent))
        simple = {
            sympy.exp: tvm.tirx.exp,
            sympy.log: tvm.tirx.log,
            sympy.tanh: tvm.tirx.tanh,
            sympy.Abs: tvm.tirx.abs,
        }
        for fn, tir_fn in simple.items():
            if e.func == fn:
                return tir_fn(go(e.args[0]))
        if e.func in (sympy.Max, sympy.Min):
            tir_fn = tvm.tirx.max if e.func == sympy.Max else tvm.tirx.min
            args = [go(a) for a in e.args]
            out = args[0]
            for arg in args[1:]:
                out = tir_fn(out, arg)
            return out
        raise NotImplementedError(f"no TIR form for {e!r}")

    return go(expr)
