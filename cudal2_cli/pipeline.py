"""The pipeline for a batch of candidates: render -> compile -> verify -> bench -> rows.

Expected failures (compile errors, unsupported shapes, wrong or cheating kernels,
crashes, hangs) become leaderboard rows with a status and a reason.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .bench import PROTOCOL
from .candidate import Candidate
from .compile import Build, Compiler
from .config import Settings
from .environment import toolchain
from .leaderboard import Leaderboard
from .problem import Problem
from .render import render
from .verify import forbidden_imports
from .worker import Worker

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

    def base_row(self) -> dict[str, Any]:
        env = self.worker.environment or {}
        p = self.problem
        return {
            "run_id": self.run_id, **{c: env.get(c) for c in ENV_COLUMNS}, **toolchain(),
            "arch": self.compiler.arch, "m": p.m, "n": p.n, "k": p.k, "dtype": p.dtype,
            "layout": p.layout, "proposer": self.proposer, "model": self.model, "bench": PROTOCOL,
        }

    def job(self, op: str, **extra: Any) -> dict[str, Any]:
        p = self.problem
        return {
            "op": op, "problem": {"m": p.m, "n": p.n, "k": p.k, "dtype": p.dtype, "layout": p.layout},
            "settings": {"mode": self.mode, "budget_s": self.settings.budget, "qps": self.settings.qps},
            **extra,
        }


def _timing_columns(timings: dict[str, dict[str, dict]], name: str, flops: int) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for mode, entries in timings.items():
        mine, cublas = entries.get(name), entries.get("cuBLAS")
        if mine is None:
            continue
        row.update({
            f"{mode}_us": mine["median_us"], f"{mode}_p20_us": mine["p20_us"],
            f"{mode}_p80_us": mine["p80_us"], f"{mode}_samples": mine["samples"],
        })
        if cublas is not None:
            row[f"cublas_{mode}_us"] = cublas["median_us"]
            row[f"speedup_{mode}"] = cublas["median_us"] / mine["median_us"]
    if "offline_us" in row:
        row["tflops"] = flops / row["offline_us"] / 1e6
    return row


def measure_baselines(ctx: Context) -> list[dict[str, Any]]:
    """cuBLAS and torch.matmul (when importable), interleaved in one worker call."""
    result = ctx.worker.request(ctx.job("baselines"), ctx.settings.timeout)
    rows = []
    for name, (err, tol) in result.get("errors", {}).items():
        row = {**ctx.base_row(), "kernel": name, "status": "ok", "max_error": err, "tolerance": tol,
               **_timing_columns(result["timings"], name, ctx.problem.flops)}
        if err > tol:
            row.update(status="wrong", error=f"max error {err:.3g} exceeds tolerance {tol:.3g}")
        rows.append(row)
    ctx.leaderboard.append(rows)
    return rows


def _candidate_row(ctx: Context, candidate: Candidate, source: str, build: Build | None) -> dict[str, Any]:
    row = {
        **ctx.base_row(), "kernel": str(candidate), "candidate_id": candidate.id,
        "template": candidate.template, "params": candidate.params_json if candidate.template else None,
        "source_hash": ctx.leaderboard.store_source(source),
    }
    if build is not None:
        row.update(build.stats, compile_s=build.seconds)
    return row


@dataclass
class Built:
    """A candidate rendered and compiled, ready for the GPU."""

    candidate: Candidate
    source: str
    build: Build


def build_all(ctx: Context, candidates: list[Candidate], generation: int | None = None) -> list[Built]:
    """Renders and compiles every candidate, in parallel (no GPU needed); `generation`:
    see Compiler.generation."""
    sources = [render(c, ctx.problem) for c in candidates]
    return [Built(c, s, b) for c, s, b in zip(candidates, sources, ctx.compiler.compile_all(sources, generation))]


def measure(ctx: Context, built: list[Built]) -> Iterator[dict[str, Any]]:
    """Verifies and benches each compiled candidate on the GPU.

    Yields one row per candidate as soon as it exists; each row is already appended to the
    leaderboard, so an interrupted run keeps everything measured so far.
    """
    for item in built:
        row = _candidate_row(ctx, item.candidate, item.source, item.build)
        if item.build.status != "ok":
            row.update(status=item.build.status, error=item.build.log[-LOG_LIMIT:])
        elif bad := forbidden_imports(item.build.imports):
            row.update(status="cheat", error=f"imports forbidden symbols: {', '.join(bad)}")
        else:
            job = ctx.job("kernel", library=str(item.build.library))
            result = ctx.worker.request(job, ctx.settings.timeout)
            row.update(status=result["status"], error=result.get("error") or None,
                       max_error=result.get("max_error"), tolerance=result.get("tolerance"),
                       **_timing_columns(result.get("timings", {}), "kernel", ctx.problem.flops))
        ctx.leaderboard.append([row])
        yield row


def evaluate(ctx: Context, candidates: list[Candidate]) -> Iterator[dict[str, Any]]:
    """build_all, then measure: one row per candidate."""
    yield from measure(ctx, build_all(ctx, candidates))


def invalid_row(ctx: Context, reason: str, text: str, label: str) -> dict[str, Any]:
    """A proposal that never became a kernel (bad parameters, unparsable reply), recorded."""
    row = {**ctx.base_row(), "kernel": label, "status": "invalid", "error": f"{reason}\n{text}"[:LOG_LIMIT]}
    ctx.leaderboard.append([row])
    return row
