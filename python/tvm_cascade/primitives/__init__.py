"""The schedule primitives tvm-cascade adds to ``tvm.s_tir.Schedule``."""
from tvm.s_tir import Schedule

from ..trace import append_instruction
from . import rolling_update as _rolling
from . import split_k_update as _split_k
from . import in_place as _in_place
from . import replicas as _replicas
from . import hoist as _hoist
from . import tiles as _tiles
from . import row_scales as _row_scales
from .loop_inference import fusion_loop, trace_kept_on_failure


def rolling_update(self: Schedule, block, loop=None) -> None:
    """Fuse the reduction ``block`` into ``loop``, the key loop of an earlier reduction
    it depends on, keeping a running value that is repaired whenever a tile starts.

    ``loop`` must drive the reduction iterator of at least one reduction block under it
    (a *producer*, e.g. ``max`` after ``split``); inside the loop those producers hold
    partial results. ``block`` reduces over the same axis and reads the producers,
    directly or through spatial blocks (``exp``, casts, masks). The primitive:

    * derives the repair ``h`` of ``block``'s combiner from its reducer with SymPy and
      proves it (see :mod:`tvm_cascade.algebra.repair`); if none exists it raises
      :class:`tvm_cascade.FusionError` and leaves the schedule unchanged;
    * makes each producer the repair reads copy its value into a new buffer
      ``<buffer>_prev`` when a tile starts (``if v % tile == 0``), before folding it in;
    * moves the spatial blocks between the producers and ``block``, then ``block``, under
      ``loop``; they get the producer's outer loops, a copy of its loops below ``loop``
      (and its predicate, so tiles that do not divide the length work), and one new loop
      ``ax*`` for each other iterator;
    * rewrites ``block``'s update ``X = f(X, e)`` to
      ``X = f(first element of a later tile ? h(X, prev, current) : X, e)``.

    A spatial block that also feeds blocks left outside ``loop`` stays there for them as
    a copy named ``<block>_complete`` writing ``<buffer>_complete``; a later
    ``rolling_update`` of those consumers reuses the copy under the loop and removes the
    ``_complete`` one. Running state is read and written in one block each, so
    ``compute_at``, ``reverse_compute_at``, ``decompose_reduction``, ``bind``,
    ``cache_read`` and ``split`` still apply afterwards.

    Parameters
    ----------
    block : SBlockRV
        The reduction block to fuse, e.g. ``sum`` or ``pv`` of attention.
    loop : Optional[LoopRV]
        The outer loop of a split of a producer's reduction loop, e.g. ``j_0`` of ``max``.
        By default the outermost split of the key loop of the chain's first reduction
        (:mod:`tvm_cascade.primitives.loop_inference`; ambiguous or unsplit key loops are
        refused); the trace records the loop found.

    Examples
    --------
    Before rolling_update, in TensorIR, the IR is:

    .. code-block:: python

        @T.prim_func(s_tir=True)
        def before(S: T.Buffer((8, 128), "float32"), V: T.Buffer((128, 64), "float32"),
                   O: T.Buffer((8, 64), "float32")):
            m = T.sblock_alloc_buffer((8,))
            e = T.sblock_alloc_buffer((8, 128))
            l = T.sblock_alloc_buffer((8,))
            for i, j in T.grid(8, 128):
                with T.sblock("max"):
                    vi, vj = T.axis.remap("SR", [i, j])
                    with T.init():
                        m[vi] = T.min_value("float32")
                    m[vi] = T.max(m[vi], S[vi, vj])
            for i, j in T.grid(8, 128):
                with T.sblock("exp"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    e[vi, vj] = T.exp(S[vi, vj] - m[vi])
            for i, j in T.grid(8, 128):
                with T.sblock("sum"):
                    vi, vj = T.axis.remap("SR", [i, j])
                    with T.init():
                        l[vi] = T.float32(0)
                    l[vi] = l[vi] + e[vi, vj]
            for i, d, j in T.grid(8, 64, 128):
                with T.sblock("pv"):
                    vi, vd, vj = T.axis.remap("SSR", [i, d, j])
                    with T.init():
                        O[vi, vd] = T.float32(0)
                    O[vi, vd] = O[vi, vd] + e[vi, vj] * V[vj, vd]

    Create the schedule and do rolling_update:

    .. code-block:: python

        sch = tvm.s_tir.Schedule(before)
        j0, j1 = sch.split(sch.get_loops(sch.get_sblock("max"))[1], [None, 32])
        sch.rolling_update(sch.get_sblock("sum"), j0)
        sch.rolling_update(sch.get_sblock("pv"), j0)

    After applying rolling_update, the IR becomes:

    .. code-block:: python

        @T.prim_func(s_tir=True)
        def after(S: T.Buffer((8, 128), "float32"), V: T.Buffer((128, 64), "float32"),
                  O: T.Buffer((8, 64), "float32")):
            m = T.sblock_alloc_buffer((8,))
            e = T.sblock_alloc_buffer((8, 128))
            l = T.sblock_alloc_buffer((8,))
            m_prev = T.sblock_alloc_buffer((8,))
            for i, j_0 in T.grid(8, 4):
                for j_1 in range(32):
                    with T.sblock("max"):
                        vi = T.axis.spatial(8, i)
                        vj = T.axis.reduce(128, j_0 * 32 + j_1)
                        T.reads(S[vi, vj])
                        T.writes(m[vi], m_prev[vi])
                        with T.init():
                            m[vi] = T.min_value("float32")
                        if vj % 32 == 0:
                            m_prev[vi] = m[vi]
                        m[vi] = T.max(m[vi], S[vi, vj])
                for j_1 in range(32):
                    with T.sblock("exp"):
                        vi = T.axis.spatial(8, i)
                        vj = T.axis.spatial(128, j_0 * 32 + j_1)
                        e[vi, vj] = T.exp(S[vi, vj] - m[vi])
                for j_1 in range(32):
                    with T.sblock("sum"):
                        vi = T.axis.spatial(8, i)
                        vj = T.axis.reduce(128, j_0 * 32 + j_1)
                        T.reads(m_prev[vi], m[vi], e[vi, vj])
                        T.writes(l[vi])
                        with T.init():
                            l[vi] = T.float32(0)
                        l[vi] = T.if_then_else(
                            0 < vj and vj % 32 == 0, l[vi] * T.exp(m_prev[vi] - m[vi]), l[vi]
                        ) + e[vi, vj]
                for ax0, j_1 in T.grid(64, 32):
                    with T.sblock("pv"):
                        vi, vd = T.axis.remap("SS", [i, ax0])
                        vj = T.axis.reduce(128, j_0 * 32 + j_1)
                        T.reads(m_prev[vi], m[vi], e[vi, vj], V[vj, vd])
                        T.writes(O[vi, vd])
                        with T.init():
                            O[vi, vd] = T.float32(0)
                        O[vi, vd] = T.if_then_else(
                            0 < vj and vj % 32 == 0, O[vi, vd] * T.exp(m_prev[vi] - m[vi]), O[vi, vd]
                        ) + e[vi, vj] * V[vj, vd]

    Returns nothing; ``block`` keeps its name and the existing block and loop random
    variables stay valid, except those of the loops that ``block`` and the moved blocks
    leave. New buffers: ``<producer buffer>_prev``, and ``<buffer>_complete`` as above.
    New blocks: only ``<block>_complete`` copies, as above.
    """
    with trace_kept_on_failure(self):
        if loop is None:
            loop = fusion_loop(self, block, "rolling_update")
        _rolling.rolling_update(self, block, loop)
    append_instruction(self, "RollingUpdate", [block, loop])


