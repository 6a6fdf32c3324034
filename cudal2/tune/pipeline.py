"""The pipeline for a batch of candidates: render -> compile -> verify -> bench -> rows.

Expected failures (compile errors, unsupported shapes, wrong or cheating kernels,
crashes, hangs) become leaderboard rows with a status and a reason.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..config import Settings
from ..errors import Cudal2Error
from ..kernels.candidate import Candidate
from ..kernels.compile import Build, Compiler
from ..kernels.render import render
from ..measure.baselines import (PICKS, RETIMED, SESSION_BUDGET_S, SESSION_MIN_ROUNDS, SESSION_SOAK_S, algo_json,
                                 build_baselines, choose_finalist, cublaslt_version, pick_key, read_pick, write_pick)
from ..measure.bench import INPUT_SETS, claimed
from ..measure.environment import toolchain
from ..measure.verify import forbidden_imports
from ..measure.worker import Worker
from ..problem import Problem
from ..protocol import BASELINE_COLUMN as COLUMN, BASELINES, OFFLINE_METHODS, PROTOCOL, SCREEN_PROTOCOL, SCREENED
from ..results.leaderboard import Leaderboard
from ..results.roofline import floor_us, roof

ENV_COLUMNS = ("gpu", "cc", "sm_count", "sm_clock_mhz", "max_sm_clock_mhz", "driver", "cuda", "cupy")
LOG_LIMIT = 4000


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


@dataclass
class Context:
    """What every row of one run shares."""

    problem: Problem
    settings: Settings
    worker: Worker
    compiler: Compiler
    leaderboard: Leaderboard
    run_id: str
    mode: str = "offline"
    proposer: str = "user"
    model: str | None = None
    libraries: dict[str, str] | None = None  # the cuBLAS and cuBLASLt baselines' (built on first use)
    # cuBLASLt's final choice per problem (its record), made in the problem's first session
    cublaslt: dict[Problem, dict[str, Any]] = field(default_factory=dict)

    def base_row(self) -> dict[str, Any]:
        env = self.worker.environment or {}
        p = self.problem
        return {
            "run_id": self.run_id, **{c: env.get(c) for c in ENV_COLUMNS}, **toolchain(),
            "arch": self.compiler.arch, "m": p.m, "n": p.n, "k": p.k, "dtype": p.dtype,
            "layout": p.layout, "proposer": self.proposer, "model": self.model, "protocol": PROTOCOL,
            "device": self.worker.device,
        }

    def floor(self) -> float | None:
        """The problem's hardware floor in us on the worker's GPU (cudal2/results/roofline.py); None
        where the GPU's rates are unknown."""
        at = roof(self.worker.environment or {})
        return None if at is None else floor_us(self.problem, at)

    def job(self, op: str, **extra: Any) -> dict[str, Any]:
        p = self.problem
        if self.libraries is None:
            self.libraries = build_baselines(self.compiler, p)
        return {
            "op": op, "problem": {"m": p.m, "n": p.n, "k": p.k, "dtype": p.dtype, "layout": p.layout},
            "settings": {"mode": self.mode, "budget_s": self.settings.budget, "qps": self.settings.qps,
                         "protocol": PROTOCOL},
            "libraries": self.libraries,
            **({"cublaslt": self.cublaslt[p]} if p in self.cublaslt else {}), **extra,
        }


def _stats(prefix: str, timing: dict) -> dict[str, Any]:
    return {f"{prefix}_us": timing["median_us"], f"{prefix}_p20_us": timing["p20_us"],
            f"{prefix}_p80_us": timing["p80_us"], f"{prefix}_samples": timing["samples"]}


def timing_columns(timings: dict[str, dict[str, dict]], name: str, flops: int,
                   floor: float | None = None) -> dict[str, Any]:
    """Leaderboard columns of contestant `name` from the worker's {method: {contestant: timing}}.

    Per method: its times and each baseline's (`cublas_kernel_us`, ...), and `speedup_<method>`
    against the fastest baseline of that method. The claimed offline speedup,
    `speedup_offline`, is the lower of the kernel and graph ratios; `offline_us`,
    `baseline_offline_us` and `baseline` are the times and the fastest baseline of that
    method. `speedup_vs_<baseline>` is the lower of the two ratios against that one baseline.
    """
    row: dict[str, Any] = {}
    ratios: dict[str, float] = {}
    fastest: dict[str, tuple[float, str]] = {}
    for method, entries in timings.items():
        mine = entries.get(name)
        if mine is None:
            continue
        row.update(_stats(method, mine))
        present = {b: entries[b]["median_us"] for b in BASELINES if b in entries}
        for baseline, us in present.items():
            row[f"{COLUMN[baseline]}_{method}_us"] = us
        if present:
            us, baseline = min((us, b) for b, us in present.items())
            fastest[method] = (us, baseline)
            ratios[method] = us / mine["median_us"]
            row[f"speedup_{method}"] = ratios[method]
    if (claim := claimed(ratios)) is not None:
        method, ratio = claim
        row.update(offline_us=row[f"{method}_us"], offline_p20_us=row[f"{method}_p20_us"],
                   offline_p80_us=row[f"{method}_p80_us"], offline_samples=row[f"{method}_samples"],
                   speedup_offline=ratio, baseline_offline_us=fastest[method][0], baseline=fastest[method][1],
                   cublas_offline_us=row.get(f"cublas_{method}_us"))
        for baseline, column in COLUMN.items():
            against = [row[f"{column}_{m}_us"] / row[f"{m}_us"] for m in OFFLINE_METHODS if f"{column}_{m}_us" in row]
            if against:
                row[f"speedup_vs_{column}"] = min(against)
    if "server" in fastest:
        row["baseline_server_us"] = fastest["server"][0]
    if "offline_us" in row:
        row["tflops"] = flops / row["offline_us"] / 1e6
        if floor is not None:
            row.update(floor_us=floor, floor_fraction=floor / row["offline_us"])
    return row


