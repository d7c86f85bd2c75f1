"""Derived metrics, console tables, Markdown, JSON and the plot (no torch/TVM import).

A configuration's measurements are :class:`Cell` objects; :func:`records` turns
them into plain dicts (the JSON rows) with TFLOP/s, GB/s, % of the measured
copy-bandwidth roofline and the speed relative to the best peer, i.e. the
fastest correct implementation other than tvm-cascade's kernels (``best_peer_ms / ms``,
so > 1 means faster than every peer).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from .configs import Config
from .peers import TVM_CASCADE, TVM_CASCADE_RUNTIME

OK, NA, WRONG = "ok", "n/a", "wrong"


@dataclass
class Cell:
    impl: str
    status: str  # OK | NA | WRONG
    ms: Optional[float] = None
    max_err: Optional[float] = None
    note: str = ""  # the reason for n/a, or how the variant was expressed


def best_peer(rows: Sequence[Dict]) -> Optional[Dict]:
    """The fastest correct record other than tvm-cascade's kernels, or None."""
    timed = [r for r in rows if r["status"] == OK and r["impl"] not in (TVM_CASCADE, TVM_CASCADE_RUNTIME)]
    return min(timed, key=lambda r: r["ms"]) if timed else None


def records(cfg: Config, cells: Sequence[Cell], bandwidth_gbps: Optional[float]) -> List[Dict]:
    """One dict per cell with the derived metrics (None where not applicable)."""
    rows = [
        dict(
            impl=c.impl,
            status=c.status,
            ms=c.ms,
            max_err=c.max_err,
            note=c.note,
            tflops=None,
            gbps=None,
            roofline_pct=None,
            vs_best_peer=None,
        )
        for c in cells
    ]
    best = best_peer(rows)
    for row in rows:
        if row["status"] != OK:
            continue
        row["tflops"] = cfg.flops() / (row["ms"] * 1e9)
        if cfg.op.kind == "decode":
            row["gbps"] = cfg.kv_bytes() / (row["ms"] * 1e6)
            if bandwidth_gbps:
                row["roofline_pct"] = 100.0 * row["gbps"] / bandwidth_gbps
        if best is not None:
            row["vs_best_peer"] = best["ms"] / row["ms"]
    return rows


def config_json(cfg: Config, rows: List[Dict]) -> Dict:
    o = cfg.op
    best = best_peer(rows)
    return {
        "name": cfg.name,
        "kind": o.kind,
        "operator": o.name,
        "variant": o.variant,
        "batch": cfg.batch,
        "heads_q": o.heads_q,
        "heads_kv": o.heads_kv,
        "seq_q": cfg.seq_q,
        "seq_kv": cfg.seq_kv,
        "head_dim": cfg.head_dim,
        "dtype": cfg.dtype,
        "flops": cfg.flops(),
        "kv_bytes": cfg.kv_bytes(),
        "best_peer": best["impl"] if best else None,
        "results": rows,
    }


