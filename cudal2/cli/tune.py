"""cudal2 bench and cudal2 optimize: measure one problem, search for a shape or a shape set."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from .. import api
from ..config import load_settings
from ..errors import Cudal2Error
from ..measure.environment import device_error
from ..problem import DTYPES, Problem
from ..protocol import PROTOCOL, best_row
from ..results.tables import (console, err_console, fmt, jsonable, optimize_summary, print_bench_table, print_optimize_summary,
                              set_summary, verdict_line)
from ..search.llm import load_llm_settings
from ..tune.cluster import optimize_on_cluster
from .options import (Arch, Dtype, Json, K, Kernels, Layout, M, ModelOpt, N, Params, Results, ShapesOpt, TemplateOpt,
                      TokensOpt, app, check_grid, cli_errors, parse_params, problems_of, read_kernel_file)
from .progress import progress_display

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
    if top is not None and top < 1:
        raise Cudal2Error(f"--top must be >= 1, got {top}")
    problem = Problem.parse(m, n, k, dtype, layout)
    settings = load_settings({"budget": budget, "qps": qps, "results": results, "arch": arch})
    grid = parse_params(param)
    check_grid(template, grid, settings.arch, settings.device)
    named = [read_kernel_file(p) for p in kernel or []]

    def started(env: dict[str, Any], count: int) -> None:
        if not json_out:
            console.print(f"{problem} on {env['gpu']} (sm_{env['cc']}), {mode} mode, {PROTOCOL}, {count} kernel(s)")

    result = api.bench(problem, kernels=named, template=template, grid=grid, mode=mode,
                       top=top, settings=settings, on_start=started)
    env, rows = result.environment, result.rows
    if json_out:
        print(json.dumps({"problem": problem.__dict__, "environment": env, "rows": jsonable(rows)}, indent=1))
    else:
        print_bench_table(rows, mode)


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
    iterations: Annotated[Optional[int], typer.Option(
        help="batches to propose per shape (default: 10; under --time-budget, as many as it allows)")] = None,
    batch: Annotated[int, typer.Option(help="candidates per batch")] = 8,
    time_budget: Annotated[Optional[float], typer.Option(help="wall-clock seconds for each shape")] = None,
    patience: Annotated[Optional[int], typer.Option(help="stop after this many batches without a better kernel")] = 3,
    screen: Annotated[Optional[int], typer.Option(
        help="screen N x --batch candidates a batch (the screening checks, timed briefly) and measure the best "
             "--batch of them by the full protocol (default: 8 under --time-budget with the search proposer, else 1: "
             "every candidate in full)")] = None,
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
    for name, value in (("iterations", iterations), ("batch", batch), ("patience", patience), ("screen", screen)):
        if value is not None and value < 1:
            raise Cudal2Error(f"--{name} must be >= 1, got {value}")
    if time_budget is not None and time_budget <= 0:
        raise Cudal2Error(f"--time-budget must be > 0 seconds, got {time_budget:g}")
    problems = problems_of(m, n, k, dtype or "fp16", layout, shapes, model, tokens, dtype is not None)
    settings = load_settings({"budget": budget, "results": results, "arch": arch})
    grid = parse_params(param)
    check_grid(template, grid, settings.arch, settings.device)
    if cluster is not None:
        if proposer != "search" or gpus or template or param:
            raise Cudal2Error("--cluster runs the search proposer on every worker's GPU: drop --proposer, --gpus, "
                              "--template and --param")
        _tune_on_cluster(problems, cluster, settings, {
            "iterations": iterations, "batch": batch, "time_budget": time_budget, "patience": patience,
            "seed": seed, "mode": mode, "remeasure": remeasure, "screen": screen})
        return
    devices = gpu_indices(gpus)
    llm_settings = None
    if proposer != "search":
        llm_settings = load_llm_settings({"model": llm_model, "base_url": base_url})
    with progress_display(json_out, len(problems), api.batches(iterations, time_budget)) as on_event:
        tuned = api.optimize(problems, proposer=proposer, iterations=iterations, batch=batch, time_budget=time_budget,
                             patience=patience, seed=seed, llm_settings=llm_settings, replay=replay,
                             template=template, grid=grid, mode=mode, remeasure=remeasure,
                             settings=settings, gpus=devices, on_event=on_event, screen=screen)
    _print_tuned(tuned, mode, json_out, one_shape=shapes is None and model is None)


def _tune_on_cluster(problems: list[Problem], cluster: str, settings, options: dict[str, Any]) -> None:
    """optimize --cluster: each shape's line as its task ends, then the count tuned."""
    def done(problem, result) -> None:
        best = (best_row(result["rows"]) or {}).get("speedup_offline")
        err_console.print(f"{problem} on {result.get('host', '?')}: " + (
            result["error"] if result.get("error") else f"{len(result['rows'])} rows, best {fmt(best, 3)}"))

    finished = optimize_on_cluster(problems, cluster, settings=settings, on_done=done, options=options)
    failed = [f for f in finished if f.get("error")]
    print(f"{len(finished) - len(failed)} of {len(problems)} shapes tuned on the cluster; rows in {settings.results}"
          f"; `cudal2 leaderboard --shapes` reports them")
    if failed:
        raise typer.Exit(1)


