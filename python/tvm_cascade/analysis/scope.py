"""The blocks of one schedule scope in program order, with the loops around each."""
from dataclasses import dataclass, field

import tvm
import tvm_ffi
from tvm.ir import expr as ir_expr
from tvm.s_tir.stmt import SBlock, SBlockRealize

REDUCE = 2  # IterVar.iter_type of a reduction iterator


@dataclass(eq=False)
class Site:
    """One block realize and the loops (outermost first) that surround it in the scope."""

    index: int
    realize: SBlockRealize
    loops: list = field(default_factory=list)

    @property
    def block(self) -> SBlock:
        return self.realize.block

    @property
    def name(self) -> str:
        return self.block.name_hint

    @property
    def is_reduction(self) -> bool:
        return self.block.init is not None

    def binding(self, iter_var):
        for iv, value in zip(self.block.iter_vars, self.realize.iter_values):
            if iv.var.same_as(iter_var.var):
                return value
        raise KeyError(iter_var)

    def under(self, loop) -> bool:
        return any(l.same_as(loop) for l in self.loops)

    def loops_above(self, loop) -> list:
        k = self._position(loop)
        return [] if k is None else self.loops[:k]

    def loops_below(self, loop) -> list:
        k = self._position(loop)
        return [] if k is None else self.loops[k + 1 :]

    def _position(self, loop):
        return next((k for k, l in enumerate(self.loops) if l.same_as(loop)), None)

    def write_buffers(self):
        return [region.source for region in self.block.writes]

    def read_buffers(self):
        return [region.source for region in self.block.reads]


def collect_sites(scope_block: SBlock) -> list:
    """Every block realize directly in ``scope_block`` (not inside child blocks)."""
    sites = []

    def visit(stmt, loops):
        if isinstance(stmt, tvm.tirx.For):
            visit(stmt.body, loops + [stmt])
        elif isinstance(stmt, tvm.tirx.SeqStmt):
            for item in stmt:
                visit(item, loops)
        elif isinstance(stmt, SBlockRealize):
            sites.append(Site(len(sites), stmt, loops))
        elif hasattr(stmt, "body"):
            visit(stmt.body, loops)

    visit(scope_block.body, [])
    return sites


def vars_in(expr) -> list:
    """The variables an expression reads."""
    found = []

    def visit(node):
        if isinstance(node, ir_expr.Var) and not any(node.same_as(v) for v in found):
            found.append(node)

    tvm_ffi.structural_walk(expr, visit)
    return found


def uses_var(expr, var) -> bool:
    return any(v.same_as(var) for v in vars_in(expr))


def buffer_accesses(stmt) -> list:
    """(buffer, indices) of every load and store in ``stmt``."""
    found = []

    def visit(node):
        if isinstance(node, ir_expr.TensorLoad):
            found.append((node.source, list(node.indices)))
        elif isinstance(node, tvm.tirx.BufferStore):
            found.append((node.buffer, list(node.indices)))

    tvm_ffi.structural_walk(stmt, visit)
    return found


def buffer_params(func) -> list:
    """The parameters of ``func`` that are buffers."""
    return [p for p in func.params if isinstance(p.ty, tvm.tirx.BufferType)]


def extent_product(loops, dtype: str):
    """The number of iterations of ``loops`` together, simplified."""
    product = tvm.tirx.const(1, dtype)
    for loop in loops:
        product = product * tvm.tirx.Cast(dtype, loop.extent)
    return tvm.sym.Analyzer().simplify(product)


def dtype_of(expr) -> str:
    """The data type of a scalar expression or variable."""
    return str(expr.ty.dtype)


def snapshot_buffer(block: SBlock):
    """The buffer an earlier fusion made ``block`` copy its accumulator into, or None."""
    body = block.body
    if isinstance(body, tvm.tirx.SeqStmt) and isinstance(body[0], tvm.tirx.IfThenElse):
        then = body[0].then_case
        if (
            isinstance(then, tvm.tirx.BufferStore)
            and isinstance(then.value, ir_expr.TensorLoad)
            and then.value.source.same_as(accumulator_store(block).buffer)
        ):
            return then.buffer
    return None


def accumulator_store(block: SBlock):
    body = block.body
    return body[len(body) - 1] if isinstance(body, tvm.tirx.SeqStmt) else body
