"""The optimize loop's bookkeeping with the real compiler and leaderboard. The GPU worker
is stood in for by a CPU object with the same interface (tests/test_gpu.py runs the real
one on a GPU)."""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from cudal2.measure.baselines import cublas_location
from cudal2.protocol import PROTOCOL
from cudal2.kernels.candidate import Candidate, Invalid
from cudal2.cli import app
from cudal2.errors import Cudal2Error
from cudal2.config import Settings
from cudal2.results.leaderboard import BASELINES, Leaderboard
from cudal2.tune.optimize import Budget, optimize
from cudal2.tune.pipeline import Context, measure_baselines
from cudal2.problem import Problem
from cudal2.search.propose import HybridProposer, SearchProposer
from cudal2.kernels.render import get_template, render, template_candidate

from conftest import cache_holding, gpu_count

pytestmark = pytest.mark.nvcc

H200 = {"gpu": "NVIDIA H200", "cc": 90, "sm_count": 132, "max_sm_clock_mhz": 1980, "sm_clock_mhz": 1980,
        "memory_clock_khz": 3201000, "memory_bus_bits": 6016, "l2_bytes": 62914560, "smem_optin_bytes": 232448}


def timing(us: float) -> dict:
    return {"median_us": us, "p20_us": us * 0.99, "p80_us": us * 1.01, "samples": 10}


def both_methods(**us: float) -> dict:
    """The protocol's timings of contestant -> us: kernel method as given, graph 2% slower."""
    return {"kernel": {name: timing(t) for name, t in us.items()},
            "graph": {name: timing(t * 1.02) for name, t in us.items()}}


class StandInWorker:
    """Answers the worker's requests on the CPU: cuBLAS takes 100 us, cuBLASLt autotuned 95,
    a kernel's time follows from its library's bytes (stable per binary), or from `times`
    in call order."""

    environment = H200

    def __init__(self, times: list[float] | None = None, device: int = 0):
        self.device = device
        self.times = list(times or [])
        self.kernels: list[str] = []
        self.sessions: list[int] = []  # kernels timed in each session
        self.screens: list[bool] = []  # whether each session was a screening one

    def start(self):
        return self.environment

    def request(self, job, timeout):
        assert set(job["libraries"]) == {"cuBLAS", "cuBLASLt"} and job["settings"]["protocol"] == PROTOCOL
        if job["op"] == "baselines":
            return {"status": "ok", "errors": {"cuBLAS": (1e-4, 1e-3), "cuBLASLt": (1e-4, 1e-3)},
                    "timings": both_methods(cuBLAS=100.0, cuBLASLt=95.0),
                    "cublaslt": job.get("cublaslt") or {"index": 3, "of": 8}}  # a job's choice holds
        self.kernels.append(job["library"])
        digest = hashlib.sha256(Path(job["library"]).read_bytes()).hexdigest()
        us = self.times.pop(0) if self.times else 50.0 + int(digest[:4], 16) % 100
        return {"status": "ok", "max_error": 1e-4, "tolerance": 1e-3,
                "timings": both_methods(kernel=us, cuBLAS=100.0, cuBLASLt=95.0)}

    def measure(self, job, libraries, timeout, screen=False):
        """Each library's answer, as the worker's measure() gives them (one session); a
        screening session's has the graph method's timings alone."""
        self.sessions.append(len(libraries))
        self.screens.append(screen)
        answers = [self.request({**job, "op": "kernel", "library": library}, timeout) for library in libraries]
        if screen:
            answers = [{**a, "timings": {"graph": a["timings"]["graph"]}} for a in answers]
        return answers

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


STAND_IN_LIBRARIES = {"cuBLAS": "(the cuBLAS shim)", "cuBLASLt": "(the cuBLASLt shim)"}


def context(tmp_path, compiler, worker, problem=Problem(256, 256, 256)) -> Context:
    settings = Settings(results=tmp_path / "results")
    return Context(problem, settings, worker, compiler, Leaderboard(settings.results), "run-1", proposer="search",
                   libraries=STAND_IN_LIBRARIES)


def sm80_search(seed=0):
    return SearchProposer(H200, seed=seed, templates={"sm80_mma": get_template("sm80_mma")})


@pytest.fixture(scope="module")
def sm80_rankings() -> dict:
    return {}


@pytest.fixture(autouse=True)
def sm80_ranked_once(sm80_rankings, monkeypatch):
    """cost.rank_values of sm80_mma's space alone (what sm80_search ranks) computed once a
    module per problem: a second or two of one core each, and most tests here search it."""
    import cudal2.search.propose as propose

    real = propose.rank_values

    def rank_values(templates, problem, device):
        if list(templates) != ["sm80_mma"]:
            return real(templates, problem, device)
        key = (problem, json.dumps(device, sort_keys=True))
        if key not in sm80_rankings:
            sm80_rankings[key] = real(templates, problem, device)
        return list(sm80_rankings[key])

    monkeypatch.setattr(propose, "rank_values", rank_values)


def test_loop_measures_batches_records_rows_and_exports_the_best(tmp_path, compiler):
    ctx = context(tmp_path, compiler, StandInWorker())
    out = optimize(ctx, sm80_search(), Budget(iterations=2, batch=2, patience=None))
    kernels = [r for r in out.rows if r["kernel"] not in ("cuBLAS", "cuBLASLt")]
    assert len(kernels) == 4 and all(r["status"] == "ok" for r in kernels)
    # the fastest library call is the baseline, and the claim is the lower of the two methods
    assert (out.baseline, out.baseline_us) == ("cuBLASLt", 95.0) and out.stopped == "iterations done"
    assert all(r["speedup_offline"] == pytest.approx(95.0 * 1.02 / r["graph_us"]) for r in kernels)
    assert all(r["speedup_vs_cublas"] == pytest.approx(100.0 / r["kernel_us"]) for r in kernels)
    assert out.best["speedup_offline"] == max(r["speedup_offline"] for r in kernels)
    exported = out.exported.read_text()
    assert out.exported == tmp_path / "results/best/NVIDIA_H200/fp16_nn/256_256_256.cu"
    assert f"speedup {out.best['speedup_offline']:.3f}x" in exported and "template sm80_mma" in exported
    assert 'extern "C" int cudal2_gemm(' in exported
    recorded = ctx.leaderboard.read()
    assert len(recorded) == 6  # every row recorded as measured
    assert set(recorded["protocol"]) == {PROTOCOL}  # and how it was timed
    assert len(list(ctx.leaderboard.parts.glob("*.parquet"))) == 3  # one part per batch (and the baselines)
    assert out.compile_s > 0 and out.wall_s >= out.gpu_s


class PacedWorker(StandInWorker):
    """A stand-in whose sessions take time on `clock` (the loop's clock, nothing else moving
    it): a screening session `screen_s` a kernel, a session of the full protocol 0.4 s; the
    fastest library call takes `call_us`."""

    def __init__(self, clock: list[float], screen_s: float = 0.05, call_us: float = 95.0):
        super().__init__()
        self.clock, self.screen_s, self.call_us = clock, screen_s, call_us

    def request(self, job, timeout):
        if job["op"] == "baselines":
            return {"status": "ok", "errors": {"cuBLAS": (1e-4, 1e-3), "cuBLASLt": (1e-4, 1e-3)},
                    "timings": both_methods(cuBLAS=self.call_us * 1.05, cuBLASLt=self.call_us),
                    "cublaslt": job.get("cublaslt") or {"index": 3, "of": 8}}
        return super().request(job, timeout)

    def measure(self, job, libraries, timeout, screen=False):
        self.clock[0] += self.screen_s * len(libraries) if screen else 0.4
        return super().measure(job, libraries, timeout, screen)


class ProposedAtOnce:
    """The loop's proposal pool, run on the caller's thread: submit() returns a done future."""

    def __init__(self, max_workers=1):
        pass

    def submit(self, fn, *args, **kwargs):
        from concurrent.futures import Future

        future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # the loop reads it as the pool's would be
            future.set_exception(exc)
        return future

    def shutdown(self, wait=True, cancel_futures=False):
        pass


def paced_run(tmp_path, compiler, monkeypatch, worker: PacedWorker, budget_s: float, batch: int = 1):
    """optimize() of 256^3 with `worker`, its clock the loop's, four kernels a batch screened
    and the best quarter confirmed, under `budget_s` (the protocol's timing budget 0.2 s a
    method)."""
    import time as real
    from types import SimpleNamespace

    loop = sys.modules["cudal2.tune.optimize"]
    monkeypatch.setattr(loop, "time", SimpleNamespace(monotonic=lambda: worker.clock[0], sleep=real.sleep))
    # Each batch is proposed when it is asked for (its builds are cached), so the run never
    # waits on this machine's real time against the stand-in's clock: on a loaded 2-core
    # machine a proposal took over the 0.5 s after which a built kernel is confirmed ahead of
    # its batch, and the sessions were sized from that confirmation.
    monkeypatch.setattr(loop, "ThreadPoolExecutor", ProposedAtOnce)
    settings = Settings(results=tmp_path / "results", budget=0.2)
    ctx = Context(Problem(256, 256, 256), settings, worker, compiler, Leaderboard(settings.results), "run-1",
                  proposer="search", libraries=STAND_IN_LIBRARIES)
    compiler.compile_all([render(c, ctx.problem) for c in sm80_search().propose(ctx.problem, [], max(8, 4 * batch))])
    return optimize(ctx, sm80_search(), Budget(iterations=5, batch=batch, screen=4, time_s=budget_s, patience=None))


