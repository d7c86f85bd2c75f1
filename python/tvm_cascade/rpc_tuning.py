"""Measure MetaSchedule's candidates on a fleet of machines through TVM's RPC tracker.

Each machine runs TVM's RPC server registered with the tracker under one key, the key
naming one kind of device (``python -m tvm.exec.rpc_server --tracker HOST:PORT --key
h100``, the tracker itself ``python -m tvm.exec.rpc_tracker``). :func:`rpc_runner` is
MetaSchedule's RPC runner for that key: it asks the tracker for a free server per
candidate, so the servers measure a round's candidates in parallel, and a candidate
whose server is lost mid-measurement comes back as a failed run (MetaSchedule records it
with a run time of 1e10 s) while the others go on to the servers that remain; once none
remains, every candidate fails at once (:func:`create_session`) rather than waiting at
the tracker for a server to come back. The candidates are built here, by MetaSchedule's
local builder, whose artifacts (a tar of object files) each server links with its own
C++ compiler. Only the tracker's host needs
tornado (``apache-tvm[rpc]``); the runner talks to it with TVM's client alone.
"""
from __future__ import annotations

import socket

from tvm import rpc
from tvm.s_tir import meta_schedule as ms

from .candidate_timing import local_runner, run_evaluator

#: Seconds an RPC session may last (upload, link, measure) before the server ends it.
SESSION_TIMEOUT_SEC = 60
#: Seconds to wait for the tracker to accept a connection.
CONNECT_TIMEOUT_SEC = 10


def parse_tracker(address: str) -> tuple[str, int]:
    """``(host, port)`` of an RPC tracker address ``"HOST:PORT"`` (an IPv6 host in
    brackets, ``"[::1]:9190"``); ValueError naming what is wrong with a malformed one."""
    if not isinstance(address, str) or not address.strip():
        raise ValueError(f"RPC tracker address must be HOST:PORT (e.g. 127.0.0.1:9190), got {address!r}")
    host, sep, port = address.strip().rpartition(":")
    if not sep:
        raise ValueError(f"RPC tracker address {address!r} has no port: expected HOST:PORT (e.g. 127.0.0.1:9190)")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host:
        raise ValueError(f"RPC tracker address {address!r} has no host: expected HOST:PORT (e.g. 127.0.0.1:9190)")
    number = int(port) if port.isdigit() else None
    if number is None or not 0 < number < 65536:
        raise ValueError(f"RPC tracker port must be an integer in 1..65535, got {port!r} in {address!r}")
    return host, number


def _check_key(key: str) -> str:
    # The tracker splits its messages on whitespace: such a key matches no server.
    if not isinstance(key, str) or not key or key != "".join(key.split()):
        raise ValueError(f"RPC key must be a non-empty word without whitespace, got {key!r}")
    return key


def rpc_config(tracker: str, key: str, session_timeout_sec: int = SESSION_TIMEOUT_SEC) -> ms.runner.RPCConfig:
    """MetaSchedule's RPC configuration for the servers registered under ``key`` with the
    tracker at ``tracker`` (``"HOST:PORT"``)."""
    host, port = parse_tracker(tracker)
    return ms.runner.RPCConfig(
        tracker_host=host, tracker_port=port, tracker_key=_check_key(key), session_timeout_sec=session_timeout_sec
    )


def count_servers(tracker: str, key: str) -> int:
    """How many RPC servers are registered under ``key`` with the tracker at ``tracker``,
    busy ones included; ConnectionError where no tracker answers there."""
    host, port = parse_tracker(tracker)
    return _count_servers(host, port, _check_key(key), tracker)


def _count_servers(host: str, port: int, key: str, tracker: str) -> int:
    # TVM's own connection retries for a minute; a wrong address should fail at once.
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_SEC).close()
    except OSError as err:
        raise ConnectionError(f"no RPC tracker answers at {tracker}: {err}") from err
    try:
        session = rpc.connect_tracker(host, port)
        try:
            summary = session.summary()
        finally:
            session.close()
    except (OSError, RuntimeError) as err:
        raise ConnectionError(f"{tracker} does not answer as an RPC tracker: {err}") from err
    return sum(1 for server in summary["server_info"] if server["key"].partition(":")[2] == key)


def create_session(config: ms.runner.RPCConfig):
    """The RPC runner's session with a server under ``config``'s key, as MetaSchedule
    creates it, except that it fails (RuntimeError) where no server is registered under
    the key: the tracker would hold the request until one registers, and the tuning
    would wait for good once the whole fleet is gone."""
    host, port, key = config.tracker_host, config.tracker_port, config.tracker_key
    tracker = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if _count_servers(host, port, key, tracker) == 0:
        raise RuntimeError(f"no RPC server is registered under key {key!r} with the tracker at {tracker} any more")
    return config.connect_server()


