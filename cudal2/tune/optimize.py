"""The optimize loop: propose -> render -> compile -> verify -> bench -> record, until a
budget runs out, with the next batch compiling while this one is on the GPU."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import Cudal2Error
from ..kernels.candidate import Candidate
from ..kernels.compile import Build, Compiler
from ..kernels.render import get_template, render
from ..measure.measure import calls_per_graph
from ..measure.worker import LONG_SCREEN_US, SCREEN_REST, SCREEN_ROUNDS, SOAK_S, SOAK_US
from ..problem import Problem
from ..protocol import BASELINES, PROTOCOL, SCREEN_PROTOCOL, SCREENED, best_row
from ..results.leaderboard import select, source_hash
from ..runtime import export_best
from ..search.propose import Proposer, from_proposer
from .pipeline import Built, Context, build_all, invalid_row, measure_baselines, measure_rows, session_size


# When the time budget ends before any kernel is verified (the baselines' session alone can
# spend it: on a fresh machine it compiles the library shims, 19 s on an H200 host), the run
# still waits this long for its batch's proposal, so that the batch's built kernels are
# measured and the run does not end empty; the batch's compiles are stopped.
PROPOSAL_WAIT_S = 60.0
# Until a kernel is verified, how long a run waits for its compiling batch whole (its builds
# cached, say) before it measures a build that has finished, alone, ahead of the batch.
EARLY_WAIT_S = 0.5
# The screening pass's halving rate (successive halving's eta) in a default run: a batch
# proposes `batch` x SCREEN candidates, screens them all and confirms the best 1 / SCREEN
# of them by the full protocol.
SCREEN = 8
# What one kernel's full verification (verify.py) costs, before a session of this run has
# measured it: a fixed part, about 80 of the problem's fastest library calls (nine fp32
# reference products, the kernel's own calls, the rounds' replays), and the passes over its
# output (the checks compare every element of each call's C). Fitted to the first sessions of
# 174 grid shapes (H200, --time-budget 5; 0.021-0.038 s a kernel where calls take
# microseconds, 0.07-0.14 s at 0.2-1.1 ms calls or 10^8 outputs): it prices them at 0.97 of
# their time in the median (0.59-1.44).
VERIFY_FIXED_S, VERIFY_CALLS, VERIFY_OUTPUT_S = 0.03, 80, 1.6e-10
# A kernel of a screening session (verify's `screen` checks, then the session's rounds): a fixed
# part, about 31 of the problem's fastest library calls and a few passes over its output.
# Fitted on the H200 to sessions of 64 copies of one kernel (sm90_cutlass's default) at
# 2048^3, 4096^3, 8192x8192x2048 and 8192^3 (library calls of 25, 182, 352 and 1516 us): 17.8,
# 22.2, 28.8 and 64.4 ms a kernel (Worker.measure with `screen`), priced at 17.0, 22.2, 28.8
# and 64.4. Sessions of 16 took 1.5-3.5x as long a kernel: the session's own part, about
# 0.2-0.4 s, shared by fewer. (Priced before as 0.4 of the full verification, it came to
# 1.3-1.7x these.)
SCREEN_FIXED_S, SCREEN_CALLS, SCREEN_OUTPUT_S = 0.016, 31, 2.8e-11
# Since fitted, counted (their sum measured once since: docs/method.md): a session's opening
# times cuBLAS alone for its graphs' length (it timed three calls of every contestant);
# screening sessions of calls of LONG_SCREEN_US or more time each graph (three calls) once, not
# three times, and upload it where they replayed it first (three calls more); and the kernels
# of a screening pass share their checks' inputs (verify.ScreenInputs: three reference
# products and two library calls a kernel, computed once a pass).
OPENING_CALLS, LONG_SCREEN_CALLS, SHARED_CHECK_CALLS = 3, 9, 5


def verification_s(call_us: float | None, outputs: int = 0, screen: bool = False) -> float:
    """Seconds one kernel's verification and screening are expected to take, given the
    problem's fastest library call (us; None: unknown, the fixed part alone) and the
    elements of its output (M x N); `screen`: a kernel of a screening session (its
    screening checks and rounds)."""
    us = call_us or 0.0
    if screen:
        calls = SCREEN_CALLS - OPENING_CALLS - SHARED_CHECK_CALLS - (LONG_SCREEN_CALLS if us >= LONG_SCREEN_US else 0)
        # and the GPU's rest after its rounds' replays (worker.SCREEN_REST), where calls are long
        rounds = 1 if us >= LONG_SCREEN_US else SCREEN_ROUNDS
        rest = SCREEN_REST * rounds * calls_per_graph(us) * us * 1e-6 if us >= SOAK_US else 0.0
        return SCREEN_FIXED_S + us * 1e-6 * calls + outputs * SCREEN_OUTPUT_S + rest
    return VERIFY_FIXED_S + us * 1e-6 * (VERIFY_CALLS - OPENING_CALLS) + outputs * VERIFY_OUTPUT_S


# A shape's first rung (its first screening pass: the first batch, batch x SCREEN candidates)
# takes as many of its candidates as the budget's time left holds, and at least as many as
# this share of the budget holds (from the rung's start), whatever the confirmation reserves
# (which then ends past the budget); later rungs screen what the budget leaves beside the
# confirmation. Measured at --time-budget 5 (H200): where the confirmation's reserve (about 3 s
# for calls of 100 us or more) came first, shapes of 100-1000 us calls screened 9 kernels in the
# median (seed 20261301); reckoned once from the whole budget, shapes whose screening sessions
# memory split ran 7-11 s (seed 20261309); from the time left alone, a run's first shape, whose
# baselines and first proposal took the budget (the library's start), screened 1 of 64 built
# and kept a kernel at 0.296 of the library where 60 s found 1.059 (64x128x12288, seed 20261310).
FIRST_RUNG_LEAST = 0.5


# Seconds of timing per method (Settings.budget) under a time budget: a tenth of the budget,
# never under TIMING_FLOOR_S, never over the setting. Measured on the H200 at --time-budget 5
# (100 fresh grid shapes): a confirmation at the default 1 s a method took 2.3-2.9 s, 3.9-4.4 s
# with the soak of calls of 100 us or more; after the baselines' 0.9-2 s it left the large
# shapes room to screen one kernel, and the shapes ran 6.0 s in the median. Whether a short
# budget's picks hold against a long one's is what `scripts/gpu_session.sh budget-compare` checks.
TIMING_SHARE, TIMING_FLOOR_S = 0.1, 0.25
# A protocol session's part beside its kernels' verification, timing and soak (both processes
# set up the contestants, capture their graphs and run the finish's checks): a confirmation of
# one kernel took 0.28-1.91 s (median 0.41) longer than those on 100 fresh grid shapes (H200,
# --time-budget 5), and each shape's first confirmation is expected to take that too.
CONFIRM_FIXED_S = 0.3


def timing_s(setting: float, time_budget: float | None) -> float:
    """Seconds of timing per method a run uses: the setting, or under a time budget the
    budget's share (TIMING_SHARE, at least TIMING_FLOOR_S) where that is less."""
    if time_budget is None:
        return setting
    return min(setting, max(TIMING_FLOOR_S, time_budget * TIMING_SHARE))


