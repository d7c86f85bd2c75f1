"""Stores of a wgmma accumulator four columns a thread at a time.

In a warpgroup's m64nNk16 accumulator a lane holds two adjacent columns of each 8-column
group of its rows, so stored as they lie a warp's stores use a quarter of each 32-byte
sector. :func:`trade_halves` has lanes 2i and 2i + 1 trade halves of two groups, after
which each holds four adjacent columns (8 bytes of 16-bit output): an even lane the
first group's columns from ``2 (lane % 4)``, an odd one the second group's from
``2 (lane % 4) - 2`` (:func:`first_column`), and a warp's stores fill whole sectors.
"""
from tvm.script import tirx as T

from . import ALL_LANES


@T.macro
def trade_halves(four, lane, first, second):
    """``four[0:4]``: this lane's four columns of the pair of groups whose two columns
    this lane holds as ``first(e)`` and ``second(e)`` (``e`` = 0, 1); every lane of the
    warp takes part."""
    for e in T.unroll(2):
        got = T.cuda.__shfl_xor_sync(T.uint32(ALL_LANES), T.if_then_else(lane % 2 == 1, first(e), second(e)), 1, 32)
        four[e] = T.if_then_else(lane % 2 == 1, got, first(e))
        four[2 + e] = T.if_then_else(lane % 2 == 1, second(e), got)


@T.macro
def store_four(out, ov, four, row, col, m, n, part_n):
    """Row ``row``'s four columns from ``col`` (:func:`first_column`) of ``four``, cast
    through ``ov`` to ``out``'s dtype, stored in ``out`` [m, n] where they lie in it: one
    8-byte store, or column by column where ``part_n`` (columns may lie past ``n``)."""
    for e in T.unroll(4):
        ov[e] = T.Cast(out.dtype, four[e])
    if row < m:
        if part_n:
            for e in T.unroll(4):
                if col + e < n:
                    out[row, col + e] = ov[e]
        else:
            out.vstore([row, col], ov.vload([0], f"{out.dtype}x4"))


def first_column(lane):
    """The column, from the first group's first, of this lane's four after
    :func:`trade_halves`."""
    return 2 * (lane % 4) + 6 * (lane % 2)
