"""``merged_tiles.merge_tile_loops``: a causal mask's inner-tile loop and boundary-tile
loop become one loop over all of a block's tiles, the statements the mask changes as
branches on the tile's kind. The kernels' numerics on the GPU: ``tests/test_kernels.py``
(causal, ALiBi and GQA at whole tiles)."""
import pytest
import tvm
from tvm.s_tir.stmt import SBlock
from tvm.script import tirx as T

from tvm_cascade import kernels, ops
from tvm_cascade.primitives import ir
from tvm_cascade.bench import VARIANTS
from tvm_cascade.schedules import prefill
from tvm_cascade.cuda import software_pipeline
from tvm_cascade.cuda.merged_tiles import MERGE, merge_tile_loops


def _names(stmt):
    return [block.name_hint for block in ir.nodes(stmt, SBlock)]


def test_inner_and_boundary_tiles_run_in_one_loop_that_branches_on_the_score():
    func = ops.attention(1, 2, 2, 512, 512, 128, dtype="float16", variant=VARIANTS["causal"], pad_to=kernels.PAD_TO["prefill"])
    before = prefill.schedule_prefill(func).mod
    marked = [loop for loop in ir.nodes(before["main"].body, tvm.tirx.For) if MERGE in loop.annotations]
    assert len(marked) == 1 and int(marked[0].annotations[MERGE]) == software_pipeline.INTERLEAVED
    after = merge_tile_loops(before)["main"]
    loops = [loop for loop in ir.nodes(after.body, tvm.tirx.For) if software_pipeline.CHOSEN in loop.annotations]
    assert len(loops) == 1 and not any(MERGE in loop.annotations for loop in ir.nodes(after.body, tvm.tirx.For))
    loop = loops[0]
    assert int(loop.annotations[software_pipeline.CHOSEN]) == software_pipeline.INTERLEAVED
    # 4 row tiles of 128 rows over 64-key tiles: block b sees 2 (b % 4) inner tiles and
    # its 2 diagonal ones.
    (block,) = [
        l.loop_var
        for l in ir.nodes(after.body, tvm.tirx.For)
        if l.thread_binding is not None and l.thread_binding.thread_tag == "blockIdx.x"
    ]
    assert tvm.sym.Analyzer().can_prove_equal(loop.extent, block % 4 * 2 + 2)
    (branch,) = ir.nodes(loop.body, tvm.tirx.IfThenElse)
    assert tvm.sym.Analyzer().can_prove_equal(branch.condition.b, block % 4 * 2) and branch.condition.a.same_as(loop.loop_var)
    assert _names(branch.then_case) == ["score_inner"] and _names(branch.else_case) == ["score"]
    # The copies are the boundary tiles' (unconditional), every other statement is one
    # for both kinds of tile, on one set of intermediate buffers.
    statements = software_pipeline.pipeline_statements(loop)
    assert [_names(s) for s in statements[:2]] == [["V_shared.dyn"], ["K_shared.dyn"]]
    assert sum(isinstance(s, tvm.tirx.IfThenElse) for s in statements) == 1
    inner = {v.name for v in ir.nodes(loop.body, tvm.ir.expr.Var) if v.name.endswith("_inner")}
    assert not inner


@pytest.mark.parametrize("followed", [True, False])
def test_a_merge_mark_without_a_boundary_loop_is_refused(followed):
    """The marked loop followed by a statement that is not a loop, or by nothing."""

    @T.prim_func(private=True, s_tir=True)
    def func(a: T.Buffer((4,), "float32")):
        for i in T.serial(4, annotations={MERGE: 3}):
            with T.sblock("a"):
                vi = T.axis.spatial(4, i)
                a[vi] = T.float32(0)
        if followed:
            with T.sblock("b"):
                a[0] = T.float32(1)

    with pytest.raises(ValueError, match="loop 'i' is marked to merge, but no tile loop follows it"):
        merge_tile_loops(tvm.IRModule({"main": func}))


def test_tile_loops_of_different_statements_are_refused():
    @T.prim_func(private=True, s_tir=True)
    def func(a: T.Buffer((8,), "float32")):
        for i in T.serial(4, annotations={MERGE: 3}):
            with T.sblock("a"):
                vi = T.axis.spatial(4, i)
                a[vi] = T.float32(0)
        for j in range(4):
            with T.sblock("b"):
                vj = T.axis.spatial(8, j + 4)
                a[vj] = T.float32(0)
            with T.sblock("c"):
                vj = T.axis.spatial(8, j + 4)
                a[vj] = a[vj] + T.float32(1)

    with pytest.raises(ValueError, match="the tile loops 'i' and 'j' differ in their statements"):
        merge_tile_loops(tvm.IRModule({"main": func}))