@dataclass(frozen=True)
class Budget:
    iterations: int = 10  # batches proposed
    batch: int = 8  # candidates per batch
    time_s: float | None = None  # wall-clock seconds for the whole run
    patience: int | None = 3  # batches without a better kernel before stopping
    # Successive halving's eta: a batch proposes batch x screen candidates, screens them all
    # (the screening checks, then the graph method for a few rounds) and sends the best
    # 1 / screen of them through the full protocol; 1: every candidate through the protocol.
    screen: int = 1


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
    screened: int = 0  # candidates through the screening pass (its verdicts included)
    screen_s: float = 0.0  # the GPU's seconds in screening sessions (of gpu_s)

    @property
    def statuses(self) -> dict[str, int]:
        return dict(Counter(row["status"] for row in self.rows if row["kernel"] not in BASELINES))


    @property
    def contributions(self) -> dict[str, dict[str, Any]]:
        """Per proposer: candidates measured, screened or rejected (each once), how many
        verified by the full protocol, its best speedup."""
        found: dict[str, dict[str, Any]] = {}
        counted: set[tuple[str, str | None]] = set()
        for row in self.rows:
            if row["kernel"] in BASELINES:
                continue
            mine = found.setdefault(row.get("proposer") or "?", {"candidates": 0, "ok": 0, "best_speedup": None})
            identity = (row["kernel"], row.get("source_hash"))
            mine["candidates"] += identity not in counted or row.get("source_hash") is None
            counted.add(identity)
            if row["status"] == "ok" and row.get("protocol") != SCREEN_PROTOCOL:
                mine["ok"] += 1
                speedup = row.get("speedup_offline")
                if speedup is not None and speedup == speedup and (mine["best_speedup"] or 0) < speedup:
                    mine["best_speedup"] = speedup
        return found


Event = Callable[[str, dict[str, Any]], None]


def problem_history(ctx: Context) -> list[dict[str, Any]]:
    """Every recorded row of this problem on this GPU, oldest first: the protocol's, and the
    screening pass's (so a re-run screens nothing twice; no reader ranks those)."""
    p, gpu = ctx.problem, (ctx.worker.environment or {}).get("gpu")
    df = select(ctx.leaderboard.read(protocol=None), m=p.m, n=p.n, k=p.k, dtype=p.dtype, layout=p.layout, gpu=gpu)
    df = df[df["protocol"].isin((PROTOCOL, SCREEN_PROTOCOL))]
    return df.sort_values("time").to_dict("records") if len(df) else []


