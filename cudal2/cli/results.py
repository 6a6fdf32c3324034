"""cudal2 leaderboard, check, report and export: what was measured, re-checked, drawn, and put to work."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import pandas as pd
import typer

from .. import api
from ..config import load_settings
from ..errors import Cudal2Error
from ..problem import DTYPES, LAYOUTS, Problem
from ..protocol import EARLIER_PROTOCOLS, PROTOCOL, PROTOCOLS
from ..results.leaderboard import SHIPPED, STATUSES, Leaderboard, best, contributions, select, shown
from ..results.tables import SHAPE_COLUMNS, emit_frame, fmt, jsonable, report_shapes, show_table
from ..runtime import MIN_SPEEDUP, DispatchTable, export_best
from ..shapes import shape_set
from .options import Json, ModelOpt, Results, TokensOpt, app, cli_errors

Shipped = Annotated[bool, typer.Option(
    "--shipped", help="the measurements shipped with cudal2 (cudal2/data/measurements.parquet) instead of the "
                      "results directory's; shown anyway while the results directory has none")]

@app.command("leaderboard")
@cli_errors
def leaderboard_cmd(
    m: Annotated[Optional[int], typer.Option("--m")] = None,
    n: Annotated[Optional[int], typer.Option("--n")] = None,
    k: Annotated[Optional[int], typer.Option("--k")] = None,
    gpu: Annotated[Optional[str], typer.Option(help="GPU name or part of it, any case (e.g. 'H200')")] = None,
    dtype: Annotated[Optional[str], typer.Option()] = None,
    layout: Annotated[Optional[str], typer.Option()] = None,
    status: Annotated[Optional[str], typer.Option(help=f"show rows of this status: {' | '.join(STATUSES)}")] = None,
    top: Annotated[int, typer.Option(help="kernels per problem")] = 1,
    protocol: Annotated[str, typer.Option(
        "--protocol", "--bench",
        help=f"rows of this bench protocol: {PROTOCOL} (this version's) | {' | '.join(EARLIER_PROTOCOLS)} "
             "(earlier versions', never ranked with it)")] = PROTOCOL,
    format: Annotated[str, typer.Option(help="table | csv | json | markdown")] = "table",
    shapes: Annotated[Optional[Path], typer.Option(
        help="a shape set (CSV with columns m, n, k[, dtype, layout]): its rows only, in its order, "
             "with the geometric mean and minimum of their best speedups")] = None,
    model: ModelOpt = None,
    tokens: TokensOpt = None,
    export: Annotated[bool, typer.Option(
        "--export", help="also write each best kernel shown to results/best/<gpu>/<dtype>_<layout>/<m>_<n>_<k>.cu")] = False,
    migrate: Annotated[bool, typer.Option(
        "--migrate", help="rewrite every part into one part of the current schema, then show as asked")] = False,
    proposers: Annotated[bool, typer.Option(
        "--proposers", help="instead: what each proposer contributed (candidates, ok, best speedup, best "
                            "kernels, LLM tokens)")] = False,
    use_shipped: Shipped = False,
    results: Results = None,
    json_out: Json = False,
) -> None:
    """Show the best verified kernel per problem with its speedup over the fastest library call.

    The speedup is the lower of the CUPTI and in-graph ratios against the fastest of
    cuBLAS, cuBLASLt autotuned and torch.matmul from the same run. With --status, show the
    rows of that status instead (for example the cheats and why). With no measurements in
    the results directory yet, or with --shipped, it shows the measurements shipped with
    cudal2 (labelled so; they keep no kernel sources, so --export refuses them).
    """
    format = "json" if json_out else format
    check_options(format, status, top, protocol, export)
    check_filters(m, n, k, dtype, layout)
    settings = load_settings({"results": results})
    board = Leaderboard(settings.results)
    if migrate:
        replaced, count = board.migrate()
        typer.echo(f"migrated {replaced} part(s), {count} rows, into one part of the current schema", err=True)
    if format == "json" and not use_shipped and not board.parts.exists():  # nothing measured yet: [], not an error
        print("[]")
        return
    rows, from_shipped = shown_rows(settings.results, protocol, use_shipped, export)
    df = select(rows, m=m, n=n, k=k, dtype=dtype, layout=layout)
    if gpu is not None:  # 'H200' finds 'NVIDIA H200'
        df = df[df["gpu"].fillna("").str.contains(gpu, case=False, regex=False)]
    keys = ["gpu", "m", "n", "k", "dtype", "layout"]
    if proposers:
        emit_frame(contributions(df, settings.results), format)
        return
    if (named := shape_set(shapes, model, tokens, dtype)) is not None:
        if status is not None:
            raise Cudal2Error("a shape set reports the best kernels; it does not combine with --status")
        chosen = report_shapes(df, named, format, "shipped" if from_shipped else None)
        if export:
            export_rows(board, settings.results, chosen)
        return
    if status is None:
        df = best(df, top)
        # a terminal's table: what a reader compares; csv, json and markdown carry every method and baseline
        columns = keys + (["kernel", "kernel_us", "graph_us", "baseline", "baseline_offline_us", "speedup_offline",
                           "tflops"] if format == "table" else SHAPE_COLUMNS[6:] + ["server_us", "speedup_server", "time"])
    else:
        df = df[df["status"] == status].sort_values(keys + ["time"]).groupby(keys, dropna=False).head(top)
        columns = keys + ["kernel", "status", "error", "time"]
    if export:
        export_rows(board, settings.results, df)
    df = df.sort_values(keys)[columns]
    if from_shipped:
        df = df.assign(source="shipped")
    emit_frame(df, format)


def check_options(format: str, status: str | None, top: int, protocol: str, export: bool) -> None:
    """The leaderboard's options that cannot go together or name nothing, said before anything is read."""
    if format not in ("table", "csv", "json", "markdown"):
        raise Cudal2Error(f"unknown format {format!r}; choose table, csv, json or markdown")
    if status is not None and status not in STATUSES:
        raise Cudal2Error(f"unknown status {status!r}; choose one of {', '.join(STATUSES)}")
    if top < 1:
        raise Cudal2Error(f"--top must be >= 1, got {top}")
    if protocol not in PROTOCOLS:
        raise Cudal2Error(f"unknown --protocol {protocol!r}; choose {', '.join(PROTOCOLS)}")
    if export and status is not None:
        raise Cudal2Error("--export writes the best kernels; it does not combine with --status")


