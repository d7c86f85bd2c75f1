"""One harness, every peer, one run on one GPU: ``python -m benchmarks.attention``.

For each configuration of the suite (see :mod:`benchmarks.configs`) every peer
(:mod:`benchmarks.peers`) is built, its output checked against a float32
reference (:mod:`benchmarks.reference`) and, if correct, timed
(:mod:`benchmarks.timing`).  After every configuration the results so far are
written to ``--out`` as ``results.json``, ``results.md`` and ``results.png``
(:mod:`benchmarks.report`), so an interrupted run keeps what it measured.
Without a CUDA GPU the command prints that it is skipping and exits 0.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from . import report
from .configs import DTYPE, HEAD_DIM, Config, suite
from .peers import PEERS, Unsupported, release_memory
from .report import NA, OK, WRONG, Cell
from .timing import FLUSHES

DEFAULT_OUT = Path(__file__).resolve().parent / "out"
#: Elementwise check ``|out - ref| <= ATOL + RTOL * |ref|`` of the fp16 output.
ATOL, RTOL = 5e-3, 2e-2
SEED = 0


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.attention", description=__doc__.splitlines()[0])
    p.add_argument("--suite", choices=("prefill", "decode", "all", "models"), default="all",
                   help="models: the model-shaped configurations of benchmarks.models (which takes the other arguments)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="only the first shape of each suite (prefill b8 s1024, decode b8 kv4096)",
    )
    p.add_argument(
        "--only",
        nargs="+",
        default=(),
        metavar="SUBSTR",
        help="keep configurations whose name contains one of these",
    )
    p.add_argument(
        "--peers",
        nargs="+",
        choices=list(PEERS),
        default=list(PEERS),
        metavar="PEER",
        help=f"subset of {', '.join(PEERS)}",
    )
    p.add_argument("--head-dim", type=int, default=HEAD_DIM, help=f"head dimension (default {HEAD_DIM})")
    p.add_argument("--dtype", choices=("float16", "bfloat16"), default=DTYPE)
    p.add_argument(
        "--decode-queries", type=int, default=1, metavar="N", help="query length of decode (default 1)"
    )
    p.add_argument(
        "--trim",
        type=int,
        default=0,
        metavar="N",
        help="shorten every sequence by N tokens (lengths that are not multiples of the tiles)",
    )
    p.add_argument(
        "--flush",
        choices=FLUSHES[:2],
        default=FLUSHES[0],
        help="how the L2 cache is evicted before each timed call: read a 256 MiB buffer (default; L2 keeps "
        "clean lines) or zero it as triton's do_bench does (its dirty lines are written back during the call)",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    return p.parse_args(argv)


def cuda_unavailable() -> Optional[str]:
    """Why there is no CUDA GPU to run on, or None."""
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    return None


def skip_without_gpu(prog: str) -> bool:
    """True, after saying so, if there is no CUDA GPU: ``prog`` then skips its work."""
    why = cuda_unavailable()
    if why is not None:
        print(f"{prog}: no CUDA GPU ({why}); skipping.", flush=True)
    return why is not None


def random_inputs(cfg: Config):
    """Seeded random q, k, v of ``cfg`` on the GPU (the same for every implementation)."""
    import torch

    o = cfg.op
    gen = torch.Generator(device="cuda").manual_seed(SEED)

    def randn(*shape):
        return torch.randn(shape, generator=gen, device="cuda", dtype=getattr(torch, cfg.dtype))

    q = randn(cfg.batch, o.heads_q, cfg.seq_q, cfg.head_dim)
    k = randn(cfg.batch, o.heads_kv, cfg.seq_kv, cfg.head_dim)
    v = randn(cfg.batch, o.heads_kv, cfg.seq_kv, cfg.head_dim)
    return q, k, v


def close_to(out, ref):
    """Whether ``out`` is within the harness's tolerance of ``ref`` everywhere (NaN is not)."""
    return bool(((out.float() - ref).abs() <= ATOL + RTOL * ref.abs()).all())