@pytest.mark.parametrize("budget_s, sessions", [(1.0, [4, 1]), (1.12, [4, 1, 2, 1]), (1.3, [4, 1, 4, 1])])
def test_screening_under_a_time_budget_leaves_the_time_of_the_confirmation(tmp_path, compiler, monkeypatch,
                                                                         budget_s, sessions):
    """A shape's run ends within its time budget, not a confirmation past it: four kernels
    screened (0.2 s) and the best confirmed (0.4 s: the protocol's two methods at its 0.2 s
    timing budget each) take 0.6 s, and a batch is begun only while its confirmation would
    still end within the budget, and screens no more than leaves its time: 1.0 s holds one
    batch, 1.12 s a second that screens two kernels, 1.3 s two whole batches."""
    worker = PacedWorker([0.0])
    out = paced_run(tmp_path, compiler, monkeypatch, worker, budget_s)
    assert worker.sessions == sessions and worker.screens == [True, False] * (len(sessions) // 2), worker.sessions
    assert out.stopped == "time budget spent" and out.best is not None
    assert out.wall_s <= budget_s, out.wall_s


class SessionPacedWorker(PacedWorker):
    """A PacedWorker whose baselines take 0.7 s and whose protocol sessions take 0.3 s
    plus 0.4 s a kernel (a session of two takes 1.1 s, 0.55 s a kernel, but one alone 0.7)."""

    def request(self, job, timeout):
        if job["op"] == "baselines":
            self.clock[0] += 0.7
        return super().request(job, timeout)

    def measure(self, job, libraries, timeout, screen=False):
        if not screen:
            self.clock[0] += 0.3 + 0.4 * len(libraries) - 0.4  # (PacedWorker adds its 0.4)
        return super().measure(job, libraries, timeout, screen)


def test_with_a_verified_kernel_a_confirmation_session_is_begun_only_if_it_would_end_within_the_budget(
        tmp_path, compiler, monkeypatch):
    """On the H200 at --time-budget 5, shapes ran 5.8 s in the mean: after a confirmation of
    two kernels (1.5 s) the last of the rung began in the 0.5-1 s left, on the two-kernel
    session's time per kernel, and took 1.3 s. Here twelve kernels are screened (0.6 s after
    the baselines' 0.7) and three confirmed: two in the first session (1.1 s), and the third
    not begun in the 0.6 s left, since a session of one is expected to take a confirmation's
    time (0.72 s: the methods' 0.4, the fixed 0.3, the verification), not 0.55."""
    worker = SessionPacedWorker([0.0])
    out = paced_run(tmp_path, compiler, monkeypatch, worker, 3.0, batch=3)
    assert worker.sessions == [12, 2] and worker.screens == [True, False], worker.sessions
    assert out.stopped == "time budget spent" and out.best is not None
    assert out.wall_s <= 3.0, out.wall_s


class TimingRecorder(StandInWorker):
    """A stand-in that records the seconds of timing per method each kernel's job asks for
    (the baselines' own session is a short one, 0.2 s a method at most)."""

    def __init__(self):
        super().__init__()
        self.timing: list[float] = []

    def request(self, job, timeout):
        if job["op"] == "kernel":
            self.timing.append(job["settings"]["budget_s"])
        return super().request(job, timeout)


@pytest.mark.parametrize("time_s, per_method", [(None, 1.0), (60.0, 1.0), (5.0, 0.5), (2.0, 0.25)])
def test_under_a_time_budget_each_method_is_timed_a_tenth_of_it(tmp_path, compiler, time_s, per_method):
    """At --time-budget 5 a confirmation timed 1 s a method took half the shape's budget and
    left a large problem room to screen one kernel: a time budget's methods are timed a tenth
    of it (at least 0.25 s, at most the setting); without a budget, the setting."""
    worker = TimingRecorder()
    optimize(context(tmp_path, compiler, worker), sm80_search(), Budget(iterations=1, batch=1, time_s=time_s))
    assert worker.timing and set(worker.timing) == {per_method}, worker.timing


@pytest.mark.parametrize("call_us, screen_s, sessions", [(5000.0, 0.45, [4, 1]), (60000.0, 1.03, [2, 1])])
def test_a_shapes_first_rung_is_screened_whole_where_its_time_budget_holds_it(tmp_path, compiler, monkeypatch,
                                                                            call_us, screen_s, sessions):
    """At --time-budget 5 on the H200, shapes of 100-1000 us calls screened 9 kernels in the
    median and those above 1 ms one: the confirmation's reserve (its timing, verification and
    soak, about 3 s) came first. A shape's first screening pass now takes its whole batch
    where the budget holds it at the expected seconds a kernel (0.09 s at 5 ms calls: four
    of them under 3 s, where the reserve of 2.6 s had left one), else as many as it holds
    (two at 1.04 s, 60 ms calls, the GPU's rest after their replay included: worker.SCREEN_REST);
    the best is confirmed, and no batch follows that cannot
    screen one kernel and confirm it. The expected seconds a kernel were fitted to 64-kernel
    screening sessions on the H200 (17.8-64.4 ms at 25-1516 us calls); since then the sessions'
    opening times cuBLAS alone, calls of a millisecond or more get one round of graphs
    uploaded, not replayed first, and a pass's kernels share their checks' inputs (counted:
    3, 9 and 5 calls of a kernel fewer)."""
    from cudal2.tune.optimize import verification_s

    assert 0.02 <= verification_s(None) <= verification_s(5.0) < 0.04 < verification_s(5000.0) < 0.5
    assert 0.07 < verification_s(167.6, 16384 * 16384) < 0.14  # 16384x16384x128: measured 0.106 s
    assert 0.016 < verification_s(25.0, 2048 * 2048, screen=True) < 0.0185  # measured 17.8 ms
    assert 0.035 < verification_s(1516.0, 8192 * 8192, screen=True) < 0.045  # measured 64.4 ms before
    assert 0.07 < verification_s(5000.0, screen=True) < 0.5 * verification_s(5000.0)
    worker = PacedWorker([0.0], screen_s=screen_s, call_us=call_us)
    out = paced_run(tmp_path, compiler, monkeypatch, worker, 3.0)
    assert worker.sessions == sessions and worker.screens == [True, False], worker.sessions
    assert out.stopped == "time budget spent" and out.best is not None
    assert out.screened == sessions[0]


class SlowSessionWorker(PacedWorker):
    """A PacedWorker whose baselines' session takes `baselines_s` and whose screening
    sessions cost `session_s` each beside their kernels' `screen_s` (setting up the
    contestants' outputs: a large problem's)."""

    def __init__(self, clock: list[float], baselines_s: float, session_s: float, **kwargs):
        super().__init__(clock, **kwargs)
        self.baselines_s, self.session_s = baselines_s, session_s

    def request(self, job, timeout):
        if job["op"] == "baselines":
            self.clock[0] += self.baselines_s
        return super().request(job, timeout)

    def measure(self, job, libraries, timeout, screen=False):
        self.clock[0] += self.session_s if screen else 0.0
        return super().measure(job, libraries, timeout, screen)


def test_a_first_rung_screens_what_the_baselines_left_of_the_budget_at_the_measured_pace(tmp_path, compiler,
                                                                                        monkeypatch):
    """Shapes whose outputs hold 10^8 elements and more ran 7-11 s at --time-budget 5 (H200,
    seed 20261309): their first rung was reckoned from the whole budget at the expected 20-90 ms
    a kernel, once, while the baselines had spent 1-2 s of it and memory split the rung into
    sessions that cost their own part each. Here the baselines take 1.4 s of a 3 s budget and
    memory holds four kernels a session: the first session (four at 0.2 s and 0.4 s of its
    own) leaves 0.4 s, which holds one kernel at the measured 0.3 s a kernel (it takes 0.6).
    The rung screens five of its 16, the best is confirmed (0.4 s), and the shape ends within
    a screening session and a confirmation of its budget (reckoned once from the budget at the
    expected pace, 3 s / 0.09 s: all 16, in four sessions, 6.6 s)."""
    monkeypatch.setattr(sys.modules["cudal2.tune.optimize"], "session_size", lambda ctx: 4)
    worker = SlowSessionWorker([0.0], baselines_s=1.4, session_s=0.4, screen_s=0.2, call_us=5000.0)
    out = paced_run(tmp_path, compiler, monkeypatch, worker, 3.0, batch=4)
    assert worker.sessions == [4, 1, 1] and worker.screens == [True, True, False], worker.sessions
    assert out.screened == 5 and out.best is not None
    assert out.wall_s == pytest.approx(3.6), out.wall_s


def test_a_first_rung_screens_half_a_budget_after_baselines_that_took_it_whole(tmp_path, compiler, monkeypatch):
    """A run's first shape pays the library's start in its baselines (4.7 s of a 5 s budget on
    the H200, seed 20261310): reckoned from the time left alone, its first rung screened 1 of
    the 64 built and kept a kernel at 0.296 of the library (60 s found 1.059). The rung screens
    at least half a budget's worth: here 16 built at 0.05 s a kernel after baselines of 3.2 s
    of a 3 s budget, all of them, and the best confirmed."""
    worker = SlowSessionWorker([0.0], baselines_s=3.2, session_s=0.0, screen_s=0.05, call_us=95.0)
    out = paced_run(tmp_path, compiler, monkeypatch, worker, 3.0, batch=4)
    assert worker.sessions == [16, 1] and worker.screens == [True, False], worker.sessions
    assert out.screened == 16 and out.best is not None


def test_a_screen_that_found_a_kernel_ahead_of_every_confirmed_one_confirms_it_past_the_budget(tmp_path, compiler,
                                                                                           monkeypatch):
    """On the H200 (--time-budget 10, seed 20261401), 6144x256x8192 confirmed a kernel ahead of
    its batch (0.405 of the library), then its first rung screened 63 to past the budget, the
    best at about 0.89 of the library; with a kernel verified, no confirmation began, and the
    shape kept 0.405. The screen's best is now confirmed, past the budget if need be, where it
    screened ahead of every confirmed kernel: here a re-run, whose earlier run's kernel (0.24
    of the library) is verified from the start, screens after baselines that took the whole
    budget, confirms the best, and keeps it."""
    first = optimize(context(tmp_path, compiler, StandInWorker(times=[400.0])), sm80_search(),
                     Budget(iterations=1, batch=1, patience=None))
    assert first.best["speedup_offline"] < 0.25
    worker = SlowSessionWorker([0.0], baselines_s=3.2, session_s=0.0, screen_s=0.05, call_us=95.0)
    out = paced_run(tmp_path, compiler, monkeypatch, worker, 3.0, batch=4)
    assert worker.screens == [True, False], worker.sessions  # a screening session, then the confirmation
    assert worker.sessions[1] == 1 and out.best["speedup_offline"] > 0.5


def test_a_batch_is_timed_in_one_session_and_a_time_budget_in_sessions_that_fit_it(tmp_path, compiler):
    from cudal2.tune.optimize import next_session

    worker = StandInWorker()
    # (the batches of test_loop_measures_batches_records_rows_and_exports_the_best: built once a session)
    out = optimize(context(tmp_path, compiler, worker), sm80_search(), Budget(iterations=2, batch=2, patience=None))
    # (until one is verified, a kernel whose compile finished first may be measured alone)
    assert worker.sessions[-1] == 2 and sum(worker.sessions) == 4 and out.stopped == "iterations done"
    assert [kernels for kernels, _ in out.sessions] == worker.sessions and out.baselines_s > 0  # where time went
    # memory bounds a session; a time budget too, by the seconds a kernel took in the last one
    assert next_session(8, 8, None, 1.0) == 8 and next_session(8, 3, None, 1.0) == 3
    assert next_session(8, 8, 5.5, 1.0) == 5 and next_session(8, 8, 0.2, 1.0) == 1
    assert next_session(2, 8, 50.0, 1.0) == 2


def test_a_session_holds_as_many_kernels_as_a_fifth_of_the_gpu_memory_allows(tmp_path, compiler):
    from cudal2.tune.pipeline import session_size

    worker = StandInWorker()
    worker.environment = {**H200, "memory_bytes": 150 << 30}
    # 16384^2 fp16: each contestant's three outputs take 1.5 GiB, the inputs 3 GiB
    assert session_size(context(tmp_path, compiler, worker, Problem(16384, 16384, 16384))) == 15
    assert session_size(context(tmp_path, compiler, worker, Problem(65536, 65536, 64))) == 1  # always one
    assert session_size(context(tmp_path, compiler, worker, Problem(64, 64, 64))) > 1000


class FinalistsWorker(StandInWorker):
    """The problem's first baselines session times cuBLASLt's finalists: the autotuning
    picked 3 (95 us), but in the session's rounds the heuristic's first, 0, reads 93."""

    def __init__(self):
        super().__init__()
        self.jobs = []

    def request(self, job, timeout):
        self.jobs.append(job)
        if job["op"] == "baselines" and job.get("finalists"):
            record = {"index": 3, "of": 8, "us": 90.0, "retimed": [3, 5], "tile": 30,
                      "finalist_configs": {"3": {"tile": 30}, "5": {"tile": 50}, "0": {"tile": 1}}}
            errors = {name: (1e-4, 1e-3) for name in ("cuBLAS", "cuBLASLt", "cuBLASLt@5", "cuBLASLt@0")}
            errors["cuBLASLt@0"] = (2e-4, 1e-3)
            return {"status": "ok", "errors": errors, "cublaslt": record,
                    "timings": both_methods(cuBLAS=100.0, cuBLASLt=95.0, **{"cuBLASLt@5": 97.0, "cuBLASLt@0": 93.0})}
        return super().request(job, timeout)


def test_the_first_session_of_a_problem_decides_cublaslt_between_its_finalists(tmp_path, compiler):
    """The autotuning's pick was timed back to back; the finalists are timed again in the
    protocol's own session, and the fastest there is the cuBLASLt every later job runs."""
    worker = FinalistsWorker()
    ctx = context(tmp_path, compiler, worker)
    rows = {r["kernel"]: r for r in measure_baselines(ctx)}
    assert set(rows) == {"cuBLAS", "cuBLASLt"}  # the finalists that lost are not rows
    lt = rows["cuBLASLt"]
    assert lt["kernel_us"] == 93.0 and lt["graph_us"] == pytest.approx(93.0 * 1.02) and lt["max_error"] == 2e-4
    record = json.loads(lt["cublaslt_algo"])
    assert record["index"] == 0 and record["autotuned"] == 3 and record["tile"] == 1 and record["us"] == 90.0
    assert set(record["finalists_us"]) == {"3", "5", "0"} and "finalist_configs" not in record
    assert worker.jobs[0]["finalists"] is True and "cublaslt" not in worker.jobs[0]
    # every later job of the problem carries the choice, and asks for no finalists again
    measure_baselines(ctx)
    assert worker.jobs[1]["finalists"] is False and worker.jobs[1]["cublaslt"]["index"] == 0
    assert ctx.job("kernel", library="k.so")["cublaslt"]["index"] == 0
    # a context's choice belongs to its problem
    ctx.problem = Problem(64, 64, 64)
    assert "cublaslt" not in ctx.job("kernel", library="k.so")


def test_rerun_resumes_and_measures_nothing_twice(tmp_path, compiler):
    first = optimize(context(tmp_path, compiler, StandInWorker()), sm80_search(), Budget(iterations=1, batch=2))
    again = optimize(context(tmp_path, compiler, StandInWorker()), sm80_search(), Budget(iterations=1, batch=2))
    hashes = lambda out: {r["source_hash"] for r in out.rows if r.get("source_hash")}
    assert len(hashes(first)) == 2 and len(hashes(again)) == 2 and not hashes(first) & hashes(again)
    redo = optimize(context(tmp_path, compiler, StandInWorker()), sm80_search(), Budget(iterations=1, batch=2),
                    remeasure=True)
    assert hashes(redo) == hashes(first)  # the same seed proposes the same first batch


def test_search_is_deterministic_for_a_seed_and_varies_across_seeds():
    p = Problem(512, 512, 512)
    assert sm80_search(7).propose(p, [], 5) == sm80_search(7).propose(p, [], 5)
    assert sm80_search(7).propose(p, [], 5) != sm80_search(8).propose(p, [], 5)


def test_search_moves_to_neighbours_of_the_fastest_measured(tmp_path):
    search = sm80_search()
    p = Problem(512, 512, 512)
    best = Candidate.from_template("sm80_mma", get_template("sm80_mma").space.defaults())
    history = [{"status": "ok", "template": "sm80_mma", "params": best.params_json, "offline_us": 10.0, "kernel": "x"}]
    proposals = search.propose(p, history, 4)
    moved = [sum(a != b for a, b in zip(best.params, c.params)) for c in proposals[:2]]
    assert moved == [1, 1] and best not in proposals


def test_search_moves_to_a_value_never_measured_before_the_model_favourites(monkeypatch):
    # A model that wrongly expects split_k=1 to be 3x slower. Every value one step from the
    # best kernel has been measured somewhere (in slower kernels two steps away), except
    # split_k=1: that move comes first.
    import cudal2.search.propose as propose

    monkeypatch.setattr(propose, "predict_us", lambda template, params, problem, device:
                        30.0 if params["split_k"] == 1 else 10.0)
    search = sm80_search()
    space = get_template("sm80_mma").space
    best = {**space.defaults(), "block_m": 64, "block_n": 64, "warps_m": 2, "warps_n": 2, "split_k": 2}
    measured = [best, best, best]  # measured three times: the three fastest rows
    for key, moved in search._neighbours("sm80_mma", best):
        if (key, moved[key]) != ("split_k", 1):
            other = "stages" if key != "stages" else "group_m"
            twice = {**moved, other: 3 if other == "stages" else 16}
            if not space.violations(twice, 90):
                measured.append(twice)
    history = [{"status": "ok", "template": "sm80_mma", "kernel": str(i), "offline_us": 6.7 + i,
                "params": Candidate.from_template("sm80_mma", params).params_json}
               for i, params in enumerate(measured)]
    picks = search.propose(Problem(512, 1024, 512), history, 2)
    assert picks[0].param_dict == {**best, "split_k": 1}


def test_correction_carries_what_one_value_measured_to_configurations_not_yet_measured():
    from cudal2.search.propose import Correction

    a = {"block_m": 64, "split_k": 1}
    b = {"block_m": 64, "split_k": 2}
    c = {"block_m": 128, "split_k": 2}
    # measured over predicted: split_k=1 ran at half the predicted time, split_k=2 as predicted
    correction = Correction([("t", a, 0.5), ("t", b, 1.0), ("t", c, 1.0)])
    assert correction("t", {"block_m": 128, "split_k": 1}) < correction("t", {"block_m": 128, "split_k": 2})
    assert correction("other", a) == 1.0  # nothing measured for that template: no correction
    assert Correction([])("t", a) == 1.0


def test_first_batch_leads_with_what_won_on_the_nearest_problems():
    space = get_template("sm80_mma").space

    def row(m, n, k, speedup, **params):
        cand = Candidate.from_template("sm80_mma", {**space.defaults(), **params})
        return {"status": "ok", "template": "sm80_mma", "params": cand.params_json, "kernel": str(cand),
                "m": m, "n": n, "k": k, "dtype": "fp16", "layout": "nn", "speedup_offline": speedup}

    prior = [row(1024, 1024, 1024, 0.9, block_m=64), row(1024, 1024, 1024, 0.7, block_m=32, warps_m=2),
             row(8192, 8192, 8192, 1.2, block_n=256), row(1024, 1024, 1024, float("nan"), stages=3),
             {**row(1024, 1024, 1024, 2.0), "dtype": "bf16"}]  # another dtype counts as far away
    search = SearchProposer(H200, prior=prior, templates={"sm80_mma": get_template("sm80_mma")})
    first = search.propose(Problem(1000, 1000, 1000), [], 6)
    heads = [(c.param_dict["block_m"], c.param_dict["block_n"]) for c in first[:3]]
    # Half the batch: the nearest problem's two (best first), then the next nearest: the same
    # size in bf16 (distance 4 + 0.1) comes before 8192^3 fp16 (3 * log2(8.192) = 9.1).
    assert heads == [(64, 128), (32, 128), (128, 128)]
    assert all(c.param_dict["stages"] != 3 for c in first[:3])  # a NaN speedup is no evidence


def test_with_the_prebuilt_set_a_first_batch_takes_no_unbuilt_winner_of_another_problem():
    # On a GPU without shipped rows, a shape set's earlier fp16 nn winners warm-start its bf16 nt
    # decode shape; their bf16 nt builds are not in the set, and the first batch waited 48 s on
    # nvcc with the prebuilt set built. The set's configurations fill the batch instead; what
    # won nearby may come in a later batch.
    space = get_template("sm80_mma").space
    winners = [Candidate.from_template("sm80_mma", {**space.defaults(), "block_m": bm, "block_n": bn})
               for bm, bn in ((64, 64), (128, 64))]
    prior = [{"status": "ok", "template": "sm80_mma", "params": c.params_json, "kernel": str(c), "m": 384, "n": 1536,
              "k": 768, "dtype": "fp16", "layout": "nn", "speedup_offline": 1.2} for c in winners]
    problem = Problem(8, 3072, 2048, "bf16", "nt")
    ranked = SearchProposer(H200, templates={"sm80_mma": get_template("sm80_mma")}).propose(problem, [], 12)
    built = [(c.template, c.param_dict) for c in ranked if c not in winners][4:10]
    search = SearchProposer(H200, prior=prior, templates={"sm80_mma": get_template("sm80_mma")},
                            built=lambda p: built, cached=lambda p, name, params: (name, params) in built)
    first = search.propose(problem, [], 4)
    assert [(c.template, c.param_dict) for c in first] == built[:4]
    # Without a prebuilt set the nearest winners still lead the first batch.
    plain = SearchProposer(H200, prior=prior, templates={"sm80_mma": get_template("sm80_mma")},
                           cached=lambda p, name, params: (name, params) in built)
    assert set(plain.propose(problem, [], 4)[:2]) == set(winners)


def test_nearest_winners_still_come_when_this_problem_has_only_a_weak_history():
    space = get_template("sm80_mma").space
    winner = Candidate.from_template("sm80_mma", {**space.defaults(), "block_m": 16, "warps_m": 1, "split_k": 2})
    prior = [{"status": "ok", "template": "sm80_mma", "params": winner.params_json, "kernel": str(winner),
              "m": 16, "n": 4096, "k": 4096, "dtype": "bf16", "layout": "nt", "speedup_offline": 1.09}]
    default = Candidate.from_template("sm80_mma", space.defaults())
    history = [{"status": "ok", "template": "sm80_mma", "params": default.params_json, "offline_us": 146.0, "kernel": "d"}]
    search = SearchProposer(H200, prior=prior, templates={"sm80_mma": get_template("sm80_mma")})
    picks = search.propose(Problem(16, 4096, 14336, "bf16", "nt"), history, 4)
    assert picks[0] == winner  # then a neighbour of the default
    assert sum(a != b for a, b in zip(default.params, picks[1].params)) == 1


def test_a_problem_measured_before_starts_from_its_own_winners():
    # A fresh results directory on a GPU the package has measurements of: the shipped best of
    # this very problem comes first (a dev-set run started 1024x128x16384 from a neighbour's
    # winner at 0.19x, with its own 0.94x kernel in the shipped file), unless measured here.
    space = get_template("sm80_mma").space
    own = Candidate.from_template("sm80_mma", {**space.defaults(), "block_m": 64, "warps_m": 2, "stages": 3})
    near = Candidate.from_template("sm80_mma", {**space.defaults(), "block_n": 64})
    prior = [{"status": "ok", "template": "sm80_mma", "params": c.params_json, "kernel": str(c), "m": m, "n": 128,
              "k": 16384, "dtype": "fp16", "layout": "nn", "speedup_offline": s}
             for c, m, s in ((near, 2048, 1.1), (own, 1024, 0.94))]
    search = SearchProposer(H200, prior=prior, templates={"sm80_mma": get_template("sm80_mma")})
    problem = Problem(1024, 128, 16384)
    assert search.propose(problem, [], 4)[:2] == [own, near]
    measured = [{**prior[1], "offline_us": 20.0}]  # measured in this results directory: not again
    assert own not in search.propose(problem, measured, 4)


def test_search_stays_within_a_given_grid(tmp_path, compiler):
    from cudal2.kernels.render import template_grid

    # (configurations other tests of the session compile too)
    grid = template_grid("sm80_mma", {"stages": ["3", "4", "5"]}, 90)
    search = SearchProposer(H200, within=grid)
    out = optimize(context(tmp_path, compiler, StandInWorker()), search, Budget(iterations=5, batch=2, patience=None))
    measured = {r["kernel"] for r in out.rows if r["kernel"] not in BASELINES}
    assert measured == {str(c) for c in grid}  # all three, nothing outside, then nothing new
    assert out.stopped == "the proposer has nothing new"


def test_first_batch_spans_the_models_distinct_predictions_nearest_the_defaults():
    # Configurations the cost model prices alike (stages, cluster orientation, ...) are one
    # option to it: a first batch tries distinct ones, each as its template's defaults would
    # have it where the model cannot tell (a 3072x768x3072 search once spent all 16 kernels on
    # one tile shape's stage counts).
    from cudal2.search.cost import predict_us

    search, p = sm80_search(), Problem(512, 512, 512)
    template = get_template("sm80_mma")
    picks = search.propose(p, [], 6)
    prices = [round(math.log(predict_us(template, c.param_dict, p, H200)), 3) for c in picks]
    assert len(set(prices)) == len(picks) == 6
    defaults = template.space.defaults()

    def distance(params):
        return sum(v != defaults[k] for k, v in params.items())

    for pick, price in zip(picks, prices):
        alike = [params for t, _, params in search.ranking(p) if round(math.log(t), 3) == price]
        assert distance(pick.param_dict) == min(map(distance, alike))


def test_a_corrected_ranking_reads_in_the_order_sorting_all_of_it_gives():
    # A batch reads a few hundred entries of a 320,000-entry ranking by corrected price;
    # sorting every entry each batch cost seconds. The lazy merge must give sorted()'s order,
    # ties in ranking order, whatever the correction does (here it lowers some entries 3x).
    import random

    from cudal2.search.propose import Correction, Ranking

    template = get_template("sm80_mma")
    keys = tuple(template.space.params)
    configs = list(template.space.value_sets(90))[:3000]
    rng = random.Random(5)
    entries = sorted(((float(rng.randint(10, 400)), "sm80_mma", values) for values in configs), key=lambda e: e[0])
    ranking = Ranking(entries, {"sm80_mma": template})
    measured = [("sm80_mma", dict(zip(keys, values)), rng.choice([0.3, 0.5, 1.0, 2.0])) for values in configs[:40]]
    correction = Correction(measured)
    assert correction.lowest() <= min(correction(name, params) for _, name, params in ranking)
    everything = sorted(((t * correction(name, params), name, params) for t, name, params in ranking),
                        key=lambda e: e[0])
    assert list(ranking.corrected(correction)) == everything


def test_a_hopper_ranking_keeps_each_configuration_in_a_few_bytes():
    # A ranking of every sm80_mma configuration keeps its value tuples (shared with the space),
    # not a dictionary each: 170 MB a problem over the Hopper spaces as dictionaries.
    import tracemalloc

    # (gemv, which cannot run the problem, keeps this module's memo of sm80_mma rankings out)
    search = SearchProposer(H200, templates={"sm80_mma": get_template("sm80_mma"), "gemv": get_template("gemv")})
    p = Problem(1000, 2000, 3000)
    search.ranking(Problem(10, 20, 30))  # the space's enumeration, shared by every problem
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    ranking = search.ranking(p)
    kept = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert len(ranking) > 50_000
    assert kept / len(ranking) < 64, kept / len(ranking)
    first = next(iter(ranking))
    assert first[1] == "sm80_mma" and set(first[2]) == set(get_template("sm80_mma").space.params)


def test_search_prefers_configurations_already_compiled():
    p = Problem(512, 512, 512)
    plain = sm80_search().propose(p, [], 4)
    favourite = plain[3]
    search = SearchProposer(H200, templates={"sm80_mma": get_template("sm80_mma")},
                            cached=lambda problem, name, params: params == favourite.param_dict)
    assert search.propose(p, [], 4)[0] == favourite


@pytest.fixture(scope="module")
def rankings() -> dict:
    """The search's whole rankings (SearchProposer.ranking) by problem, computed once for the
    tests below: seconds of one core each (every template's space, 420,000 configurations)."""
    return {}


@pytest.fixture
def hopper_ranking(rankings):
    """The search over every template at 4096^3 on an H200, as a fresh run proposes (12).
    For the test's length, search proposers of every template with the default seed share
    their rankings (what they rank does not depend on what is built)."""
    from cudal2.kernels.render import load_templates

    real = SearchProposer.ranking

    def ranking(self, problem):
        if self.within is not None or self.seed != 0 or self.device != H200 or self.templates.keys() != load_templates().keys():
            return real(self, problem)
        if problem not in rankings:
            rankings[problem] = real(self, problem)
        return rankings[problem]

    patch = pytest.MonkeyPatch()  # its own: a test's monkeypatch.undo() leaves it in place
    patch.setattr(SearchProposer, "ranking", ranking)
    p = Problem(4096, 4096, 4096)
    yield p, SearchProposer(H200).propose(p, [], 12)
    patch.undo()


def test_a_first_batch_measures_every_built_configuration_before_compiling_any(hopper_ranking):
    # The prebuilt set is what a first batch runs: three built configurations the model
    # ranks 9th-11th come before its own top picks, none of them built (a 20 s budget on a
    # shape set once went to compiling one kernel per shape, with 180 built ones unused).
    p, ranked = hopper_ranking
    built = ranked[8:11]
    search = SearchProposer(H200, cached=lambda problem, name, params: any(
        name == c.template and params == c.param_dict for c in built))
    picks = search.propose(p, [], 4)
    assert set(picks[:3]) == set(built) and picks[3] not in built


def test_with_nothing_built_a_first_batch_holds_the_template_that_compiles_in_seconds(hopper_ranking):
    # From an empty cache the model's top four are CUTLASS kernels (35 s of nvcc each); one
    # sm80_mma configuration (4 s) among them gives the run a verified kernel within a minute.
    p, ranked = hopper_ranking
    assert {c.template for c in ranked[:4]} == {"sm90_cutlass"}
    picks = SearchProposer(H200, cached=lambda problem, name, params: False).propose(p, [], 4)
    assert picks[:3] == ranked[:3] and picks[3].template == "sm80_mma"
    assert get_template("sm80_mma").space.compile_s < get_template("sm90_cutlass").space.compile_s


def test_a_first_batch_with_enough_built_configurations_ranks_them_alone(hopper_ranking, monkeypatch):
    # Ranking the whole Hopper space takes seconds a problem (230,000 configurations); a
    # first batch drawn from the prebuilt set ranks its 150 or so built configurations alone,
    # best predicted first, and leaves the whole ranking to the next batch.
    p, ranked = hopper_ranking
    built = [(c.template, c.param_dict) for c in ranked[4:12]]
    search = SearchProposer(H200, built=lambda problem: built,
                            cached=lambda problem, name, params: (name, params) in built)
    monkeypatch.setattr(search, "ranking", lambda problem: pytest.fail("the whole space was ranked"))
    assert search.propose(p, [], 4) == ranked[4:8]
    monkeypatch.undo()  # fewer built than wanted: the whole ranking, the built ones first
    few = built[:2]
    picks = SearchProposer(H200, built=lambda problem: few,
                           cached=lambda problem, name, params: (name, params) in few).propose(p, [], 4)
    assert [(c.template, c.param_dict) for c in picks[:2]] == few and picks[2:] == ranked[:2]


def test_recorded_parameters_complete_with_defaults_of_newer_parameters():
    space = get_template("sm80_mma").space
    older = {k: v for k, v in space.defaults().items() if k != "split_k"}  # recorded before split_k existed
    assert space.complete(older) == space.defaults()
    assert space.complete({**older, "retired": 1}) is None and space.complete({"block_m": 100}) is None
    # Kernels recorded before `epilogue` existed stored C directly, though the default is now smem.
    before_epilogue = {k: v for k, v in space.defaults().items() if k != "epilogue"}
    assert space.defaults()["epilogue"] == "smem" and space.complete(before_epilogue)["epilogue"] == "direct"
    split = {**before_epilogue, "block_m": 16, "warps_m": 1, "split_k": 4}  # reduced through smem then too
    assert space.complete(split) == {**split, "epilogue": "smem"}


def test_patience_stops_a_run_that_no_longer_improves(tmp_path, compiler):
    worker = StandInWorker(times=[50.0, 60.0, 70.0, 80.0, 90.0, 95.0])
    out = optimize(context(tmp_path, compiler, worker), sm80_search(), Budget(iterations=5, batch=2, patience=1))
    assert "patience" in out.stopped and len(worker.kernels) == 4
    assert out.best["offline_us"] == 50.0


def test_a_time_budget_the_baselines_spend_still_measures_the_built_kernels_of_the_first_batch(tmp_path, compiler):
    """The budget is spent before the first batch is proposed (on a fresh machine the
    baselines' session compiles the library shims: 19 s of a 20 s budget, and a shape ended
    with nothing measured): the batch's built kernel is measured, its unbuilt one is not
    compiled, and nothing more is proposed."""
    problem = Problem(256, 256, 256)
    built = template_candidate("sm80_mma", {}, 90)
    compiler = cache_holding(tmp_path / "cache", compiler, [render(built, problem)])
    unbuilt = template_candidate("sm80_mma", {"stages": "3"}, 90)
    scripted = Scripted([built, unbuilt], [template_candidate("sm80_mma", {"stages": "5"}, 90)])
    out = optimize(context(tmp_path, compiler, StandInWorker()), scripted, Budget(iterations=5, batch=2, time_s=0.0))
    assert out.stopped == "time budget spent (while the next batch compiled); the 1 kernel(s) built by then measured"
    assert [r["kernel"] for r in out.rows if r["kernel"] not in BASELINES] == [str(built)]
    assert out.best is not None and out.compile_s == 0.0 and scripted.batches  # the second batch never asked for
    assert compiler.lookup(render(unbuilt, problem)) is None


def test_time_budget_waits_for_a_slow_compile_only_so_long_past_its_end(tmp_path, monkeypatch):
    """With nothing verified when the budget ends, the run waits PROPOSAL_WAIT_S past it for
    a build; the CUTLASS compile (a minute) is not done by then: it is stopped with the run,
    leaves nothing in the cache and no thread behind."""
    import sys
    import threading
    import time as clock

    from cudal2.kernels.compile import Compiler

    monkeypatch.setattr(sys.modules["cudal2.tune.optimize"], "PROPOSAL_WAIT_S", 2.0)  # a minute in a run
    compiler = Compiler("sm_90a", tmp_path / "cache")  # empty: the CUTLASS kernel takes minutes
    before = set(threading.enumerate())
    began = clock.monotonic()
    out = optimize(context(tmp_path, compiler, StandInWorker()), Scripted([template_candidate("sm90_cutlass", {}, 90)]),
                   Budget(iterations=3, batch=1, time_s=0.5))
    assert out.stopped == "time budget spent (while the next batch compiled)" and out.best is None
    assert clock.monotonic() - began < 20
    for thread in set(threading.enumerate()) - before:  # nothing keeps compiling behind the run
        thread.join(timeout=30)
        assert not thread.is_alive()
    assert not list((tmp_path / "cache" / "kernels").glob("*/*"))  # the stopped compile left nothing


class Scripted:
    """A proposer returning fixed proposals (stands in for a model's replies)."""

    name = "scripted"

    def __init__(self, *batches):
        self.batches = list(batches)

    def propose(self, problem, history, n):
        return self.batches.pop(0) if self.batches else []


def test_a_kernel_measured_ahead_of_its_batch_is_recorded_in_the_batch_s_one_part(tmp_path, compiler):
    """The built kernel is measured while the other compiles (a few seconds of nvcc), and its
    row goes into the batch's part with the other's: one part per batch, beside the
    baselines' part."""
    problem = Problem(256, 256, 256)
    quick = template_candidate("sm80_mma", {}, 90)
    compiler = cache_holding(tmp_path / "cache", compiler, [render(quick, problem)])
    other = template_candidate("sm80_mma", {"stages": "3"}, 90)  # not built: compiled in the batch
    order = []
    out = optimize(context(tmp_path, compiler, StandInWorker()), Scripted([quick, other]),
                   Budget(iterations=1, batch=2, patience=None),
                   on_event=lambda kind, info: order.append(info["row"]["kernel"]) if kind == "measured" else None)
    assert order == [str(quick), str(other)] and out.stopped == "iterations done"
    parts = list((tmp_path / "results" / "leaderboard").glob("*.parquet"))
    assert len(parts) == 2
    kernels = Leaderboard(tmp_path / "results").read()["kernel"]
    assert sorted(kernels[~kernels.isin(BASELINES)]) == sorted([str(quick), str(other)])


def test_the_proposer_is_shown_as_pending_only_what_is_not_measured_yet(tmp_path, compiler):
    """A kernel measured ahead of its batch (while the other compiles) is measured, not
    pending, when the next batch is proposed; and once its batch is measured no candidate of
    it is shown as pending again."""
    problem = Problem(256, 256, 256)
    quick = template_candidate("sm80_mma", {}, 90)
    compiler = cache_holding(tmp_path / "cache", compiler, [render(quick, problem)])  # measured ahead of its batch
    other = template_candidate("sm80_mma", {"stages": "3"}, 90)
    third = template_candidate("sm80_mma", {"stages": "2"}, 90)
    seen = []

    class Recording(Scripted):
        def propose(self, problem, history, n):
            seen.append(list(history))
            return super().propose(problem, history, n)

    out = optimize(context(tmp_path, compiler, StandInWorker()), Recording([quick, other], [third], []),
                   Budget(iterations=3, batch=2, patience=None))
    assert out.stopped == "the proposer has nothing new" and len(seen) == 3
    for history in seen:
        measured = {r["kernel"] for r in history if r["status"] != "pending"}
        pending = {r["kernel"] for r in history if r["status"] == "pending"}
        assert not measured & pending, (measured & pending)
    assert {r["kernel"] for r in seen[1] if r["status"] == "pending"} == {str(other)}  # compiled ahead, not yet measured
    assert not [r for r in seen[2] if r["status"] == "pending" and r["kernel"] != str(third)]


def test_a_kernel_built_while_its_batch_compiles_is_measured_at_once(tmp_path, compiler):
    """Until a kernel is verified, each build of the compiling batch is measured as soon as
    it is there: the built sm80_mma kernel is measured within the 3 s budget while the
    CUTLASS one (about a minute of nvcc) compiles, and that compile is stopped at the end."""
    import time as clock

    quick = template_candidate("sm80_mma", {}, 90)
    problem = Problem(256, 256, 256)
    # built before the run (a cache a CPU host filled)
    compiler = cache_holding(tmp_path / "cache", compiler, [render(quick, problem)])
    slow = template_candidate("sm90_cutlass", {}, 90)  # a CUTLASS compile: about a minute
    began, measured_at = clock.monotonic(), []
    out = optimize(context(tmp_path, compiler, StandInWorker()), Scripted([quick, slow]),
                   Budget(iterations=2, batch=2, time_s=3.0),
                   on_event=lambda kind, info: measured_at.append(clock.monotonic() - began) if kind == "measured" else None)
    assert clock.monotonic() - began < 30
    assert out.stopped == "time budget spent (while the next batch compiled)"
    assert len(measured_at) == 1 and measured_at[0] < 3.0
    assert out.first_verified_s is not None and out.first_verified_s <= measured_at[0]  # what the summary says
    assert out.best is not None and out.best["kernel"] == str(quick) and out.exported.is_file()
    measured = Leaderboard(tmp_path / "results").read()
    assert list(measured[~measured["kernel"].isin(BASELINES)]["kernel"]) == [str(quick)]


def test_a_screened_batch_confirms_its_best_and_screened_rows_are_never_ranked_exported_or_priors(tmp_path, compiler,
                                                                                              monkeypatch):
    """Successive halving: four candidates screened (graph method alone), the best quarter
    confirmed by the full protocol. Only the confirmed row is ranked, exported, shown to a
    model or taken as a prior; the screened rows say what was screened, no speedup."""
    from cudal2.results.leaderboard import priors
    from cudal2.kernels.prebuilt import kernel_set
    from cudal2.search.prompt import round_facts
    from cudal2.tune.optimize import problem_history
    from cudal2.search.propose import nearest_winners, tried
    from cudal2.protocol import SCREEN_PROTOCOL, SCREENED, best, best_row

    worker = StandInWorker(times=[70.0, 50.0, 90.0, 60.0, 52.0])  # screened in call order, then confirmed
    ctx = context(tmp_path, compiler, worker)
    # built before, and the batch waited for whole however slow this machine reads the cache
    # (else the first build is measured alone, ahead of its batch)
    compiler.compile_all([render(c, ctx.problem) for c in sm80_search().propose(ctx.problem, [], 4)])
    monkeypatch.setattr(sys.modules["cudal2.tune.optimize"], "EARLY_WAIT_S", 30.0)
    out = optimize(ctx, sm80_search(), Budget(iterations=1, batch=1, screen=4, patience=None))
    assert worker.screens == [True, False] and worker.sessions == [4, 1]
    screened = [r for r in out.rows if r.get("protocol") == SCREEN_PROTOCOL]
    assert [r["status"] for r in screened] == [SCREENED] * 4 and out.screened == 4
    assert all(r.get("speedup_offline") is None and r["speedup_graph"] > 0 for r in screened)
    confirmed = [r for r in out.rows if r["kernel"] not in BASELINES and r.get("protocol") == PROTOCOL]
    assert [r["kernel"] for r in confirmed] == [screened[1]["kernel"]] and confirmed[0]["offline_us"] == 52.0
    assert out.best["kernel"] == screened[1]["kernel"] and out.best["protocol"] == PROTOCOL
    assert "speedup 1.8" in out.exported.read_text()  # 95 * 1.02 / (52 * 1.02): the confirmed time
    assert out.statuses == {SCREENED: 4, "ok": 1} and out.contributions["search"]["candidates"] == 4

    every = Leaderboard(tmp_path / "results").read(protocol=None)
    assert set(every["protocol"]) == {PROTOCOL, SCREEN_PROTOCOL}
    only_screened = every[every["protocol"] == SCREEN_PROTOCOL]
    assert best(only_screened).empty and best_row(only_screened.to_dict("records")) is None
    assert list(best(every)["kernel"]) == [out.best["kernel"]]
    prior = priors(every, "NVIDIA H200")  # (with the shipped measurements)
    assert [r["kernel"] for r in prior if r["run_id"] == "run-1" and isinstance(r["template"], str)] == [out.best["kernel"]]
    assert nearest_winners(Problem(512, 512, 512), only_screened.to_dict("records")) == []
    assert kernel_set(90, only_screened, regions=False) == []
    assert sm80_search()._correction(ctx.problem, only_screened.to_dict("records"))("sm80_mma", {}) == 1.0
    facts = round_facts(ctx.problem, only_screened.to_dict("records"), 4, cc=90, device=H200, prior=[], max_tokens=999)
    assert facts["best"] == [] and facts["failures"] == []
    # a re-run screens nothing twice: it knows what was screened
    history = problem_history(context(tmp_path, compiler, StandInWorker()))
    assert {(r["template"], r["params"]) for r in screened} <= tried(history)


def test_under_a_budget_the_gpu_measures_built_candidates_while_the_others_compile_behind_it(tmp_path, compiler):
    """Built first: of a batch of one built and one unbuilt candidate, the built one is on
    the GPU before the other's compile ends (the GPU never waits on nvcc while a built
    candidate is unmeasured); the unbuilt one, compiled behind the GPU, is measured when built."""
    import time as clock

    problem = Problem(256, 256, 256)
    built = template_candidate("sm80_mma", {}, 90)
    compiler.compile(render(built, problem))
    unbuilt = template_candidate("sm80_mma", {"stages": "2", "group_m": "1"}, 90)  # built by no other test
    assert compiler.lookup(render(unbuilt, problem)) is None
    began, events = clock.monotonic(), []
    out = optimize(context(tmp_path, compiler, StandInWorker()), Scripted([unbuilt, built]),
                   Budget(iterations=2, batch=2, time_s=600.0, patience=None),
                   on_event=lambda kind, info: events.append((info["row"]["kernel"], clock.monotonic() - began))
                   if kind == "measured" else None)
    assert [kernel for kernel, _ in events] == [str(built), str(unbuilt)]
    compiled_s = next(r for r in out.rows if r["kernel"] == str(unbuilt))["compile_s"]
    assert events[0][1] < compiled_s  # measured while the other compiled
    assert out.compile_s == pytest.approx(compiled_s) and out.stopped == "iterations done"


def test_out_of_patience_under_a_budget_a_run_measures_what_still_compiles_behind_the_gpu(tmp_path, compiler):
    """Patience counts batches whose proposals were measured: the first batch's unbuilt
    candidate still compiles behind the GPU when the second batch (built, no better) runs out
    of patience. The run waits for it within its budget, measures it, and it is the best
    (the search goes on, until its proposer has nothing new)."""
    problem = Problem(256, 256, 256)
    built_a = template_candidate("sm80_mma", {}, 90)
    built_b = template_candidate("sm80_mma", {"stages": "3"}, 90)
    for candidate in (built_a, built_b):
        compiler.compile(render(candidate, problem))
    unbuilt = template_candidate("sm80_mma", {"stages": "5", "group_m": "1"}, 90)  # built by no other test
    assert compiler.lookup(render(unbuilt, problem)) is None
    worker = StandInWorker(times=[60.0, 70.0, 40.0])  # in the order measured
    out = optimize(context(tmp_path, compiler, worker), Scripted([unbuilt, built_a], [built_b]),
                   Budget(iterations=5, batch=2, time_s=600.0, patience=1))
    measured = [r["kernel"] for r in out.rows if r["kernel"] not in BASELINES and r["status"] == "ok"]
    assert measured == [str(built_a), str(built_b), str(unbuilt)]
    assert out.best["kernel"] == str(unbuilt) and out.best["offline_us"] == 40.0
    assert out.stopped == "the proposer has nothing new"


def test_out_of_patience_a_run_does_not_wait_for_a_build_its_budget_cannot_hold(tmp_path, compiler):
    """The same, with a CUTLASS build behind the GPU (35 s expected) and 20 s of budget: the
    run stops on patience at once, and the build is stopped with it."""
    import time as clock

    problem = Problem(256, 256, 256)
    built_a = template_candidate("sm80_mma", {}, 90)
    built_b = template_candidate("sm80_mma", {"stages": "3"}, 90)
    for candidate in (built_a, built_b):
        compiler.compile(render(candidate, problem))
    slow = template_candidate("sm90_cutlass", {"tile_n": "64"}, 90)
    assert compiler.lookup(render(slow, problem)) is None
    began = clock.monotonic()
    out = optimize(context(tmp_path, compiler, StandInWorker(times=[60.0, 70.0])), Scripted([slow, built_a], [built_b]),
                   Budget(iterations=5, batch=2, time_s=20.0, patience=1))
    assert "patience" in out.stopped and clock.monotonic() - began < 10.0
    assert str(slow) not in {r["kernel"] for r in out.rows} and compiler.lookup(render(slow, problem)) is None


def test_a_run_whose_budget_ends_before_any_build_still_measures_the_quickest(tmp_path, monkeypatch):
    """From an empty cache, a budget spent at once: the quickest template's candidate is
    compiled first (behind the GPU), measured, and the run ends with a verified kernel; the
    CUTLASS compile (a minute) is stopped with the run and leaves nothing."""
    from cudal2.kernels.compile import Compiler

    compiler = Compiler("sm_90a", tmp_path / "cache")
    problem = Problem(256, 256, 256)
    slow, quick = template_candidate("sm90_cutlass", {}, 90), template_candidate("sm80_mma", {}, 90)
    out = optimize(context(tmp_path, compiler, StandInWorker()), Scripted([slow, quick]),
                   Budget(iterations=3, batch=2, time_s=0.0))
    assert out.best is not None and out.best["kernel"] == str(quick) and out.exported.is_file()
    assert out.stopped.startswith("time budget spent") and [r["kernel"] for r in out.rows
                                                          if r["kernel"] not in BASELINES] == [str(quick)]
    assert compiler.lookup(render(slow, problem)) is None


def test_invalid_and_unbuildable_proposals_become_rows(tmp_path, compiler):
    example = (Path(__file__).parent.parent / "examples" / "simt_gemm_fp16_nn.cu").read_text()
    batch = [Invalid("no candidate blocks in the reply", "I think tiles should be bigger"),
             Candidate.from_source("int broken(", label="broken.cu"),
             Candidate.from_source(example, label="simt.cu"),
             Candidate.from_source(example, label="simt-again.cu")]  # same source: measured once
    out = optimize(context(tmp_path, compiler, StandInWorker()), Scripted(batch), Budget(iterations=3, batch=4))
    by_kernel = {r["kernel"]: r for r in out.rows}
    assert by_kernel["scripted proposal"]["status"] == "invalid"
    assert "no candidate blocks" in by_kernel["scripted proposal"]["error"]
    assert by_kernel["broken.cu"]["status"] == "compile_error"
    assert by_kernel["simt.cu"]["status"] == "ok" and "simt-again.cu" not in by_kernel
    assert out.duplicates == 1 and out.stopped == "the proposer has nothing new"
    assert out.exported.read_text().count("cudal2_gemm(") == 1


def test_hybrid_splits_the_batch_and_search_fills_the_rest():
    example = (Path(__file__).parent.parent / "examples" / "simt_gemm_fp16_nn.cu").read_text()
    hybrid = HybridProposer(Scripted([Candidate.from_source(example, "llm-1"), Invalid("bad", "x")]), sm80_search())
    proposals = hybrid.propose(Problem(512, 512, 512), [], 4)
    assert [type(p).__name__ for p in proposals] == ["Candidate", "Invalid", "Candidate", "Candidate", "Candidate"]
    assert all(p.template == "sm80_mma" for p in proposals[2:])


@pytest.mark.parametrize("args, text", [
    (("--proposer", "magic"), "unknown proposer 'magic'"),
    (("--mode", "both"), "unknown mode 'both'"),
    (("--iterations", "0"), "--iterations must be >= 1"),
    (("--param", "stages=3"), "--param needs --template"),
    (("--template", "sm80_mma", "--proposer", "llm"), "restrict the search proposer"),
    (("--template", "nope"), "unknown template 'nope'"),
])
def test_optimize_rejects_bad_options_in_one_line(args, text, tmp_path):
    result = CliRunner().invoke(app, ["optimize", "--m", "64", "--n", "64", "--k", "64", "--results", str(tmp_path), *args])
    assert result.exit_code == 1 and result.output.strip() == f"error: {result.output.strip()[7:]}"
    assert text in result.output


@pytest.mark.parametrize("args, text", [
    (("--m", "64", "--n", "64"), "give --m, --n and --k, or a shape set"),
    (("--shapes", "missing.csv"), "cannot read shape set missing.csv"),
    (("--model", "llama9"), "unknown model 'llama9'"),
    (("--model", "llama3-8b", "--tokens", "1,x"), "comma-separated integers"),
    (("--model", "llama3-8b", "--m", "64"), "not both"),
    (("--shapes", "missing.csv", "--model", "llama3-8b"), "a shape file or a model preset, not both"),
    (("--m", "64", "--n", "64", "--k", "64", "--replay", "saved"), "--replay stands in for the llm endpoint"),
    (("--m", "64", "--n", "64", "--k", "64", "--proposer", "llm", "--replay", "nowhere"), "no replay directory nowhere"),
])
def test_optimize_names_a_bad_shape_set_in_one_line(args, text, tmp_path):
    result = CliRunner().invoke(app, ["optimize", "--results", str(tmp_path), *args])
    assert result.exit_code == 1 and result.output.strip().startswith("error: ") and len(result.output.strip().splitlines()) == 1
    assert text in result.output


def test_llm_proposals_from_a_loopback_endpoint_run_through_the_loop(tmp_path, compiler, endpoint, monkeypatch):
    from conftest import fenced

    from cudal2.search.llm import LLMProposer, LLMSettings

    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-not-written")
    example = (Path(__file__).parent.parent / "examples" / "simt_gemm_fp16_nn.cu").read_text()
    endpoint.reply("The simple kernel is a start.\n" + fenced("cuda", example) + "\n" + fenced("json", '{"template": "nope"}'))
    ctx = context(tmp_path, compiler, StandInWorker())
    llm = LLMProposer(LLMSettings(base_url=endpoint.url, max_retries=0), run_dir=tmp_path / "run", cc=90, device=H200)
    out = optimize(ctx, llm, Budget(iterations=2, batch=2))
    statuses = sorted(r["status"] for r in out.rows if r["kernel"] not in BASELINES)
    assert statuses == ["invalid", "ok"]
    assert "unknown template 'nope'" in next(r["error"] for r in out.rows if r["status"] == "invalid")
    assert "95.00 us" in endpoint.prompt(0)  # the fastest baseline (cuBLASLt here) reached the model
    # The second round found the endpoint failing (its script ran out: HTTP 500): the run
    # stops with that reason and keeps, and exports, what it measured.
    assert len(endpoint.requests) == 2 and "HTTP 500" in out.stopped
    assert out.exported is not None and out.exported.is_file()


def test_best_is_judged_in_the_run_mode_and_ignores_missing_speedups():
    from cudal2.tune.optimize import best_row

    rows = [{"kernel": "a", "status": "ok", "speedup_offline": 1.2, "speedup_server": float("nan")},
            {"kernel": "b", "status": "ok", "speedup_offline": 0.9, "speedup_server": 1.4},
            {"kernel": "c", "status": "cheat", "speedup_offline": 9.0, "speedup_server": 9.0},
            {"kernel": "cuBLAS", "status": "ok", "speedup_offline": 1.0, "speedup_server": 1.0}]
    assert best_row(rows, "offline")["kernel"] == "a"
    assert best_row(rows, "server")["kernel"] == "b"
    assert best_row(rows[2:], "offline") is None


class KilledWorker(StandInWorker):
    """A stand-in killed (Ctrl-C) at its `at`-th kernel request."""

    def __init__(self, at: int):
        super().__init__()
        self.at = at

    def request(self, job, timeout):
        if job["op"] == "kernel" and len(self.kernels) + 1 == self.at:
            raise KeyboardInterrupt
        return super().request(job, timeout)


def shape_set_run(tmp_path, compiler, worker, problems):
    """The set tuned by a search of three sm80_mma configurations (two of them compiled by
    other tests of the session too), two a shape."""
    from cudal2.tune.optimize import optimize_shapes
    from cudal2.kernels.render import template_grid

    def make(problem, slot):
        return context(tmp_path, compiler, worker, problem)

    grid = template_grid("sm80_mma", {"stages": ["3", "4", "5"]}, 90)
    return optimize_shapes(problems, make, lambda ctx: SearchProposer(H200, within=grid),
                           Budget(iterations=1, batch=2, patience=None))


def test_a_shape_set_is_tuned_in_one_run_and_a_killed_run_resumes(tmp_path, compiler):
    problems = [Problem(256, 256, 256), Problem(128, 512, 64), Problem(64, 64, 1000, "bf16", "nt")]
    with pytest.raises(KeyboardInterrupt):
        shape_set_run(tmp_path, compiler, KilledWorker(at=4), problems)
    board = Leaderboard(tmp_path / "results").read()
    kept = board[~board["kernel"].isin(BASELINES)]
    # the first shape's session was measured before the kill; of the second shape's, killed
    # part-way, only a kernel measured ahead of its batch (one whose build was there first,
    # which depends on what this session's cache holds) is kept; the third was never started
    counts = kept.groupby("m").size().to_dict()
    assert counts.pop(256) == 2 and counts.pop(128, 0) <= 1 and not counts
    outcomes = shape_set_run(tmp_path, compiler, StandInWorker(), problems)
    assert [o.best is not None for o in outcomes] == [True, True, True]
    board = Leaderboard(tmp_path / "results").read()
    kernels = board[~board["kernel"].isin(BASELINES)]
    assert not kernels.duplicated(["m", "n", "k", "dtype", "layout", "source_hash"]).any()  # nothing measured twice
    assert set(zip(kernels["m"], kernels["dtype"])) == {(256, "fp16"), (128, "fp16"), (64, "bf16")}


def test_a_round_replayed_from_saved_replies_runs_through_the_loop(tmp_path, compiler):
    from conftest import fenced

    from cudal2.search.llm import LLMProposer, LLMSettings, ReplayClient

    saved = tmp_path / "saved"
    saved.mkdir()
    example = (Path(__file__).parent.parent / "examples" / "simt_gemm_fp16_nn.cu").read_text()
    (saved / "llm-round-1-reply.md").write_text("A plain kernel first.\n" + fenced("cuda", example))
    llm = LLMProposer(LLMSettings(), run_dir=tmp_path / "run", cc=90, device=H200, client=ReplayClient(saved))
    out = optimize(context(tmp_path, compiler, StandInWorker()), llm, Budget(iterations=2, batch=1))
    kernels = [r for r in out.rows if r["kernel"] not in BASELINES]
    assert [(r["status"], r["template"]) for r in kernels] == [("ok", None)]  # the free-form kernel, measured
    assert "no reply for round 2" in out.stopped


# A free-form source that declares a record of resources as the templates do, with made-up values.
FORGED = """#include <cuda_runtime.h>
struct Cudal2Resources { char tag[20]; int dynamic_smem_bytes, producer_registers, consumer_registers; };
extern "C" const Cudal2Resources cudal2_resources = {"cudal2-resources", 1, 2, 3};
extern "C" int cudal2_gemm(const void*, const void*, void*, int, int, int, void*, size_t, cudaStream_t) { return 1; }
"""


def test_a_template_kernels_declared_resources_reach_its_row_and_the_next_prompt(tmp_path, compiler):
    """Compiled for real: the template's record (its dynamic shared memory, which ptxas counts
    as 0) is kept on its leaderboard row and shown in the next round's prompt; a free-form
    source's record is its author's word and is not kept ("-")."""
    from conftest import fenced

    from cudal2.search.llm import LLMProposer, LLMSettings, ReplayClient

    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "llm-round-1-reply.md").write_text(
        fenced("json", json.dumps({"template": "sm80_mma", "params": {}})) + "\n" + fenced("cuda", FORGED))
    # Round 2 is asked while round 1's batch is on the GPU; round 3 sees its rows (its prompt is
    # written before the request that finds no reply).
    (saved / "llm-round-2-reply.md").write_text("Nothing new.")
    llm = LLMProposer(LLMSettings(), run_dir=tmp_path / "run", cc=90, device=H200, client=ReplayClient(saved))
    out = optimize(context(tmp_path, compiler, StandInWorker()), llm, Budget(iterations=3, batch=2, patience=None))
    assert "no reply for round 3" in out.stopped
    rows = Leaderboard(tmp_path / "results").read().set_index("kernel")
    space = get_template("sm80_mma").space
    template = rows.loc[str(template_candidate("sm80_mma", {}, 90))]
    assert template["smem_bytes"] == 0 and template["dynamic_smem_bytes"] == space.facts(space.defaults(), 90)["smem_bytes"]
    assert pd.isna(template["producer_registers"]) and pd.isna(template["consumer_registers"])
    forged = rows.loc["llm-r1-2"]
    assert forged[["dynamic_smem_bytes", "producer_registers", "consumer_registers"]].isna().all()
    prompt = (tmp_path / "run" / "llm-round-3-prompt.md").read_text()
    [shown] = [line for line in prompt.splitlines() if line.startswith("| sm80_mma {")]
    assert shown.endswith(f"| {template['registers']:.0f} | 0 | {template['dynamic_smem_bytes']:.0f} | 0 |"), shown
    [free] = [line for line in prompt.splitlines() if line.startswith("| free-form source llm-r1-2 |")]
    assert free.endswith(f"| {forged['registers']:.0f} | 0 | - | 0 |"), free


