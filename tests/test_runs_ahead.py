"""The suite's runs ahead (``runs_ahead.py``): tests whose runs name one shared key get
one run between them."""
import sys
import types

from runs_ahead import RunsAhead, runs


def _item(nodeid, function, **params):
    return types.SimpleNamespace(nodeid=nodeid, function=function, callspec=types.SimpleNamespace(params=params))


def test_tests_sharing_a_run_get_one_run(tmp_path, tmp_path_factory):
    log = tmp_path / "runs"

    def make(_factory, n):
        append = f"open({str(log)!r}, 'a').write({n % 2!r} and 'odd ' or 'even ')"
        return {"args": [sys.executable, "-c", append], "shared": n % 2}

    test = runs(make)(lambda n: None)
    items = [_item(f"test[{n}]", test, n=n) for n in range(4)]
    ahead = RunsAhead(items, tmp_path_factory)
    try:
        results = [ahead.result(item) for item in reversed(items)]
    finally:
        ahead.close()
    assert all(run.returncode == 0 for run in results)
    assert sorted(log.read_text().split()) == ["even", "odd"]
