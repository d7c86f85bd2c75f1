"""A minimal GPU schedule for fused attention: one CUDA thread per query row.

It exists to show that the fused TIR runs through TVM's own CUDA codegen; it uses no
shared memory or tensor cores, so it is no benchmark.
"""


def fuse_attention(sch, tile: int) -> None:
    """Fuse the attention chain of ``ops.attention`` into one key loop with ``tile``."""
    j0, _ = sch.split(sch.get_loops(sch.get_sblock("max"))[-1], [None, tile])
    sch.rolling_update(sch.get_sblock("sum"), j0)
    sch.rolling_update(sch.get_sblock("pv"), j0)
    sch.compute_at(sch.get_sblock("score"), j0)
    sch.compute_at(sch.get_sblock("qk"), j0)


def bind_rows(sch, threads: int = 64) -> None:
    """Bind the fused nest's row loops (b, h, i), and the epilogue's loops, to blocks and
    threads; the per-tile intermediates live in registers."""
    max_rv = sch.get_sblock("max")
    rows = sch.get_loops(max_rv)[:3]
    _bind(sch, sch.fuse(*rows), threads)
    out = sch.get_sblock("out")
    _bind(sch, sch.fuse(*sch.get_loops(out)), threads)
    for name in ("qk", "score", "exp"):
        sch.set_scope(sch.get_sblock(name), 0, "local")


def _bind(sch, loop, threads):
    bx, tx = sch.split(loop, [None, threads])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