# The API tests below search a grid of two sm80_mma configurations that other tests of the
# session compile too (one build serves every shape of a dtype and layout): what they assert
# is the set's bookkeeping, not the search, and a search of the whole space would rank it
# and compile CUTLASS kernels (a minute each) for every test.
TWO_BUILT = {"template": "sm80_mma", "grid": {"stages": ["3", "4"]}}


@pytest.mark.skipif(cublas_location() is None, reason="cuBLAS headers not installed (pip install nvidia-cublas)")
def test_the_python_api_tunes_a_shape_set_end_to_end(tmp_path, cache_dir):
    """import cudal2: optimize() over two shapes with the GPU worker stood in for (the
    baselines' shims and the kernels compiled for real), then leaderboard() and bench()'s
    bad input; the typed results carry each shape's best kernel."""
    import cudal2
    from cudal2.config import Settings

    settings = Settings(results=tmp_path / "results", cache_dir=cache_dir, arch="sm_90a")
    shapes = [cudal2.Problem(256, 256, 256), cudal2.Problem(64, 128, 256)]
    tuned = cudal2.optimize(shapes, iterations=1, batch=2, template="sm80_mma", settings=settings,
                            workers=[StandInWorker()])
    assert [t.problem for t in tuned] == shapes and all(t.best["status"] == "ok" for t in tuned)
    assert all(t.outcome.baseline == "cuBLASLt" and t.environment["gpu"] == "NVIDIA H200" for t in tuned)
    best = cudal2.leaderboard(results=settings.results, shapes=shapes)
    assert sorted(best["m"]) == [64, 256] and (best["speedup_offline"] > 0).all()
    with pytest.raises(Cudal2Error, match="unknown template"):
        cudal2.bench(shapes[0], template="nope", settings=settings, worker=StandInWorker())


