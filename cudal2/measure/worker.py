"""Worker: the parent's side of the GPU worker processes (their side: cudal2/measure/jobs.py), and
how a session of the protocol is run across the two.

Candidate kernels are untrusted code. A kernel that crashes, corrupts the CUDA context or
hangs costs its worker process, never the run: the parent records `crash` or `timeout`
and the next request starts a fresh worker.
"""

from __future__ import annotations

import atexit
import json
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

from ..errors import Cudal2Error
from ..protocol import BASELINES
from .environment import gpu_temperature


MIN_ROUNDS = 5  # rounds of each process's methods in a job, at least
# Calls shorter than this (us): each process's rounds in one block, the graph process's first;
# longer: the two processes' rounds alternate. Measured on an H200: long calls by CUPTI read
# up to 13% faster than in the graph when timed after it (a GPU at its power cap runs at 1.4
# instead of 1.98 GHz, and cools between the two); alternated, the two agree within 5% for
# 76 of the 82 contestants of the dev set (28 shapes) that take 20 us or more. Short calls draw too little power to move the clock, and
# alternated, kernels launched with programmatic dependent launch (as our GEMMs then were)
# read 0.1-0.35 us more in the graph than in one block (and than the independent check,
# scripts/remeasure.py).
INTERLEAVE_US = 20.0
# Calls this long are timed after SOAK_S of untimed replays (cudal2/measure/bench.py: the steady state).
SOAK_US, SOAK_S = 100.0, 1.5
# Rounds of a screening session (job settings' `screen`): the graph method alone, in the
# graph process, each round one replay of every contestant's graph (its calls rotating
# through the input sets, every output checked at the finish); no soak (SCREEN_REST below), no
# CUPTI process.
# Calls of LONG_SCREEN_US or more (a replay of three of them: 3 ms and more of device time)
# get one round, and their graphs are uploaded, not replayed first (measure.Session): each
# three calls were a fifth of a kernel's screening calls, and where calls take milliseconds
# a 5 s budget screened 30-53 kernels, not 64 (H200, --time-budget 5).
SCREEN_ROUNDS, LONG_SCREEN_US = 3, 1000.0
# Where calls take SOAK_US or more, a screening session's GPU idles SCREEN_REST times each
# replay's device time after it (the job settings' `screen_rest`), so that it runs at the
# clock the protocol's sessions time at, not at its power cap. Back to back, the H200 ran
# 12288x2048x12288 at 761 us a call for the first 50 ms after an idle GPU, then at 900-920
# (torch.mm, SM clock 1980 MHz falling to about 1450, power-capped); the protocol's session,
# its two processes taking turns, timed it at 796, and a screening session, replaying its
# 65 contestants back to back, at 922 (16384x2048x4096: 348, 405-420, 361 and 412 us). So
# the screen ranked kernels by their speed at the power cap, where ping-pong 128x128 tiles
# lead, and the protocol ranked cooperative 128x256 ones first (0.964 against 0.989 of the
# library confirmed; a soak before the screening rounds made every screened time 1.11-1.17x
# the confirmed one and the order no better).
SCREEN_REST = 1.0