class InFlight:
    """What the compile thread shares with the loop, behind one lock: the kernel sources
    already claimed (measured, or proposed and not yet measured), the candidates pending
    (proposed, not yet measured: shown to the proposer, so that the batch compiled ahead does
    not repeat the batch on the GPU), the proposals that repeated a claimed source, and the
    builds of the batch compiling now as they finish."""

    def __init__(self, seen: set[str]):
        self._lock = threading.Lock()
        self._seen = set(seen)
        self._pending: dict[str, dict[str, Any]] = {}  # source hash -> its "pending" row
        self._repeats: list[tuple[Candidate, str]] = []
        self._compiled: list[Built] = []
        self._behind: list[Built] = []  # built behind the GPU (a time budget's), not yet taken into a batch
        # This run's compiles behind the GPU not finished yet: source -> when the build is
        # expected (its submission plus its template's compile time, queueing aside).
        self._due_behind: dict[str, float] = {}
        self.duplicates = 0  # candidates skipped: a claimed source, or a binary already measured
        self.compile_s = 0.0  # nvcc seconds of the compiles run (not cached)

    def claim(self, proposal: Candidate, digest: str) -> bool:
        """True if `proposal` (its source's hash `digest`) is new: it is then pending."""
        with self._lock:
            if digest in self._seen:
                self.duplicates += 1
                self._repeats.append((proposal, digest))
                return False
            self._seen.add(digest)
            self._pending[digest] = {"kernel": str(proposal), "template": proposal.template, "status": "pending",
                                     "params": proposal.params_json if proposal.template else None}
            return True

    def compiling(self) -> None:
        """A new batch starts compiling: the builds seen are the previous batch's."""
        with self._lock:
            self._compiled.clear()

    def built(self, item: Built) -> None:
        with self._lock:
            self._compiled.append(item)

    def compiled(self) -> list[Built]:
        """The compiling batch's builds so far, and those built behind the GPU not yet taken."""
        with self._lock:
            return self._compiled + self._behind

    def behind(self, source: str, compile_s: float) -> None:
        """A compile behind the GPU of `source` started, expected to take `compile_s`."""
        with self._lock:
            self._due_behind[source] = time.monotonic() + compile_s

    def built_behind(self, source: str, item: Built | None) -> None:
        """A compile behind the GPU ended: its build (None: stopped)."""
        with self._lock:
            self._due_behind.pop(source, None)
            if item is not None:
                self._behind.append(item)
                self.compile_s += 0.0 if item.build.cached else item.build.seconds

    def take_behind(self) -> list[Built]:
        """The builds made behind the GPU since the last take, for the next batch."""
        with self._lock:
            taken, self._behind = self._behind, []
            return taken

    def compiling_behind(self) -> int:
        with self._lock:
            return len(self._due_behind)

    def first_due_behind(self) -> float | None:
        """When the first of the compiles behind the GPU is expected to end (monotonic clock)."""
        with self._lock:
            return min(self._due_behind.values(), default=None)

    def add_compile_s(self, seconds: float) -> None:
        with self._lock:
            self.compile_s += seconds

    def skipped(self) -> None:
        with self._lock:
            self.duplicates += 1

    def measured(self, items: list[Built]) -> None:
        """These candidates were measured (or skipped as a measured binary): no longer pending."""
        with self._lock:
            for item in items:
                self._pending.pop(source_hash(item.source), None)

    def pending(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._pending.values())

    def repeats(self, last: int) -> list[tuple[Candidate, str]]:
        with self._lock:
            return self._repeats[-last:]