def test_a_run_reads_the_prebuilt_set_from_its_start_on_a_thread_of_its_own_and_once(tmp_path, cache_dir, monkeypatch):
    """On the H200 the first shape of a --time-budget 5 run waited about 2.4 s for its first
    batch (the prebuilt set was read when its search first asked) and screened 15 kernels,
    where the shapes after it screened 64: a run reads the set from its start, beside the
    first shape's baselines, once; the first search to ask waits for that read, not another.
    An LLM-only run never reads it."""
    import threading
    import time

    from cudal2.tune import tuner as wiring
    from cudal2.search.llm import LLMSettings

    reads = []
    real = wiring.prebuilt.available

    def slow(*args):
        reads.append(threading.current_thread().name)
        time.sleep(0.5)
        return real(*args)

    monkeypatch.setattr(wiring.prebuilt, "available", slow)
    settings = Settings(results=tmp_path / "results", cache_dir=cache_dir, arch="sm_90a")
    began = time.monotonic()
    tuner = wiring.Tuner(settings, [StandInWorker()], wiring.Search(), Budget(iterations=1, batch=1))
    assert time.monotonic() - began < 0.4  # the run does not wait for it
    tuner._built_here(Problem(256, 256, 256))  # what a shape's search asks first
    assert reads == ["cudal2-prebuilt-set"]
    llm_only = wiring.Search(proposer="llm", llm=LLMSettings(base_url="http://127.0.0.1:9/v1"))  # (never called)
    wiring.Tuner(settings, [StandInWorker()], llm_only, Budget(iterations=1))
    time.sleep(0.2)
    assert reads == ["cudal2-prebuilt-set"]


