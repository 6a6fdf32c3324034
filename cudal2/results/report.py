"""Report: one self-contained HTML page (PNG plots embedded, and written beside it) of the
best kernel per shape, read top-down: the verdict and a table per regime first, then plots
that stay readable from 20 to 1,000 shapes (the speedups sorted, the speedup by regime,
achieved TFLOP/s against the roof, which template wins where, what tuning cost), and the
long per-shape table last. summary.json beside it holds the numbers of the first table."""

from __future__ import annotations

import base64
import html
import io
import json
import math
from pathlib import Path

import pandas as pd

from ..errors import Cudal2Error
from ..measure.environment import tensor_peak
from ..problem import Problem
from ..protocol import BASELINES, TIE, best
from .roofline import REGIMES, regime
from .tables import speedup_summary, verdict_line

# The speedup columns a row may carry, each against one library call or the claim (the lower
# of the CUPTI and graph ratios against the fastest). Shipped rows carry the claim alone.
SERIES = (("speedup_offline", "claimed: vs the fastest library call"), ("speedup_vs_cublas", "vs cuBLAS"),
          ("speedup_vs_cublaslt", "vs cuBLASLt autotuned"), ("speedup_vs_torch", "vs torch.matmul"))
COLOURS = dict(zip(REGIMES, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:gray")))
KEYS = ["m", "n", "k", "dtype", "layout"]
REGIME_HELP = ("unaligned: N or K not a multiple of 8; decode: M or N at most 128 against a wide other side; "
               "few-tile long-K: K of 2048 or more on fewer 128x128 output tiles than SMs; short-K: K of 256 or less; "
               "large: M, N and K of 2048 or more; other: the rest")


def _figure(width: float = 6.0, height: float = 4.0):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(width, height))


def _problem(row) -> Problem:
    return Problem(int(row.m), int(row.n), int(row.k), row.dtype, row.layout)


def _label(row) -> str:
    layout = "" if row.layout == "nn" else f" {row.layout}"
    return f"{row.m}x{row.n}x{row.k} {row.dtype}{layout}"


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return buffer.getvalue()


def _tie_band(ax, tie: float) -> None:
    """The line at 1.0 and the band of ties around it, on a log axis labelled in plain numbers."""
    from matplotlib.ticker import FuncFormatter

    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhspan(1 - tie, 1 + tie, color="gray", alpha=0.15, label=f"tie (within {tie:.0%})")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}".strip("0.")[:1] in "25" else ""))


def _sorted_plot(winners: pd.DataFrame, tie: float) -> bytes:
    """Each series' speedups sorted, against the share of shapes: a curve whatever their count."""
    fig, ax = _figure()
    for column, name in SERIES:
        values = winners[column].dropna().sort_values().to_numpy()
        if len(values):
            share = [(i + 0.5) / len(values) * 100 for i in range(len(values))]
            ax.plot(share, values, label=f"{name} ({len(values)})", linewidth=2 if column == "speedup_offline" else 1.2,
                    marker="." if len(values) <= 60 else None)
    _tie_band(ax, tie)
    ax.set_xlim(0, 100)
    ax.set_xlabel("% of shapes (sorted by speedup)")
    ax.set_ylabel("speedup of the best kernel")
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title("Speedups, sorted")
    ax.grid(alpha=0.3, which="both")
    return _png(fig)


def _regime_plot(winners: pd.DataFrame, tie: float) -> bytes:
    """The claimed speedup of every shape, one column of points per regime."""
    fig, ax = _figure()
    present = [r for r in REGIMES if (winners["regime"] == r).any()]
    for x, regime in enumerate(present):
        values = winners.loc[winners["regime"] == regime, "speedup_offline"].sort_values().to_numpy()
        spread = [x + 0.6 * ((i + 0.5) / len(values) - 0.5) for i in range(len(values))]  # sorted: no overlap
        ax.scatter(spread, values, s=12, color=COLOURS[regime], alpha=0.8)
    _tie_band(ax, tie)
    ax.set_xticks(range(len(present)), [f"{r}\n({(winners['regime'] == r).sum()})" for r in present], fontsize=8)
    ax.set_ylabel("claimed speedup")
    ax.set_title("Speedup by regime")
    ax.grid(alpha=0.3, axis="y", which="both")
    return _png(fig)