def _num(x: Optional[float], fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def short_status(row: Dict) -> str:
    if row["status"] == WRONG:
        return f"WRONG (max err {row['max_err']:.3g})"
    return "n/a"


def console_table(cfg: Config, rows: List[Dict]) -> str:
    o = cfg.op
    head = (
        f"{cfg.name}: batch {cfg.batch}, heads {o.heads_q}/{o.heads_kv}, "
        f"seq {cfg.seq_q}x{cfg.seq_kv}, d {cfg.head_dim}, {cfg.dtype}"
    )
    lines = [
        head,
        f"  {'implementation':<16}{'ms':>10}{'TFLOP/s':>10}{'GB/s':>9}{'%roof':>7}{'vs best':>9}  note",
    ]
    for r in rows:
        if r["status"] == OK:
            cols = (
                f"{_num(r['ms'], '.4f'):>10}{_num(r['tflops'], '.1f'):>10}{_num(r['gbps'], '.0f'):>9}"
                f"{_num(r['roofline_pct'], '.0f'):>7}{_num(r['vs_best_peer'], '.2f'):>9}"
            )
        else:
            cols = f"{short_status(r):>45}"
        lines.append(f"  {r['impl']:<16}{cols}  {r['note']}")
    return "\n".join(lines)


def progress_line(index: int, total: int, cfg: Config, rows: List[Dict]) -> str:
    mine = next((r for r in rows if r["impl"] == TVM_CASCADE), None)
    best = best_peer(rows)
    parts = [f"[{index}/{total}] {cfg.name}:"]
    if mine is not None:
        parts.append(
            f"{TVM_CASCADE} {_num(mine['ms'], '.4f')} ms"
            if mine["status"] == OK
            else f"{TVM_CASCADE} {short_status(mine)}"
        )
    parts.append(f"best peer {best['impl']} {best['ms']:.4f} ms" if best else "no timed peer")
    if mine is not None and mine["vs_best_peer"] is not None:
        parts.append(f"({mine['vs_best_peer']:.2f}x)")
    return " ".join(parts)


#: Peers whose speed relative to tvm-cascade gets a column of its own in the markdown
#: tables (the targets are stated against them), besides the best peer's.
NAMED_PEERS = ("sdpa-flash", "sdpa-cudnn", "flex")


def speed_vs(rows: Sequence[Dict], impl: str) -> Optional[float]:
    """``impl``'s time over tvm-cascade's (above 1: tvm-cascade is faster), or None unless
    both were timed."""
    times = {r["impl"]: r["ms"] for r in rows if r["status"] == OK}
    if TVM_CASCADE not in times or impl not in times:
        return None
    return times[impl] / times[TVM_CASCADE]


def markdown(results: Sequence[Tuple[Config, List[Dict]]], bandwidth_gbps: Optional[float]) -> str:
    """Tables (one per suite) with a row per configuration and a column per implementation.

    Prefill cells are ``ms (TFLOP/s)``, decode cells ``ms (% of roofline)``; n/a
    cells carry a footnote number whose reason is listed below the tables.
    """
    notes: List[str] = []

    def cell(r: Dict, kind: str) -> str:
        if r["status"] == OK:
            extra = r["tflops"] if kind == "prefill" else r["roofline_pct"]
            suffix = "" if extra is None else (f" ({extra:.0f})" if kind == "prefill" else f" ({extra:.0f}%)")
            return f"{r['ms']:.3f}{suffix}"
        label = short_status(r)
        if not r["note"]:
            return label
        if r["note"] not in notes:
            notes.append(r["note"])
        return f"{label} [{notes.index(r['note']) + 1}]"

    out = []
    for kind, caption in (
        ("prefill", "Prefill: ms (TFLOP/s)"),
        ("decode", f"Decode: ms (% of the measured copy bandwidth, {_num(bandwidth_gbps, '.0f')} GB/s)"),
    ):
        rows = [(cfg, rs) for cfg, rs in results if cfg.op.kind == kind]
        if not rows:
            continue
        impls = [r["impl"] for r in rows[0][1]]
        out += [f"**{caption}**", ""]
        named = [p for p in NAMED_PEERS if p in impls]
        out.append(
            "| configuration | " + " | ".join(impls) + " | best peer | tvm-cascade vs best peer |"
            + "".join(f" vs {p} |" for p in named)
        )
        out.append("|---" * (len(impls) + 3 + len(named)) + "|")
        for cfg, rs in rows:
            best = best_peer(rs)
            mine = next((r for r in rs if r["impl"] == TVM_CASCADE), None)
            ratios = [mine["vs_best_peer"] if mine else None]
            ratios += [speed_vs(rs, p) for p in named]
            ratios = " | ".join(r if r == "-" else r + "x" for r in (_num(x, ".2f") for x in ratios))
            cells = " | ".join(cell(r, kind) for r in rs)
            out.append(f"| {cfg.name} | {cells} | {best['impl'] if best else '-'} | {ratios} |")
        out.append("")
    if notes:
        out += ["Notes:", ""] + [f"{i}. {n}" for i, n in enumerate(notes, 1)] + [""]
    return "\n".join(out)


def write_json(path, document: Dict) -> None:
    with open(path, "w") as f:
        json.dump(document, f, indent=2)
        f.write("\n")


def grouped_bars(ax, groups: Sequence[str], series: Dict[str, Sequence[Optional[float]]], ylabel: str) -> None:
    """Each series' value per group as bars beside each other on a log axis with a line
    at 1; a None leaves its bar out."""
    width = 0.8 / len(series)
    for n, (label, values) in enumerate(series.items()):
        xs = [x + (n - (len(series) - 1) / 2) * width for x, v in enumerate(values) if v is not None]
        ax.bar(xs, [v for v in values if v is not None], width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)


def plot(results: Sequence[Tuple[Config, List[Dict]]], path) -> bool:
    """Grouped bars of speed relative to the best peer per configuration; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    kinds = [k for k in ("prefill", "decode") if any(cfg.op.kind == k for cfg, _ in results)]
    fig, axes = plt.subplots(
        len(kinds), 1, figsize=(max(8, 0.9 * len(results)), 4.5 * len(kinds)), squeeze=False
    )
    for ax, kind in zip(axes[:, 0], kinds):
        rows = [(cfg, rs) for cfg, rs in results if cfg.op.kind == kind]
        impls = [r["impl"] for r in rows[0][1]]
        series = {
            impl: [next(r for r in rs if r["impl"] == impl)["vs_best_peer"] for _, rs in rows] for impl in impls
        }
        grouped_bars(ax, [cfg.name for cfg, _ in rows], series, "speed vs best peer (x, log)")
        ax.set_title(f"{kind} (missing bar: n/a or wrong)")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
