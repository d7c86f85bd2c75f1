"""Integer-to-float conversions with their constant offsets added after the conversion.

An unrolled fragment loop leaves one conversion per element that differs from its
neighbours' only in a constant, e.g. ALiBi's ``float(key - row)`` as
``float(base + 9)``: one ``I2F`` per score (a quarter-rate instruction on Hopper), twice
per tile (the max and the exp passes). Written ``float(base) + 9.0`` the conversion is
common to the elements, computed once, and each element costs an addition. Exact where
the analyzer bounds the integers within float32's exact range.
"""
import tvm
import tvm_ffi
from tvm import tirx

from ..analysis.chain import substitute
from ..analysis.scope import vars_in

#: float32 represents every integer of magnitude up to 2**24 exactly.
_EXACT = 1 << 24


def _bound_loops(func, analyzer):
    def visit(node):
        if isinstance(node, tirx.For):
            analyzer.bind(node.loop_var, tvm.ir.Range.from_min_extent(node.min, node.extent))
        elif isinstance(node, tirx.AttrStmt) and node.attr_key == "thread_extent":
            analyzer.bind(node.node.var, tvm.ir.Range.from_min_extent(0, node.value))

    tvm_ffi.structural_walk(func.body, visit)


def _rewrite(func):
    analyzer = tvm.sym.Analyzer()
    _bound_loops(func, analyzer)

    def split(cast):
        value = cast.value
        if str(cast.ty.dtype) != "float32" or not str(value.ty.dtype).startswith("int"):
            return cast
        # The offset: the value with every variable at zero, where the terms it differs
        # in from its neighbours are constants.
        zero = {var: tirx.const(0, var.ty.dtype) for var in vars_in(value)}
        offset = analyzer.simplify(substitute(value, zero))
        if not isinstance(offset, tirx.IntImm) or offset.value == 0:
            return cast
        rest = analyzer.simplify(value - offset)
        bound = analyzer.const_int_bound(rest)
        if max(-bound.min_value, bound.max_value) + abs(offset.value) > _EXACT:
            return cast
        return tirx.Cast("float32", rest) + tirx.const(float(offset.value), "float32")

    return func.with_body(tvm_ffi.structural_map(func.body, (tirx.Cast, split)))


@tirx.transform.prim_func_pass(opt_level=0, name="tvm_cascade.HoistCastOffsets")
def hoist_cast_offsets(func, _mod, _ctx):
    """Rewrite ``float32(x + c)`` (``x`` an int expression, ``c`` a constant) as
    ``float32(x) + float32(c)`` where both are exact (see the module's docstring)."""
    return _rewrite(func)
