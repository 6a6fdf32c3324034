"""How results are shown: Rich tables on a terminal and plain aligned lines otherwise,
CSV, JSON and markdown for scripts, and a shape set's report."""

from __future__ import annotations

import json
import math
import os
import sys
import textwrap
from typing import Any

import pandas as pd
from rich.console import Console
from rich.table import Table

from ..problem import Problem
from ..protocol import TIE, best
from .leaderboard import select

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)


def show_table(headers: list[str], rows: list[list[str]]) -> None:
    """A Rich table on a terminal; plain aligned lines otherwise (logs, pipes, CI)."""
    if console.is_terminal:
        table = Table()
        for header in headers:
            table.add_column(header, overflow="fold")
        for row in rows:
            table.add_row(*row)
        console.print(table)
        return
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    widths = _fit(widths, width_limit())
    for line in [headers, *rows]:
        cells = [textwrap.wrap(cell, w, break_on_hyphens=False) or [""] for cell, w in zip(line, widths)]
        for i in range(max(map(len, cells))):
            print("  ".join((c[i] if i < len(c) else "").ljust(w) for c, w in zip(cells, widths)).rstrip())


def width_limit() -> int | None:
    """The width a plain table keeps within: $COLUMNS where it is set (none otherwise: a log
    or a pipe gets whole lines)."""
    try:
        return int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        return None


def _fit(widths: list[int], limit: int | None, gap: int = 2, narrowest: int = 6) -> list[int]:
    """Column widths narrowed, widest first, until the line fits `limit` (cells then wrap)."""
    widths = list(widths)
    while limit and sum(widths) + gap * (len(widths) - 1) > limit:
        widest = max(range(len(widths)), key=widths.__getitem__)
        if widths[widest] <= narrowest:
            break
        widths[widest] -= 1
    return widths