def shown_rows(results: Path, protocol: str, use_shipped: bool, export: bool) -> tuple[pd.DataFrame, bool]:
    """The rows to show (leaderboard.shown) and whether they are the shipped ones, which
    stderr labels and --export refuses (they keep no sources)."""
    rows, from_shipped = shown(results, protocol, use_shipped)
    if from_shipped:
        if export:
            raise Cudal2Error("the shipped measurements keep no kernel sources to export: `cudal2 bench --m M --n N "
                              "--k K --top 1` measures a shape's best recorded kernel here and stores it")
        typer.echo(f"the measurements shipped with cudal2 ({SHIPPED.relative_to(SHIPPED.parents[2])}"
                   + ("" if use_shipped else f"; nothing measured in {results} yet") + ")", err=True)
    return rows, from_shipped


def check_filters(m: int | None, n: int | None, k: int | None, dtype: str | None, layout: str | None) -> None:
    """Filters that no row could match are mistakes, said before anything is read."""
    Problem(m or 1, n or 1, k or 1, dtype or DTYPES[0], layout or LAYOUTS[0])


def export_rows(board: Leaderboard, results: Path, rows: pd.DataFrame) -> None:
    """Each best-kernel row as a self-contained .cu file (stderr says where)."""
    paths = [export_best(board, results, row) for row in rows.to_dict("records") if row.get("source_hash")]
    typer.echo(f"exported {len(paths)} kernel(s) to {results / 'best'}", err=True)


@app.command()
@cli_errors
def check(
    shapes: Annotated[Optional[Path], typer.Option(help="a shape set (CSV m,n,k[,dtype,layout]); default: every "
                                                         "problem of the leaderboard")] = None,
    model: ModelOpt = None,
    tokens: TokensOpt = None,
    dtype: Annotated[Optional[str], typer.Option(help="a preset's dtype (default bf16)")] = None,
    fail_under: Annotated[str, typer.Option(help="the lowest speedup that passes")] = "1.0",
    library: Annotated[Optional[Path], typer.Option(
        help="an exported dispatch library (cudal2 export --library): measure the kernels it serves")] = None,
    results: Results = None,
    json_out: Json = False,
) -> None:
    """Measure each shape's best kernel again on this GPU against the baselines (after a
    driver or CUDA upgrade, in CI); exit 3 when any falls below --fail-under."""
    try:
        threshold = float(fail_under)
    except ValueError:
        raise Cudal2Error(f"--fail-under takes a number, got {fail_under!r}") from None
    if library is not None and (shapes is not None or model is not None):
        raise Cudal2Error("--library checks the kernels a library serves: drop --shapes and --model")
    if library is not None:
        DispatchTable.load(library)  # not a library: one line, before the GPU is touched
    settings = load_settings({"results": results})
    outcome = api.check(shape_set(shapes, model, tokens, dtype), fail_under=threshold, settings=settings,
                        library=library)
    if json_out:
        print(json.dumps({"fail_under": threshold, "passed": outcome.passed, "rows": jsonable(outcome.rows)}, indent=1))
    else:
        show_table(["shape", "kernel", "recorded", "measured", "status", "pass"],
                   [[r["problem"], r["kernel"] or "-", fmt(r["recorded"], 3), fmt(r["measured"], 3), r["status"],
                     "yes" if r["passed"] else "NO"] for r in outcome.rows])
        print(f"{sum(r['passed'] for r in outcome.rows)} of {len(outcome.rows)} shapes at or above {threshold:g}x "
              "the fastest library call")
    if not outcome.passed:
        raise typer.Exit(3)


