"""The cudal2 command line: parse, call, print."""

from __future__ import annotations

import functools
import json
import time
import warnings
from pathlib import Path
from typing import Annotated, Any, Optional

import pandas as pd
import typer

from . import api
from . import render as render_stage
from .candidate import Candidate
from .bench import PROTOCOL, PROTOCOLS, STUDY_PROTOCOLS
from .compile import Compiler, find_nvcc
from .config import load_settings
from .errors import Cudal2Error
from .leaderboard import BASELINES, STATUSES, Leaderboard, best, select
from .problem import DTYPES, Problem
from .shapes import MODELS, shape_set
from .tables import (SHAPE_COLUMNS, console, emit_frame, err_console, fmt, jsonable, optimize_summary,
                     print_bench_table, print_optimize_summary, progress_display, report_shapes, set_summary,
                     show_table)

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Find the fastest HGEMM kernel for your shapes on your GPU, honestly measured.")


def _print_version(value: bool) -> None:
    if value:
        from . import __version__

        print(f"cudal2 {__version__}")
        raise typer.Exit()


@app.callback()
def _options(version: Annotated[bool, typer.Option(
        "--version", callback=_print_version, is_eager=True, help="print the version and exit")] = False) -> None:
    """Find the fastest HGEMM kernel for your shapes on your GPU, honestly measured."""

M = Annotated[str, typer.Option("--m", help="rows of A and C")]
N = Annotated[str, typer.Option("--n", help="columns of B and C")]
K = Annotated[str, typer.Option("--k", help="the reduction dimension")]
Dtype = Annotated[str, typer.Option(help=f"element type of A, B and C: {' | '.join(DTYPES)}")]
Layout = Annotated[str, typer.Option(help="nn: A[M,K] @ B[K,N]; nt: A[M,K] @ W[N,K]^T")]
Json = Annotated[bool, typer.Option("--json", help="print JSON for scripts")]
Results = Annotated[Optional[Path], typer.Option(help="results directory (leaderboard, sources)")]
Arch = Annotated[Optional[str], typer.Option(help="nvcc target, e.g. sm_90a (default: the GPU's)")]
TemplateOpt = Annotated[Optional[str], typer.Option("--template", help="a template name (see `cudal2 templates`)")]
Params = Annotated[Optional[list[str]], typer.Option(
    "--param", help="KEY=VALUE for --template, repeatable; KEY=V1,V2 tries each value (a grid)")]
Kernels = Annotated[Optional[list[Path]], typer.Option("--kernel", help="a free-form .cu file implementing the ABI, repeatable")]


