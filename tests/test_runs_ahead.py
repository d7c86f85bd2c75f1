"""The suite's runs ahead (``runs_ahead.py``): tests whose runs name one shared key get
one run between them; a forked run is its script's run as the interpreter would run it,
in a process forked from a preloaded one, its exit status its own."""
import multiprocessing
import os
import subprocess
import sys
import threading
import types

import pytest

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


def test_a_forked_run_is_the_interpreters_run_of_its_script_in_a_preloaded_process(tmp_path, tmp_path_factory):
    """A ``"forked"`` run's script sees its arguments, environment and working folder
    as in a new interpreter, finds TVM imported already, and its output and exit status
    come back as ``subprocess.run``'s; a module on the run's ``PYTHONPATH`` runs as
    ``-m`` runs it; a run past its timeout is killed and raises ``TimeoutExpired``."""
    script = tmp_path / "script.py"
    script.write_text(
        "import os, sys\n"
        "print(sys.argv[1:], os.getcwd(), os.environ['RUN_NAME'], 'tvm' in sys.modules, __name__)\n"
        "print('to stderr', file=sys.stderr)\n"
        "sys.exit(3)\n"
    )
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "as_module.py").write_text("import sys\nprint('module', sys.argv[1:], __name__)\n")
    (tmp_path / "slow.py").write_text("import time\ntime.sleep(60)\n")
    runs_of = {
        "script": {"args": [sys.executable, str(script), "a", "b"], "cwd": str(tmp_path),
                   "env": {**os.environ, "RUN_NAME": "first"}, "forked": True},
        "module": {"args": [sys.executable, "-m", "as_module", "c"], "cwd": str(tmp_path),
                   "env": {**os.environ, "PYTHONPATH": str(tmp_path / "lib")}, "forked": True},
        "slow": {"args": [sys.executable, str(tmp_path / "slow.py")], "timeout": 1, "forked": True},
    }
    test = runs(lambda _factory, name: dict(runs_of[name]))(lambda name: None)
    items = [_item(f"test[{name}]", test, name=name) for name in runs_of]
    ahead = RunsAhead(items, tmp_path_factory)
    try:
        first, module = ahead.result(items[0]), ahead.result(items[1])
        with pytest.raises(subprocess.TimeoutExpired):
            ahead.result(items[2])
    finally:
        ahead.close()
    assert first.returncode == 3
    assert first.stdout == f"['a', 'b'] {tmp_path} first True __main__\n"
    assert first.stderr == "to stderr\n"
    assert (module.returncode, module.stdout) == (0, "module ['c'] __main__\n")


def test_forked_runs_keep_their_exit_status_while_others_start_processes(tmp_path, tmp_path_factory):
    """Forked runs ending at once, while the process starts others (each start of a
    multiprocessing process polls every child), each report their own exit status."""
    script = tmp_path / "exits.py"
    script.write_text("import sys\nsys.exit(int(sys.argv[1]))\n")
    codes = list(range(2, 26))
    test = runs(lambda _factory, code: {"args": [sys.executable, str(script), str(code)], "forked": True})(
        lambda code: None)
    items = [_item(f"test[{code}]", test, code=code) for code in codes]
    done = threading.Event()

    def start_others():
        context = multiprocessing.get_context("forkserver")
        while not done.is_set():
            context.Process(target=os.getpid).start()

    starter = threading.Thread(target=start_others)
    ahead = RunsAhead(items, tmp_path_factory)
    starter.start()
    try:
        results = [ahead.result(item).returncode for item in items]
    finally:
        done.set()
        starter.join()
        ahead.close()
    assert results == codes