def remote_run_evaluator(session, rt_mod, device, evaluator_config, repeated_args) -> list:
    """The RPC runner's ``f_run_evaluator``: the candidate on a server's ``device`` timed
    as :func:`~tvm_cascade.candidate_timing.run_evaluator` times a local one."""
    del session  # (the device belongs to it)
    return run_evaluator(rt_mod, device, evaluator_config, repeated_args)


def rpc_runner(
    tracker: str,
    key: str,
    *,
    max_workers: int | None = None,
    session_timeout_sec: int = SESSION_TIMEOUT_SEC,
    evaluator_config: ms.runner.EvaluatorConfig | None = None,
) -> ms.runner.RPCRunner:
    """MetaSchedule's RPC runner over the servers registered under ``key`` with the
    tracker at ``tracker`` (``"HOST:PORT"``): ``max_workers`` candidates measured at once
    (default: one per server registered now), each in a session of at most
    ``session_timeout_sec`` seconds, timed by :func:`remote_run_evaluator`
    (``evaluator_config``: its runs). Raises ValueError for a malformed address
    or key or where no server is registered under ``key``, ConnectionError where no
    tracker answers."""
    if max_workers is not None and max_workers < 1:
        raise ValueError(f"max_workers must be at least 1, got {max_workers}")
    config = rpc_config(tracker, key, session_timeout_sec)
    servers = count_servers(tracker, key)
    if servers == 0:
        raise ValueError(
            f"no RPC server is registered under key {key!r} with the tracker at {tracker} "
            f"(python -m tvm.exec.query_rpc_tracker --host {config.tracker_host} --port {config.tracker_port} "
            "lists the keys)"
        )
    # MetaSchedule's default of one worker would measure on one server at a time.
    return ms.runner.RPCRunner(
        config, evaluator_config, f_create_session=create_session, f_run_evaluator=remote_run_evaluator,
        max_workers=max_workers or servers,
    )


def resolve_runner(runner=None, rpc_tracker: str | None = None, rpc_key: str | None = None, rpc_workers: int | None = None):
    """The runner a tuning entry point passes to MetaSchedule: ``runner`` as given, else
    :func:`rpc_runner` of ``rpc_tracker`` and ``rpc_key`` (``rpc_workers``: its
    ``max_workers``), else MetaSchedule's local runner timing candidates by
    :func:`~tvm_cascade.candidate_timing.run_evaluator`. ValueError for a
    tracker without a key or a key without a tracker, for both a runner and a tracker, or
    for ``rpc_workers`` without a tracker."""
    if rpc_tracker is None and rpc_key is None:
        if rpc_workers is not None:
            raise ValueError("rpc_workers applies to an RPC tracker; no rpc_tracker was given")
        return local_runner() if runner is None else runner
    if runner is not None:
        raise ValueError("give either a runner or an RPC tracker (rpc_tracker, rpc_key), not both")
    if rpc_tracker is None or rpc_key is None:
        missing = "rpc_key" if rpc_key is None else "rpc_tracker"
        raise ValueError(f"an RPC tracker needs both rpc_tracker='HOST:PORT' and rpc_key; {missing} is missing")
    return rpc_runner(rpc_tracker, rpc_key, max_workers=rpc_workers)


def remote_cuda_target(tracker: str, key: str, session_timeout_sec: int = SESSION_TIMEOUT_SEC):
    """The CUDA target of the GPU of a server registered under ``key`` (as
    ``Target.from_device`` detects a local one, which it cannot do for a remote device):
    the target a fleet's candidates are built for. The key is taken to name one kind of
    GPU; RuntimeError where that server has none."""
    from tvm.target import Target  # pylint: disable=import-outside-toplevel

    session = rpc_config(tracker, key, session_timeout_sec).connect_server()
    device = session.cuda(0)
    if not device.exist:
        raise RuntimeError(f"the RPC server under key {key!r} (tracker {tracker}) has no CUDA GPU")
    return Target(
        {
            "kind": "cuda",
            "max_shared_memory_per_block": device.max_shared_memory_per_block,
            "max_threads_per_block": device.max_threads_per_block,
            "thread_warp_size": device.warp_size,
            "arch": "sm_" + device.compute_version.replace(".", ""),
        }
    )
