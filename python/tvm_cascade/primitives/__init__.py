"""The schedule primitives tvm-cascade adds to ``tvm.s_tir.Schedule``."""
from tvm.s_tir import Schedule

from ..trace import append_instruction
from . import rolling_update as _rolling


def rolling_update(self: Schedule, block, loop) -> None:
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
    loop : LoopRV
        The outer loop of a split of a producer's reduction loop, e.g. ``j_0`` of ``max``.

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
    _rolling.rolling_update(self, block, loop)
    append_instruction(self, "RollingUpdate", [block, loop])


def install() -> None:
    """Make the primitives methods of every ``tvm.s_tir.Schedule``."""
    Schedule.rolling_update = rolling_update
