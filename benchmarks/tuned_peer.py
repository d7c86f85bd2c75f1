"""The "tvm-cascade (tuned)" peer of the benchmarks beyond attention (``cascades``,
``scaled_gemm``, ``fp8_gemm``) and their shared command line: the unfused function built from its best MetaSchedule record
(:func:`tvm_cascade.meta_schedule.tuned_schedule`) in the records the package ships, or
in ``--records DIR``; with ``--tune TRIALS`` the shape is tuned into that database
(default ``OUT/tuning/records``) first, over :func:`tvm_cascade.meta_schedule.cascade_space`
(which proposes the fusions itself), starting from the unfused function. The package's
records (``python/tvm_cascade/tuned/cascades``) are such a database, its two tables
xz-compressed (``xz database_*.json``)."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional, Sequence

from .attention import named, run_shapes, shapes_parser, write_table

TUNED = "tvm-cascade (tuned)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tune", type=int, default=0, metavar="TRIALS", help="tune each shape with MetaSchedule first")
    parser.add_argument("--records", type=Path, default=None, metavar="DIR",
                        help="the tuning database read (and tuned into); default: the package's")


def records_of(args) -> Optional[Path]:
    """The database the peer reads: ``--records``, or with ``--tune`` ``OUT/tuning/records``
    (the package's is read only), else None (the package's)."""
    return args.out / "tuning" / "records" if args.tune and args.records is None else args.records


def tuned_kernel(func, target, trials: int, records: Optional[Path], logs: Path, **tuning):
    """``func``'s kernel (its ``main``) from its best record in the database at ``records``
    (None: the package's), tuned there first with ``trials`` candidates if asked
    (``tuning``: more of :func:`tvm_cascade.meta_schedule.tune_tir`'s options), and the
    schedule the record gives."""
    import tvm

    from tvm_cascade.meta_schedule import build, tune_tir, tuned_database, tuned_schedule

    mod = tvm.IRModule({"main": func})
    database = tuned_database(records)
    if trials:
        tune_tir(mod, target, str(logs), trials, database=database, num_trials_per_iter=min(trials, 32), **tuning)
    sch = tuned_schedule(mod, target, database)
    if sch is None:
        raise RuntimeError(f"no record of this shape (why: {logs}/logs)" if trials else "no record of this shape")
    return build(sch.mod, target)["main"], sch


def main(prog: str, doc: str, outputs: str, shapes, run_shape, markdown, argv: Sequence[str], **options):
    """The command line of a benchmark with the tuned peer: the shapes ``--only`` names,
    each measured by ``run_shape(shape, tune, work_dir, records)``
    (:func:`benchmarks.attention.run_shapes`, ``options`` to it), the table written;
    ``(results, args)``, results None where nothing ran."""
    parser = shapes_parser(prog, doc, outputs)
    add_arguments(parser)
    args = parser.parse_args(argv)
    records = records_of(args)
    results = run_shapes(prog, args.out, argv, named(shapes, args.only),
                         lambda shape: run_shape(shape, args.tune, args.out / "tuning", records), **options)
    if results is not None:
        write_table(prog, args.out, results, markdown)
    return results, args