def split_k_update(self: Schedule, block, loop=None) -> None:
    """Split the reduction ``block`` into independent chunks of the key loop: each chunk
    folds its own partial result, and a separate global block combines the partials,
    repairing each from the earlier reductions' chunk partials to their global values
    (FlashDecoding's ``l = sum_c l_c * exp(m_c - m)``).

    ``loop`` must be the chunk loop: the outer loop of a split of the reduction loop of the
    chain's first reduction (``j0, j1 = sch.split(j, [chunks, None])``). Call the primitive
    on the chain's reductions in order: the first (``max``) needs no repair; each later one
    (``sum``, ``pv``) reads earlier results, directly or through spatial blocks, and its
    repair is derived and proven exactly as for :meth:`rolling_update` (else
    :class:`tvm_cascade.FusionError`, with the schedule unchanged).

    For ``block`` writing ``X`` the primitive creates:

    * ``<block>_partial`` under ``loop``, with iterators ``(v_chunk, <block's spatial
      iterators>, <reduced>_in)``, folding one chunk into a new buffer ``X_partial[c, ...]``
      and reading earlier reductions' partials ``Y_partial[c, ...]`` instead of ``Y``;
    * ``block`` itself, now the global combine, right after the root-level loop nest it
      was in (the chunk loop's nest for the first reduction), reducing over ``v_chunk``.

    Spatial blocks between the earlier reductions and ``block`` move under ``loop`` and
    read the partial of their chunk (``Y_partial[v_j // chunk, ...]``); one that also feeds
    blocks left outside keeps a ``<block>_complete`` copy for them, as in
    :meth:`rolling_update`. Iterations of ``loop`` share no state, so it can be bound to
    thread blocks; the combines can be scheduled on their own. Where the chunks do not
    divide the length, the partials run every position of the last chunk with no
    predicate (which TVM would judge non-affine, refusing ``bind`` and ``parallel`` on
    ``loop``): their reads are clamped into the axis and positions past it fold nothing
    (``X_partial = Select(pos < n, f(X_partial, x), X_partial)``); a chunk past the last
    key holds the reduction's identity and the combines skip it. Beside reductions rolled
    within each chunk (:meth:`rolling_update` under ``loop``), the partials keep the
    split's predicate instead.

    Parameters
    ----------
    block : SBlockRV
        The reduction to split, e.g. ``max``, then ``sum``, then ``pv``.
    loop : Optional[LoopRV]
        The chunk loop, e.g. ``j_0`` of ``sch.split(j, [8, None])`` on ``max``'s key loop.
        By default the outermost split of the key loop of the chain's first reduction, as
        for :meth:`rolling_update`.

    Examples
    --------
    Before split_k_update, in TensorIR, the IR is the ``before`` function shown for
    :meth:`rolling_update`. Create the schedule and do split_k_update:

    .. code-block:: python

        sch = tvm.s_tir.Schedule(before)
        j0, j1 = sch.split(sch.get_loops(sch.get_sblock("max"))[1], [4, None])
        sch.split_k_update(sch.get_sblock("max"), j0)
        sch.split_k_update(sch.get_sblock("sum"), j0)
        sch.split_k_update(sch.get_sblock("pv"), j0)

    After applying split_k_update, the IR becomes:

    .. code-block:: python

        @T.prim_func(s_tir=True)
        def after(S: T.Buffer((8, 128), "float32"), V: T.Buffer((128, 64), "float32"),
                  O: T.Buffer((8, 64), "float32")):
            m = T.sblock_alloc_buffer((8,))
            e = T.sblock_alloc_buffer((8, 128))
            l = T.sblock_alloc_buffer((8,))
            m_partial = T.sblock_alloc_buffer((4, 8))
            l_partial = T.sblock_alloc_buffer((4, 8))
            O_partial = T.sblock_alloc_buffer((4, 8, 64))
            for i, j_0 in T.grid(8, 4):
                for j_1 in range(32):
                    with T.sblock("max_partial"):
                        v_chunk, vi, vj_in = T.axis.remap("SSR", [j_0, i, j_1])
                        with T.init():
                            m_partial[v_chunk, vi] = T.min_value("float32")
                        m_partial[v_chunk, vi] = T.max(m_partial[v_chunk, vi], S[vi, v_chunk * 32 + vj_in])
                for j_1 in range(32):
                    with T.sblock("exp"):
                        vi = T.axis.spatial(8, i)
                        vj = T.axis.spatial(128, j_0 * 32 + j_1)
                        e[vi, vj] = T.exp(S[vi, vj] - m_partial[vj // 32, vi])
                for j_1 in range(32):
                    with T.sblock("sum_partial"):
                        v_chunk, vi, vj_in = T.axis.remap("SSR", [j_0, i, j_1])
                        with T.init():
                            l_partial[v_chunk, vi] = T.float32(0)
                        l_partial[v_chunk, vi] = l_partial[v_chunk, vi] + e[vi, v_chunk * 32 + vj_in]
                for ax0, j_1 in T.grid(64, 32):
                    with T.sblock("pv_partial"):
                        v_chunk, vi, vd, vj_in = T.axis.remap("SSSR", [j_0, i, ax0, j_1])
                        with T.init():
                            O_partial[v_chunk, vi, vd] = T.float32(0)
                        O_partial[v_chunk, vi, vd] = (
                            O_partial[v_chunk, vi, vd]
                            + e[vi, v_chunk * 32 + vj_in] * V[v_chunk * 32 + vj_in, vd]
                        )
            for ax0, chunk in T.grid(8, 4):
                with T.sblock("max"):
                    vi, v_chunk = T.axis.remap("SR", [ax0, chunk])
                    with T.init():
                        m[vi] = T.min_value("float32")
                    m[vi] = T.max(m[vi], m_partial[v_chunk, vi])
            for ax0, chunk in T.grid(8, 4):
                with T.sblock("sum"):
                    vi, v_chunk = T.axis.remap("SR", [ax0, chunk])
                    with T.init():
                        l[vi] = T.float32(0)
                    l[vi] = l[vi] + l_partial[v_chunk, vi] * T.exp(m_partial[v_chunk, vi] - m[vi])
            for ax0, ax1, chunk in T.grid(8, 64, 4):
                with T.sblock("pv"):
                    vi, vd, v_chunk = T.axis.remap("SSR", [ax0, ax1, chunk])
                    with T.init():
                        O[vi, vd] = T.float32(0)
                    O[vi, vd] = O[vi, vd] + O_partial[v_chunk, vi, vd] * T.exp(m_partial[v_chunk, vi] - m[vi])

    (``T.reads``/``T.writes`` omitted.) Returns nothing; ``block``'s random variable now
    denotes the global combine; get the partial with ``sch.get_sblock("<block>_partial")``.
    """
    with trace_kept_on_failure(self):
        if loop is None:
            loop = fusion_loop(self, block, "split_k_update")
        _split_k.split_k_update(self, block, loop)
    append_instruction(self, "SplitKUpdate", [block, loop])


