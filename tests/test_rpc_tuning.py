"""Tuning measures its candidates on RPC servers registered with TVM's tracker
(``tvm_cascade.rpc_tuning``, ``tune_tir(rpc_tracker=..., rpc_key=...)``): a tracker and
two llvm servers on 127.0.0.1, one of them killed while it measures a candidate; the
tuning finishes on the other, the lost candidate recorded as a failed run, and the
database reloads with a best record that computes what numpy does."""
import json
import multiprocessing
import socket
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import tvm
import tvm_cascade.meta_schedule
from tvm.s_tir import meta_schedule as ms

from tvm_cascade import trace as cascade_trace
from tvm_cascade.candidate_timing import run_evaluator
from tvm_cascade.meta_schedule import tune_relax, tune_tir
from tvm_cascade.ops import cascades, testing
from tvm_cascade.ops import reference as R
from tvm_cascade.rpc_tuning import (
    count_servers, create_session, parse_tracker, remote_cuda_target, resolve_runner, rpc_config, rpc_runner,
)

from test_meta_schedule import TARGET, build_without_tensor_intrinsics, clear_capture_handlers

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # `benchmarks` is not an installed package

from benchmarks.tuning import parse_args  # noqa: E402

KEY = "cascade-llvm"
#: Three rounds of four: the server is lost in the second, the third runs on the other.
TRIALS, PER_ROUND = 12, 4
#: MetaSchedule's record of a run that failed.
FAILED = [1e10]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _popen_workers():
    """The pids of this process's children that are TVM popen workers (a tracker or a
    server runs in one); other children, such as the suite's runs ahead, start at any time."""
    pids = set()
    for child in psutil.Process().children():
        try:
            if "tvm.exec.popen_worker" in child.cmdline():
                pids.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return pids


def _new_child(start):
    """The process ``start()`` spawns from this one (a TVM tracker or server runs in one)."""
    before = _popen_workers()
    handle = start()
    (pid,) = _popen_workers() - before
    return handle, psutil.Process(pid)


@pytest.fixture
def fleet():
    """``(tracker address, [(server, its process), ...])``: a tracker and two servers
    registered under KEY, all stopped afterwards."""
    pytest.importorskip("tornado", reason="TVM's RPC tracker needs tornado (the test extra)")
    from tvm import rpc
    from tvm.rpc.tracker import Tracker

    port = _free_port()
    tracker = Tracker(host="127.0.0.1", port=port, port_end=port + 100, silent=True)
    address = f"127.0.0.1:{tracker.port}"
    servers = []
    try:
        for _ in range(2):
            port = _free_port()
            servers.append(_new_child(lambda: rpc.Server(
                host="127.0.0.1", port=port, port_end=port + 100, key=KEY,
                tracker_addr=("127.0.0.1", tracker.port), silent=True,
            )))
        deadline = time.monotonic() + 60
        while count_servers(address, KEY) < 2:
            assert time.monotonic() < deadline, "the RPC servers did not register with the tracker"
            time.sleep(0.1)
        yield address, servers
    finally:
        for server, _ in servers:
            server.terminate()
        tracker.terminate()


def _kill_mid_session(server_pid, records, after, killed_at, stop, settled=0.1):
    """Kill the RPC server of ``server_pid`` as a lost host goes (the server, the session
    measuring a candidate), once ``records`` holds ``after`` lines, at its next session
    past the handshake: the session's process unpacks or links the uploaded candidate,
    or has lived ``settled`` seconds. (A server lost within the handshake fails no
    candidate: the client asks the tracker for another server.) ``killed_at`` gets the
    number of records then. Runs in a process of its own: a thread of the tuning
    process gets the interpreter too seldom to see a session of a few tenths of a
    second."""
    server = psutil.Process(server_pid)

    def lines():
        return sum(1 for line in records.read_text().splitlines() if line.strip()) if records.exists() else 0

    while not stop.is_set() and lines() < after:
        time.sleep(0.05)
    seen = {}  # session pid: when first seen (psutil's create_time is off by up to a second)
    while not stop.is_set():
        try:
            sessions = server.children()
            now = time.monotonic()
            busy = any(s.children() or now - seen.setdefault(s.pid, now) >= settled for s in sessions)
        except psutil.NoSuchProcess:  # a session ending as it is looked at
            continue
        if busy:
            killed_at.value = lines()
            for process in [server] + server.children(recursive=True):
                process.kill()
            return
        time.sleep(0.002)