@app.command()
@cli_errors
def report(
    out: Annotated[Path, typer.Option(help="the directory to write index.html and the PNG plots into")],
    shapes: Annotated[Optional[Path], typer.Option(help="a shape set (CSV m,n,k[,dtype,layout]); default: every "
                                                         "problem of the leaderboard")] = None,
    model: ModelOpt = None,
    tokens: TokensOpt = None,
    dtype: Annotated[Optional[str], typer.Option(help="a preset's dtype (default bf16)")] = None,
    protocol: Annotated[str, typer.Option(
        "--protocol", "--bench", help=f"the rows of this bench protocol ({' | '.join(PROTOCOLS)})")] = PROTOCOL,
    use_shipped: Shipped = False,
    results: Results = None,
    json_out: Json = False,
) -> None:
    """Write a self-contained HTML page: the verdict and a table per regime (geometric mean,
    wins, losses), then plots (speedups sorted, speedup by regime, achieved TFLOP/s against
    the roof, which template wins where, tuning cost), then every shape. Its numbers also go
    to summary.json beside it (and to stdout with --json)."""
    if protocol not in PROTOCOLS:
        raise Cudal2Error(f"unknown --protocol {protocol!r}; choose {', '.join(PROTOCOLS)}")
    settings = load_settings({"results": results})
    page = api.report(out, shapes=shape_set(shapes, model, tokens, dtype), results=settings.results, protocol=protocol,
                      use_shipped=use_shipped)
    if json_out:
        print(json.dumps({"page": str(page), **json.loads((page.parent / "summary.json").read_text())}, indent=1))
        return
    summary = json.loads((page.parent / "summary.json").read_text())
    if summary["source"]:
        typer.echo(f"the measurements shipped with cudal2 ({summary['source']})", err=True)
    print(page)


@app.command()
@cli_errors
def export(
    library: Annotated[Path, typer.Option(help="the directory to write the library into (index.json, kernels/)")],
    gpu: Annotated[Optional[str], typer.Option(help="the GPU whose kernels to export (part of its name)")] = None,
    shapes: Annotated[Optional[Path], typer.Option(help="only the problems of this shape set")] = None,
    model: ModelOpt = None,
    tokens: TokensOpt = None,
    dtype: Annotated[Optional[str], typer.Option(help="a preset's dtype (default bf16)")] = None,
    min_speedup: Annotated[float, typer.Option(
        help="the lowest claimed speedup a kernel is exported at; below it the library call runs")] = MIN_SPEEDUP,
    results: Results = None,
    json_out: Json = False,
) -> None:
    """Build a dispatch library: this GPU's best kernel per tuned problem and a table that
    picks one per call (the exact problem; else the nearest tuned M where that kernel was
    verified; else none, and the caller's library call runs). A problem whose best kernel
    is slower than the library call gets none."""
    settings = load_settings({"results": results})
    table = api.export(library, gpu=gpu, shapes=shape_set(shapes, model, tokens, dtype), settings=settings,
                       min_speedup=min_speedup)
    if json_out:
        print(json.dumps({"library": str(library), "versions": table.versions,
                          "entries": [e.__dict__ for e in table.entries],
                          "library_call": sorted(table.library_call)}, indent=1, default=str))
    else:
        print(f"{len(table.entries)} kernel(s) for {table.versions.get('gpu')} -> {library}"
              + (f"; {len(table.library_call)} problem(s) left to the library call (no kernel beat it)"
                 if table.library_call else ""))