class Worker:
    """The parent's handle on the GPU: two worker processes on one device (started on first use).

    One verifies, autotunes cuBLASLt and times by the graph method; it never loads CUPTI.
    The other times by CUPTI (the kernel method, server mode). CUPTI cannot leave a process
    once attached: there, each kernel replayed from a graph cost 0.4-0.9 us more on an H200
    with every activity kind disabled, 0.15-0.35 us after cuptiFinalize (a 2 us call reads
    up to 50% slower). A session of the protocol opens in the graph process first, then in
    the CUPTI process with the cuBLASLt algorithm chosen there; the timings merge.
    """

    def __init__(self, device: int = 0):
        self.device = device
        self._graph = _Child(device, cupti=False)
        self._cupti = _Child(device, cupti=True)

    @property
    def environment(self) -> dict[str, Any] | None:
        return self._graph.environment

    def start(self) -> dict[str, Any]:
        """Starts both processes if needed, side by side; returns the device description.
        Every run's first session needs both: started here, before a tuning run's first
        shape, their start-up (CuPy, CUPTI, torch and their CUDA state: 10.8-13.8 s on the
        H200 host when the CUPTI process started inside the first shape's baselines) is not
        taken from that shape's time budget."""
        with ThreadPoolExecutor(2) as pool:
            starts = [pool.submit(child.start) for child in (self._graph, self._cupti)]
        if failed := next((error for f in starts if (error := f.exception()) is not None), None):
            self.close()
            raise failed
        return self._graph.environment

    def request(self, job: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Runs one job (see _session); a dead or silent worker becomes a `crash` or `timeout`
        result. After a session that failed (a check, a crash, a hang) or whose kernels left
        a CUDA error pending, later sessions run in fresh processes: what one contestant
        left behind (an error, a corrupted context or memory) never decides another's verdict."""
        answer = self._session(job, timeout)
        if answer.get("status") != "ok" or answer.get("left_errors"):
            self._graph.close()
            self._cupti.close()
        return answer

    def _session(self, job: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Runs one job.

        A session of the protocol (op "baselines", or "kernels": verified kernels beside the
        baselines): both processes set up (the graph process autotunes first), then each
        times rounds of its methods (at least MIN_ROUNDS, or the job's `min_rounds`) for the
        job's timing budget, which grows with its contestants beyond one kernel and the
        baselines, so that each gets the rounds it would in a session of one kernel; after
        SOAK_S (or the job's `soak_s`) of untimed replays for calls (cuBLAS's) of SOAK_US or
        more. For calls of INTERLEAVE_US or more, the two processes' rounds alternate (twice
        the budget in all), so that clock and thermal drift fall on both methods alike; then
        each returns its methods' timings. A screening session (job settings' `screen`): _screen."""
        if job["settings"].get("screen"):
            return self._screen(job, timeout)
        first = self._graph.request(job, timeout)
        if first.get("status") != "ok":
            return first
        second = self._cupti.request({**job, "phase": "cupti", "cublaslt": first.get("cublaslt")}, timeout)
        if second.get("status") != "ok":
            return {**first, **second, "timings": {}}
        children = (self._graph, self._cupti)
        contestants = first.get("contestants", 1 + len(BASELINES))
        budget = job["settings"].get("budget_s", 1.0) * max(1.0, contestants / (1 + len(BASELINES)))
        typical = first.get("typical_us") or INTERLEAVE_US
        short = typical < INTERLEAVE_US
        temperature = None
        if typical >= SOAK_US:
            soak = {"op": "soak", "seconds": job["settings"].get("soak_s", SOAK_S)}
            if (answer := self._graph.request(soak, timeout)).get("status") != "ok":
                return {**first, **answer, "timings": {}}
            temperature = gpu_temperature(self.device)  # what the clock at the power cap depends on
        least = job["settings"].get("min_rounds", MIN_ROUNDS)
        for turn in ([(c,) for c in children] if short else [children]):
            deadline = time.perf_counter() + budget * (2 if len(turn) == 2 else 1)
            rounds = 0
            while rounds < least or time.perf_counter() < deadline:
                for child in turn:
                    if (answer := child.request({"op": "round"}, timeout)).get("status") != "ok":
                        return {**first, **answer, "timings": {}}
                rounds += 1
        timings, rejected, left = {}, {}, {}
        for child in children:
            if (answer := child.request({"op": "finish"}, timeout)).get("status") != "ok":
                return {**first, **answer, "timings": {}}
            timings.update(answer["timings"])
            rejected.update(answer.get("rejected", {}))
            left.update(answer.get("left_errors", {}))
        return {**first, "timings": timings, "rejected": rejected, "left_errors": left, "temperature_c": temperature}

    def _screen(self, job: dict[str, Any], timeout: float) -> dict[str, Any]:
        """A screening session: the graph process alone opens it, times SCREEN_ROUNDS rounds
        (one for long calls: LONG_SCREEN_US) of the graph method and finishes it (its checks,
        the physical limit): what a kernel's rank among many needs, at a fraction of the
        protocol's time."""
        first = self._graph.request(job, timeout)
        if first.get("status") != "ok":
            return first
        rounds = 1 if (first.get("typical_us") or 0.0) >= LONG_SCREEN_US else SCREEN_ROUNDS
        for _ in range(rounds):
            if (answer := self._graph.request({"op": "round"}, timeout)).get("status") != "ok":
                return {**first, **answer, "timings": {}}
        if (answer := self._graph.request({"op": "finish"}, timeout)).get("status") != "ok":
            return {**first, **answer, "timings": {}}
        return {**first, "timings": answer["timings"], "rejected": answer.get("rejected", {}),
                "left_errors": answer.get("left_errors", {})}

    def measure(self, job: dict[str, Any], libraries: list[str], timeout: float,
                screen: bool = False) -> list[dict[str, Any]]:
        """Verifies each kernel library alone (a fault costs that kernel: after a crash, a hang,
        a verdict other than ok or unsupported, or a CUDA error its calls left pending, the
        next kernel is verified in a fresh process), then times the verified ones together, in one
        session of the protocol beside the baselines (`job`: the problem's, op "kernels"):
        one result per library, verify's verdict with the kernel's timings and the
        baselines' of its session under "kernel" and their names. A session of several that
        fails (a check, a crash, a hang) convicts none: the contestant whose check failed may
        be another's victim (a kernel that writes into cuBLAS's output, say), so each half of
        it is timed again, and so on down to a session of one, which answers for its kernel
        (one culprit among 64 screened costs about 12 sessions, not 64). A kernel below the
        physical limit is rejected at the finish, by its own times. With `screen`, every
        kernel is verified by the screening checks (verify's `screen`) and the session is a
        screening one (_screen)."""
        if screen:
            job = {**job, "settings": {**job["settings"], "screen": True, "screen_rest": SCREEN_REST}}
        results = []
        for library in libraries:
            results.append(self._graph.request({**job, "op": "kernel", "library": library}, timeout))
            if results[-1].get("status") not in ("ok", "unsupported") or results[-1].get("left_error"):
                self._graph.close()
        verified = [i for i, result in enumerate(results) if result.get("status") == "ok"]
        groups = [verified] if verified else []
        while groups:
            members = groups.pop(0)
            group = {f"kernel:{i}": i for i in members}
            kernels = [{"name": name, "library": libraries[i], "tolerance": results[i]["tolerance"]}
                       for name, i in group.items()]
            answer = self.request({**job, "op": "kernels", "kernels": kernels}, timeout)
            if answer.get("status") == "ok":
                for name, i in group.items():
                    if name in answer["rejected"]:
                        status, error = answer["rejected"][name]
                        results[i] = {**results[i], "status": status, "error": error, "timings": {}}
                    else:
                        results[i] = {**results[i], "cublaslt": answer.get("cublaslt"),
                                      "temperature_c": answer.get("temperature_c"),
                                      "timings": _own_timings(answer["timings"], name)}
            elif len(members) == 1:
                results[members[0]] = {**results[members[0]], "status": answer["status"], "error": answer.get("error"),
                                       "timings": {}}
            else:  # convicts none: each half is timed again, down to a session of one
                half = len(members) // 2
                groups[:0] = [members[:half], members[half:]]
        return results

    def pool_bytes(self, timeout: float = 60.0) -> dict[str, int]:
        """What each started process's memory pool holds (its "graph" and "cupti" process)."""
        return {name: child.request({"op": "memory"}, timeout)["pool_bytes"]
                for name, child in (("graph", self._graph), ("cupti", self._cupti)) if child.started}

    def close(self) -> None:
        self._graph.close()
        self._cupti.close()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _own_timings(timings: dict[str, dict[str, dict]], name: str) -> dict[str, dict[str, dict]]:
    """A session's timings as one kernel's: its own under "kernel", beside the baselines'."""
    return {method: {"kernel": entries[name], **{b: entries[b] for b in BASELINES if b in entries}}
            for method, entries in timings.items()}


# The worker process's start: the parent's import path, then cudal2.measure.jobs.main. A fresh
# interpreter, not multiprocessing's spawn, which re-runs the caller's main module in the
# child (a script calling cudal2.bench() at its top level then runs it again, and dies).
_START = "import json, sys; sys.path[:] = json.loads(sys.argv[1]); from cudal2.measure.jobs import main; main(*sys.argv[2:])"
_LIVE: set[subprocess.Popen] = set()  # killed at exit, so that no worker outlives its parent


@atexit.register
def _kill_live() -> None:
    for proc in list(_LIVE):
        proc.kill()


class _Child:
    """One worker process (started on first use); `cupti`: whether it loads CUPTI."""

    def __init__(self, device: int, cupti: bool):
        self.device, self.cupti = device, cupti
        self._proc: subprocess.Popen | None = None
        self._conn = None
        self._closed_code: int | None = None  # the exit code of the last process closed
        self.environment: dict[str, Any] | None = None

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        with theirs:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _START, json.dumps(sys.path), str(theirs.fileno()), str(self.device),
                 str(int(self.cupti))], pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        _LIVE.add(self._proc)
        self._conn = Connection(ours.detach())
        if not self._conn.poll(300):
            self.close()
            raise Cudal2Error("the GPU worker did not start within 300 s")
        try:
            hello = self._conn.recv()
        except EOFError:
            self.close()
            raise Cudal2Error("the GPU worker exited as it started (its error is printed above)") from None
        if "fatal" in hello:
            self.close()
            raise Cudal2Error(hello["fatal"])
        self.environment = hello["environment"]

    @property
    def started(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> dict[str, Any]:
        """Starts the worker if needed; returns the device description."""
        if not self.started:
            self._start()
        return self.environment

    def request(self, job: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Runs one job; a dead or silent worker becomes a `crash` or `timeout` result."""
        self.start()
        try:
            self._conn.send(job)
            if not self._conn.poll(timeout):
                self.close()
                return {"status": "timeout", "error": f"no result within {timeout:.0f} s (hang?)"}
            result = self._conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            self.close()
            code = self._closed_code
            return {"status": "crash", "error": f"worker process died (exit code {code})"}
        if result.get("status") == "crash":
            self.close()
        if result.get("status") == "error":
            raise RuntimeError(f"GPU worker failed:\n{result['error']}")
        return result

    def close(self) -> None:
        if self._proc is not None:
            try:
                self._conn.send(None)  # a worker that listens exits
                self._proc.wait(2)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()  # a hung or dead one
                self._proc.wait(5)
            self._conn.close()
            _LIVE.discard(self._proc)
            self._closed_code = self._proc.returncode
        self._proc = self._conn = None