def test_a_time_budget_bounds_the_batches_unless_iterations_are_given():
    from cudal2.api import UNBOUNDED_BATCHES, batches

    assert batches(None, None) == 10 and batches(None, 60.0) == UNBOUNDED_BATCHES
    assert batches(3, 60.0) == 3 and batches(3, None) == 3


def test_screening_is_on_under_a_budget_for_the_search_off_otherwise_and_screen_says_so_anywhere():
    from cudal2.api import screen_eta
    from cudal2.tune.optimize import SCREEN

    assert screen_eta(None, 5.0, "search") == SCREEN and screen_eta(None, None, "search") == 1
    assert screen_eta(None, 5.0, "llm") == 1 and screen_eta(None, 5.0, "hybrid") == 1
    assert screen_eta(4, None, "search") == 4 and screen_eta(2, 5.0, "llm") == 2 and screen_eta(1, 5.0, "search") == 1


class FailingOn(StandInWorker):
    """A stand-in whose GPU work fails for one problem (an allocation failing, say)."""

    def __init__(self, m: int):
        super().__init__()
        self.m = m

    def request(self, job, timeout):
        if job["problem"]["m"] == self.m:
            raise RuntimeError("GPU worker failed:\ntorch.OutOfMemoryError: CUDA out of memory.")
        return super().request(job, timeout)