def hoist_independent(self: Schedule, block) -> None:
    """Move the root-level loop nests after ``block``'s that do not depend on it (read
    nothing it writes, directly or through other nests) before it, keeping the order
    within each group.

    The fusion primitives take a loop only if the inputs of the blocks they move under it
    are computed before it; a legalised Relax function transposes V after the softmax,
    between the softmax's max and P·V: this moves that transpose before the max.

    Parameters
    ----------
    block : SBlockRV
        A block at the root level, e.g. the ``max`` a chain starts with.

    Examples
    --------
    Before hoist_independent, in TensorIR, the IR is:

    .. code-block:: python

        @T.prim_func(s_tir=True)
        def before(S: T.Buffer((8, 16), "float32"), V: T.Buffer((16, 8), "float32"),
                   O: T.Buffer((8, 8), "float32")):
            m = T.sblock_alloc_buffer((8,))
            Vt = T.sblock_alloc_buffer((8, 16))
            for i, j in T.grid(8, 16):
                with T.sblock("max"):
                    vi, vj = T.axis.remap("SR", [i, j])
                    with T.init():
                        m[vi] = T.min_value("float32")
                    m[vi] = T.max(m[vi], S[vi, vj])
            for d, j in T.grid(8, 16):
                with T.sblock("transpose"):
                    vd, vj = T.axis.remap("SS", [d, j])
                    Vt[vd, vj] = V[vj, vd]
            for i, d, j in T.grid(8, 8, 16):
                with T.sblock("pv"):
                    vi, vd, vj = T.axis.remap("SSR", [i, d, j])
                    with T.init():
                        O[vi, vd] = T.float32(0)
                    O[vi, vd] = O[vi, vd] + T.exp(S[vi, vj] - m[vi]) * Vt[vd, vj]

    Create the schedule and do hoist_independent:

    .. code-block:: python

        sch = tvm.s_tir.Schedule(before)
        sch.hoist_independent(sch.get_sblock("max"))

    After applying hoist_independent, the nest of ``transpose`` comes first, then those
    of ``max`` and ``pv``, each as it was.

    Raises :class:`tvm_cascade.FusionError` naming the block if a root-level statement is
    not a loop nest around one block; the schedule is then unchanged.
    """
    _hoist.hoist_independent(self, block)
    append_instruction(self, "HoistIndependent", [block])


def install() -> None:
    """Make the primitives methods of every ``tvm.s_tir.Schedule``."""
    Schedule.rolling_update = rolling_update
    Schedule.split_k_update = split_k_update
    Schedule.hoist_independent = hoist_independent
    Schedule.distribute = _tiles.distribute
    Schedule.split_tile_accumulation = _tiles.split_tile_accumulation
    Schedule.skip_masked_tiles = _tiles.skip_masked_tiles
    Schedule.unmask_inner_tiles = _tiles.unmask_inner_tiles
    Schedule.replicate = _replicas.replicate
    Schedule.accumulate_in_place = _in_place.accumulate_in_place
    Schedule.defer_row_scales = _row_scales.defer_row_scales
    Schedule.fold_from_copy = _row_scales.fold_from_copy
    Schedule.over_padded_rows = _row_scales.over_padded_rows
