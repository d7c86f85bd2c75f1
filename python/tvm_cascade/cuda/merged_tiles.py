"""A mask's inner and boundary tile loops merged into one loop that branches per statement.

``unmask_inner_tiles`` splits a causal mask's key loop into the inner tiles (no mask;
as many as the block has rows before its first: none for the first block) and the
boundary tiles. TVM cannot software-pipeline the inner loop: its trip count may be 0,
so the pipeline's prologue runs under a condition, and TVM's barrier planner refuses
barriers there. Merged at build time (:func:`merge_tile_loops`), the loop runs over all
of a block's tiles (at least the boundary ones), the K and V copies are the boundary
loop's (valid for every tile), a statement that the mask changes becomes ``if j <
inner: <unmasked> else <masked>`` and the others stay one statement; the merged loop
takes the software pipeline the inner loop's :data:`MERGE` annotation names.
"""
import tvm
import tvm_ffi
from tvm.s_tir.stmt import SBlock, SBlockRealize

from ..analysis.chain import substitute
from ..analysis.scope import vars_in
from ..primitives import ir
from . import software_pipeline

#: A loop annotation (on the inner tiles' loop): merge with the next loop, the boundary
#: tiles', and give the merged loop this :data:`.software_pipeline.CHOSEN` value.
MERGE = "tvm_cascade.merge_with_boundary_tiles"
#: The suffix of the inner tiles' copies of intermediate buffers (``unmask_inner_tiles``).
_INNER = "_inner"


@tvm.tirx.transform.prim_func_pass(opt_level=0, name="tvm_cascade.MergeTileLoops")
def merge_tile_loops(func, _mod, _ctx):
    """Each loop annotated :data:`MERGE` merged with the boundary tiles' loop after it
    (see the module's docstring). For scheduled functions, before lowering."""
    body = tvm_ffi.structural_map(func.body, (tvm.tirx.SeqStmt, _merge_in))
    for loop in ir.nodes(body, tvm.tirx.For):
        if MERGE in loop.annotations:
            raise ValueError(f"loop '{loop.loop_var.name}' is marked to merge, but no tile loop follows it")
    return func.with_body(body)


def _merge_in(seq):
    stmts = list(seq.seq)
    for index, inner in enumerate(stmts):
        if isinstance(inner, tvm.tirx.For) and MERGE in inner.annotations:
            if index + 1 == len(stmts) or not isinstance(stmts[index + 1], tvm.tirx.For):
                raise ValueError(f"loop '{inner.loop_var.name}' is marked to merge, but no tile loop follows it")
            # (The boundary tiles' index adds the inner tiles' count, bound before them.)
            bound = {s.var: s.value for s in stmts[:index] if isinstance(s, tvm.tirx.Bind)}
            merged = _merge(inner, substitute(stmts[index + 1], bound))
            return tvm.tirx.SeqStmt(stmts[:index] + [merged] + stmts[index + 2 :])
    return seq


def _merge(inner, boundary):
    j = tvm.tirx.Var(inner.loop_var.name, inner.loop_var.ty.dtype)
    end = inner.min + inner.extent  # the merged loop's first boundary tile
    in_inner = _statements(inner, {inner.loop_var: j})
    in_boundary = _statements(boundary, {boundary.loop_var: j - end + boundary.min})
    if len(in_inner) != len(in_boundary):
        raise ValueError(
            f"the tile loops '{inner.loop_var.name}' and '{boundary.loop_var.name}' differ in their statements"
        )
    # The inner tiles' statements on the boundary tiles' intermediate buffers
    # (unmask_inner_tiles gave the inner ones copies, X_inner for X): one set for both.
    by_name = {var.name: var for var in vars_in(in_boundary)}
    twins = {var: by_name.get(var.name[: -len(_INNER)]) for var in vars_in(in_inner) if var.name.endswith(_INNER)}
    in_inner = substitute(in_inner, {var: twin for var, twin in twins.items() if twin is not None})
    # A statement the mask changes becomes a branch on the tile's kind; one it does not
    # change stays one statement (a branch around a statement that needs warp barriers
    # is refused by TVM's barrier planner). The copies are the boundary tiles'.
    body = [
        b if _copies_to_shared(b) or tvm_ffi.structural_equal(a, b) else tvm.tirx.IfThenElse(j < end, a, b)
        for a, b in zip(in_inner, in_boundary)
    ]
    annotations = {k: v for k, v in inner.annotations.items() if k != MERGE}
    annotations[software_pipeline.CHOSEN] = inner.annotations[MERGE]
    extent = tvm.sym.Analyzer().simplify(inner.extent + boundary.extent)
    return ir.copy_loop(inner, loop_var=j, extent=extent, body=tvm.tirx.SeqStmt(body), annotations=annotations)


def _statements(loop, vmap):
    """The statements of ``loop``'s body, variables replaced as ``vmap`` says, their
    blocks' bindings and predicates simplified."""
    analyzer = tvm.sym.Analyzer()

    def realize(node):
        values = [analyzer.simplify(v) for v in node.iter_values]
        return SBlockRealize(values, analyzer.simplify(node.predicate), node.block)

    statements = substitute(ir.statements(loop.body), vmap)
    return [tvm_ffi.structural_map(stmt, (SBlockRealize, realize)) for stmt in statements]


def _copies_to_shared(stmt):
    """Whether every block of ``stmt`` writes shared memory only."""
    writes = [region.source for block in ir.nodes(stmt, SBlock) for region in block.writes]
    return bool(writes) and all(buffer.scope().startswith("shared") for buffer in writes)