@pytest.mark.skipif(cublas_location() is None, reason="cuBLAS headers not installed (pip install nvidia-cublas)")
def test_a_shape_whose_run_fails_costs_that_shape_not_the_set(tmp_path, cache_dir):
    """An overnight set goes on past a shape whose GPU work failed: the shapes after it are
    tuned, and the failed one says why (the CLI then exits 1, after its summary)."""
    import cudal2
    from cudal2.config import Settings

    settings = Settings(results=tmp_path / "results", cache_dir=cache_dir, arch="sm_90a")
    shapes = [cudal2.Problem(m, 256, 256) for m in (256, 128, 64)]
    tuned = cudal2.optimize(shapes, iterations=1, batch=1, settings=settings, workers=[FailingOn(128)], **TWO_BUILT)
    assert [t.outcome.error for t in tuned] == [None, "torch.OutOfMemoryError: CUDA out of memory.", None]
    assert tuned[0].best is not None and tuned[2].best is not None and tuned[1].best is None
    assert tuned[1].outcome.stopped.startswith("failed: ")


@pytest.mark.skipif(cublas_location() is None, reason="cuBLAS headers not installed (pip install nvidia-cublas)")
def test_a_shape_set_spreads_over_every_gpu_worker(tmp_path, cache_dir):
    """Two GPU workers (stood in for) share four shapes: each takes the next untuned one,
    every row records the device it was measured on, and each shape's kernels are ranked
    within its own device's run."""
    import cudal2
    from cudal2.config import Settings

    settings = Settings(results=tmp_path / "results", cache_dir=cache_dir, arch="sm_90a")
    shapes = [cudal2.Problem(m, 256, 256) for m in (64, 128, 256, 512)]
    workers = [StandInWorker(device=0), StandInWorker(device=1)]
    tuned = cudal2.optimize(shapes, iterations=1, batch=2, settings=settings, workers=workers, **TWO_BUILT)
    assert [t.problem for t in tuned] == shapes and all(t.best is not None for t in tuned)
    assert all(w.kernels for w in workers)  # both measured
    rows = Leaderboard(settings.results).read()
    assert set(rows["device"]) == {0, 1}
    for shape in tuned:
        assert rows[rows["m"] == shape.problem.m]["device"].nunique() == 1  # one shape, one device
    mixed = [StandInWorker(device=0), StandInWorker(device=1)]
    mixed[1].environment = {**H200, "gpu": "NVIDIA H100 80GB HBM3"}
    with pytest.raises(Cudal2Error, match="different models or drivers"):
        cudal2.optimize(shapes, iterations=1, batch=1, settings=settings, workers=mixed, **TWO_BUILT)