def test_tracker_address_and_runner_arguments_are_checked():
    assert parse_tracker("10.0.0.1:9190") == ("10.0.0.1", 9190)
    assert parse_tracker("[::1]:9190") == ("::1", 9190)
    for address, complaint in [("10.0.0.1", "has no port"), (":9190", "has no host"), ("h:x", "1..65535"), ("h:70000", "1..65535")]:
        with pytest.raises(ValueError, match=complaint):
            parse_tracker(address)
    local = resolve_runner()
    assert isinstance(local, ms.runner.LocalRunner) and local.f_run_evaluator is run_evaluator
    with pytest.raises(ValueError, match="rpc_key is missing"):
        resolve_runner(rpc_tracker="10.0.0.1:9190")
    with pytest.raises(ValueError, match="not both"):
        resolve_runner("local", rpc_tracker="10.0.0.1:9190", rpc_key=KEY)
    nobody = f"127.0.0.1:{_free_port()}"
    with pytest.raises(ConnectionError, match=f"no RPC tracker answers at {nobody}"):
        rpc_runner(nobody, KEY)


def test_entry_points_hand_metaschedule_the_space_database_and_runner(monkeypatch, tmp_path):
    """Without a tracker ``tune_tir`` and ``tune_relax`` measure locally, as before; a
    runner given goes to MetaSchedule as it is, and a runner beside a tracker is refused
    before any tuning starts."""
    calls = []
    default_builder = object()
    monkeypatch.setattr(tvm_cascade.meta_schedule, "candidate_builder", lambda: default_builder)
    monkeypatch.setattr(ms, "tune_tir", lambda *args, **kwargs: calls.append((args, kwargs)))
    monkeypatch.setattr(ms.relax_integration, "tune_relax", lambda *args, **kwargs: calls.append((args, kwargs)))
    func = cascades.logsumexp(8, 64)
    runner = ms.runner.LocalRunner()
    tune_tir(func, TARGET, str(tmp_path / "tir"), 8, num_trials_per_iter=4)
    tune_relax(tvm.IRModule(), {}, TARGET, str(tmp_path / "relax"), 8, runner=runner)
    (tir_args, tir), (relax_args, relax) = calls
    assert tir_args == (func, TARGET, str(tmp_path / "tir"), 8) and tir["num_trials_per_iter"] == 4
    assert tir["runner"].f_run_evaluator is run_evaluator and relax["runner"].same_as(runner)
    assert tir["builder"] is default_builder and relax["builder"] is default_builder
    for kwargs in (tir, relax):
        assert isinstance(kwargs["space"], ms.space_generator.PostOrderApply)
        assert isinstance(kwargs["database"], cascade_trace.JSONDatabase)
    with pytest.raises(ValueError, match="not both"):
        tune_tir(func, TARGET, str(tmp_path), 8, runner=runner, rpc_tracker="10.0.0.1:9190", rpc_key=KEY)
    assert len(calls) == 2


def test_tune_commands_take_a_tracker():
    args = parse_args("tune", "", 8, Path("."), ["--rpc-tracker", "10.0.0.1:9190", "--rpc-key", "h100"])
    assert (args.rpc_tracker, args.rpc_key, args.rpc_workers) == ("10.0.0.1:9190", "h100", None)
    assert parse_args("tune", "", 8, Path("."), []).rpc_tracker is None
    for argv in (["--rpc-tracker", "10.0.0.1"], ["--rpc-tracker", "10.0.0.1:9190"], ["--rpc-key", "h100"]):
        with pytest.raises(SystemExit):
            parse_args("tune", "", 8, Path("."), argv)


