"""The tuning loop ``tune_decode`` and ``tune_prefill`` share: parse the command line,
then tune each configuration of a suite with :func:`tvm_cascade.kernels.tune`
(MetaSchedule's evolutionary search with the xgboost cost model over the schedule's
design space) into one JSON database. With ``--rpc-tracker HOST:PORT --rpc-key KEY`` the
candidates are built here and measured on the GPU servers registered under KEY with
TVM's RPC tracker (:func:`tvm_cascade.rpc_tuning.rpc_runner`), one candidate per server
at a time; this machine then needs no GPU."""
import argparse
from pathlib import Path

from .configs import suite


def _tracker(address: str) -> str:
    from tvm_cascade.rpc_tuning import parse_tracker

    try:
        parse_tracker(address)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err
    return address


def parse_args(prog: str, doc: str, default_trials: int, default_work_dir: Path, argv=None, spaces=None):
    """The command line; with ``spaces`` (names of design spaces), a ``--spaces`` option
    that picks some of them (default: all)."""
    parser = argparse.ArgumentParser(prog=prog, description=doc)
    parser.add_argument("--only", nargs="*", default=[], help="config name substrings")
    parser.add_argument("--trials", type=int, default=default_trials, help="trials per configuration")
    parser.add_argument("--work-dir", type=Path, default=default_work_dir)
    if spaces is not None:
        parser.add_argument("--spaces", nargs="+", choices=spaces, default=list(spaces), help="design spaces searched")
    rpc = parser.add_argument_group("measuring on RPC servers (python -m tvm.exec.rpc_tracker / rpc_server)")
    rpc.add_argument("--rpc-tracker", type=_tracker, metavar="HOST:PORT", help="TVM RPC tracker the GPU servers register with")
    rpc.add_argument("--rpc-key", metavar="KEY", help="key the GPU servers registered under (one kind of GPU)")
    rpc.add_argument("--rpc-workers", type=int, metavar="N", help="candidates measured at once (default: one per server)")
    args = parser.parse_args(argv)
    if (args.rpc_tracker is None) != (args.rpc_key is None):
        parser.error("--rpc-tracker HOST:PORT and --rpc-key KEY go together")
    if args.rpc_workers is not None and (args.rpc_tracker is None or args.rpc_workers < 1):
        parser.error("--rpc-workers N takes a positive N and goes with --rpc-tracker")
    return args


def tune_suite(kind: str, args) -> int:
    """Tune every ``kind`` configuration selected by ``args`` into ``args.work_dir``: on
    this machine's GPU, or on the RPC servers of ``args.rpc_tracker`` and ``args.rpc_key``."""
    import tvm

    from tvm_cascade import kernels, ops
    from tvm_cascade.bench import VARIANTS

    remote = {}
    if args.rpc_tracker is not None:
        from tvm_cascade.rpc_tuning import remote_cuda_target, rpc_runner

        remote["runner"] = rpc_runner(args.rpc_tracker, args.rpc_key, max_workers=args.rpc_workers)
        target = remote_cuda_target(args.rpc_tracker, args.rpc_key)
        print(f"measuring on the servers under key {args.rpc_key!r} ({args.rpc_tracker}): {target}", flush=True)
    elif not tvm.cuda(0).exist:
        print("no CUDA GPU: nothing to tune; skipping.")
        return 0
    else:
        target = tvm.target.Target.from_device(tvm.cuda(0))
    spaces = {"spaces": tuple(args.spaces)} if "spaces" in args else {}
    for cfg in suite(kind, only=args.only):
        op = cfg.op
        func = ops.attention(
            cfg.batch, op.heads_q, op.heads_kv, cfg.seq_q, cfg.seq_kv, cfg.head_dim,
            dtype=cfg.dtype, variant=VARIANTS[op.variant],
        )
        print(f"tuning {cfg.name}: {args.trials} trials", flush=True)
        best = kernels.tune(func, target, args.work_dir, args.trials, VARIANTS[op.variant], **spaces, **remote)
        if best is not None:
            print(f"  best {1e3 * best:.4f} ms", flush=True)
        else:
            print(f"  no valid record: see {args.work_dir / 'logs'}", flush=True)
    return 0
