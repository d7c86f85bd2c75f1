"""Tests whose body runs in a subprocess that the session starts ahead of them
(``runs_ahead.py``), on the core the pytest process leaves idle: for tests that only
build (compile for a GPU, replay a design space) and check what they built, taking
their parameters and no fixtures. Run as a script, this module is that subprocess."""
import functools
import inspect
import sys

from runs_ahead import call_run, called, runs


def in_a_process_ahead(test):
    """Marks ``test`` (at the top of its module; its arguments are its parameters, no
    fixtures): its body runs in a subprocess started with the session, and the test
    passes where that run did (its output shown where it did not)."""

    def make(tmp_path_factory, **params):
        return call_run(tmp_path_factory.mktemp("ahead"), __file__, test, params)

    @functools.wraps(test)
    def checked(runs_ahead, request, **params):
        run = runs_ahead.result(request.node)
        assert run.returncode == 0, run.stdout + run.stderr

    names = list(inspect.signature(test).parameters) + ["runs_ahead", "request"]
    checked.__signature__ = inspect.Signature(
        [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in names]
    )
    checked.body = test
    return runs(make)(checked)


if __name__ == "__main__":
    test, params, _ = called(sys.argv[1:])
    test.body(**params)
