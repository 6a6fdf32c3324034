"""The Python API (`import cudal2`): measure, tune and read results; the CLI parses, calls
these and prints.

    import cudal2
    result = cudal2.bench(cudal2.Problem(4096, 4096, 4096))
    [tuned] = cudal2.optimize([cudal2.Problem(16, 4096, 4096, "bf16", "nt")], iterations=2)
    best = cudal2.leaderboard(shapes=cudal2.preset("llama3-8b", "16"))
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from .config import Settings, load_settings
from .errors import Cudal2Error
from .kernels import render as render_stage
from .kernels.candidate import Candidate
from .kernels.compile import Build, Compiler, find_nvcc, first_error_line, library_symbols
from .measure.environment import default_arch
from .measure.worker import Worker
from .problem import Problem
from .protocol import BASELINES, PROTOCOL, best
from .results.leaderboard import SHIPPED, Leaderboard, select, shipped, shown
from .results.report import write_report
from .runtime import MIN_SPEEDUP, DispatchTable, export_library
from .search.llm import ReplayClient, load_llm_settings
from .tune.optimize import SCREEN, Budget, Event, Outcome
from .tune.pipeline import Built, Context, evaluate, measure, new_run_id
from .tune.tuner import Search, Tuner


@dataclass
class BenchResult:
    """One problem measured: the environment and a leaderboard row per contestant."""

    problem: Problem
    environment: dict[str, Any]
    rows: list[dict[str, Any]]


@dataclass
class TuneResult:
    """One problem tuned: what the optimize loop did (its rows, best kernel, time)."""

    problem: Problem
    environment: dict[str, Any]
    run_id: str
    outcome: Outcome = field(repr=False)
    llm_tokens: int | None = None  # the LLM proposers' tokens over the whole run (None: no LLM)

    @property
    def best(self) -> dict[str, Any] | None:
        return self.outcome.best


def known_candidates(problem: Problem, leaderboard: Leaderboard, rows: pd.DataFrame, cc: int,
                     top: int | None = None) -> list[Candidate]:
    """What `bench` measures when no kernel is named: the leaderboard's verified kernels for
    this problem (of every bench protocol) plus every applicable template's default
    configuration; with `top`, only the `top` fastest of each protocol, and no defaults."""
    known = select(rows, m=problem.m, n=problem.n, k=problem.k, dtype=problem.dtype,
                   layout=problem.layout, status="ok")
    known = known[~known["kernel"].isin(BASELINES)]
    if top is not None:
        known = best(known, top)
    known = known[known["source_hash"].isna() | ~known.duplicated("source_hash")]  # shipped rows: no source
    found = []
    for row in known.to_dict("records"):
        # A template row re-renders with today's template (parameters added since take their
        # defaults); one whose parameters left the space is measured from its stored source
        # (a shipped row has none: it is left out).
        if (params := render_stage.recorded_params(row)) is not None:
            found.append(Candidate.from_template(row["template"], params))
        elif isinstance(row.get("source_hash"), str):
            found.append(Candidate.from_source(leaderboard.source(row["source_hash"]), label=row["kernel"]))
    for name, tmpl in render_stage.load_templates().items() if top is None else ():
        if tmpl.supports(problem, cc):
            found.append(render_stage.template_candidate(name, {}, cc))
    return list(dict.fromkeys(found))


def _worker(settings: Settings, worker) -> contextlib.AbstractContextManager:
    """The GPU worker to use: a given one (left open) or a new one (closed after)."""
    return contextlib.nullcontext(worker) if worker is not None else Worker(settings.device)


def bench(problem: Problem, *, kernels: list[Candidate] | None = None, template: str | None = None,
          grid: dict[str, list[str]] | None = None, mode: str = "offline",
          top: int | None = None, settings: Settings | None = None, worker=None,
          on_start=None) -> BenchResult:
    """Measures the baselines and kernels on one problem: `kernels` (free-form or template
    candidates), a `template`'s `grid`, or else what the leaderboard holds for the problem
    (`top`: its best of each protocol) and each template's default. A named kernel that
    does not compile is an error, raised before any GPU time is spent. `on_start(env, n)`
    hears of the device and the number of kernels before measuring."""
    settings = settings or load_settings()
    if template:
        render_stage.get_template(template)
    named = list(kernels or [])
    find_nvcc()
    leaderboard = Leaderboard(settings.results)
    recorded = leaderboard.read(protocol=None)  # an unreadable leaderboard fails before any measurement
    with _worker(settings, worker) as gpu:
        cc = render_stage.arch_cc(settings.arch) if settings.arch else gpu.start()["cc"]
        compiler = Compiler(settings.arch or default_arch(cc), settings.cache_dir, settings.jobs, settings.timeout)
        if template:
            named += render_stage.template_grid(template, grid or {}, cc)
        for candidate, build in zip(named, compiler.compile_all([render_stage.render(c, problem) for c in named])):
            if build.status != "ok":
                raise Cudal2Error(f"{candidate} does not compile ({build.status}): {first_error_line(build.log)}")
        env = gpu.start()
        # the results directory's rows, and the shipped measurements of this GPU (a machine
        # with no results yet re-measures what was measured on its kind of GPU before)
        here = shipped(protocol=None)
        known = pd.concat([df for df in (recorded, here[here["gpu"] == env["gpu"]]) if len(df)] or [recorded])
        candidates = named or known_candidates(problem, leaderboard, known, env["cc"], top)
        ctx = Context(problem, settings, gpu, compiler, leaderboard, new_run_id(), mode=mode)
        if on_start:
            on_start(env, len(candidates))
        rows = list(evaluate(ctx, candidates, baselines=True))
    return BenchResult(problem, env, rows)


def optimize(problems: list[Problem] | Problem, *, proposer: str = "search", iterations: int | None = None,
             batch: int = 8, time_budget: float | None = None, patience: int | None = 3, seed: int = 0,
             llm_settings=None, replay: Path | None = None, template: str | None = None,
             grid: dict[str, list[str]] | None = None, mode: str = "offline", remeasure: bool = False,
             settings: Settings | None = None, gpus: list[int] | None = None, workers: list | None = None,
             on_event: Event | None = None, screen: int | None = None) -> list[TuneResult]:
    """Tunes every problem, each warm-started from the leaderboard (the shapes tuned before
    it included): `proposer` search | llm | hybrid (`llm_settings`, or `replay`: a directory
    of saved replies standing in for the endpoint). One GPU worker per device of `gpus`
    (default: settings.device), each taking the next untuned shape; all share the compile
    cache and the cores nvcc runs on. `workers` stands in for the GPU workers (tests).
    `screen`: successive halving's eta (Budget.screen); by default SCREEN under a time budget
    with the search proposer, else 1 (every candidate through the full protocol).
    `iterations`: batches per shape; by default 10, or as many as `time_budget` allows."""
    problems = [problems] if isinstance(problems, Problem) else list(problems)
    settings = settings or load_settings()
    _check_search(proposer, template, grid, replay)
    if proposer != "search":
        llm_settings = llm_settings or load_llm_settings()
    search = Search(proposer, seed, template, grid, llm_settings if proposer != "search" else None,
                    ReplayClient(replay) if replay is not None else None)
    find_nvcc()
    board = Leaderboard(settings.results)
    board.read()  # an unreadable leaderboard fails before any measurement
    with contextlib.ExitStack() as stack:
        gpu_workers = workers or [stack.enter_context(Worker(d)) for d in (gpus or [settings.device])]
        tuner = Tuner(settings, gpu_workers, search,
                      Budget(batches(iterations, time_budget), batch, time_budget, patience,
                             screen_eta(screen, time_budget, proposer)),
                      mode=mode, remeasure=remeasure, leaderboard=board)
        outcomes = tuner.run(problems, on_event)
    return [TuneResult(p, tuner.environment, tuner.run_id, o, tuner.llm_tokens) for p, o in zip(problems, outcomes)]


# Batches a time-budgeted run may propose when --iterations is not given: the budget bounds it.
UNBOUNDED_BATCHES = 1_000_000


def batches(iterations: int | None, time_budget: float | None) -> int:
    """Batches per shape: `iterations` where given; else as many as a time budget allows (a
    user who gives 60 s expects them used, not 10 batches' worth), or 10 without one."""
    if iterations is not None:
        return iterations
    return UNBOUNDED_BATCHES if time_budget is not None else 10


def screen_eta(screen: int | None, time_budget: float | None, proposer: str) -> int:
    """Successive halving's eta for a run (Budget.screen): `screen` where given; else, under a
    time budget, the search screens batch x SCREEN candidates a batch and confirms the best
    `batch` (cudal2/tune/optimize.py, docs/method.md); else (and for an LLM, whose proposals cost
    tokens) every candidate goes through the full protocol."""
    if screen is not None:
        return screen
    return SCREEN if time_budget is not None and proposer == "search" else 1


def _check_search(proposer: str, template: str | None, grid: dict | None, replay: Path | None) -> None:
    """The proposer's options agree, and a named template exists (before any GPU work)."""
    if grid and not template:
        raise Cudal2Error("--param needs --template")
    if template and proposer == "llm":
        raise Cudal2Error("--template/--param restrict the search proposer; use --proposer search or hybrid")
    if template:
        render_stage.get_template(template)
    if replay is not None and proposer == "search":
        raise Cudal2Error("--replay stands in for the llm endpoint; use --proposer llm or hybrid")


@dataclass
class CheckResult:
    """Each shape's best kernel measured again: `rows` (shape, kernel, recorded and measured
    speedup, status, passed) and whether all passed `fail_under`."""

    fail_under: float
    rows: list[dict[str, Any]]

    @property
    def passed(self) -> bool:
        return all(row["passed"] for row in self.rows)


def check(shapes: list[Problem] | None = None, *, fail_under: float = 1.0, settings: Settings | None = None,
          worker=None, library: Path | None = None) -> CheckResult:
    """Measures the leaderboard's best kernel of each shape (every problem it has, if no
    shapes are given) again on this GPU, from its stored source, against the baselines: after
    a driver or CUDA upgrade, or in CI. A shape passes when its kernel verifies and its
    speedup is at least `fail_under`; a shape with no kernel fails. With `library` (an
    exported dispatch library), the kernels it serves are measured instead, as built."""
    settings = settings or load_settings()
    if library is not None:
        return _check_library(Path(library), shapes, fail_under, settings, worker)
    board = Leaderboard(settings.results)
    if not board.parts.exists():
        raise Cudal2Error(f"no leaderboard in {settings.results} (nothing measured there yet, or another --results)")
    winners = best(board.read(), 1)
    if shapes is None:
        shapes = [Problem(int(r.m), int(r.n), int(r.k), r.dtype, r.layout) for r in winners.itertuples()]
    rows = []
    with _worker(settings, worker) as gpu:
        for problem in shapes:
            found = select(winners, m=problem.m, n=problem.n, k=problem.k, dtype=problem.dtype, layout=problem.layout)
            if found.empty:
                rows.append(_check_record(problem, fail_under))
                continue
            claim = found.iloc[0]
            kernel = Candidate.from_source(board.source(claim["source_hash"]), label=claim["kernel"])
            measured = next(r for r in bench(problem, kernels=[kernel], settings=settings, worker=gpu).rows
                            if r["kernel"] == claim["kernel"])
            rows.append(_check_record(problem, fail_under, claim["kernel"], float(claim["speedup_offline"]), measured))
    return CheckResult(fail_under, rows)


def _check_record(problem: Problem, fail_under: float, kernel: str | None = None, recorded: float | None = None,
                  measured: dict[str, Any] | None = None) -> dict[str, Any]:
    """One shape's line of a check: its kernel's recorded and measured speedup (no kernel,
    no measurement: it fails)."""
    speedup = measured.get("speedup_offline") if measured else None
    status = measured["status"] if measured else "no kernel"
    return {"problem": str(problem), "kernel": kernel, "recorded": recorded, "measured": speedup, "status": status,
            "passed": status == "ok" and speedup is not None and speedup >= fail_under}


def _check_library(root: Path, shapes: list[Problem] | None, fail_under: float, settings: Settings,
                   worker) -> CheckResult:
    """check() of an exported library: each entry's kernel library (the binary a model's op
    loads, not a new build of its source) verified and timed against the baselines here; the
    measurements go to the results directory as a bench's do. A library built for another
    GPU model is refused; one built with another driver or toolkit is what a check is for."""
    table = DispatchTable.load(root)
    wanted = None if shapes is None else {(p.m, p.n, p.k, p.dtype, p.layout) for p in shapes}
    entries = [e for e in table.entries if wanted is None or (e.m, e.n, e.k, e.dtype, e.layout) in wanted]
    find_nvcc()  # the baselines' shims
    leaderboard = Leaderboard(settings.results)
    rows = []
    with _worker(settings, worker) as gpu:
        env = gpu.start()
        if table.versions.get("gpu") != env["gpu"]:
            raise Cudal2Error(f"{root} was built for {table.versions.get('gpu')}, this machine has {env['gpu']}")
        compiler = Compiler(settings.arch or default_arch(env["cc"]), settings.cache_dir, settings.jobs, settings.timeout)
        run_id = new_run_id()
        for entry in entries:
            problem = Problem(entry.m, entry.n, entry.k, entry.dtype, entry.layout)
            path = table.root / entry.library
            source_file = path.with_suffix(".cu")
            source = source_file.read_text() if source_file.is_file() else f"// {entry.kernel}: {path.name}, no source\n"
            exports, imports = library_symbols(path)
            build = Build(key=path.stem, status="ok", library=path, log="", seconds=0.0, cached=True,
                          exports=exports, imports=imports)
            ctx = Context(problem, settings, gpu, compiler, leaderboard, run_id)
            *_, row = measure(ctx, [Built(Candidate.from_source(source, label=entry.kernel), source, build)],
                              baselines=True)
            rows.append(_check_record(problem, fail_under, entry.kernel, entry.speedup, row))
    if wanted is not None:  # a shape the library does not serve has no kernel: it fails
        served = {r["problem"] for r in rows}
        rows += [_check_record(p, fail_under) for p in shapes if str(p) not in served]
    return CheckResult(fail_under, rows)


def report(out: Path, *, shapes: list[Problem] | None = None, results: Path | None = None,
           protocol: str = PROTOCOL, use_shipped: bool = False) -> Path:
    """Writes the HTML report (plots embedded; PNGs and summary.json beside it) of the best
    kernel per shape of one bench protocol to `out`; returns the page's path. The shipped
    measurements are reported (and labelled so) with `use_shipped`, or while the results
    directory has none."""
    rows, from_shipped = shown(results or load_settings().results, protocol, use_shipped)
    label = str(SHIPPED.relative_to(SHIPPED.parents[2])) if from_shipped else None
    return write_report(rows, Path(out), shapes, source=label)


def export(library: Path, *, gpu: str | None = None, shapes: list[Problem] | None = None,
           settings: Settings | None = None, min_speedup: float = MIN_SPEEDUP):
    """Builds the dispatch library (cudal2/runtime.py) of the best kernel per problem of
    this protocol (of `shapes` if given) on one GPU (`gpu`: part of its name) into
    `library`; a problem whose best claim is below `min_speedup` (default: runtime's
    MIN_SPEEDUP, 1.03: a claim within the runs' spread of 1.0 is a tie) is left to the
    library call. Returns its DispatchTable."""
    settings = settings or load_settings()
    board = Leaderboard(settings.results)
    if not board.parts.exists():
        raise Cudal2Error(f"no leaderboard in {settings.results} (nothing measured there yet, or another --results)")
    rows = board.read()
    if gpu is not None:
        rows = rows[rows["gpu"].fillna("").str.contains(gpu, case=False, regex=False)]
    if shapes is not None:
        keys = ["m", "n", "k", "dtype", "layout"]
        wanted = pd.DataFrame([p.__dict__ for p in shapes], columns=keys)
        rows = rows.merge(wanted, on=keys, how="inner")
    arches = sorted(set(rows.loc[rows["status"] == "ok", "arch"].dropna()))
    if not arches:
        raise Cudal2Error("no verified kernel to export" + (f" for GPU {gpu!r}" if gpu else ""))
    compiler = Compiler(settings.arch or arches[0], settings.cache_dir, settings.jobs, settings.timeout)
    table = export_library(board, rows, compiler, Path(library), min_speedup)
    if importlib.util.find_spec("torch") is not None:
        importlib.import_module("cudal2.torch")  # builds the op that serves it now, not at a model's first call
    return table


def leaderboard(*, results: Path | None = None, protocol: str = PROTOCOL, shapes: list[Problem] | None = None,
                top: int = 1, use_shipped: bool = False, **filters: Any) -> pd.DataFrame:
    """The best verified kernels per problem (the `top` of each), of one bench protocol:
    of the shapes given, else of every problem matching `filters` (m, n, k, dtype, layout).
    The shipped measurements with `use_shipped`, or while the results directory has none."""
    rows, _ = shown(results or load_settings().results, protocol, use_shipped)
    df = best(select(rows, **filters), top)
    if shapes is None:
        return df
    keys = ["m", "n", "k", "dtype", "layout"]
    wanted = pd.DataFrame([p.__dict__ for p in shapes], columns=keys)
    return wanted.merge(df, on=keys, how="inner")