def test_tuning_finishes_on_the_server_left_when_one_is_lost(fleet, tmp_path):
    """Tuned through the tracker, one server killed in the second round: the candidate
    it measured is recorded as failed (run time 1e10 s, the runner's error in the log),
    the third round runs on the other server, and the JSON database reloads with a best
    record that computes what numpy does. Once the other server is gone too, a session
    fails at once."""
    address, [(_, victim_process), (survivor, _)] = fleet
    with pytest.raises(ValueError, match="no RPC server is registered under key 'elsewhere'"):
        rpc_runner(address, "elsewhere")
    with pytest.raises(RuntimeError, match=f"the RPC server under key '{KEY}' .* has no CUDA GPU"):
        remote_cuda_target(address, KEY)
    func = cascades.logsumexp(8, 64)
    spawn = multiprocessing.get_context("spawn")
    killed_at, stop = spawn.Value("i", -1), spawn.Event()
    killer = spawn.Process(
        target=_kill_mid_session,
        args=(victim_process.pid, tmp_path / "database_tuning_record.json", PER_ROUND, killed_at, stop),
    )
    killer.start()
    clear_capture_handlers()
    try:
        tune_tir(
            func, TARGET, str(tmp_path), TRIALS, num_trials_per_iter=PER_ROUND, rpc_tracker=address, rpc_key=KEY,
            builder=ms.builder.LocalBuilder(f_build=build_without_tensor_intrinsics(), max_workers=2, timeout_sec=120),
            strategy=ms.search_strategy.EvolutionarySearch(population_size=8, init_min_unmeasured=4),
            cost_model="random", num_tuning_cores=1, seed=0,
        )
    finally:
        stop.set()
        killer.join()
    assert killed_at.value == PER_ROUND, f"the server was not lost in the second round ({killed_at.value} records then)"
    assert count_servers(address, KEY) == 1

    database = cascade_trace.JSONDatabase(work_dir=str(tmp_path), allow_missing=False)
    assert len(database) == TRIALS
    # The file keeps the records in commit order, round by round.
    lines = (tmp_path / "database_tuning_record.json").read_text().splitlines()
    run_secs = [json.loads(line)[1][1] for line in lines if line.strip()]
    rounds = [run_secs[i:i + PER_ROUND] for i in range(0, TRIALS, PER_ROUND)]
    assert FAILED not in rounds[0]
    assert rounds[1].count(FAILED) == 1, "the candidate on the lost server was not recorded as failed"
    assert all(secs != FAILED for secs in rounds[2]), "the last round did not run on the server left"
    logs = "".join(path.read_text() for path in (tmp_path / "logs").glob("*task_0*.log"))
    assert logs.count("Error in running:\nRPCRunner: An exception occurred") == 1

    # With the whole fleet gone a candidate fails at once instead of waiting at the tracker.
    survivor.terminate()
    deadline = time.monotonic() + 30
    while count_servers(address, KEY):
        assert time.monotonic() < deadline, "the tracker still lists a stopped server"
        time.sleep(0.1)
    with pytest.raises(RuntimeError, match=f"no RPC server is registered under key '{KEY}'"):
        create_session(rpc_config(address, KEY))

    sch = database.query_schedule(tvm.IRModule({"main": func}), target=tvm.target.Target(TARGET), workload_name="main")
    x = np.random.default_rng(0).standard_normal((8, 64)).astype("float32") * 4
    (out,) = testing.run_prim_func(sch.mod["main"], [x])
    np.testing.assert_allclose(out, R.logsumexp_ref(x), rtol=1e-5)
