"""Subprocesses of the session's tests, started ahead of the tests that check them.

The pytest process keeps one core busy, which leaves the second core of the two-core CI
machine idle. A test that only waits on a subprocess of its own (an example script, a
command-line entry point, ``pip install``, a kernel's build and assembly: see
``ptxas.assembled``) is marked by :func:`runs`. The session's ``runs_ahead`` fixture
(``conftest.py``) starts the runs of all its selected tests when it starts,
:data:`WORKERS` at a time in the tests' order and at the lowest priority, and such a
test checks the result of its own run (:meth:`RunsAhead.result`).

A run that says ``"forked": True`` (``python SCRIPT ...`` or ``python -m MODULE ...``)
runs in a process forked from one that has imported :data:`PRELOAD` once for the
session (multiprocessing's fork server), not in a new interpreter: those imports take
about two seconds of CPU a run. Not for a run that needs other copies of those modules
than the session's (an installed package's, say)."""
import contextlib
import importlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import runpy
import subprocess
import sys
import tempfile
import threading
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

#: Runs at a time. At the lowest priority they take only what the pytest process leaves
#: of the two cores: one while it runs a test, both while it waits for a run.
WORKERS = 2
#: What the process that forked runs fork from imports first.
PRELOAD = ("numpy", "tvm", "tvm_cascade")


def runs(make):
    """Marks a test whose run ``make(tmp_path_factory, **the test's parameters)`` gives: a
    dict of ``subprocess.run``'s arguments (output captured as text), or None (no run).
    Tests whose runs name the same ``"shared"`` key (an extra item of the dict) share the
    first one's run."""

    def mark(test):
        test.run_ahead = make
        return test

    return mark


def call_run(folder, script, function, params, *more):
    """The run of ``script`` (a module of this folder run as a script, which reads its
    arguments with :func:`called`) for ``function`` (at the top of a test module) with
    ``params``, ``more`` arguments after them; kernels the library builds are cached in
    ``folder``, not the user's cache."""
    args = [sys.executable, str(script), function.__module__, function.__name__, pickle.dumps(params).hex(), *more]
    return {"args": args, "env": {**os.environ, "TVM_CASCADE_CACHE": str(folder / "cache")}, "forked": True}


def called(argv):
    """In a :func:`call_run` script: the function it names, its parameters, and the
    arguments after them."""
    module, name, blob, *more = argv
    return getattr(importlib.import_module(module), name), pickle.loads(bytes.fromhex(blob)), more