def _roofline_plot(winners: pd.DataFrame) -> bytes:
    fig, ax = _figure()
    problems = [_problem(r) for r in winners.itertuples()]
    intensity = [p.flops / p.min_bytes for p in problems]
    ax.scatter(intensity, winners["tflops"], label="best kernel", s=12, zorder=3)
    ax.scatter(intensity, [p.flops / us / 1e6 for p, us in zip(problems, winners["baseline_offline_us"])], marker="x",
               s=12, label="fastest library call", zorder=3)
    first = winners.iloc[0]
    if pd.notna(first.get("sm_count")) and pd.notna(first.get("max_sm_clock_mhz")):
        peak = tensor_peak({"cc": int(first["cc"]), "sm_count": int(first["sm_count"]),
                            "max_sm_clock_mhz": int(first["max_sm_clock_mhz"])}) / 1e12
        ax.axhline(peak, color="gray", linestyle="--", label=f"tensor-core peak at boost clock ({peak:.0f})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per byte of A, B and C)")
    ax.set_ylabel("TFLOP/s")
    ax.legend(fontsize=8)
    ax.set_title("Achieved TFLOP/s against the roof")
    return _png(fig)


def _template_plot(winners: pd.DataFrame) -> bytes:
    fig, ax = _figure()
    kind = winners.apply(lambda r: "library call faster" if r.speedup_offline < 1 else
                         (r.template if isinstance(r.template, str) else "free-form"), axis=1)
    for name in sorted(set(kind)):
        chosen = winners[kind == name]
        ax.scatter([math.log2(r.m * r.n) for r in chosen.itertuples()], [math.log2(r.k) for r in chosen.itertuples()],
                   label=f"{name} ({len(chosen)})", s=16, alpha=0.8)
    ax.set_xlabel("log2(M x N)")
    ax.set_ylabel("log2(K)")
    ax.legend(fontsize=8, framealpha=0.95)
    ax.set_title("Which template wins where")
    return _png(fig)


def _tuning_plot(spent: pd.DataFrame) -> bytes:
    """Per shape: candidates measured against nvcc seconds recorded."""
    fig, ax = _figure()
    ax.scatter(spent["candidates"], spent["compile_s"], s=14)
    ax.set_xlabel("candidates measured")
    ax.set_ylabel("nvcc seconds recorded")
    ax.set_title(f"Tuning cost per shape ({spent['compile_s'].sum() / 3600:.1f} nvcc hours in all)")
    ax.grid(alpha=0.3)
    return _png(fig)


def _tuning(rows: pd.DataFrame, winners: pd.DataFrame) -> pd.DataFrame | None:
    """Candidates and nvcc seconds per reported shape; None when no compile time is recorded
    (the shipped measurements keep none): no plot of zeros."""
    kernels = rows[~rows["kernel"].isin(BASELINES)]
    if not (kernels["compile_s"].fillna(0) > 0).any():
        return None
    spent = kernels.groupby(KEYS).agg(candidates=("kernel", "size"), compile_s=("compile_s", "sum")).reset_index()
    return winners[KEYS].merge(spent, on=KEYS, how="left").fillna(0)


def regime_table(winners: pd.DataFrame) -> list[dict]:
    """Per regime with shapes in it, then all: shapes, geometric mean, minimum, wins, ties, losses."""
    groups = [(r, winners[winners["regime"] == r]) for r in REGIMES] + [("all", winners)]
    return [{"regime": name, "shapes": len(group), **speedup_summary([float(v) for v in group["speedup_offline"]])}
            for name, group in groups if len(group)]


def _cell(value, digits: int = 3) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else (
        f"{value:.{digits}f}" if isinstance(value, float) else html.escape(str(value)))


def _output_dir(out: Path) -> Path:
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise Cudal2Error(f"--out {out} is a file: give a directory for index.html and the plots")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".cudal2-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise Cudal2Error(f"cannot write the report into {out}: {exc.strerror}") from None
    return out


def _long_rows(winners: pd.DataFrame, shown: list[tuple[str, str]]) -> str:
    """Every shape's row of the long table, slowest first: its best kernel, both methods, the
    fastest library call, the speedups shown, TFLOP/s and the share of the floor reached."""
    return "\n".join(
        f"<tr><td>{html.escape(_label(r))}</td><td>{html.escape(r.regime)}</td><td>{html.escape(str(r.kernel))}</td>"
        f"<td>{_cell(r.kernel_us, 2)}</td><td>{_cell(r.graph_us, 2)}</td><td>{_cell(r.baseline)}</td>"
        f"<td>{_cell(r.baseline_offline_us, 2)}</td><td><b>{_cell(r.speedup_offline)}</b></td>"
        + "".join(f"<td>{_cell(getattr(r, c))}</td>" for c, _ in shown)
        + f"<td>{_cell(r.tflops, 1)}</td><td>{_cell(getattr(r, 'floor_fraction', None), 2)}</td></tr>"
        for r in winners.sort_values("speedup_offline").itertuples())