@pytest.mark.skipif(gpu_count() > 0, reason="this machine has a GPU")
def test_gpus_on_a_machine_without_one_is_a_one_line_error(tmp_path):
    result = CliRunner().invoke(app, ["optimize", "--m", "64", "--n", "64", "--k", "64", "--gpus", "all",
                                      "--results", str(tmp_path)])
    assert result.exit_code == 1 and "no usable CUDA device" in result.output and len(result.output.strip().splitlines()) == 1


@pytest.mark.skipif(cublas_location() is None, reason="cuBLAS headers not installed (pip install nvidia-cublas)")
def test_check_measures_the_best_kernels_again_and_exits_3_below_the_bar(tmp_path, cache_dir, monkeypatch):
    import cudal2
    from cudal2 import api
    from cudal2.config import Settings

    settings = Settings(results=tmp_path / "results", cache_dir=cache_dir, arch="sm_90a")
    shapes = [cudal2.Problem(256, 256, 256), cudal2.Problem(128, 256, 512)]
    cudal2.optimize(shapes, iterations=1, batch=1, settings=settings, workers=[StandInWorker()], **TWO_BUILT)
    # the stand-in's kernels run 50-149 us against cuBLASLt's 95: speedups 0.64-1.9
    passed = cudal2.check(shapes, fail_under=0.1, settings=settings, worker=StandInWorker())
    assert passed.passed and [r["status"] for r in passed.rows] == ["ok", "ok"]
    assert all(r["measured"] == pytest.approx(r["recorded"]) for r in passed.rows)  # same binary, same stand-in time
    failed = cudal2.check(shapes + [cudal2.Problem(64, 64, 64)], fail_under=0.1, settings=settings, worker=StandInWorker())
    assert not failed.passed and failed.rows[-1]["status"] == "no kernel"

    monkeypatch.setattr(api, "Worker", lambda device: StandInWorker(device=device))
    env = {"CUDAL2_CACHE_DIR": str(cache_dir), "CUDAL2_ARCH": "sm_90a"}
    below = CliRunner(env=env).invoke(app, ["check", "--fail-under", "100", "--results", str(settings.results)])
    assert below.exit_code == 3 and "0 of 2 shapes at or above 100x" in below.output
    above = CliRunner(env=env).invoke(app, ["check", "--fail-under", "0.1", "--results", str(settings.results), "--json"])
    assert above.exit_code == 0 and json.loads(above.output)["passed"] is True
    bad = CliRunner(env=env).invoke(app, ["check", "--fail-under", "fast", "--results", str(settings.results)])
    assert bad.exit_code == 1 and bad.output.strip() == "error: --fail-under takes a number, got 'fast'"