class ShapeRun:
    """One problem's tuning loop: propose -> render -> compile -> verify -> bench -> record
    until the budget is spent, the next batch proposed and compiled on a thread (prepare)
    while this one is on the GPU. Each batch's rows are appended to the leaderboard as it
    ends (or is interrupted), so an interrupted run keeps what it measured; a re-run
    measures nothing twice (same source, or same binary) unless `remeasure`.

    The compile thread (_prepare) reads the context, the proposer and the budget, and
    writes only to `inflight`; every other field is the loop's thread's alone."""

    def __init__(self, ctx: Context, proposer: Proposer, budget: Budget, *, remeasure: bool = False,
                 on_event: Event | None = None):
        if (seconds := timing_s(ctx.settings.budget, budget.time_s)) != ctx.settings.budget:
            ctx = dataclasses.replace(ctx, settings=dataclasses.replace(ctx.settings, budget=seconds))
        self.ctx, self.proposer, self.budget = ctx, proposer, budget
        self.emit: Event = on_event or (lambda kind, info: None)
        self.start = time.monotonic()
        self.out = Outcome()
        self.history = problem_history(ctx)  # everything known: warm start, best kernel
        # What the proposer sees: all history, or only this run's rows when re-measuring.
        self.visible: list[dict[str, Any]] = [] if remeasure else self.history
        self.inflight = InFlight(set() if remeasure else {r["source_hash"] for r in self.history
                                                          if r.get("source_hash")})
        self.seen_binaries: set[str] = set()
        self.held: list[dict[str, Any]] = []  # rows measured ahead of their batch, recorded in its part
        self.held_improved = False
        self.early: set[str] = set()  # sources measured while their batch was still compiling
        self.metric = f"speedup_{ctx.mode}"  # the mode that decides "best": offline or server
        best = best_row(self.history, ctx.mode)
        self.best_speedup = best[self.metric] if best else 0.0
        self.verified = best is not None  # a verified kernel is known
        # Seconds a kernel takes on the GPU, from this run's latest session (at first, the
        # baselines' session): a time budget is spent in sessions that fit it.
        self.per_kernel_s = 0.0
        self.per_screen_s = 0.0  # the same, of a screening session (until one ran: a verification's expected time)
        # Seconds the full protocol takes to confirm one screened kernel (its verification and
        # its methods' timing budgets, until a session of one kernel is seen): screening leaves
        # that much of a time budget, so that a shape's run ends near its budget, not a
        # confirmation past it. Set with the baselines (the verification's part needs their time).
        self.confirm_s = 2 * ctx.settings.budget + CONFIRM_FIXED_S
        self.number = next(_RUNS)  # its compiles behind the GPU go before an earlier run's
        self.ended = threading.Event()  # the run is over: its proposal thread starts no compile

    # ------------------------------------------------------------------ the run

    def run(self) -> Outcome:
        self._baselines()
        # Not a `with` block: when the time budget ends during a compile the run stops
        # without waiting for it (the compile is cancelled).
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            self._batches(pool)
        finally:
            self.ended.set()
            pool.shutdown(wait=False, cancel_futures=True)
            if self.held:  # measured ahead of a batch that never came (stopped, interrupted)
                self._record(self.held)
            self.out.duplicates, self.out.compile_s = self.inflight.duplicates, self.inflight.compile_s
        out = self.out
        out.wall_s = time.monotonic() - self.start
        out.best = best_row(self.history, self.ctx.mode)
        if out.best is not None:
            out.exported = export_best(self.ctx.leaderboard, self.ctx.settings.results, out.best, self.ctx.mode)
        return out

    def _baselines(self) -> None:
        t0 = time.monotonic()
        rows = measure_baselines(self.ctx)
        self._record(rows)
        self.per_kernel_s = self.out.baselines_s = time.monotonic() - t0
        self.out.gpu_s += self.out.baselines_s
        self.out.rows += rows
        self._see(rows)
        column = f"{self.ctx.mode}_us"
        fastest = min((r for r in rows if r.get(column) is not None), key=lambda r: r[column], default=None)
        self.out.baseline, self.out.baseline_us = (fastest["kernel"], fastest[column]) if fastest else (None, None)
        # Until a session measures them: a screened kernel costs its screening checks (a problem
        # of seconds-long fp32 references screens few kernels in a short budget, not a session
        # of as many as memory holds), and a confirmation the full verification beside its
        # timing (and the soak that long calls are timed after).
        us, outputs = self.out.baseline_us, self.ctx.problem.m * self.ctx.problem.n
        self.per_screen_s = verification_s(us, outputs, screen=True)
        self.confirm_s += verification_s(us, outputs) + (SOAK_S if (us or 0.0) >= SOAK_US else 0.0)
        self.emit("baseline", {"us": self.out.baseline_us, "name": self.out.baseline})

    def _batches(self, pool: ThreadPoolExecutor) -> None:
        """Batch after batch until the budget ends; sets out.stopped."""
        budget, out = self.budget, self.out
        pending = pool.submit(self._prepare, list(self.visible), self.ctx.compiler.generation)
        stale = 0
        for iteration in range(budget.iterations):
            try:
                built, invalid = self._batch_result(pending)
                built = [item for item in built + self.inflight.take_behind() if item.source not in self.early]
            except FutureTimeout:
                self._stop_in_compile(pending)
                return
            except Cudal2Error as exc:  # e.g. the LLM endpoint failed for good: keep what we have
                out.stopped = f"the proposer failed: {exc}"
                return
            out.rows += invalid
            self._see(invalid)
            last = iteration + 1 >= budget.iterations or self._over_time(self._reserve())
            if not last:  # the next batch compiles while this one is on the GPU
                pending = self._next_batch(pool)
            self.emit("batch", {"iteration": iteration + 1, "candidates": len(built), "invalid": len(invalid)})
            if not built and not invalid and not (built := self._await_behind()):
                out.stopped = ("time budget spent (while the next batch compiled)" if self._over_time()
                               else "the proposer has nothing new")
                return
            stale = 0 if self._measure_batch(built, list(invalid)) else stale + 1
            # with a verified kernel, a batch whose confirmation would end past the budget is not begun
            spent = self._over_time(self._reserve() if self.verified else 0.0)
            if last or spent:
                out.stopped = "time budget spent" if spent else "iterations done"
                return
            if budget.patience is not None and stale >= budget.patience:
                if self._drain_behind():
                    stale = 0
                    continue
                out.stopped = f"no better kernel in {stale} batches (patience)"
                pending.cancel()
                return

    def _next_batch(self, pool: ThreadPoolExecutor) -> Future:
        """The next batch, proposed and built on the pool's thread; none while a batch's worth
        of candidates compiles behind the GPU (a time budget's): their builds are the next."""
        if self.inflight.compiling_behind() >= self.budget.batch * self.budget.screen:
            nothing: Future = Future()
            nothing.set_result(([], []))
            return nothing
        return pool.submit(self._prepare, self._proposer_view(), self.ctx.compiler.generation)

    def _stop_in_compile(self, pending: Future) -> None:
        """The time budget ended while the next batch was proposed (its built candidates
        looked up; its others compile behind the GPU, where a budget run is stopped by
        optimize's end, to serve the shapes after it). A run with no verified kernel yet
        still waits up to PROPOSAL_WAIT_S for the proposal and for a build, and measures what
        is built by then (it never ends empty while a build comes)."""
        self.out.stopped = "time budget spent (while the next batch compiled)"
        if self.verified:
            return
        with contextlib.suppress(Exception):  # its compiles stopped: Cancelled
            pending.result(timeout=PROPOSAL_WAIT_S)
        ready = self._built_unmeasured() or self._await_behind()
        if ready:
            self.out.stopped += f"; the {len(ready)} kernel(s) built by then measured"
            self.inflight.take_behind()
            self._measure_batch(ready, [])

    def _drain_behind(self) -> bool:
        """Patience counts batches whose proposals were measured. Under a time budget a
        batch's unbuilt proposals compile behind the GPU (a CUTLASS build: about a minute), so
        a run out of patience may not have measured what its search ranked first: while the
        first of them is expected built with a confirmation's time of the budget left, each is
        measured as it is built. True as soon as one improves the best (the search goes on)."""
        while True:
            built = [item for item in self.inflight.take_behind() if item.source not in self.early]
            if not built:
                due, left = self.inflight.first_due_behind(), self._time_left(self._reserve() or self.confirm_s)
                if due is None or left is None or due - time.monotonic() > left:
                    return False  # none compiling, no budget, or none expected built in time for it
                if not (built := self._await_behind()):
                    return False
            if self._measure_batch(built, []):
                return True

    def _await_behind(self) -> list[Built]:
        """With nothing else for the GPU: the builds made behind it, as soon as one is there
        (while this run compiles any), until the budget ends; a run with no verified kernel
        waits PROPOSAL_WAIT_S past it."""
        while self.inflight.compiling_behind():
            if (built := [item for item in self.inflight.take_behind() if item.source not in self.early]):
                return built
            if self._over_time() and (self.verified or self._overrun() > PROPOSAL_WAIT_S):
                return []
            time.sleep(0.1)
        return [item for item in self.inflight.take_behind() if item.source not in self.early]

    # ------------------------------------------------------------------ the compile thread

    def _prepare(self, snapshot: list[dict[str, Any]], generation: int) -> tuple[list[Built], list[dict[str, Any]]]:
        """Proposes and compiles one batch (on the pool's thread, beside the GPU work of the
        previous one): its builds, and the rows of proposals that never became a kernel.
        Shares nothing with the loop but `inflight`."""
        ctx, name = self.ctx, self.proposer.name
        wanted = self.budget.batch * self.budget.screen
        proposals = [from_proposer(p, name) for p in self.proposer.propose(ctx.problem, snapshot, wanted)]
        fresh, invalid = [], []  # fresh: (proposal, its source)
        for proposal in proposals:
            if not isinstance(proposal, Candidate):
                invalid.append(invalid_row(ctx, proposal.reason, proposal.text, f"{name} proposal"))
                continue
            try:
                source = render(proposal, ctx.problem)
            except Cudal2Error as exc:
                invalid.append(invalid_row(ctx, str(exc), str(proposal), f"{name} proposal"))
                continue
            # else measured (or being measured): the proposer is told
            if self.inflight.claim(proposal, source_hash(source)):
                fresh.append((proposal, source))
        self.inflight.compiling()
        if self.budget.time_s is not None:  # built first: the others compile behind the GPU
            fresh = self._built_first(fresh, generation)
        built = build_all(ctx, [p for p, _ in fresh], generation, on_built=self.inflight.built,
                          sources=[s for _, s in fresh])
        self.inflight.add_compile_s(sum(b.build.seconds for b in built if not b.build.cached))
        return built, invalid

    def _built_first(self, proposals: list[tuple[Candidate, str]], generation: int) -> list[tuple[Candidate, str]]:
        """Under a time budget: the proposals already built (in the compile cache: the
        prebuilt set, earlier runs), which this batch measures. The others compile behind the
        GPU (Behind: the quickest template first), and join the first batch after
        each is built: the GPU never waits on nvcc while a built candidate is unmeasured."""
        ready, later = [], []
        for proposal, source in proposals:
            (ready if self.ctx.compiler.lookup(source) is not None else later).append((proposal, source))
        for proposal, source in later:
            if self.ended.is_set():  # a proposal the run did not wait for
                break
            self.inflight.behind(source, _compile_s(proposal))
            behind(self.ctx.compiler).submit(
                self.number, _compile_s(proposal), source, generation,
                lambda build, proposal=proposal, source=source: self.inflight.built_behind(source,
                    None if build is None else Built(proposal, source, build)))
        return ready

    def _proposer_view(self) -> list[dict[str, Any]]:
        """What the next batch's proposer sees: the visible rows, the candidates pending,
        and the latest repeated proposals (never recorded), each with the earlier
        measurement's result."""
        notes = []
        for proposal, digest in self.inflight.repeats(6):
            earlier = next((r for r in reversed(self.history) if r.get("source_hash") == digest), None)
            speedup = earlier.get("speedup_offline") if earlier else None
            result = ("is still being measured" if earlier is None else
                      f"was measured as {earlier['kernel']}: {earlier['status']}"
                      + (f", {speedup:.3f}x the fastest library call" if speedup == speedup and speedup else ""))
            notes.append({"kernel": str(proposal), "template": proposal.template, "status": "repeat",
                          "params": proposal.params_json if proposal.template else None,
                          "error": f"proposed again: it {result}"})
        return list(self.visible) + self.inflight.pending() + notes

    def _built_unmeasured(self) -> list[Built]:
        """The compiling batch's builds that finished and were not measured early."""
        return [item for item in self.inflight.compiled() if item.build.status == "ok" and item.source not in self.early]

    def _batch_result(self, pending: Future) -> tuple[list[Built], list[dict[str, Any]]]:
        """The compiling batch's builds and invalid rows. Until a kernel is verified, each
        build that finishes meanwhile is measured at once: a run from an empty cache has its
        first verified kernel when the quickest compile ends, not the slowest."""
        while not self.verified:
            left = self._time_left()
            try:  # the batch, if it comes within EARLY_WAIT_S (its builds cached, say)
                return pending.result(timeout=EARLY_WAIT_S if left is None else min(EARLY_WAIT_S, left))
            except FutureTimeout:
                if self._over_time():
                    raise
            ready = self._built_unmeasured()
            if ready:
                self.early.add(ready[0].source)
                self._measure_batch(ready[:1], [], ahead=True)
        return pending.result(timeout=self._time_left())

    # ------------------------------------------------------------------ the GPU

    def _measure_batch(self, built: list[Built], rows: list[dict[str, Any]], ahead: bool = False) -> bool:
        """Measures the batch's kernels, session by session, until the time budget is spent
        once a kernel is verified (a run never ends without one while it has one to measure);
        records the rows as one part, even when interrupted, with any measured `ahead` of
        the batch (those are held for it). True if the best speedup improved."""
        improved = False
        fresh, binaries = self._distinct_binaries(built)
        lead = None  # the screened ratio of the screen's best
        try:
            if self.budget.screen > 1 and len(fresh) > 1:
                fresh, lead = self._screen(fresh, binaries, rows)
            # With a verified kernel, a session is begun only if it is expected to end within the
            # budget; but the screen's best is confirmed, past the budget if need be, where it
            # screened ahead of every confirmed kernel (the one confirmed ahead of its batch, or an
            # earlier run's): a screen that found a better kernel never goes unconfirmed.
            owed = lead is not None and lead > self.best_speedup
            for session in self._sessions(fresh):
                if self.verified and not owed and self._over_time(self._session_s(len(session))):
                    break
                owed = False
                self.seen_binaries.update(b for item in session if (b := binaries[item.source]) is not None)
                for row in self._measure_session(session):
                    rows.append(row)
                    improved |= self._take(row)
        finally:
            self.inflight.measured(built)
            if ahead:
                self.held.extend(rows)
            else:
                self._record(self.held + rows)
                self.held.clear()
        if ahead:
            self.held_improved |= improved
            return improved
        improved, self.held_improved = improved or self.held_improved, False
        return improved

    def _screen(self, items: list[Built], binaries: dict[str, str | None],
                rows: list[dict[str, Any]]) -> tuple[list[Built], float | None]:
        """Successive halving's first rung (Jamieson and Talwalkar, 2016): every kernel of
        the batch screened (the screening checks, then timed by the graph method alone for a
        few rounds, Worker._screen), in sessions that fit the time left beside the
        confirmation (the shape's first rung: at least _first_rung of them, reckoned again
        after each session); its rows join `rows` (status SCREENED where it passed: never
        ranked). Returns the second rung: the best 1 / budget.screen of the batch by the
        screened ratio, best first, for the full protocol; and the best's screened ratio (None
        where none passed)."""
        passed = []
        first = not self.out.screened  # the shape's first screening pass
        least_until = time.monotonic() + FIRST_RUNG_LEAST * (self.budget.time_s or 0.0)
        batch, items, most = len(items), list(items), session_size(self.ctx)
        while items:
            owed = self._first_rung(len(items), least_until) if first else 0
            left = self._time_left(self.confirm_s)  # what the confirmation leaves of the budget
            if left is not None and left < self.per_screen_s and owed <= 0 and (self.verified or passed):
                break
            size = max(next_session(len(items), most, left, self.per_screen_s), min(owed, most))
            session, items = items[:size], items[size:]
            self.seen_binaries.update(b for item in session if (b := binaries[item.source]) is not None)
            for item, row in zip(session, self._measure_session(session, screen=True), strict=True):
                rows.append(row)
                self._take(row)
                if row["status"] == SCREENED and (ratio := row.get("speedup_graph")) is not None and ratio == ratio:
                    passed.append((ratio, item))
        passed.sort(key=lambda pair: -pair[0])
        return [item for _, item in passed[:math.ceil(batch / self.budget.screen)]], (passed[0][0] if passed else None)

    def _first_rung(self, count: int, least_until: float) -> int:
        """How many of `count` kernels the next session of a shape's first screening pass
        takes whatever the confirmation reserves: under a time budget, as many as the
        budget's time left holds, or the time until `least_until` (the rung's start plus
        FIRST_RUNG_LEAST of the budget) if longer, at the seconds a screened kernel is
        expected to take (measured by the latest screening session, its own part included,
        once one ran); otherwise none."""
        left = self._time_left()
        if left is None or self.per_screen_s <= 0:
            return 0
        span = max(left, least_until - time.monotonic())
        return min(count, int(span / self.per_screen_s))

    def _distinct_binaries(self, built: list[Built]) -> tuple[list[Built], dict[str, str | None]]:
        """The builds whose binary is not measured already (identical binaries are
        measured once), and each one's binary hash."""
        fresh, binaries = [], {}
        for item in built:
            binary = _binary_hash(item)
            if binary is not None and (binary in self.seen_binaries or binary in binaries.values()):
                self.inflight.skipped()
                continue
            fresh.append(item)
            binaries[item.source] = binary
        return fresh, binaries

    def _sessions(self, items: list[Built]):
        """The batch's kernels for the full protocol, session by session (next_session), in
        the time left."""
        items = list(items)
        while items:
            size = next_session(len(items), session_size(self.ctx), self._time_left(), self.per_kernel_s)
            yield items[:size]
            del items[:size]

    def _measure_session(self, session: list[Built], screen: bool = False) -> list[dict[str, Any]]:
        t0 = time.monotonic()
        measured = measure_rows(self.ctx, session, screen=screen)
        on_gpu = sum(item.build.status == "ok" for item in session)
        if on_gpu:
            spent = time.monotonic() - t0
            self.out.gpu_s += spent
            self.out.sessions.append((on_gpu, round(spent, 3)))
            if screen:
                self.out.screen_s += spent
                self.per_screen_s = spent / on_gpu
            else:
                self.per_kernel_s = spent / on_gpu
                if on_gpu == 1:
                    self.confirm_s = spent
        self.out.screened += on_gpu if screen else 0
        return measured

    def _take(self, row: dict[str, Any]) -> bool:
        """A measured row joins the run; True if it is the best speedup so far."""
        self.out.rows.append(row)
        verified = row["status"] == "ok"
        if verified and self.out.first_verified_s is None:
            self.out.first_verified_s = time.monotonic() - self.start
        self._see([row])
        speedup = row.get(self.metric)
        improved = bool(verified and speedup and speedup > self.best_speedup)
        if improved:
            self.best_speedup = speedup
        self.emit("measured", {"row": row, "speedup": speedup, "best_speedup": self.best_speedup})
        return improved

    # ------------------------------------------------------------------ bookkeeping

    def _see(self, rows: list[dict[str, Any]]) -> None:
        """This run's rows join the history, and what the proposer sees (with `remeasure`,
        only this run's rows)."""
        self.history.extend(rows)
        if self.visible is not self.history:
            self.visible.extend(rows)
        speedup = self.metric
        self.verified |= any(r["status"] == "ok" and r["kernel"] not in BASELINES and r.get(speedup) is not None
                             and r[speedup] == r[speedup] for r in rows)

    def _record(self, rows: list[dict[str, Any]]) -> None:
        """The loop's one writer: rows go to the leaderboard as one part."""
        self.ctx.leaderboard.append(rows)

    def _over_time(self, reserve: float = 0.0) -> bool:
        """Whether the time budget is spent, or all but `reserve` seconds of it."""
        return self.budget.time_s is not None and time.monotonic() - self.start + reserve >= self.budget.time_s

    def _session_s(self, kernels: int) -> float:
        """Seconds a session of the full protocol of `kernels` is expected to take: at the
        latest session's time per kernel, and at least a confirmation's (a session of one
        costs its fixed part whole: after a session of two took 1.5 s, one took 1.3)."""
        return max(self.confirm_s, kernels * self.per_kernel_s)

    def _reserve(self) -> float:
        """Seconds a batch needs beyond its proposal: one screened kernel and its
        confirmation; none without screening (its sessions fit the time left)."""
        return self.confirm_s + self.per_screen_s if self.budget.screen > 1 else 0.0

    def _overrun(self) -> float:
        """Seconds the run is past its time budget."""
        return time.monotonic() - self.start - (self.budget.time_s or 0.0)

    def _time_left(self, reserve: float = 0.0) -> float | None:
        if self.budget.time_s is None:
            return None
        return max(0.0, self.budget.time_s - reserve - (time.monotonic() - self.start))