def write_report(rows: pd.DataFrame, out: Path, shapes: list[Problem] | None = None, source: str | None = None,
                 tie: float = TIE) -> Path:
    """Writes out/index.html (plots embedded), out/<plot>.png and out/summary.json from
    leaderboard `rows` of one bench protocol; `shapes` limits it to those problems, in
    their order; `source` says where the rows come from (the shipped measurements)."""
    winners = best(rows, 1)
    if shapes is not None:
        winners = pd.DataFrame([p.__dict__ for p in shapes], columns=KEYS).merge(winners, on=KEYS, how="inner")
    if winners.empty:
        raise Cudal2Error("nothing to report: no verified kernel" + (" for those shapes" if shapes is not None else ""))
    out = _output_dir(out)
    winners = winners.reset_index(drop=True)
    sm_count = winners["sm_count"].dropna()
    winners["regime"] = [regime(_problem(r), int(sm_count.iloc[0]) if len(sm_count) else 132)
                         for r in winners.itertuples()]
    plots = {"speedups": _sorted_plot(winners, tie), "regimes": _regime_plot(winners, tie),
             "roofline": _roofline_plot(winners), "templates": _template_plot(winners)}
    spent = _tuning(rows, winners)
    if spent is not None:
        plots["tuning"] = _tuning_plot(spent)
    for name, data in plots.items():
        (out / f"{name}.png").write_bytes(data)
    regimes = regime_table(winners)
    overall = regimes[-1]
    gpu, protocol = str(winners.iloc[0]["gpu"]), str(winners.iloc[0]["protocol"])
    summary = {"gpu": gpu, "protocol": protocol, "source": source, "shapes": len(winners), "regimes": regimes,
               "plots": [f"{name}.png" for name in plots]}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))

    regime_rows = "\n".join(
        f"<tr><td>{html.escape(r['regime'])}</td><td>{r['shapes']}</td><td><b>{_cell(r['geomean_speedup'])}</b></td>"
        f"<td>{_cell(r['min_speedup'])}</td><td>{r['wins']}</td><td>{r['ties']}</td><td>{r['losses']}</td></tr>"
        for r in regimes)
    images = "\n".join(f'<figure><img alt="{name}" src="data:image/png;base64,{base64.b64encode(data).decode()}">'
                       f"</figure>" for name, data in plots.items())
    shown = [(c, n) for c, n in SERIES[1:] if winners[c].notna().any()]
    long_rows = _long_rows(winners, shown)
    origin = (f"<p class=note>These are the <b>measurements shipped with cudal2</b> ({html.escape(source)}): "
              "re-measure a shape here with <code>cudal2 bench --m M --n N --k K --top 1</code>.</p>"
              if source else "")
    tuning_note = "" if spent is not None else (
        "<p class=note>No compile times are recorded for these rows, so there is no tuning-cost plot.</p>")
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>cudal2 report: {html.escape(gpu)}</title>
<style>body{{font-family:sans-serif;margin:1.5em auto;max-width:1240px;padding:0 1em;color:#222}}
h1{{font-size:1.5em;margin-bottom:.2em}} h2{{font-size:1.15em;margin-top:1.6em}} .note{{color:#555}}
table{{border-collapse:collapse;font-size:13px}} td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}}
td:first-child,th:first-child{{text-align:left}} .long td:nth-child(3){{text-align:left;max-width:380px;
overflow-wrap:anywhere;font-size:11px}} .plots{{display:grid;grid-template-columns:1fr 1fr;gap:12px}}
figure{{margin:0}} img{{width:100%}}</style></head><body>
<h1>cudal2 report: {html.escape(gpu)}, {len(winners)} shapes</h1>
{origin}
<p>Speedup of the best verified kernel over the fastest library call (cuBLAS, cuBLASLt autotuned, torch.matmul:
the lower of the CUPTI and in-graph ratios, bench protocol <code>{html.escape(protocol)}</code>): geometric mean
<b>{_cell(overall["geomean_speedup"])}</b>, minimum <b>{_cell(overall["min_speedup"])}</b>;
{html.escape(verdict_line(overall))}.</p>
<table><tr><th>regime</th><th>shapes</th><th>geomean</th><th>min</th><th>wins</th><th>ties</th><th>losses</th></tr>
{regime_rows}
</table>
<p class=note>Regimes (cudal2/results/roofline.py): {html.escape(REGIME_HELP)}</p>
<h2>Plots</h2>
<div class=plots>
{images}
</div>
{tuning_note}
<h2>Every shape, slowest first</h2>
<table class=long><tr><th>shape</th><th>regime</th><th>best kernel</th><th>kernel us</th><th>graph us</th>
<th>fastest library call</th><th>its us</th><th>speedup</th>{"".join(f"<th>{html.escape(n)}</th>" for _, n in shown)}
<th>TFLOP/s</th><th>of floor</th></tr>
{long_rows}
</table>
</body></html>
"""
    index = out / "index.html"
    index.write_text(page)
    return index
