"""Report: one self-contained HTML page (PNG plots embedded, and written beside it) of the
best kernel per shape: its speedup against each baseline, achieved TFLOP/s against the
tensor-core roof, which template wins where, and what tuning each shape cost."""

from __future__ import annotations

import base64
import html
import io
import math
from pathlib import Path

import pandas as pd

from .environment import tensor_peak
from .protocol import BASELINES, best
from .problem import Problem
from .tables import speedup_summary, verdict_line

PLOTS = ("speedup", "roofline", "templates", "tuning")


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(row) -> str:
    layout = "" if row.layout == "nn" else f" {row.layout}"
    return f"{row.m}x{row.n}x{row.k} {row.dtype}{layout}"


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    return buffer.getvalue()


def _speedup_plot(winners: pd.DataFrame) -> bytes:
    plt = _figure()
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(winners) + 2), 4.2))
    x = range(len(winners))
    series = [("speedup_vs_cublas", "vs cuBLAS"), ("speedup_vs_cublaslt", "vs cuBLASLt autotuned"),
              ("speedup_vs_torch", "vs torch.matmul"), ("speedup_offline", "claimed (vs the fastest)")]
    width = 0.8 / len(series)
    for i, (column, name) in enumerate(series):
        ax.bar([v + (i - 1.5) * width for v in x], winners[column].fillna(0), width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(list(x), [_label(r) for r in winners.itertuples()], rotation=70, ha="right", fontsize=7)
    ax.set_ylabel("speedup (lower of CUPTI and graph)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    ax.set_title("Best kernel per shape against each library call")
    return _png(fig)


def _roofline_plot(winners: pd.DataFrame) -> bytes:
    plt = _figure()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    problems = [Problem(int(r.m), int(r.n), int(r.k), r.dtype, r.layout) for r in winners.itertuples()]
    intensity = [p.flops / p.min_bytes for p in problems]
    ax.scatter(intensity, winners["tflops"], label="best kernel", zorder=3)
    ax.scatter(intensity, [p.flops / us / 1e6 for p, us in zip(problems, winners["baseline_offline_us"])], marker="x",
               label="fastest library call", zorder=3)
    first = winners.iloc[0]
    if pd.notna(first.get("sm_count")) and pd.notna(first.get("max_sm_clock_mhz")):
        peak = tensor_peak({"cc": int(first["cc"]), "sm_count": int(first["sm_count"]),
                            "max_sm_clock_mhz": int(first["max_sm_clock_mhz"])}) / 1e12
        ax.axhline(peak, color="gray", linestyle="--", label=f"tensor-core peak at boost clock ({peak:.0f})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per byte of A, B and C)")
    ax.set_ylabel("TFLOP/s")
    ax.legend(fontsize=7)
    ax.set_title("Achieved TFLOP/s against the roof")
    return _png(fig)


def _template_plot(winners: pd.DataFrame) -> bytes:
    plt = _figure()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    kind = winners.apply(lambda r: "library call faster" if r.speedup_offline < 1 else
                         (r.template if isinstance(r.template, str) else "free-form"), axis=1)
    for name in sorted(set(kind)):
        chosen = winners[kind == name]
        ax.scatter([math.log2(r.m * r.n) for r in chosen.itertuples()], [math.log2(r.k) for r in chosen.itertuples()],
                   label=name, s=40)
    ax.set_xlabel("log2(M x N)")
    ax.set_ylabel("log2(K)")
    ax.legend(fontsize=7)
    ax.set_title("Which template wins where")
    return _png(fig)


def _tuning_plot(rows: pd.DataFrame, winners: pd.DataFrame) -> bytes:
    plt = _figure()
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(winners) + 2), 4.2))
    keys = ["m", "n", "k", "dtype", "layout"]
    kernels = rows[~rows["kernel"].isin(BASELINES)]
    spent = kernels.groupby(keys).agg(candidates=("kernel", "size"), compile_s=("compile_s", "sum")).reset_index()
    spent = winners[keys].merge(spent, on=keys, how="left").fillna(0)
    x = range(len(spent))
    ax.bar(list(x), spent["compile_s"], label="nvcc seconds")
    ax.set_ylabel("nvcc seconds (compiles this leaderboard recorded)")
    ax.set_xticks(list(x), [_label(r) for r in spent.itertuples()], rotation=70, ha="right", fontsize=7)
    twin = ax.twinx()
    twin.plot(list(x), spent["candidates"], color="tab:red", marker="o", label="candidates measured")
    twin.set_ylabel("candidates measured")
    ax.set_title("Tuning cost per shape")
    return _png(fig)


def write_report(rows: pd.DataFrame, out: Path, shapes: list[Problem] | None = None) -> Path:
    """Writes out/index.html (plots embedded) and out/<plot>.png from leaderboard `rows` of
    one bench protocol; `shapes` limits it to those problems, in their order."""
    winners = best(rows, 1)
    if shapes is not None:
        keys = ["m", "n", "k", "dtype", "layout"]
        winners = pd.DataFrame([p.__dict__ for p in shapes], columns=keys).merge(winners, on=keys, how="inner")
    if winners.empty:
        raise ValueError("no verified kernel to report on")
    winners = winners.reset_index(drop=True)
    out.mkdir(parents=True, exist_ok=True)
    pngs = {"speedup": _speedup_plot(winners), "roofline": _roofline_plot(winners),
            "templates": _template_plot(winners), "tuning": _tuning_plot(rows, winners)}
    for name, data in pngs.items():
        (out / f"{name}.png").write_bytes(data)
    summary = speedup_summary([float(v) for v in winners["speedup_offline"]])
    table = "\n".join(
        f"<tr><td>{html.escape(_label(r))}</td><td>{html.escape(str(r.kernel))}</td><td>{r.kernel_us:.2f}</td>"
        f"<td>{r.graph_us:.2f}</td><td>{html.escape(str(r.baseline))}</td><td>{r.baseline_offline_us:.2f}</td>"
        f"<td>{r.speedup_offline:.3f}</td><td>{r.tflops:.1f}</td></tr>" for r in winners.itertuples())
    images = "\n".join(f'<h2>{name}</h2><img alt="{name}" src="data:image/png;base64,'
                       f'{base64.b64encode(data).decode()}">' for name, data in pngs.items())
    gpu = html.escape(str(winners.iloc[0]["gpu"]))
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>cudal2 report: {gpu}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1200px}}table{{border-collapse:collapse;font-size:12px}}
td,th{{border:1px solid #ccc;padding:3px 6px;text-align:right}}td:nth-child(2){{text-align:left;max-width:420px;
overflow-wrap:anywhere}}img{{max-width:100%}}</style></head><body>
<h1>cudal2 report: {gpu}</h1>
<p>{len(winners)} shapes; speedup over the fastest library call (the lower of CUPTI and in-graph
ratios, bench protocol <code>{html.escape(str(winners.iloc[0]["protocol"]))}</code>): geometric mean
<b>{summary["geomean_speedup"]:.3f}</b>, minimum <b>{summary["min_speedup"]:.3f}</b>; {html.escape(verdict_line(summary))}.</p>
<table><tr><th>shape</th><th>best kernel</th><th>kernel us</th><th>graph us</th><th>fastest baseline</th>
<th>its us</th><th>speedup</th><th>TFLOP/s</th></tr>
{table}
</table>
{images}
</body></html>
"""
    index = out / "index.html"
    index.write_text(page)
    return index