def cli_errors(fn):
    """Turns the project's expected failures into one line on stderr and exit code 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = lambda msg, *a, **k: typer.echo(f"warning: {msg}", err=True)
                return fn(*args, **kwargs)
        except Cudal2Error as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None

    return wrapper


def parse_params(items: list[str] | None) -> dict[str, list[str]]:
    """['block_m=64,128', 'stages=4'] -> {'block_m': ['64', '128'], 'stages': ['4']}."""
    params = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        values = [v.strip() for v in value.split(",") if v.strip()]
        if not sep or not key.strip() or not values:
            raise Cudal2Error(f"--param takes KEY=VALUE, got {item!r}")
        params[key.strip()] = values
    return params


def read_kernel_file(path: Path) -> Candidate:
    try:
        return Candidate.from_source(path.read_text(), label=path.name)
    except OSError as exc:
        raise Cudal2Error(f"cannot read kernel file {path}: {exc.strerror}") from None


@app.command()
@cli_errors
def bench(
    m: M, n: N, k: K,
    dtype: Dtype = "fp16",
    layout: Layout = "nn",
    mode: Annotated[str, typer.Option(help="offline (warm, back to back) | server (cold L2, idle gaps) | both")] = "offline",
    kernel: Kernels = None,
    template: TemplateOpt = None,
    param: Params = None,
    budget: Annotated[Optional[float], typer.Option(help="seconds of timing per method and kernel")] = None,
    qps: Annotated[Optional[float], typer.Option(help="server mode: mean calls per second")] = None,
    bench_protocol: Annotated[str, typer.Option("--bench", help=(
        f"how to time: {PROTOCOL} (CUPTI device time and in-graph time against cuBLAS, cuBLASLt autotuned "
        f"and torch.matmul) | {' | '.join(STUDY_PROTOCOLS)} (earlier protocols, for study: against cuBLAS, "
        "never ranked with the protocol's rows)"))] = PROTOCOL,
    top: Annotated[Optional[int], typer.Option(
        help="without --kernel/--template: only the leaderboard's N fastest kernels of this problem per "
             "bench protocol (to re-measure them), no template defaults")] = None,
    results: Results = None,
    arch: Arch = None,
    json_out: Json = False,
) -> None:
    """Measure kernels against the best library call on one problem, on this GPU.

    Without --kernel or --template: the leaderboard's kernels for this problem (of any bench
    protocol: this re-measures them) and every template's default configuration. Every
    kernel is verified first (untrusted code: see the README), then timed with cuBLAS,
    cuBLASLt autotuned and torch.matmul in the same process, by CUPTI device time and in a
    CUDA graph, on rotating inputs; the speedup is the lower of the two ratios against the
    fastest baseline of that run. Measured rows are added to the leaderboard.
    """
    if mode not in ("offline", "server", "both"):
        raise Cudal2Error(f"unknown mode {mode!r}; choose offline, server or both")
    if bench_protocol not in PROTOCOLS:
        raise Cudal2Error(f"unknown --bench {bench_protocol!r}; choose {', '.join(PROTOCOLS)}")
    if top is not None and top < 1:
        raise Cudal2Error(f"--top must be >= 1, got {top}")
    problem = Problem.parse(m, n, k, dtype, layout)
    settings = load_settings({"budget": budget, "qps": qps, "results": results, "arch": arch})
    grid = parse_params(param)
    if grid and not template:
        raise Cudal2Error("--param needs --template")
    named = [read_kernel_file(p) for p in kernel or []]

    def started(env: dict[str, Any], count: int) -> None:
        if not json_out:
            console.print(f"{problem} on {env['gpu']} (sm_{env['cc']}), {mode} mode, {bench_protocol}, {count} kernel(s)")

    result = api.bench(problem, kernels=named, template=template, grid=grid, mode=mode, protocol=bench_protocol,
                       top=top, settings=settings, on_start=started)
    env, rows = result.environment, result.rows
    if json_out:
        print(json.dumps({"problem": problem.__dict__, "environment": env, "rows": jsonable(rows)}, indent=1))
    else:
        print_bench_table(rows, bench_protocol, mode)


ShapesOpt = Annotated[Optional[Path], typer.Option(
    "--shapes", help="a shape set: CSV with columns m, n, k[, dtype, layout] (instead of --m --n --k)")]
ModelOpt = Annotated[Optional[str], typer.Option(
    "--model", help=f"a model preset, its projection GEMMs (nt, bf16 unless --dtype): {' | '.join(MODELS)}")]
TokensOpt = Annotated[Optional[str], typer.Option(help="the preset's token counts, the GEMMs' M (default 1,16,128,4096)")]


def problems_of(m, n, k, dtype, layout, shapes, model, tokens, dtype_given: bool) -> list[Problem]:
    """The problems a command names: one shape (--m --n --k), a shape file or a preset."""
    named = shape_set(shapes, model, tokens, dtype if dtype_given else None)
    if named is not None:
        if any(v is not None for v in (m, n, k)):
            raise Cudal2Error("give --m --n --k, or a shape set (--shapes, --model), not both")
        return named
    if any(v is None for v in (m, n, k)):
        raise Cudal2Error("give --m, --n and --k, or a shape set (--shapes FILE or --model NAME)")
    return [Problem.parse(m, n, k, dtype, layout)]


@app.command()
@cli_errors
def optimize(
    m: Annotated[Optional[str], typer.Option("--m", help="rows of A and C")] = None,
    n: Annotated[Optional[str], typer.Option("--n", help="columns of B and C")] = None,
    k: Annotated[Optional[str], typer.Option("--k", help="the reduction dimension")] = None,
    dtype: Annotated[Optional[str], typer.Option(help=f"element type of A, B and C: {' | '.join(DTYPES)} (default fp16; "
                                                      "bf16 for a --model preset)")] = None,
    layout: Layout = "nn",
    shapes: ShapesOpt = None,
    model: ModelOpt = None,
    tokens: TokensOpt = None,
    proposer: Annotated[str, typer.Option(help="search (cost model + local search) | llm | hybrid")] = "search",
    iterations: Annotated[int, typer.Option(help="batches to propose")] = 10,
    batch: Annotated[int, typer.Option(help="candidates per batch")] = 8,
    time_budget: Annotated[Optional[float], typer.Option(help="wall-clock seconds for each shape")] = None,
    patience: Annotated[Optional[int], typer.Option(help="stop after this many batches without a better kernel")] = 3,
    seed: Annotated[int, typer.Option(help="seed of the search proposer")] = 0,
    llm_model: Annotated[Optional[str], typer.Option(help="LLM model name (llm, hybrid)")] = None,
    base_url: Annotated[Optional[str], typer.Option(help="OpenAI-compatible endpoint (llm, hybrid)")] = None,
    replay: Annotated[Optional[Path], typer.Option(
        help="a directory of saved replies (llm-round-<k>-reply.md, as a run saves them) standing in for the "
             "endpoint (llm, hybrid)")] = None,
    mode: Annotated[str, typer.Option(help="offline | server: the mode that decides the best kernel")] = "offline",
    budget: Annotated[Optional[float], typer.Option(help="seconds of timing per kernel")] = None,
    remeasure: Annotated[bool, typer.Option(help="measure candidates again even if the leaderboard has them")] = False,
    template: Annotated[Optional[str], typer.Option(
        "--template", help="search only this template's configurations (with --param: only that grid)")] = None,
    param: Params = None,
    gpus: Annotated[Optional[str], typer.Option(
        help="all | 0,1,...: one GPU worker per device, the shapes spread over them (same GPU model and driver)")] = None,
    cluster: Annotated[Optional[str], typer.Option(
        help="a Dask scheduler (tcp://head:8786) whose workers each own a GPU (--resources GPU=1): one task "
             "per shape, the rows merged here (search proposer)")] = None,
    results: Results = None,
    arch: Arch = None,
    json_out: Json = False,
) -> None:
    """Search for the fastest kernel for one problem or a shape set: propose, compile,
    verify, bench, record.

    Warm-starts from the leaderboard (each shape of a set from the ones before it too); the
    rows of every batch are recorded as it ends, so Ctrl-C keeps what was measured and a
    re-run measures nothing twice. The best kernel of each shape is exported to
    results/best/<gpu>/<dtype>_<layout>/<m>_<n>_<k>.cu.
    """
    if mode not in ("offline", "server"):
        raise Cudal2Error(f"unknown mode {mode!r}; choose offline or server")
    if proposer not in ("search", "llm", "hybrid"):
        raise Cudal2Error(f"unknown proposer {proposer!r}; choose search, llm or hybrid")
    for name, value in (("iterations", iterations), ("batch", batch)):
        if value < 1:
            raise Cudal2Error(f"--{name} must be >= 1, got {value}")
    problems = problems_of(m, n, k, dtype or "fp16", layout, shapes, model, tokens, dtype is not None)
    settings = load_settings({"budget": budget, "results": results, "arch": arch})
    if cluster is not None:
        if proposer != "search" or gpus or template or param:
            raise Cudal2Error("--cluster runs the search proposer on every worker's GPU: drop --proposer, --gpus, "
                              "--template and --param")
        from .cluster import optimize_on_cluster

        def done(problem, result) -> None:
            best = max((r.get("speedup_offline") or 0.0 for r in result["rows"]
                        if r.get("status") == "ok" and r.get("kernel") not in BASELINES), default=None)
            err_console.print(f"{problem} on {result.get('host', '?')}: " + (
                result["error"] if result.get("error") else f"{len(result['rows'])} rows, best {fmt(best, 3)}"))

        finished = optimize_on_cluster(problems, cluster, settings=settings, on_done=done, options={
            "iterations": iterations, "batch": batch, "time_budget": time_budget, "patience": patience,
            "seed": seed, "mode": mode, "remeasure": remeasure})
        failed = [f for f in finished if f.get("error")]
        print(f"{len(finished) - len(failed)} of {len(problems)} shapes tuned on the cluster; rows in {settings.results}"
              f"; `cudal2 leaderboard --shapes` reports them")
        if failed:
            raise typer.Exit(1)
        return
    llm_settings = None
    if proposer != "search":
        from .llm import load_llm_settings

        llm_settings = load_llm_settings({"model": llm_model, "base_url": base_url})
    with progress_display(json_out, len(problems) * iterations * batch) as on_event:
        tuned = api.optimize(problems, proposer=proposer, iterations=iterations, batch=batch, time_budget=time_budget,
                             patience=patience, seed=seed, llm_settings=llm_settings, replay=replay,
                             template=template, grid=parse_params(param), mode=mode, remeasure=remeasure,
                             settings=settings, gpus=api.gpu_indices(gpus), on_event=on_event)
    outcomes = [t.outcome for t in tuned]
    env, run_id = tuned[0].environment, tuned[0].run_id
    summaries = [{**optimize_summary(p, env, o, run_id), "llm_tokens_run": tuned[0].llm_tokens}
                 for p, o in zip(problems, outcomes)]
    if not json_out:
        for problem, outcome in zip(problems, outcomes):
            if len(problems) > 1:
                print(f"{problem}:")
            print_optimize_summary(outcome, mode)
        if tuned[0].llm_tokens is not None:
            print(f"LLM tokens this run: {tuned[0].llm_tokens}")
    if json_out:
        print(json.dumps(summaries[0] if shapes is None and model is None else
                         {"shapes": summaries, "summary": set_summary(summaries, mode)}, indent=1, default=str))
    elif len(summaries) > 1:
        total = set_summary(summaries, mode)
        print(f"{total['tuned']} of {total['shapes']} shapes with a verified kernel; speedup over the fastest library "
              f"call: geometric mean {fmt(total['geomean_speedup'], 3)}, minimum {fmt(total['min_speedup'], 3)}; "
              f"wall {total['wall_s']:.1f} s")


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
    bench: Annotated[str, typer.Option(
        help=f"rows of this bench protocol: {PROTOCOL} (this version's) | {' | '.join(STUDY_PROTOCOLS)} "
             "(earlier protocols, never ranked with it)")] = PROTOCOL,
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
    results: Results = None,
) -> None:
    """Show the best verified kernel per problem with its speedup over the fastest library call.

    The speedup is the lower of the CUPTI and in-graph ratios against the fastest of
    cuBLAS, cuBLASLt autotuned and torch.matmul from the same run. With --status, show the
    rows of that status instead (for example the cheats and why).
    """
    if format not in ("table", "csv", "json", "markdown"):
        raise Cudal2Error(f"unknown format {format!r}; choose table, csv, json or markdown")
    if status is not None and status not in STATUSES:
        raise Cudal2Error(f"unknown status {status!r}; choose one of {', '.join(STATUSES)}")
    if top < 1:
        raise Cudal2Error(f"--top must be >= 1, got {top}")
    if bench not in PROTOCOLS:
        raise Cudal2Error(f"unknown --bench {bench!r}; choose {', '.join(PROTOCOLS)}")
    if export and status is not None:
        raise Cudal2Error("--export writes the best kernels; it does not combine with --status")
    settings = load_settings({"results": results})
    board = Leaderboard(settings.results)
    if migrate:
        replaced, count = board.migrate()
        typer.echo(f"migrated {replaced} part(s), {count} rows, into one part of the current schema", err=True)
    if not board.parts.exists():
        raise Cudal2Error(f"no leaderboard in {settings.results} (nothing measured there yet, or another --results)")
    df = select(board.read(bench), m=m, n=n, k=k, dtype=dtype, layout=layout)
    if gpu is not None:  # 'H200' finds 'NVIDIA H200'
        df = df[df["gpu"].fillna("").str.contains(gpu, case=False, regex=False)]
    keys = ["gpu", "m", "n", "k", "dtype", "layout"]
    if (named := shape_set(shapes, model, tokens, dtype)) is not None:
        if status is not None:
            raise Cudal2Error("a shape set reports the best kernels; it does not combine with --status")
        shown = report_shapes(df, named, format)
        if export:
            export_rows(board, settings.results, shown)
        return
    if status is None:
        df = best(df, top)
        columns = keys + SHAPE_COLUMNS[6:] + ["server_us", "speedup_server", "time"]
    else:
        df = df[df["status"] == status].sort_values(keys + ["time"]).groupby(keys, dropna=False).head(top)
        columns = keys + ["kernel", "status", "error", "time"]
    if export:
        export_rows(board, settings.results, df)
    df = df.sort_values(keys)[columns]
    emit_frame(df, format)


def export_rows(board: Leaderboard, results: Path, rows: pd.DataFrame) -> None:
    """Each best-kernel row as a self-contained .cu file (stderr says where)."""
    from .optimize import export_best

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
    results: Results = None,
    json_out: Json = False,
) -> None:
    """Measure each shape's best kernel again on this GPU against the baselines (after a
    driver or CUDA upgrade, in CI); exit 3 when any falls below --fail-under."""
    try:
        threshold = float(fail_under)
    except ValueError:
        raise Cudal2Error(f"--fail-under takes a number, got {fail_under!r}") from None
    settings = load_settings({"results": results})
    outcome = api.check(shape_set(shapes, model, tokens, dtype), fail_under=threshold, settings=settings)
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
    bench: Annotated[str, typer.Option(help=f"the rows of this bench protocol ({' | '.join(PROTOCOLS)})")] = PROTOCOL,
    results: Results = None,
) -> None:
    """Write a self-contained HTML page with plots: speedup per shape against each baseline,
    achieved TFLOP/s against the roof, which template wins where, tuning cost."""
    if bench not in PROTOCOLS:
        raise Cudal2Error(f"unknown --bench {bench!r}; choose {', '.join(PROTOCOLS)}")
    settings = load_settings({"results": results})
    page = api.report(out, shapes=shape_set(shapes, model, tokens, dtype), results=settings.results, bench=bench)
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
        help="the lowest claimed speedup a kernel is exported at; below it the library call runs")] = 1.0,
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


@app.command("compile")
@cli_errors
def compile_cmd(
    template: TemplateOpt = None,
    param: Params = None,
    kernel: Kernels = None,
    all_configs: Annotated[bool, typer.Option("--all", help="every valid configuration of --template")] = False,
    dtype: Dtype = "fp16",
    layout: Layout = "nn",
    arch: Arch = None,
    jobs: Annotated[Optional[int], typer.Option(help="parallel nvcc processes")] = None,
    json_out: Json = False,
) -> None:
    """Render and compile without a GPU, filling the kernel cache (e.g. on a CPU build host)."""
    settings = load_settings({"arch": arch, "jobs": jobs})
    if settings.arch is None:
        raise Cudal2Error("compile needs --arch (e.g. sm_90a) or CUDAL2_ARCH")
    cc = render_stage.arch_cc(settings.arch)
    problem = Problem(1, 1, 1, dtype, layout)  # only dtype and layout shape the source
    candidates = [read_kernel_file(p) for p in kernel or []]
    if template:
        tmpl = render_stage.get_template(template)
        if all_configs:
            if param:
                raise Cudal2Error("--all compiles the whole space; drop --param")
            candidates += [Candidate.from_template(template, p) for p in tmpl.space.configurations(cc)]
        else:
            candidates += render_stage.template_grid(template, parse_params(param), cc)
    elif param or all_configs:
        raise Cudal2Error("--param and --all need --template")
    if not candidates:
        raise Cudal2Error("nothing to compile: give --template NAME or --kernel FILE")
    find_nvcc()
    compiler = Compiler(settings.arch, settings.cache_dir, settings.jobs, settings.timeout)
    builds = compiler.compile_all([render_stage.render(c, problem) for c in candidates])
    records = [
        {"kernel": str(c), "status": b.status, "cached": b.cached, "seconds": round(b.seconds, 2),
         **b.stats, **b.declared, "library": str(b.library) if b.library else None,
         "error": None if b.status == "ok" else b.log[-2000:]}
        for c, b in zip(candidates, builds)
    ]
    columns = ["kernel", "status", "cached", "seconds", "registers", "smem_bytes", "dynamic_smem_bytes", "spill_bytes"]
    if json_out:
        print(json.dumps(records, indent=1))
    else:
        show_table(columns, [[fmt(r[c]) for c in columns] for r in records])
        for r in records:
            if r["error"]:
                err_console.print(f"{r['kernel']}: {api.first_error_line(r['error']) if r['error'].strip() else r['status']}")
    if any(b.status != "ok" for b in builds):
        raise typer.Exit(1)


@app.command()
@cli_errors
def prebuild(
    arch: Arch = None,
    jobs: Annotated[Optional[int], typer.Option(help="parallel nvcc processes (default: every core)")] = None,
    pack: Annotated[Optional[Path], typer.Option(help="also write the built set to this tarball (.tar.gz)")] = None,
    unpack: Annotated[Optional[Path], typer.Option(
        help="instead: add another machine's build (a --pack tarball or a cache directory) to this cache")] = None,
    list_only: Annotated[bool, typer.Option("--list", help="only list the set (no compiling)")] = False,
    results: Results = None,
    json_out: Json = False,
) -> None:
    """Compile the prebuilt kernel set of an architecture into the kernel cache (no GPU
    needed): every configuration within 2% of the best on a measured problem, plus the cost
    model's best per region. What is cached already is skipped, so a stopped build resumes."""
    from . import prebuilt
    from .leaderboard import with_shipped

    settings = load_settings({"arch": arch, "jobs": jobs, "results": results})
    if unpack is not None:
        added = prebuilt.unpack(unpack, settings.cache_dir)
        print(f"{added} kernel build(s) added to {settings.cache_dir}")
        return
    if settings.arch is None:
        raise Cudal2Error("prebuild needs --arch (e.g. sm_90a) or CUDAL2_ARCH")
    measured = with_shipped(Leaderboard(settings.results).read(bench=None))
    entries = prebuilt.kernel_set(render_stage.arch_cc(settings.arch), measured)
    if not entries:
        raise Cudal2Error(f"no measurements of a {settings.arch} GPU to choose a kernel set from")
    if list_only:
        records = prebuilt.describe(entries)
        if json_out:
            print(json.dumps(records, indent=1))
        else:
            show_table(["kernel", "dtype", "layout", "why"], [[r["kernel"], r["dtype"], r["layout"], r["why"]]
                                                              for r in records])
        return
    find_nvcc()
    compiler = Compiler(settings.arch, settings.cache_dir, settings.jobs, settings.timeout)
    todo = sum(compiler.lookup(e.source) is None for e in entries)
    err_console.print(f"{len(entries)} configurations for {settings.arch}, {todo} to compile "
                      f"with {compiler.jobs} jobs into {settings.cache_dir}")

    def progress(done: int, total: int, entry, build) -> None:
        state = "cached" if build.cached else f"{build.status} in {build.seconds:.0f} s"
        err_console.print(f"[{done}/{total}] {state}: {entry.candidate} {entry.dtype} {entry.layout}")

    start = time.perf_counter()
    builds = prebuilt.build(entries, compiler, progress)
    failed = [b for b in builds if b.status != "ok"]
    size = sum(b.library.stat().st_size for b in builds if b.status == "ok" and b.library)
    summary = {"configurations": len(entries), "compiled": todo, "failed": len(failed), "megabytes": size / 1e6,
               "seconds": time.perf_counter() - start, "jobs": compiler.jobs, "cache": str(settings.cache_dir)}
    if pack is not None:
        summary["packed"] = prebuilt.pack(entries, compiler, pack)
        summary["tarball"] = str(pack)
    if json_out:
        print(json.dumps(summary, indent=1))
    else:
        print(f"{summary['configurations']} configurations ({summary['megabytes']:.1f} MB of libraries), "
              f"{todo} compiled in {summary['seconds']:.0f} s on {compiler.jobs} jobs, {len(failed)} failed"
              + (f"; packed into {pack}" if pack is not None else ""))
    if failed:
        raise typer.Exit(1)


# -------------------------------------------------------------------------- templates

@app.command()
@cli_errors
def templates(json_out: Json = False) -> None:
    """List the kernel templates and their parameter spaces."""
    found = render_stage.load_templates()
    if json_out:
        print(json.dumps({
            name: {"description": t.space.description, "min_cc": t.space.min_cc, "max_cc": t.space.max_cc,
                   "dtypes": t.space.dtypes, "layouts": t.space.layouts, "constraints": t.space.constraints,
                   "params": {p.name: {"values": p.values, "default": p.default, "help": p.help}
                              for p in t.space.params.values()}}
            for name, t in found.items()}, indent=1))
        return
    for name, t in found.items():
        print(f"{name}: {t.space.description}")
        show_table(["parameter", "values", "default", "meaning"],
                   [[p.name, ", ".join(map(str, p.values)), str(p.default), p.help] for p in t.space.params.values()])
        print("constraints: " + "; ".join(t.space.constraints))


def main() -> None:
    app()