def _one_line(text: str, limit: int = 240) -> str:
    text = re.sub(r"\s+", " ", text).strip()
    return text if len(text) <= limit else text[: limit // 2] + " ... " + text[-limit // 2 :]


def _reason(err: Exception, caught: List[warnings.WarningMessage]) -> str:
    lines = str(err).strip().splitlines()
    reason = f"{type(err).__name__}: {_one_line(lines[0] if lines else '')}"
    if caught:
        reason += " [warnings: " + _one_line("; ".join(str(w.message) for w in caught)) + "]"
    return reason


def _verify_and_time(name: str, build, cfg: Config, q, k, v, ref, flush: str) -> Cell:
    import torch

    from .timing import bench

    fn, note = build(cfg, q, k, v)
    out = fn(q, k, v)
    torch.cuda.synchronize()
    if tuple(out.shape) != tuple(ref.shape):
        return Cell(name, WRONG, note=f"output shape {tuple(out.shape)}, expected {tuple(ref.shape)}")
    max_err = (out.float() - ref).abs().max().item()
    if not close_to(out, ref):
        return Cell(name, WRONG, max_err=max_err, note=note)
    del out
    return Cell(name, OK, ms=bench(lambda: fn(q, k, v), flush), max_err=max_err, note=note)


def measure(name: str, build, cfg: Config, q, k, v, ref, flush: str = "read") -> Cell:
    """Build one peer, verify its output against ``ref`` and, if correct, time it (the
    L2 flushed before each call as ``flush`` says: ``timing.FLUSHES``).

    Any exception (including an out-of-memory error) makes the cell n/a with the
    reason, plus the warnings raised meanwhile (SDPA explains its rejections there).
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return _verify_and_time(name, build, cfg, q, k, v, ref, flush)
        except Unsupported as err:
            return Cell(name, NA, note=str(err))
        except Exception as err:  # a failing peer is reported, not fatal
            return Cell(name, NA, note=_reason(err, caught))


def run_config(cfg: Config, peers: Dict, flush: str = "read") -> List[Cell]:
    from .reference import attention_reference

    q, k, v = random_inputs(cfg)
    ref = attention_reference(cfg, q, k, v)
    cells = []
    for name, build in peers.items():
        cells.append(measure(name, build, cfg, q, k, v, ref, flush))
        release_memory()
    return cells


def _version(module: str) -> Optional[str]:
    try:
        return __import__(module).__version__
    except Exception:  # not installed or broken: recorded as None
        return None


def _command_output(cmd: List[str]) -> Optional[str]:
    try:
        return (
            subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=30).stdout.strip() or None
        )
    except (OSError, subprocess.SubprocessError):
        return None


def environment(argv: Sequence[str]) -> Dict:
    """What a run measured on: the GPU and its software (the CPU where there is no GPU),
    the versions and the commit."""
    import torch

    repo = Path(__file__).resolve().parent.parent
    env = {"command": " ".join([Path(sys.executable).name, "-m", "benchmarks.attention", *argv])}
    if torch.cuda.is_available():
        env.update({
            "gpu": torch.cuda.get_device_name(),
            "driver": _command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
            "cuda_runtime": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
        })
    else:
        env["cpu"] = platform.processor() or platform.machine()
    return {
        **env,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "tvm": _version("tvm"),
        "python": platform.python_version(),
        "git_commit": _command_output(["git", "-C", str(repo), "rev-parse", "HEAD"]),
        "git_dirty": bool(_command_output(["git", "-C", str(repo), "status", "--porcelain"])),
    }


def shapes_parser(module: str, doc: str, outputs: str, only: bool = True) -> argparse.ArgumentParser:
    """The arguments of a benchmark over named shapes: ``--out`` (where ``outputs``
    go) and, with ``only``, ``--only``."""
    p = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/out"), help=f"where {outputs} go")
    if only:
        p.add_argument("--only", nargs="*", help="the shapes whose names contain one of these")
    return p


def named(shapes: Sequence, only: Optional[Sequence[str]]) -> list:
    """The ``shapes`` (each named first) whose names contain one of ``only`` (all
    without it)."""
    return [s for s in shapes if not only or any(o in s[0] for o in only)]


def shape_progress(index: int, total: int, rows: List[Dict]) -> str:
    """The progress line of a benchmark over named shapes: each peer's time or why not."""
    cells = []
    for row in rows:
        ms = f"{row['ms']:.4f} ms" if row.get("ms") else f"-- ({row.get('error')})"
        cells.append(f"{row['peer']} {ms}")
    return f"[{index}/{total}] {rows[0]['shape']}: " + "; ".join(cells)


def run_shapes(module: str, out: Path, argv: Sequence[str], shapes: Sequence, measure, **document) -> Optional[List[Dict]]:
    """Run benchmark ``module`` (its arguments ``argv``) over ``shapes``: each one's rows
    from ``measure(shape)``, a progress line each, and ``<out>/<name>.json`` (the
    environment, ``document``'s entries and the rows so far) rewritten after each.
    Returns the rows; None without a CUDA GPU (said so)."""
    if skip_without_gpu(module):
        return None
    env = run_environment(module, out, argv)
    path = out / f"{module.rsplit('.', 1)[-1]}.json"
    results: List[Dict] = []
    for index, shape in enumerate(shapes, 1):
        rows = measure(shape)
        results += rows
        print(shape_progress(index, len(shapes), rows), flush=True)
        path.write_text(json.dumps({"environment": env, **document, "results": results}, indent=1))
    return results


def write_table(module: str, out: Path, results: List[Dict], markdown) -> None:
    """Write the table ``markdown(results)`` of benchmark ``module`` to
    ``<out>/<name>.md`` and print it."""
    table = markdown(results)
    (out / f"{module.rsplit('.', 1)[-1]}.md").write_text(table)
    print(table)


def run_environment(module: str, out: Path, argv: Sequence[str]) -> Dict:
    """Make ``out``; what the run of ``module`` with ``argv`` measures on (``environment``)."""
    out.mkdir(parents=True, exist_ok=True)
    env = environment(argv)
    env["command"] = " ".join(["python", "-m", module, *argv])
    return env


def write_outputs(out_dir: Path, env: Dict, bandwidth: float, results, flush: str = FLUSHES[0]) -> List[str]:
    """Write results.md, results.json and (with matplotlib) results.png; their names."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md = report.markdown(results, bandwidth)
    (out_dir / "results.md").write_text(md)
    report.write_json(
        out_dir / "results.json",
        {
            "environment": env,
            "copy_bandwidth_gbps": bandwidth,
            "tolerance": {"atol": ATOL, "rtol": RTOL, "reference": "float32 torch on the GPU"},
            "timing": "median of CUDA-event timed calls after warm-up, L2 flushed before each (benchmarks/timing.py)",
            "l2_flush": flush,
            "flops": "4*b*hq*sq*skv*d, halved for causal prefill; window counts visible pairs",
            "configs": [report.config_json(cfg, rows) for cfg, rows in results],
        },
    )
    written = ["results.md", "results.json"]
    if report.plot(results, out_dir / "results.png"):
        written.append("results.png")
    return written


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    suite_only = argparse.ArgumentParser(add_help=False)
    suite_only.add_argument("--suite")
    chosen, rest = suite_only.parse_known_args(argv)
    if chosen.suite == "models":
        from .models import main as models_main

        return models_main(rest)
    args = parse_args(argv)
    if skip_without_gpu("benchmarks.attention"):
        return 0
    from .timing import copy_bandwidth_gbps

    configs = suite(
        args.suite,
        quick=args.quick,
        only=args.only,
        head_dim=args.head_dim,
        dtype=args.dtype,
        decode_queries=args.decode_queries,
        trim=args.trim,
    )
    peers = {name: PEERS[name] for name in args.peers}
    env = environment(argv)
    bandwidth = copy_bandwidth_gbps()
    print(
        f"{env['gpu']}: measured copy bandwidth {bandwidth:.0f} GB/s; {len(configs)} configurations",
        flush=True,
    )
    results = []
    written: List[str] = []
    for i, cfg in enumerate(configs, 1):
        rows = report.records(cfg, run_config(cfg, peers, args.flush), bandwidth)
        results.append((cfg, rows))
        print(report.progress_line(i, len(configs), cfg, rows), flush=True)
        print(report.console_table(cfg, rows), flush=True)
        written = write_outputs(args.out, env, bandwidth, results, args.flush)
    print("\n" + report.markdown(results, bandwidth), flush=True)
    print(f"wrote {', '.join(written)} to {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
