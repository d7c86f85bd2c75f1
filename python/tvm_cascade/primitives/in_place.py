"""``Schedule.accumulate_in_place``: a tile's reduction that starts from the running value.

After ``split_tile_accumulation`` a tile's ``P·V`` is reduced from zero into an
accumulator of its own, and the fold ``O = O * factor + PV_tile`` adds it to the running
output: two accumulators live side by side (registers a tensor-core kernel lacks), and
every element pays a zero fill and an add. Started from the repaired running value
instead, the tile's matrix products accumulate onto it (FlashAttention's order) and the
fold becomes a copy, which register allocation removes.
"""
import tvm
import tvm_ffi
from tvm.ir import expr as ir_expr
from tvm.s_tir import Schedule
from tvm.s_tir.stmt import SBlockRealize

from ..algebra.reducers import REDUCERS, match_reducer
from ..analysis.chain import substitute
from ..analysis.scope import buffer_params, uses_var
from ..errors import FusionError
from ..trace import append_instruction
from ..trace.kinds import register_kind
from . import ir
from .rolling_update import scope_of
from .tiles import identity_of


def accumulate_in_place(self: Schedule, block, init) -> None:
    """Start the tile reduction that ``block`` folds in from the running value ``block``
    folds it into, and make ``block`` take the result.

    ``block`` must end in the fold ``X = f(a, Y[...])`` of ``split_tile_accumulation``
    (``a`` the running value ``X``, repaired or not, e.g. ``X * X_scale[t]``); ``Y`` must
    be written by ``init``, which stores the identity of ``f`` at its own iterators (as
    ``decompose_reduction`` leaves the initial value of ``<block>_tile``), and by one
    other block, the tile's reduction by ``f`` with no initial value of its own. ``block``
    must read ``Y`` at its own iterators, one per index, among them all that ``a`` uses,
    and have no initial value of its own (``decompose_reduction`` it too), so that ``X``
    holds its value before the first tile. Then ``init`` stores ``a`` instead and the fold
    becomes ``X = Y[...]``. Otherwise :class:`tvm_cascade.FusionError` is raised and the
    schedule is left unchanged.

    ``init`` then reads ``X``, which ``block`` writes after it: TVM's compute-at
    primitives refuse a scope with such a write-after-read, so place blocks first.

    Parameters
    ----------
    block : SBlockRV
        The fold of a tile's reduction into the running value, e.g. ``pv`` after
        ``split_tile_accumulation(pv, j0)`` and ``decompose_reduction(pv, j0)``.
    init : SBlockRV
        The tile reduction's initial value, e.g. the result of
        ``decompose_reduction(pv_tile, loop)``.

    Examples
    --------
    Before accumulate_in_place, in TensorIR, the IR is:

    .. code-block:: python

        @T.prim_func(s_tir=True)
        def before(E: T.Buffer((4, 32), "float32"), V: T.Buffer((32, 8), "float32"),
                   C: T.Buffer((2, 4), "float32"), O: T.Buffer((4, 8), "float32")):
            O_tile = T.sblock_alloc_buffer((2, 4, 8))
            for i, d in T.grid(4, 8):
                with T.sblock("pv_init"):
                    vi, vd = T.axis.remap("SS", [i, d])
                    O[vi, vd] = T.float32(0)
            for t in range(2):
                for i, d in T.grid(4, 8):
                    with T.sblock("pv_tile_init"):
                        vi, vd, vt = T.axis.remap("SSS", [i, d, t])
                        O_tile[vt, vi, vd] = T.float32(0)
                for i, d, r in T.grid(4, 8, 16):
                    with T.sblock("pv_tile_update"):
                        vi, vd, vt, vr = T.axis.remap("SSSR", [i, d, t, r])
                        O_tile[vt, vi, vd] = O_tile[vt, vi, vd] + E[vi, vt * 16 + vr] * V[vt * 16 + vr, vd]
                for i, d in T.grid(4, 8):
                    with T.sblock("pv"):
                        vi, vd, vt = T.axis.remap("SSR", [i, d, t])
                        O[vi, vd] = O[vi, vd] * C[vt, vi] + O_tile[vt, vi, vd]

    Create the schedule and do accumulate_in_place:

    .. code-block:: python

        sch = tvm.s_tir.Schedule(before)
        sch.accumulate_in_place(sch.get_sblock("pv"), sch.get_sblock("pv_tile_init"))

    After applying accumulate_in_place, the IR becomes ``before`` with two statements
    changed:

    .. code-block:: python

        O_tile[vt, vi, vd] = O[vi, vd] * C[vt, vi]  # in pv_tile_init
        O[vi, vd] = O_tile[vt, vi, vd]  # in pv
    """
    target, seed = self.get(block), self.get(init)
    name = target.name_hint
    func, root_sref = scope_of(self, block)
    root = root_sref.stmt
    if target.init is not None:
        raise FusionError(
            f"accumulate_in_place: block '{name}' has an initial value; decompose_reduction it "
            "first, so that the running value is set before the first tile"
        )
    statements = ir.statements(target.body)
    fold = statements[-1]
    parts = _fold_parts(fold)
    if parts is None:
        raise FusionError(f"accumulate_in_place: block '{name}' does not end in a fold X = f(a, Y[...])")
    node, running, tile_load = parts
    tile = tile_load.source
    others = [
        b for b in ir.blocks_in(root) if not b.same_as(seed) and any(r.source.same_as(tile) for r in b.writes)
    ]
    update = others[0].body if len(others) == 1 and others[0].init is None else None
    matched = match_reducer(update) if isinstance(update, tvm.tirx.BufferStore) else None
    if matched is None or matched[0].tir_node is not node:
        raise FusionError(
            f"accumulate_in_place: {tile.name}, which block '{name}' folds in, is not the result "
            f"of one reduction by the fold's own reducer besides block '{seed.name_hint}'"
        )
    reducer = matched[0]
    start = seed.body
    if not (
        isinstance(start, tvm.tirx.BufferStore)
        and start.buffer.same_as(tile)
        and tvm_ffi.structural_equal(start.value, identity_of(reducer, tile.dtype))
    ):
        raise FusionError(
            f"accumulate_in_place: block '{seed.name_hint}' does not set {tile.name} to the "
            f"identity of its {reducer}"
        )
    # block's iterators as init's: through the indices of the tile's result.
    mapping = _positions(tile_load.indices, start.indices, target, seed)
    if mapping is None or any(uses_var(running, iv.var) and iv.var not in mapping for iv in target.iter_vars):
        raise FusionError(
            f"accumulate_in_place: blocks '{name}' and '{seed.name_hint}' do not access {tile.name} "
            f"at their own iterators, one per index, covering those of the running value"
        )
    seeded = ir.copy_block(seed, body=tvm.tirx.BufferStore(tile, substitute(running, mapping), start.indices))
    copied = tvm.tirx.BufferStore(fold.buffer, tile_load, fold.indices)
    folded = ir.copy_block(target, body=ir.seq(statements[:-1] + [copied]))
    buffers = buffer_params(func) + list(root.alloc_buffers)
    reuse = {seed: ir.with_regions(seeded, buffers), target: ir.with_regions(folded, buffers)}

    def rewrite(realize):
        new = reuse.get(realize.block)
        return realize if new is None else SBlockRealize(realize.iter_values, realize.predicate, new)

    new_root = ir.copy_block(root, body=tvm_ffi.structural_map(root.body, (SBlockRealize, rewrite)))
    ir.replace_root(self, root_sref, new_root, reuse)
    append_instruction(self, "AccumulateInPlace", [block, init])


def _positions(read, written, reader, writer):
    """{reader iterator: writer iterator} of two accesses that index every dimension by a
    distinct iterator of their block, or None."""
    own = lambda indices, block: (
        all(isinstance(i, tvm.tirx.Var) for i in indices)
        and len({i for i in indices}) == len(indices)
        and all(any(i.same_as(iv.var) for iv in block.iter_vars) for i in indices)
    )
    if not (own(read, reader) and own(written, writer)):
        return None
    return dict(zip(read, written))


def _fold_parts(store):
    """``(reducer node type, a, Y load)`` of ``X = f(a, Y[...])``, or None."""
    if not isinstance(store, tvm.tirx.BufferStore):
        return None
    value = store.value
    for reducer in REDUCERS:
        if isinstance(value, reducer.tir_node):
            for running, tile in ((value.a, value.b), (value.b, value.a)):
                if isinstance(tile, ir_expr.TensorLoad) and not tile.source.same_as(store.buffer):
                    return reducer.tir_node, running, tile
    return None


register_kind("AccumulateInPlace", "accumulate_in_place", ("block", "init"))