@pytest.mark.skipif(cublas_location() is None, reason="cuBLAS headers not installed (pip install nvidia-cublas)")
def test_check_of_an_exported_library_measures_the_binaries_it_serves(tmp_path, cache_dir, monkeypatch):
    """`check --library DIR` (after a driver or CUDA upgrade, or in CI beside a model that
    loads the library): each kernel the library serves, as the binary it ships, verified
    and timed against the baselines; exit 3 below the bar; bad libraries in one line."""
    import cudal2
    from cudal2 import api
    from cudal2.config import Settings

    settings = Settings(results=tmp_path / "results", cache_dir=cache_dir, arch="sm_90a")
    shapes = [cudal2.Problem(256, 256, 256), cudal2.Problem(128, 256, 512)]
    cudal2.optimize(shapes, iterations=1, batch=1, settings=settings, workers=[StandInWorker()], **TWO_BUILT)
    table = cudal2.export(tmp_path / "lib", settings=settings, min_speedup=0.0)
    assert all((tmp_path / "lib" / e.library).with_suffix(".cu").is_file() for e in table.entries)
    served = [str(cudal2.Problem(e.m, e.n, e.k, e.dtype, e.layout)) for e in table.entries]
    worker = StandInWorker()
    passed = cudal2.check(fail_under=0.1, settings=settings, worker=worker, library=tmp_path / "lib")
    assert passed.passed and sorted(r["problem"] for r in passed.rows) == sorted(served)
    assert sorted(worker.kernels) == sorted(str(tmp_path / "lib" / e.library) for e in table.entries)  # as shipped
    assert all(r["measured"] == pytest.approx(r["recorded"]) for r in passed.rows)  # same binary, same stand-in time
    slow = cudal2.check(fail_under=0.5, settings=settings, worker=StandInWorker(times=[950.0, 950.0]),
                        library=tmp_path / "lib")
    assert not slow.passed and all(r["measured"] == pytest.approx(0.1) for r in slow.rows)  # 95 / 950
    elsewhere = StandInWorker()
    elsewhere.environment = {**StandInWorker.environment, "gpu": "NVIDIA A100"}
    with pytest.raises(Cudal2Error, match="was built for NVIDIA H200, this machine has NVIDIA A100"):
        cudal2.check(settings=settings, worker=elsewhere, library=tmp_path / "lib")

    monkeypatch.setattr(api, "Worker", lambda device: StandInWorker(device=device, times=[950.0, 950.0]))
    env = {"CUDAL2_CACHE_DIR": str(cache_dir), "CUDAL2_ARCH": "sm_90a"}
    args = ["check", "--library", str(tmp_path / "lib"), "--results", str(settings.results)]
    assert CliRunner(env=env).invoke(app, [*args, "--fail-under", "1.0"]).exit_code == 3
    missing = CliRunner(env=env).invoke(app, ["check", "--library", str(tmp_path / "nowhere")])
    assert missing.exit_code == 1 and len(missing.output.strip().splitlines()) == 1
    assert "is not a cudal2 library" in missing.output
    both = CliRunner(env=env).invoke(app, [*args, "--shapes", "x.csv"])
    assert both.exit_code == 1 and "drop --shapes" in both.output


def test_a_proposal_measured_before_is_reported_back_not_dropped(tmp_path, compiler):
    """Proposed again, a kernel is not measured twice, and the next round's history says so
    with its earlier result (the LLM prompt lists it among the failures)."""
    first, second = template_candidate("sm80_mma", {}, 90), template_candidate("sm80_mma", {"stages": "3"}, 90)

    class Recording(Scripted):
        def propose(self, problem, history, n):
            self.seen = list(history)
            return super().propose(problem, history, n)

    proposer = Recording([first], [first, second], [])
    out = optimize(context(tmp_path, compiler, StandInWorker()), proposer, Budget(iterations=3, batch=2, patience=None))
    assert out.duplicates == 1 and [r["kernel"] for r in out.rows if r["kernel"] not in BASELINES] == [str(first), str(second)]
    [repeat] = [r for r in proposer.seen if r["status"] == "repeat"]
    assert repeat["kernel"] == str(first) and f"was measured as {first}: ok, " in repeat["error"]
    assert "the fastest library call" in repeat["error"]
    assert "repeat" not in set(Leaderboard(tmp_path / "results").read()["status"])  # a note, not a measurement


def test_each_row_names_the_proposer_that_made_it_and_the_run_counts_them(tmp_path, compiler):
    """hybrid: the LLM's (here a script's) candidates and the search's share a batch; each
    row's `proposer` says whose it was, and the outcome sums what each contributed."""
    scripted = Scripted([template_candidate("sm80_mma", {"stages": "3"}, 90)])
    hybrid = HybridProposer(scripted, sm80_search())
    out = optimize(context(tmp_path, compiler, StandInWorker()), hybrid, Budget(iterations=1, batch=3))
    rows = Leaderboard(tmp_path / "results").read()
    kernels = rows[~rows["kernel"].isin(BASELINES)]
    assert sorted(kernels["proposer"]) == ["scripted", "search", "search"]
    assert {name: c["candidates"] for name, c in out.contributions.items()} == {"scripted": 1, "search": 2}
    assert all(c["ok"] == c["candidates"] and c["best_speedup"] > 0 for c in out.contributions.values())


def test_the_search_measures_one_of_the_caps_that_launch_alike():
    # sm90_splitk's k_clusters is a cap: at 4096x128x12288 (32 tiles of 128x128, no cluster) a
    # launch takes 132 // 32 = 4 clusters a tile at most, so caps of 4 to 128 run the same kernel
    # work (atomic and spread: the same code too). The model prices them alike and put six of
    # them in its first ten; a batch now takes one, and a neighbour's move to a larger cap than
    # the one measured is no new value.
    splitk = get_template("sm90_splitk")
    p = Problem(4096, 128, 12288)
    search = SearchProposer(H200, templates={"sm90_splitk": splitk})
    picks = search.propose(p, [], 16)
    launched = [json.dumps(splitk.space.launched(c.param_dict, 90, p, 132), sort_keys=True) for c in picks]
    assert len(set(launched)) == len(picks) == 16
    best = {"block_m": 128, "block_n": 128, "stages": 6, "producer": "warp", "split_k": 1, "k_clusters": 4,
            "epilogue": "smem", "fixup": "spread", "schedule": "tile", "n_parts": 1}
    assert splitk.space.launched({**best, "k_clusters": 128}, 90, p, 132) == best
    cand = Candidate.from_template("sm90_splitk", best)
    history = [{"status": "ok", "template": "sm90_splitk", "params": cand.params_json, "offline_us": 31.0, "kernel": "b"}]
    later = search.propose(p, history, 16)
    caps = [c.param_dict["k_clusters"] for c in later if c.param_dict == {**best, "k_clusters": c.param_dict["k_clusters"]}]
    assert caps == [2]  # the move below the bound; none above it
    # Where the cap is below the bound, or sizes the source (the workspace fixup's last cluster
    # loads K_CLUSTERS partials a float4), the configurations stay apart.
    assert splitk.space.launched({**best, "k_clusters": 2}, 90, p, 132)["k_clusters"] == 2
    workspace = {**best, "fixup": "workspace", "k_clusters": 8}
    assert splitk.space.launched(workspace, 90, p, 132) == workspace