def fmt(value: Any, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def jsonable(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    def clean(v: Any) -> Any:
        if isinstance(v, float) and math.isnan(v):
            return None
        if hasattr(v, "isoformat"):
            return v.isoformat()
        if hasattr(v, "item"):
            return v.item()
        return v

    return [{k: clean(v) for k, v in row.items()} for row in rows]


def print_bench_table(rows: list[dict[str, Any]], mode: str) -> None:
    """One line per contestant: its time by each method, and its speedup against the fastest
    baseline in each mode (offline: the lower of the kernel and graph ratios)."""
    offline = ["kernel", "graph"]
    methods = {"offline": offline, "server": ["server"], "both": offline + ["server"]}[mode]
    claims = ["offline", "server"] if mode == "both" else [mode]
    headers = ["kernel", "status"]
    for md in methods:
        headers += [f"{md} us", "p20/p80"]
    headers += ["TFLOP/s", "of floor"]
    headers += [f"speedup ({md})" for md in claims]
    lines = []
    for row in rows:
        status = row["status"]
        if status != "ok":
            status += ": " + ((row.get("error") or "").strip().splitlines() or [""])[0][:120]
        cells = [row["kernel"], status]
        for md in methods:
            cells += [fmt(row.get(f"{md}_us")), f"{fmt(row.get(f'{md}_p20_us'))}/{fmt(row.get(f'{md}_p80_us'))}"]
        cells += [fmt(row.get("tflops"), 1), fmt(row.get("floor_fraction"), 2)]
        cells += [fmt(row.get(f"speedup_{md}"), 3) for md in claims]
        lines.append(cells)
    show_table(headers, lines)


def optimize_summary(problem: Problem, env: dict[str, Any], outcome, run_id: str) -> dict[str, Any]:
    return {
        "problem": problem.__dict__, "gpu": env["gpu"], "baseline": outcome.baseline, "baseline_us": outcome.baseline_us,
        "best": jsonable([outcome.best])[0] if outcome.best else None,
        "exported": str(outcome.exported) if outcome.exported else None,
        "statuses": outcome.statuses, "contributions": outcome.contributions, "stopped": outcome.stopped,
        "duplicates": outcome.duplicates, "error": outcome.error,
        "wall_s": round(outcome.wall_s, 2), "gpu_s": round(outcome.gpu_s, 2), "compile_s": round(outcome.compile_s, 2),
        "first_verified_s": None if outcome.first_verified_s is None else round(outcome.first_verified_s, 2),
        "baselines_s": round(outcome.baselines_s, 2), "sessions": [list(s) for s in outcome.sessions],
        "screened": outcome.screened, "screen_s": round(outcome.screen_s, 2),
        "run_id": run_id,
    }


def speedup_summary(speedups: list[float]) -> dict[str, Any]:
    """A set's best speedups in brief: geometric mean, minimum, and how many are wins, ties
    (within TIE of 1.0) and losses."""
    return {"geomean_speedup": math.exp(sum(map(math.log, speedups)) / len(speedups)) if speedups else None,
            "min_speedup": min(speedups) if speedups else None,
            "wins": sum(v >= 1 + TIE for v in speedups), "ties": sum(1 - TIE < v < 1 + TIE for v in speedups),
            "losses": sum(v <= 1 - TIE for v in speedups)}


def verdict_line(summary: dict[str, Any]) -> str:
    return (f"{summary['wins']} win(s), {summary['ties']} tie(s), {summary['losses']} loss(es) "
            f"(within {TIE:.0%} of 1.0 is a tie: what a claim moves between runs)")


def set_summary(summaries: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    """Over a shape set's runs: how many found a verified kernel, the geometric mean and
    minimum of their best speedups, the wall time."""
    speedups = [s["best"][f"speedup_{mode}"] for s in summaries if s["best"] and s["best"].get(f"speedup_{mode}")]
    return {"shapes": len(summaries), "tuned": len(speedups), **speedup_summary(speedups),
            "wall_s": round(sum(s["wall_s"] for s in summaries), 2)}


def print_optimize_summary(outcome, mode: str) -> None:
    best = outcome.best
    print(f"fastest baseline: {outcome.baseline or '-'} {fmt(outcome.baseline_us)} us")
    if best:
        print(f"best: {best['kernel']}: {fmt(best[f'{mode}_us'])} us, {fmt(best[f'speedup_{mode}'], 3)}x the fastest "
              f"library call ({best.get('baseline') or '-'}, {mode}) -> {outcome.exported}")
    else:
        print("best: no verified kernel")
    print("candidates: " + ", ".join(f"{n} {s}" for s, n in sorted(outcome.statuses.items())) +
          f"; {outcome.duplicates} skipped as already measured")
    print("by proposer: " + "; ".join(
        f"{name} {c['candidates']} candidate(s), {c['ok']} ok, best {fmt(c['best_speedup'], 3)}x"
        for name, c in sorted(outcome.contributions.items())))
    first = "-" if outcome.first_verified_s is None else f"{outcome.first_verified_s:.1f} s"
    print(f"stopped: {outcome.stopped}; wall {outcome.wall_s:.1f} s (first verified kernel at {first}), "
          f"GPU {outcome.gpu_s:.1f} s, compile {outcome.compile_s:.1f} s")


# What a report shows of each best kernel: both methods, every baseline, the claim.
SHAPE_COLUMNS = ["gpu", "m", "n", "k", "dtype", "layout", "kernel", "kernel_us", "graph_us", "baseline",
                 "baseline_offline_us", "speedup_kernel", "speedup_graph", "speedup_vs_cublas", "speedup_vs_cublaslt",
                 "speedup_vs_torch", "speedup_offline", "tflops", "floor_us", "floor_fraction", "protocol"]


def report_shapes(df: pd.DataFrame, problems: list[Problem], format: str, source: str | None = None) -> pd.DataFrame:
    """The best kernel of every listed problem (per GPU), then the geometric mean and the
    minimum of their speedups; a problem with no verified kernel is listed as missing.
    `source` labels every row (the shipped measurements). Returns the winners' full rows."""
    winners = best(df, 1)
    chosen = []
    columns = SHAPE_COLUMNS
    rows = []
    for p in problems:
        found = select(winners, m=p.m, n=p.n, k=p.k, dtype=p.dtype, layout=p.layout)
        if found.empty:
            rows.append({"gpu": None, "m": p.m, "n": p.n, "k": p.k, "dtype": p.dtype, "layout": p.layout,
                         "kernel": "(none measured)"})
        rows += found[columns].to_dict("records")
        chosen.append(found)
    frame = pd.DataFrame(rows, columns=columns)
    if source is not None:
        frame["source"] = source
    speedups = frame["speedup_offline"].dropna()
    summary = {
        "shapes": len(problems), "measured": int(len(speedups)), "missing": int(frame["speedup_offline"].isna().sum()),
        **speedup_summary([float(v) for v in speedups]), **({"source": source} if source else {}),
    }
    if format == "json":
        print(json.dumps({"rows": jsonable(frame.to_dict("records")), "summary": summary}, indent=1))
    else:
        emit_frame(frame, format)
        if format != "csv":
            print(f"{summary['measured']} of {summary['shapes']} shapes measured; speedup over the fastest library "
                  "call (lower of CUPTI and graph): geometric "
                  f"mean {fmt(summary['geomean_speedup'], 3)}, minimum {fmt(summary['min_speedup'], 3)}; "
                  + verdict_line(summary))
    return pd.concat(chosen) if chosen else winners.iloc[0:0]


def emit_frame(df: pd.DataFrame, format: str) -> None:
    if format == "csv":
        sys.stdout.write(df.to_csv(index=False))
    elif format == "json":
        print(json.dumps(jsonable(df.to_dict("records")), indent=1))
    elif format == "markdown":
        cells = [[fmt(v, 3) for v in row] for row in df.itertuples(index=False)]
        print("| " + " | ".join(df.columns) + " |")
        print("|" + "---|" * len(df.columns))
        for row in cells:
            print("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in row) + " |")
    elif df.empty:
        print("no results match")
    else:
        show_table(list(df.columns), [
            [fmt(v, 3) if not hasattr(v, "isoformat") else f"{v:%Y-%m-%d %H:%M}" for v in row]
            for row in df.itertuples(index=False)])


# ---------------------------------------------------------------------------- compile