def measure_baselines(ctx: Context) -> list[dict[str, Any]]:
    """cuBLAS, cuBLASLt autotuned and torch.matmul (when importable), in one worker call of
    about 2 s at most (a short session: baselines.SESSION_BUDGET_S): their rows, not yet
    recorded. cuBLASLt's choice is the one kept on this machine for the problem (baselines.PICKS), else the autotuning's,
    decided between its finalists in this session (baselines.finalists) where memory holds
    them, and then kept; it holds for the context's later jobs."""
    picks = ctx.settings.cache_dir / PICKS
    key = pick_key(ctx.problem, ctx.worker.environment or {}, cublaslt_version())
    if ctx.problem not in ctx.cublaslt and (kept := read_pick(picks, key)):
        ctx.cublaslt[ctx.problem] = kept
    first = ctx.problem not in ctx.cublaslt
    finalists = first and session_size(ctx) >= RETIMED - 1  # up to RETIMED - 1 more contestants
    job = ctx.job("baselines", finalists=finalists)
    job["settings"] = {**job["settings"], "budget_s": min(job["settings"]["budget_s"], SESSION_BUDGET_S),
                       "soak_s": SESSION_SOAK_S, "min_rounds": SESSION_MIN_ROUNDS}
    result = ctx.worker.request(job, ctx.settings.timeout)
    if result.get("status") != "ok":
        raise Cudal2Error(f"the library baselines failed ({result.get('status')}): {result.get('error')}")
    record, timings, errors = result.get("cublaslt"), result["timings"], result.get("errors", {})
    if first and record:
        record, timings, errors = choose_finalist(record, timings, errors)
    if record and record != ctx.cublaslt.get(ctx.problem):  # new, or the kept one was stale
        if key["gpu"] and key["cublaslt"]:
            write_pick(picks, key, record)
        ctx.cublaslt[ctx.problem] = record
    rows = []
    for name, (err, tol) in errors.items():
        row = {**ctx.base_row(), "kernel": name, "status": "ok", "max_error": err, "tolerance": tol,
               "cublaslt_algo": algo_json(record), "temperature_c": result.get("temperature_c"),
               **timing_columns(timings, name, ctx.problem.flops, ctx.floor())}
        if err > tol:
            row.update(status="wrong", error=f"max error {err:.3g} exceeds tolerance {tol:.3g}")
        rows.append(row)
    return rows


def _candidate_row(ctx: Context, candidate: Candidate, source: str, build: Build | None) -> dict[str, Any]:
    row = {
        **ctx.base_row(), "proposer": candidate.origin or ctx.proposer, "kernel": str(candidate),
        "candidate_id": candidate.id,
        "template": candidate.template, "params": candidate.params_json if candidate.template else None,
        "source_hash": ctx.leaderboard.store_source(source),
    }
    if build is not None:
        row.update(build.stats, compile_s=build.seconds)
        if candidate.template is not None:  # a free-form source's record is its author's word, not a fact
            row.update(build.declared)
    return row


@dataclass
class Built:
    """A candidate rendered and compiled, ready for the GPU."""

    candidate: Candidate
    source: str
    build: Build


def build_all(ctx: Context, candidates: list[Candidate], generation: int | None = None,
              on_built: Callable[[Built], None] | None = None, sources: list[str] | None = None) -> list[Built]:
    """Renders (unless their `sources` are given) and compiles every candidate, in parallel
    (no GPU needed); `generation`: see Compiler.generation; `on_built` hears of each
    candidate as its build finishes."""
    sources = sources if sources is not None else [render(c, ctx.problem) for c in candidates]

    def finished(source: str, build: Build) -> None:
        for candidate in (c for c, s in zip(candidates, sources) if s == source):
            on_built(Built(candidate, source, build))

    builds = ctx.compiler.compile_all(sources, generation, finished if on_built else None)
    return [Built(c, s, b) for c, s, b in zip(candidates, sources, builds)]


