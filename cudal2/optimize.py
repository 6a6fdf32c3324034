"""The optimize loop: propose -> render -> compile -> verify -> bench -> record, until a
budget runs out, with the next batch compiling while this one is on the GPU."""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .candidate import Candidate
from .errors import Cudal2Error
from .leaderboard import BASELINES, select, source_hash
from .pipeline import Built, Context, build_all, invalid_row, measure_baselines, measure_rows, session_size
from .problem import Problem
from .propose import Proposer, from_proposer
from .render import render
from .runtime import export_best


# When the time budget ends before any kernel is verified (the baselines' session alone can
# spend it: on a fresh machine it compiles the library shims, 19 s on an H200 host), the run
# still waits this long for its batch's proposal, so that the batch's built kernels are
# measured and the run does not end empty; the batch's compiles are stopped.
PROPOSAL_WAIT_S = 60.0


@dataclass(frozen=True)
class Budget:
    iterations: int = 10  # batches proposed
    batch: int = 8  # candidates per batch
    time_s: float | None = None  # wall-clock seconds for the whole run
    patience: int | None = 3  # batches without a better kernel before stopping


@dataclass
class Outcome:
    """What a run did: its rows, the best kernel for the problem, and where time went."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    baseline: str | None = None  # the fastest library call
    baseline_us: float | None = None
    best: dict[str, Any] | None = None
    exported: Path | None = None
    stopped: str = ""
    wall_s: float = 0.0
    gpu_s: float = 0.0  # time the GPU worker was busy (verify + bench)
    compile_s: float = 0.0  # nvcc seconds of the compiles this run ran (not cached)
    duplicates: int = 0  # candidates skipped as already measured or identical binaries
    error: str | None = None  # a shape of a set whose run failed (the set went on without it)
    first_verified_s: float | None = None  # from the run's start to its first verified kernel
    baselines_s: float = 0.0  # the baselines' session (cuBLASLt's autotuning included)
    sessions: list[tuple[int, float]] = field(default_factory=list)  # (kernels on the GPU, seconds) each

    @property
    def statuses(self) -> dict[str, int]:
        return dict(Counter(row["status"] for row in self.rows if row["kernel"] not in BASELINES))

    @property
    def contributions(self) -> dict[str, dict[str, Any]]:
        """Per proposer: candidates measured (or rejected), how many verified, its best speedup."""
        found: dict[str, dict[str, Any]] = {}
        for row in self.rows:
            if row["kernel"] in BASELINES:
                continue
            mine = found.setdefault(row.get("proposer") or "?", {"candidates": 0, "ok": 0, "best_speedup": None})
            mine["candidates"] += 1
            if row["status"] == "ok":
                mine["ok"] += 1
                speedup = row.get("speedup_offline")
                if speedup is not None and speedup == speedup and (mine["best_speedup"] or 0) < speedup:
                    mine["best_speedup"] = speedup
        return found


Event = Callable[[str, dict[str, Any]], None]


def problem_history(ctx: Context) -> list[dict[str, Any]]:
    """Every recorded row of this problem on this GPU, oldest first."""
    p, gpu = ctx.problem, (ctx.worker.environment or {}).get("gpu")
    df = select(ctx.leaderboard.read(), m=p.m, n=p.n, k=p.k, dtype=p.dtype, layout=p.layout, gpu=gpu)
    return df.sort_values("time").to_dict("records") if len(df) else []


def optimize(ctx: Context, proposer: Proposer, budget: Budget, *, remeasure: bool = False,
             on_event: Event | None = None) -> Outcome:
    """Runs the loop for ctx.problem. Each batch's rows are appended to the leaderboard as
    it ends (or is interrupted), so an interrupted run keeps what it measured; a re-run
    measures nothing twice (same source, or same binary) unless `remeasure`."""
    emit = on_event or (lambda kind, info: None)
    start = time.monotonic()
    out = Outcome()
    history = problem_history(ctx)  # everything known: warm start, best kernel
    # What the proposer sees: all history, or only this run's rows when re-measuring.
    visible = [] if remeasure else history
    seen_sources = set() if remeasure else {r["source_hash"] for r in history if r.get("source_hash")}
    seen_binaries: set[str] = set()
    # Candidates proposed but not yet measured, shown to the proposer as "pending" rows so
    # the batch compiled ahead does not repeat the batch on the GPU.
    in_flight: list[dict[str, Any]] = []

    t0 = time.monotonic()
    baseline_rows = measure_baselines(ctx)
    baseline_s = out.baselines_s = time.monotonic() - t0
    out.gpu_s += baseline_s
    out.rows += baseline_rows
    history += baseline_rows
    if remeasure:
        visible += baseline_rows
    fastest = min((r for r in baseline_rows if r.get(f"{ctx.mode}_us") is not None),
                  key=lambda r: r[f"{ctx.mode}_us"], default=None)
    out.baseline, out.baseline_us = (fastest["kernel"], fastest[f"{ctx.mode}_us"]) if fastest else (None, None)
    emit("baseline", {"us": out.baseline_us, "name": out.baseline})

    def over_time() -> bool:
        return budget.time_s is not None and time.monotonic() - start >= budget.time_s

    def time_left() -> float | None:
        return None if budget.time_s is None else max(0.0, budget.time_s - (time.monotonic() - start))

    def prepare(snapshot: list[dict[str, Any]], generation: int) -> tuple[list[Built], list[dict[str, Any]]]:
        """Propose and compile one batch (runs beside the GPU work of the previous one)."""
        proposals = [from_proposer(p, proposer.name) for p in proposer.propose(ctx.problem, snapshot, budget.batch)]
        fresh, invalid = [], []
        for proposal in proposals:
            if not isinstance(proposal, Candidate):
                invalid.append(invalid_row(ctx, proposal.reason, proposal.text, f"{proposer.name} proposal"))
                continue
            try:
                digest = source_hash(render(proposal, ctx.problem))
            except Cudal2Error as exc:
                invalid.append(invalid_row(ctx, str(exc), str(proposal), f"{proposer.name} proposal"))
                continue
            if digest in seen_sources:  # measured (or being measured) already: the proposer is told
                out.duplicates += 1
                repeats.append((proposal, digest))
                continue
            seen_sources.add(digest)
            fresh.append(proposal)
            in_flight.append({"kernel": str(proposal), "template": proposal.template, "status": "pending",
                              "params": proposal.params_json if proposal.template else None})
        compiled.clear()
        built = build_all(ctx, fresh, generation, on_built=compiled.append)
        out.compile_s += sum(b.build.seconds for b in built if not b.build.cached)
        return built, invalid

    compiled: list[Built] = []  # the batch compiling now: its builds as they finish
    repeats: list[tuple[Candidate, str]] = []  # proposals already measured (and their source hash)

    def repeat_notes() -> list[dict[str, Any]]:
        """The latest repeated proposals as rows for the proposer (never recorded), each with
        the earlier measurement's result."""
        notes = []
        for proposal, digest in repeats[-6:]:
            earlier = next((r for r in reversed(history) if r.get("source_hash") == digest), None)
            speedup = earlier.get("speedup_offline") if earlier else None
            result = ("is still being measured" if earlier is None else
                      f"was measured as {earlier['kernel']}: {earlier['status']}"
                      + (f", {speedup:.3f}x the fastest library call" if speedup == speedup and speedup else ""))
            notes.append({"kernel": str(proposal), "template": proposal.template, "status": "repeat",
                          "params": proposal.params_json if proposal.template else None,
                          "error": f"proposed again: it {result}"})
        return notes

    def verified() -> bool:
        return best_row(history, ctx.mode) is not None

    held: list[dict[str, Any]] = []  # rows measured ahead of their batch, recorded in its part
    held_improved = False

    # Seconds a kernel takes on the GPU, from this run's latest session (at first, the
    # baselines' session): a time budget is spent in sessions that fit it.
    per_kernel_s = baseline_s

    def sessions(items: list[Built]):
        """The batch's kernels, session by session (next_session)."""
        items = list(items)
        while items:
            size = next_session(len(items), session_size(ctx), time_left(), per_kernel_s)
            yield items[:size]
            del items[:size]

    def measure_batch(built: list[Built], rows: list[dict[str, Any]], ahead: bool = False) -> bool:
        """Measures the batch's kernels, session by session, until the time budget is spent
        once a kernel is verified (a run never ends without one while it has one to measure);
        records the rows as one part, even when interrupted, with any measured `ahead` of
        the batch (those are held for it). True if the best speedup improved."""
        nonlocal best_speedup, held_improved, per_kernel_s
        improved = False
        fresh, binaries = [], {}
        for item in built:
            binary = _binary_hash(item)
            if binary is not None and (binary in seen_binaries or binary in binaries.values()):
                out.duplicates += 1
                continue
            fresh.append(item)
            binaries[item.source] = binary
        try:
            for session in sessions(fresh):
                if over_time() and verified():
                    break
                seen_binaries.update(b for item in session if (b := binaries[item.source]) is not None)
                t0 = time.monotonic()
                measured = measure_rows(ctx, session)
                on_gpu = sum(item.build.status == "ok" for item in session)
                if on_gpu:
                    spent = time.monotonic() - t0
                    out.gpu_s += spent
                    out.sessions.append((on_gpu, round(spent, 3)))
                    per_kernel_s = spent / on_gpu
                for row in measured:
                    rows.append(row)
                    out.rows.append(row)
                    if row["status"] == "ok" and out.first_verified_s is None:
                        out.first_verified_s = time.monotonic() - start
                    _extend(history, visible, [row])
                    speedup = row.get(metric)
                    if row["status"] == "ok" and speedup and speedup > best_speedup:
                        best_speedup, improved = speedup, True
                    emit("measured", {"row": row, "speedup": speedup, "best_speedup": best_speedup})
        finally:
            if ahead:
                held.extend(rows)
            else:
                ctx.leaderboard.append(held + rows)
                held.clear()
        if ahead:
            held_improved |= improved
            return improved
        improved, held_improved = improved or held_improved, False
        return improved

    early: set[str] = set()  # sources measured while their batch was still compiling

    def built_unmeasured() -> list[Built]:
        """The compiling batch's builds that finished and were not measured early."""
        return [item for item in list(compiled) if item.build.status == "ok" and item.source not in early]

    def batch_result(pending) -> tuple[list[Built], list[dict[str, Any]]]:
        """The compiling batch's builds and invalid rows. Until a kernel is verified, each
        build that finishes meanwhile is measured at once: a run from an empty cache has its
        first verified kernel when the quickest compile ends, not the slowest."""
        while not verified():
            ready = built_unmeasured()
            if ready:
                early.add(ready[0].source)
                measure_batch(ready[:1], [], ahead=True)
                continue
            wait = 0.5 if time_left() is None else min(0.5, time_left())
            try:
                return pending.result(timeout=wait)
            except FutureTimeout:
                if over_time():
                    raise
        return pending.result(timeout=time_left())

    metric = f"speedup_{ctx.mode}"  # the mode that decides "best": offline or server
    best = best_row(history, ctx.mode)
    best_speedup = best[metric] if best else 0.0
    stale = 0
    # Not a `with` block: when the time budget ends during a compile the run stops without
    # waiting for it (the compile is cancelled).
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        pending = pool.submit(prepare, list(visible), ctx.compiler.generation)
        for iteration in range(budget.iterations):
            try:
                built, invalid = batch_result(pending)
                built = [item for item in built if item.source not in early]
            except FutureTimeout:
                out.stopped = "time budget spent (while the next batch compiled)"
                ctx.compiler.cancel()  # its nvcc processes stop; nothing half-done is cached
                if not verified():  # never end empty: the batch's proposal, and what of it is built
                    with contextlib.suppress(Exception):  # its compiles stopped: Cancelled
                        pending.result(timeout=PROPOSAL_WAIT_S)
                    ready = built_unmeasured()
                    if ready:
                        out.stopped += f"; the {len(ready)} kernel(s) built by then measured"
                        measure_batch(ready, [])
                break
            except Cudal2Error as exc:  # e.g. the LLM endpoint failed for good: keep what we have
                out.stopped = f"the proposer failed: {exc}"
                break
            out.rows += invalid
            _extend(history, visible, invalid)
            last = iteration + 1 >= budget.iterations or over_time()
            if not last:  # the next batch compiles while this one is on the GPU
                pending = pool.submit(prepare, list(visible) + list(in_flight) + repeat_notes(), ctx.compiler.generation)
            emit("batch", {"iteration": iteration + 1, "candidates": len(built), "invalid": len(invalid)})
            if not built and not invalid:
                out.stopped = "the proposer has nothing new"
                break
            improved = measure_batch(built, list(invalid))
            del in_flight[: len(built)]
            stale = 0 if improved else stale + 1
            if last:
                out.stopped = "time budget spent" if over_time() else "iterations done"
                break
            if budget.patience is not None and stale >= budget.patience:
                out.stopped = f"no better kernel in {stale} batches (patience)"
                pending.cancel()
                break
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        if held:  # measured ahead of a batch that never came (stopped, interrupted)
            ctx.leaderboard.append(held)
    out.wall_s = time.monotonic() - start
    out.best = best_row(history, ctx.mode)
    if out.best is not None:
        out.exported = export_best(ctx.leaderboard, ctx.settings.results, out.best, ctx.mode)
    return out