def _print_tuned(tuned: list[api.TuneResult], mode: str, json_out: bool, one_shape: bool) -> None:
    """Each shape's summary (and a shape set's), as text or JSON; exit 1 if a shape failed."""
    problems, outcomes = [t.problem for t in tuned], [t.outcome for t in tuned]
    env, run_id, tokens = tuned[0].environment, tuned[0].run_id, tuned[0].llm_tokens
    summaries = [{**optimize_summary(p, env, o, run_id), "llm_tokens_run": tokens} for p, o in zip(problems, outcomes)]
    if json_out:
        print(json.dumps(summaries[0] if one_shape else
                         {"shapes": summaries, "summary": set_summary(summaries, mode)}, indent=1, default=str))
    else:
        for problem, outcome in zip(problems, outcomes):
            if len(problems) > 1:
                print(f"{problem}:")
            print_optimize_summary(outcome, mode)
        if tokens is not None:
            print(f"LLM tokens this run: {tokens}")
    if not json_out and len(summaries) > 1:
        total = set_summary(summaries, mode)
        print(f"{total['tuned']} of {total['shapes']} shapes with a verified kernel; speedup over the fastest library "
              f"call: geometric mean {fmt(total['geomean_speedup'], 3)}, minimum {fmt(total['min_speedup'], 3)}; "
              f"{verdict_line(total)}; wall {total['wall_s']:.1f} s")
    if failed := [(p, o.error) for p, o in zip(problems, outcomes) if o.error]:
        for problem, error in failed:
            err_console.print(f"error: {problem}: {error}")
        raise typer.Exit(1)


def gpu_indices(spec: str | None) -> list[int] | None:
    """--gpus: "all" or "0,1,..." as device indices, each checked to exist; None for None."""
    if spec is None:
        return None
    try:
        wanted = None if spec.strip() == "all" else [int(part) for part in spec.split(",")]
    except ValueError:
        raise Cudal2Error(f"--gpus takes 'all' or comma-separated indices, got {spec!r}") from None
    if wanted is not None and min(wanted) < 0:
        raise Cudal2Error(f"--gpus takes device indices >= 0, got {spec!r}")
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, no device, no CuPy
        raise Cudal2Error(device_error(exc)) from None
    if wanted is None:
        return list(range(count))
    for index in wanted:
        if not 0 <= index < count:
            raise Cudal2Error(f"GPU {index} is not there ({count} GPU{'s' if count != 1 else ''}: 0-{count - 1})")
    return list(dict.fromkeys(wanted))