# The most of the GPU's memory one session's input sets and outputs take in each of the two
# worker processes (every contestant has an output per input set).
SESSION_MEMORY = 0.2


def session_size(ctx: Context) -> int:
    """The most kernels one session of this problem times together, by memory."""
    memory = (ctx.worker.environment or {}).get("memory_bytes")
    if not memory:
        return 1 << 20
    p, element = ctx.problem, 2  # fp16 and bf16
    per_contestant = INPUT_SETS * p.m * p.n * element
    inputs = INPUT_SETS * (p.m * p.k + p.k * p.n) * element
    return max(1, int((SESSION_MEMORY * memory - inputs) // per_contestant) - len(BASELINES))


def measure_rows(ctx: Context, items: list[Built], screen: bool = False) -> list[dict[str, Any]]:
    """Verifies and benches compiled candidates on the GPU, each verified alone and those
    that pass timed together in one session beside the baselines (Worker.measure): their
    leaderboard rows, in order (not yet appended). With `screen`, the session is a screening
    one (Worker._screen) and the rows are screen_row's."""
    rows = [_candidate_row(ctx, item.candidate, item.source, item.build) for item in items]
    on_gpu = []
    for row, item in zip(rows, items):
        if item.build.status != "ok":
            row.update(status=item.build.status, error=item.build.log[-LOG_LIMIT:])
        elif bad := forbidden_imports(item.build.imports):
            row.update(status="cheat", error=f"imports forbidden symbols: {', '.join(bad)}")
        else:
            on_gpu.append((row, item))
    if on_gpu:
        results = ctx.worker.measure(ctx.job("kernels"), [str(item.build.library) for _, item in on_gpu],
                                     ctx.settings.timeout, screen=screen)
        for (row, _), result in zip(on_gpu, results, strict=True):
            row.update(status=result["status"], error=result.get("error") or None,
                       max_error=result.get("max_error"), tolerance=result.get("tolerance"),
                       cublaslt_algo=algo_json(result.get("cublaslt")), temperature_c=result.get("temperature_c"),
                       **timing_columns(result.get("timings", {}), "kernel", ctx.problem.flops, ctx.floor()))
    return [screen_row(row) for row in rows] if screen else rows


# What a screening pass leaves out of its rows: the claim (the lower of the two methods'
# ratios) and what derives from it; the graph method's columns stay.
CLAIM_COLUMNS = ("offline_us", "offline_p20_us", "offline_p80_us", "offline_samples", "speedup_offline",
                 "baseline_offline_us", "baseline", "cublas_offline_us", "speedup_vs_cublas", "speedup_vs_cublaslt",
                 "speedup_vs_torch", "tflops", "floor_us", "floor_fraction")


def screen_row(row: dict[str, Any]) -> dict[str, Any]:
    """A row of the screening pass: its protocol SCREEN_PROTOCOL, its status SCREENED where
    the kernel passed (verified, and its screening session's checks), never "ok"; it claims
    no speedup (CLAIM_COLUMNS dropped), so no reader can rank it. Its graph method's ratio
    (`speedup_graph`) ranks it among the batch's screened kernels only."""
    screened = {key: value for key, value in row.items() if key not in CLAIM_COLUMNS}
    screened["protocol"] = SCREEN_PROTOCOL
    if screened.get("status") == "ok":
        screened["status"] = SCREENED
    return screened


def measure(ctx: Context, built: list[Built], *, baselines: bool = False) -> Iterator[dict[str, Any]]:
    """measure_rows for the candidates (after the baselines, with `baselines`), as many to a
    session as memory allows, yielding each session's rows as soon as they exist. The rows
    go to the leaderboard as one part when the batch ends, or when it is interrupted
    (Ctrl-C, an error): what was measured is kept either way."""
    rows = []
    size = session_size(ctx)
    try:
        if baselines:
            for row in measure_baselines(ctx):
                rows.append(row)
                yield row
        for first in range(0, len(built), size):
            for row in measure_rows(ctx, built[first:first + size]):
                rows.append(row)
                yield row
    finally:
        ctx.leaderboard.append(rows)


def evaluate(ctx: Context, candidates: list[Candidate], *, baselines: bool = False) -> Iterator[dict[str, Any]]:
    """build_all, then measure: one row per candidate (after the baselines', with `baselines`)."""
    yield from measure(ctx, build_all(ctx, candidates), baselines=baselines)


def invalid_row(ctx: Context, reason: str, text: str, label: str) -> dict[str, Any]:
    """A proposal that never became a kernel (bad parameters, unparsable reply): its row."""
    return {**ctx.base_row(), "kernel": label, "status": "invalid", "error": f"{reason}\n{text}"[:LOG_LIMIT]}