class RunsAhead:
    """The runs of the ``items`` :func:`runs` marks, in the environment
    and working directory of the process when made (a test's ``monkeypatch`` of either
    does not reach a run started meanwhile) unless a run names its own."""

    def __init__(self, items, tmp_path_factory):
        self._tmp_path_factory = tmp_path_factory
        self._defaults = {"env": dict(os.environ), "cwd": os.getcwd()}
        self._pool = ThreadPoolExecutor(WORKERS)
        self._forks = multiprocessing.get_context("forkserver")
        self._forks.set_forkserver_preload(list(PRELOAD))
        self._keys = {}  # a test's node id -> its run's key: the shared key, or the node id
        self._futures = {}
        self._runs = {}
        self._running = set()
        self._closed = False
        self._lock = threading.Lock()
        for item in items:
            self._future(item)

    def _future(self, item):
        if item.nodeid not in self._keys:
            make = getattr(getattr(item, "function", None), "run_ahead", None)
            params = item.callspec.params if hasattr(item, "callspec") else {}
            run = None if make is None else make(self._tmp_path_factory, **params)
            key = self._keys[item.nodeid] = item.nodeid if run is None else run.pop("shared", item.nodeid)
            if run is not None and key not in self._futures:
                self._runs[key] = {**self._defaults, **run}
                self._futures[key] = self._pool.submit(self._run, **self._runs[key])
        return self._futures.get(self._keys[item.nodeid])

    @contextlib.contextmanager
    def _tracked(self, start):
        """The process ``start()`` starts, which :meth:`close` can kill while it runs."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the session's runs ahead are closed")
            process = start()
            self._running.add(process)
        try:
            yield process
        finally:
            with self._lock:
                self._running.discard(process)

    def _run(self, args, timeout=None, forked=False, **kwargs):
        """``subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kwargs)``
        whose process :meth:`close` can kill; ``forked``, the same from a fork of the
        preloaded process."""
        if forked:
            return self._run_forked(args, timeout, **kwargs)
        # At the lowest priority: a run takes the core the tests leave idle, not the
        # one a test's own builders or servers use meanwhile.
        start = lambda: subprocess.Popen(  # noqa: E731
            ["nice", "-n", "19", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs
        )
        with self._tracked(start) as process, process:
            try:
                stdout, stderr = process.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()
                raise
        return subprocess.CompletedProcess(args, process.returncode, stdout, stderr)

    def _run_forked(self, args, timeout, env, cwd):
        with tempfile.TemporaryDirectory() as folder:
            out, err, status = (Path(folder, name) for name in ("out", "err", "status"))

            def start():
                process = self._forks.Process(target=_forked, args=(args, env, cwd, str(out), str(err), str(status)))
                process.start()
                return process

            # The run's exit status comes from the file it writes, not Process.exitcode:
            # multiprocessing polls its children from any thread that starts a process,
            # and two polls of one fork-server child at once leave one of them 255.
            with self._tracked(start) as process:
                if not multiprocessing.connection.wait([process.sentinel], timeout):
                    process.kill()
                    multiprocessing.connection.wait([process.sentinel])
                    raise subprocess.TimeoutExpired(args, timeout)
            code = int(status.read_text()) if status.exists() else process.exitcode  # (killed or crashed)
            return subprocess.CompletedProcess(args, code, out.read_text(), err.read_text())

    def result(self, item) -> subprocess.CompletedProcess:
        """The finished run of test item ``item``; raises what ``subprocess.run`` would
        (``TimeoutExpired`` past the run's ``timeout``)."""
        future = self._future(item)
        assert future is not None, f"{item.nodeid} is not marked with a run (runs_ahead.runs)"
        if future.cancel():
            # Not started yet: the queue is behind the tests, and this process would
            # only wait, so it runs it now beside the queue's (once for tests sharing it).
            key = self._keys[item.nodeid]
            future = self._futures[key] = Future()
            try:
                future.set_result(self._run(**self._runs[key]))
            except Exception as err:  # (raised again below, to every test that shares it)
                future.set_exception(err)
        return future.result()

    def close(self):
        """Drops the runs not started and kills those under way (a session stopped
        early checks neither)."""
        for future in self._futures.values():
            if future is not None:
                future.cancel()
        with self._lock:
            self._closed = True
            for process in self._running:
                process.kill()
        self._pool.shutdown(wait=True)


def _forked(args, env, cwd, out, err, status):
    """A forked run: ``args`` (``[python, SCRIPT, ...]`` or ``[python, -m, MODULE, ...]``)
    as the interpreter runs them, in ``env`` and ``cwd``, its output to the files ``out``
    and ``err`` and its exit status, as the interpreter's, to the file ``status``, at the
    lowest priority."""
    os.nice(19)
    for fd, path in ((1, out), (2, err)):
        with open(path, "w") as file:
            os.dup2(file.fileno(), fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    # (the preloaded modules stay those the session imported, whatever the path says)
    sys.path[:0] = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    code = 0
    try:
        if args[1] == "-m":
            sys.argv = args[2:]
            sys.path.insert(0, cwd)
            runpy.run_module(args[2], run_name="__main__", alter_sys=True)
        else:
            sys.argv = args[1:]
            sys.path.insert(0, os.path.dirname(os.path.abspath(args[1])))
            runpy.run_path(args[1], run_name="__main__")
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:  # pylint: disable=broad-except
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    Path(status).write_text(str(code))