def optimize_shapes(problems: list[Problem], context: Callable[[Problem, int], Context],
                    proposer: Callable[[Context], Proposer], budget: Budget, *, workers: int = 1,
                    remeasure: bool = False, on_event: Event | None = None) -> list[Outcome]:
    """optimize() for every problem; `context(problem, worker)` makes its context on GPU
    worker number `worker` (0 .. workers - 1), and a proposer is made for each (so each
    warm-starts from the shapes tuned before it). With several workers, one thread drives
    each, taking the next untuned shape as it finishes one. Each batch's rows are in the
    leaderboard as it ends, so a killed run keeps them and a re-run measures nothing twice;
    `on_event` also hears ("shape", {index, of, problem, worker}). Outcomes come in the
    problems' order."""
    emit = on_event or (lambda kind, info: None)
    outcomes: list[Outcome | None] = [None] * len(problems)
    pending = iter(list(enumerate(problems, start=1)))
    lock = threading.Lock()
    failures: list[BaseException] = []

    def drain(worker: int) -> None:
        while not failures:
            with lock:
                item = next(pending, None)
            if item is None:
                return
            index, problem = item
            emit("shape", {"index": index, "of": len(problems), "problem": problem, "worker": worker})
            ctx = context(problem, worker)
            began = time.monotonic()
            try:
                outcomes[index - 1] = optimize(ctx, proposer(ctx), budget, remeasure=remeasure, on_event=on_event)
            except Exception as exc:  # this shape's run failed (its measured rows are kept): the set goes on
                if len(problems) == 1:
                    failures.append(exc)
                    return
                reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
                outcomes[index - 1] = Outcome(stopped=f"failed: {reason}", error=reason,
                                              wall_s=time.monotonic() - began)
                emit("failed", {"index": index, "problem": problem, "error": reason})
            except BaseException as exc:  # Ctrl-C: the others stop after their shape
                failures.append(exc)
                return

    if workers == 1:
        drain(0)
    else:
        threads = [threading.Thread(target=drain, args=(w,), name=f"cudal2-gpu-{w}", daemon=True)
                   for w in range(workers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    if failures:
        raise failures[0]
    return outcomes


def next_session(kernels: int, most: int, time_left: float | None, per_kernel_s: float) -> int:
    """How many of a batch's `kernels` the next session times: all that memory allows
    (`most`), and with a time budget, those the time left is expected to hold at
    `per_kernel_s` each, but at least one."""
    size = min(kernels, most)
    if time_left is not None and per_kernel_s > 0:
        size = max(1, min(size, int(time_left / per_kernel_s)))
    return size


def _extend(history: list, visible: list, rows: list) -> None:
    history.extend(rows)
    if visible is not history:
        visible.extend(rows)


def _binary_hash(item: Built) -> str | None:
    if item.build.library is None:
        return None
    return hashlib.sha256(item.build.library.read_bytes()).hexdigest()


def best_row(history: list[dict[str, Any]], mode: str = "offline") -> dict[str, Any] | None:
    """The verified kernel with the highest speedup in `mode` (NaN and missing excluded)."""
    key = f"speedup_{mode}"
    ok = [r for r in history if r.get("status") == "ok" and r["kernel"] not in BASELINES
          and r.get(key) and r[key] == r[key]]
    return max(ok, key=lambda r: r[key], default=None)
