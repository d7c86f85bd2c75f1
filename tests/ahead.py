"""Tests whose body runs in a subprocess that the session starts ahead of them
(``runs_ahead.py``), on the core the pytest process leaves idle: for tests that stand
alone (compile for a GPU, replay a design space, run a benchmark on the CPU) and check
what they made, taking their parameters and no fixtures but ``tmp_path``. Run as a
script, this module is that subprocess."""
import functools
import inspect
import sys
from pathlib import Path

import pytest

from runs_ahead import call_run, called, runs


#: The exit status of a run whose body skipped (``pytest.skip``, ``importorskip``).
SKIPPED = 77


def in_a_process_ahead(test):
    """Marks ``test`` (at the top of its module; its arguments are its parameters, and
    ``tmp_path`` where it takes one: a folder of the run's own): its body runs in a
    subprocess started with the session, and the test passes where that run did (its
    output shown where it did not), or skips where it skipped."""
    takes = list(inspect.signature(test).parameters)

    def make(tmp_path_factory, **params):
        folder = tmp_path_factory.mktemp("ahead")
        return call_run(folder, __file__, test, params, *([str(folder / "tmp")] if "tmp_path" in takes else []))

    @functools.wraps(test)
    def checked(runs_ahead, request, **params):
        run = runs_ahead.result(request.node)
        if run.returncode == SKIPPED:
            pytest.skip(run.stdout.strip())
        assert run.returncode == 0, run.stdout + run.stderr

    names = [name for name in takes if name != "tmp_path"] + ["runs_ahead", "request"]
    checked.__signature__ = inspect.Signature(
        [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in names]
    )
    checked.body = test
    return runs(make)(checked)


if __name__ == "__main__":
    test, params, folder = called(sys.argv[1:])
    if folder:
        params["tmp_path"] = Path(folder[0])
        params["tmp_path"].mkdir()
    try:
        test.body(**params)
    except pytest.skip.Exception as skipped:
        print(skipped.msg)
        sys.exit(SKIPPED)