def optimize(ctx: Context, proposer: Proposer, budget: Budget, *, remeasure: bool = False,
             on_event: Event | None = None) -> Outcome:
    """Tunes ctx.problem: a ShapeRun, run; then the compiles it left behind the GPU stop."""
    try:
        return ShapeRun(ctx, proposer, budget, remeasure=remeasure, on_event=on_event).run()
    finally:
        stop_behind(ctx.compiler)


def optimize_shapes(problems: list[Problem], context: Callable[[Problem, int], Context],
                    proposer: Callable[[Context], Proposer], budget: Budget, *, workers: int = 1,
                    remeasure: bool = False, on_event: Event | None = None) -> list[Outcome]:
    """optimize() for every problem; `context(problem, worker)` makes its context on GPU
    worker number `worker` (0 .. workers - 1), and a proposer is made for each (so each
    warm-starts from the shapes tuned before it). With several workers, one thread drives
    each, taking the next untuned shape as it finishes one. Each batch's rows are in the
    leaderboard as it ends, so a killed run keeps them and a re-run measures nothing twice;
    `on_event` also hears ("shape", {index, of, problem, worker}). Compiles a shape left
    behind the GPU (a time budget's) go on for the shapes after it, and stop when the set
    ends. Outcomes come in the problems' order."""
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
            compilers.add(ctx.compiler)
            began = time.monotonic()
            try:
                outcomes[index - 1] = ShapeRun(ctx, proposer(ctx), budget, remeasure=remeasure,
                                               on_event=on_event).run()
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

    compilers: set[Compiler] = set()
    try:
        if workers == 1:
            drain(0)
        else:
            threads = [threading.Thread(target=drain, args=(w,), name=f"cudal2-gpu-{w}", daemon=True)
                       for w in range(workers)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
    finally:
        for compiler in compilers:
            stop_behind(compiler)
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


# Compiles behind the GPU (a time budget's built-first rule), one pool per compiler: a shape
# set's shapes share it, so what one shape proposed and did not get built in its time is
# built for the shapes after it (one build serves every shape of its dtype and layout).
SLOW_COMPILE_S = 10.0  # a template whose build takes longer (CUTLASS: a minute) is a slow one
SLOW_SHARE = 0.75  # of the compile slots, the most that slow builds hold at once


class Behind:
    """The compiles behind the GPU of one compiler. The latest run's first (a shape's
    proposals go before those an earlier shape left), and in a run the quickest template
    first; slow builds hold at most SLOW_SHARE of the compiler's slots, so that a quick build
    (seconds) never queues a minute behind them. stop() ends them all."""

    def __init__(self, compiler: Compiler):
        self.compiler = compiler
        self._queue: list[tuple[tuple, str, int, Callable[[Build | None], None]]] = []
        self._cond = threading.Condition()
        self._slow, self._slow_most = 0, max(1, int(compiler.jobs * SLOW_SHARE))
        self._stopped = False
        self._order = 0
        for _ in range(compiler.jobs):
            threading.Thread(target=self._work, name="cudal2-behind", daemon=True).start()

    def submit(self, run: int, compile_s: float, source: str, generation: int,
               done: Callable[[Build | None], None]) -> None:
        with self._cond:
            if self._stopped:
                done(None)
                return
            self._order += 1
            self._queue.append(((-run, compile_s, self._order), source, generation, done))
            self._queue.sort(key=lambda job: job[0])
            self._cond.notify()

    def _next(self) -> tuple[tuple, str, int, Callable] | None:
        with self._cond:
            while not self._stopped:
                for i, job in enumerate(self._queue):
                    if job[0][1] <= SLOW_COMPILE_S or self._slow < self._slow_most:
                        self._slow += job[0][1] > SLOW_COMPILE_S
                        return self._queue.pop(i)
                self._cond.wait()
            return None

    def _work(self) -> None:
        while (job := self._next()) is not None:
            (_, compile_s, _), source, generation, done = job
            build = None
            try:
                build = self.compiler.compile(source, generation)
            except Exception:  # stopped (Cancelled): nothing was cached
                pass
            finally:
                with self._cond:
                    self._slow -= compile_s > SLOW_COMPILE_S
                    self._cond.notify_all()
                done(build)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            queued, self._queue = self._queue, []
            self._cond.notify_all()
        for *_, done in queued:
            done(None)
        self.compiler.cancel()


_BEHIND: weakref.WeakKeyDictionary[Compiler, Behind] = weakref.WeakKeyDictionary()
_BEHIND_LOCK = threading.Lock()
_RUNS = iter(range(1, 1 << 62))  # each ShapeRun's number: the latest's compiles behind go first


def behind(compiler: Compiler) -> Behind:
    """The compiler's pool of compiles behind the GPU (started on first use)."""
    with _BEHIND_LOCK:
        if compiler not in _BEHIND:
            _BEHIND[compiler] = Behind(compiler)
        return _BEHIND[compiler]


def stop_behind(compiler: Compiler) -> None:
    """Stops the compiles behind the GPU, queued and running (the run is over): nothing
    half-done is cached."""
    with _BEHIND_LOCK:
        pool = _BEHIND.pop(compiler, None)
    if pool is not None:
        pool.stop()


def _compile_s(candidate: Candidate) -> float:
    """What a candidate's build costs, as its template's space says (a free-form source: a
    minute)."""
    if candidate.template is None:
        return 60.0
    return get_template(candidate.template).space.compile_s


def _binary_hash(item: Built) -> str | None:
    if item.build.library is None:
        return None
    return hashlib.sha256(item.build.library.read_bytes()).hexdigest()
