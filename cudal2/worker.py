"""Worker: a child process that owns the GPU and runs verify and bench for the parent.

Candidate kernels are untrusted code. A kernel that crashes, corrupts the CUDA context or
hangs costs its worker process, never the run: the parent records `crash` or `timeout`
and the next request starts a fresh worker.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import time
import traceback
from typing import Any

from .baselines import NAMES as BASELINES, abi_call, library_calls
from .bench import STUDY_PROTOCOLS, study_job
from .environment import gpu_temperature
from .errors import Cudal2Error
from .problem import Problem
from .verify import UNIT_ROUNDOFF, poison_output


MIN_ROUNDS = 5  # rounds of each process's methods in a job, at least
# Calls shorter than this (us): each process's rounds in one block, the graph process's first;
# longer: the two processes' rounds alternate. Measured on an H200: long calls by CUPTI read
# up to 13% faster than in the graph when timed after it (a GPU at its power cap runs at 1.4
# instead of 1.98 GHz, and cools between the two); alternated, the two agree within 5% for
# 76 of the 82 contestants of the dev set (28 shapes) that take 20 us or more. Short calls draw too little power to move the clock, and
# alternated, PDL kernels read 0.1-0.35 us more in the graph than in one block (and than
# the independent check, scripts/remeasure.py).
INTERLEAVE_US = 20.0
# Calls this long are timed after SOAK_S of untimed replays (cudal2/bench.py: the steady state).
SOAK_US, SOAK_S = 100.0, 1.5


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
        """Starts the graph process if needed; returns the device description."""
        return self._graph.start()

    def request(self, job: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Runs one job; a dead or silent worker becomes a `crash` or `timeout` result.

        A session of the protocol (op "baselines", or "kernels": verified kernels beside the
        baselines): both processes set up (the graph process autotunes first), then each
        times rounds of its methods (at least MIN_ROUNDS) for the job's timing budget, which
        grows with its contestants beyond one kernel and the baselines, so that each gets the
        rounds it would in a session of one kernel; after SOAK_S of untimed replays for calls
        (cuBLAS's) of SOAK_US or more. For
        calls of INTERLEAVE_US or more, the two processes' rounds alternate (twice the budget
        in all), so that clock and thermal drift fall on both methods alike; then each
        returns its methods' timings. A study protocol's job runs in the graph process alone."""
        first = self._graph.request(job, timeout)
        if job["settings"].get("protocol") in STUDY_PROTOCOLS or first.get("status") != "ok":
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
            if (answer := self._graph.request({"op": "soak", "seconds": SOAK_S}, timeout)).get("status") != "ok":
                return {**first, **answer, "timings": {}}
            temperature = gpu_temperature(self.device)  # what the clock at the power cap depends on
        for turn in ([(c,) for c in children] if short else [children]):
            deadline = time.perf_counter() + budget * (2 if len(turn) == 2 else 1)
            rounds = 0
            while rounds < MIN_ROUNDS or time.perf_counter() < deadline:
                for child in turn:
                    if (answer := child.request({"op": "round"}, timeout)).get("status") != "ok":
                        return {**first, **answer, "timings": {}}
                rounds += 1
        timings, rejected = {}, {}
        for child in children:
            if (answer := child.request({"op": "finish"}, timeout)).get("status") != "ok":
                return {**first, **answer, "timings": {}}
            timings.update(answer["timings"])
            rejected.update(answer.get("rejected", {}))
        return {**first, "timings": timings, "rejected": rejected, "temperature_c": temperature}

    def measure(self, job: dict[str, Any], libraries: list[str], timeout: float) -> list[dict[str, Any]]:
        """Verifies each kernel library alone (a crash or a hang costs that kernel, and the
        next request starts a fresh process), then times the verified ones together, in one
        session of the protocol beside the baselines (`job`: the problem's, op "kernels"):
        one result per library, verify's verdict with the kernel's timings and the
        baselines' of its session under "kernel" and their names. A session of several that
        fails (a check, a crash, a hang) convicts none: the contestant whose check failed may
        be another's victim (a kernel that writes into cuBLAS's output, say), so each kernel
        left is timed alone, and a session of one answers for its kernel. A kernel below the
        physical limit is rejected at the finish, by its own times."""
        results = [self._graph.request({**job, "op": "kernel", "library": library}, timeout) for library in libraries]
        if job["settings"].get("protocol") in STUDY_PROTOCOLS:
            return results
        pending = [i for i, result in enumerate(results) if result.get("status") == "ok"]
        alone = False
        while pending:
            group = {f"kernel:{i}": i for i in (pending[:1] if alone else pending)}
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
                pending = [i for i in pending if i not in group.values()]
            elif len(group) == 1:
                i = next(iter(group.values()))
                results[i] = {**results[i], "status": answer["status"], "error": answer.get("error"), "timings": {}}
                pending.remove(i)
            else:
                alone = True
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


class _Child:
    """One worker process (started on first use); `cupti`: whether it loads CUPTI."""

    def __init__(self, device: int, cupti: bool):
        self.device, self.cupti = device, cupti
        self._ctx = multiprocessing.get_context("spawn")
        self._proc = None
        self._conn = None
        self.environment: dict[str, Any] | None = None

    def _start(self) -> None:
        parent, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=_serve, args=(child, self.device, self.cupti), daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        if not parent.poll(300):
            self.close()
            raise Cudal2Error("the GPU worker did not start within 300 s")
        hello = parent.recv()
        if "fatal" in hello:
            self.close()
            raise Cudal2Error(hello["fatal"])
        self.environment = hello["environment"]

    @property
    def started(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

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
            code = self._proc.exitcode if self._proc else None
            self.close()
            return {"status": "crash", "error": f"worker process died (exit code {code})"}
        if result.get("status") == "crash":
            self.close()
        if result.get("status") == "error":
            raise RuntimeError(f"GPU worker failed:\n{result['error']}")
        return result

    def close(self) -> None:
        if self._proc is not None:
            if self._proc.is_alive():
                try:
                    self._conn.send(None)
                except OSError:
                    pass
                self._proc.join(2)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(5)
        self._proc = self._conn = None


# ---------------------------------------------------------------- in the child process

def _serve(conn, device: int, cupti: bool) -> None:
    try:
        import cupy

        from .environment import describe_device
        from .measure import CuptiTimer

        if cupy.cuda.runtime.getDeviceCount() <= device:
            raise RuntimeError(f"device {device} does not exist")
        cupy.cuda.Device(device).use()
        environment = describe_device(device)
        try:  # no persisting-L2 carve-out survives from earlier work
            cupy.cuda.runtime.deviceSetLimit(0x06, 0)  # cudaLimitPersistingL2CacheSize
        except cupy.cuda.runtime.CUDARuntimeError:
            pass
        timer = CuptiTimer() if cupti else None
    except Exception as exc:  # no driver, no device, no CuPy, no CUPTI
        conn.send({"fatal": f"no usable CUDA device: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"})
        return
    conn.send({"environment": environment})
    handlers = {"kernel": _kernel_job, "kernels": _kernels_job, "baselines": _baselines_job, "round": _round_job,
                "soak": _soak_job, "finish": _finish_job, "memory": _memory_job}
    while True:
        job = conn.recv()
        if job is None:
            return
        untrusted = job["op"] in ("kernel", "kernels") or (
            job["op"] in ("round", "soak", "finish") and _SESSION.get("kind") == "kernels")
        try:
            result = handlers[job["op"]](job, environment, timer)
        except (cupy.cuda.runtime.CUDARuntimeError, cupy.cuda.driver.CUDADriverError) as exc:
            # The context may be unusable (illegal address, launch failure): report and die.
            conn.send({"status": "crash", "error": str(exc)})
            os._exit(3)
        except Exception:
            if untrusted:
                # After untrusted code ran, any failure (a cuBLAS or CuPy error from a broken
                # context, say) is the kernel's: a crash, with the traceback as its reason.
                conn.send({"status": "crash", "error": traceback.format_exc()[-2000:]})
                os._exit(3)
            conn.send({"status": "error", "error": traceback.format_exc()})
        else:
            conn.send(result)


# The open timing session of this process (a job's measure.Session, between its rounds).
_SESSION: dict[str, Any] = {}


def _methods(job: dict[str, Any]) -> tuple[str, ...]:
    """The timing methods of this job's phase: the graph process's, or the CUPTI process's."""
    return ("kernel", "server") if job.get("phase") == "cupti" else ("graph",)


def _kernel_job(job: dict[str, Any], environment: dict[str, Any], timer) -> dict[str, Any]:
    """Verifies one kernel (graph process); a study protocol's job then times it as it did."""
    import cupy

    from .baselines import cublas_gemm
    from .verify import Kernel, seed_from_os, verify

    problem = Problem(**job["problem"])
    rng = random.Random(seed_from_os())
    stream = cupy.cuda.Stream(non_blocking=True)
    kernel = Kernel(job["library"])
    with stream:
        verdict = verify(kernel, problem, stream, cublas_gemm(problem, stream), rng)
        result = {"status": verdict.status, "error": verdict.reason,
                  "max_error": verdict.max_error, "tolerance": verdict.tolerance}
        if verdict.status == "ok" and job["settings"].get("protocol") in STUDY_PROTOCOLS:
            return {**result, **study_job(job, environment, stream, rng, kernel)}
    return result


def _kernels_job(job: dict[str, Any], environment: dict[str, Any], timer) -> dict[str, Any]:
    """Opens this process's session of verified kernels (job["kernels"]: name, library,
    tolerance) beside the baselines."""
    import cupy

    from .verify import Kernel, Rejected, seed_from_os

    problem = Problem(**job["problem"])
    rng = random.Random(seed_from_os())
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        run, record = library_calls(problem, job, stream, rng)
        tolerance = {name: 2 * UNIT_ROUNDOFF[problem.dtype] for name in run}
        kernels = {}
        for entry in job["kernels"]:
            kernel = Kernel(entry["library"])
            workspace = cupy.empty(max(1, kernel.workspace_bytes(problem.m, problem.n, problem.k)), cupy.uint8)
            kernels[entry["name"]] = abi_call(kernel, workspace, problem, stream, entry["name"])
            tolerance[entry["name"]] = entry["tolerance"]
        try:
            session = _open("kernels", job, {**kernels, **run}, problem, stream=stream, timer=timer,
                            environment=environment, rng=rng, tolerance=tolerance)
        except Rejected as r:
            return _rejected(r, frozenset(kernels))
    return {"status": "ok", "cublaslt": record, "typical_us": session.typical_us, "contestants": len(session.names)}


def _open(kind: str, job: dict[str, Any], run: dict, problem: Problem, **timing: Any):
    """This process's timing session of the job (its phase's methods), kept for the rounds
    and the finish that follow; `kind`: "kernels" (their contestants the suspects) or
    "baselines"."""
    from .measure import Session

    _SESSION.clear()
    _release_memory()
    suspects = frozenset(name for name in run if name.startswith("kernel:")) if kind == "kernels" else frozenset()
    session = Session(run, problem, settings=job["settings"], methods=_methods(job), suspects=suspects, **timing)
    _SESSION.update(session=session, kind=kind, problem=problem)
    return session


def _round_job(job: dict[str, Any], environment: dict[str, Any], timer) -> dict[str, Any]:
    """One round of the open session's methods."""
    from .verify import Rejected

    try:
        _SESSION["session"].round()
    except Rejected as r:
        return _rejected(r, _SESSION["session"].suspects)
    return {"status": "ok"}


def _soak_job(job: dict[str, Any], environment: dict[str, Any], timer) -> dict[str, Any]:
    """The open session's graphs replayed, untimed, for the job's seconds."""
    _SESSION["session"].soak(job["seconds"])
    return {"status": "ok"}


def _finish_job(job: dict[str, Any], environment: dict[str, Any], timer) -> dict[str, Any]:
    """The open session's timings, and the kernels it rejects (`rejected`: name -> status,
    reason): one faster than this GPU's physical limit is a cheat."""
    from .verify import Rejected, physical_floor_us

    session, problem = _SESSION["session"], _SESSION["problem"]
    try:
        timings = session.finish()
    except Rejected as r:
        return _rejected(r, session.suspects)
    _SESSION.clear()
    rejected = {}
    for method, entries in timings.items():
        floor = physical_floor_us(problem, environment, cold_l2=method == "server")
        for name in sorted(session.suspects - set(rejected)):
            if entries[name]["median_us"] < 0.9 * floor:
                rejected[name] = ("cheat", f"{method} time {entries[name]['median_us']:.2f} us is below the "
                                           f"physical limit {floor:.2f} us of this GPU")
    return {"status": "ok", "timings": timings, "rejected": rejected}


def _memory_job(job: dict[str, Any], environment: dict[str, Any], timer) -> dict[str, Any]:
    """The bytes this process's CuPy memory pool holds, in use or kept free."""
    import cupy

    return {"status": "ok", "pool_bytes": cupy.get_default_memory_pool().total_bytes()}


def _release_memory() -> None:
    """Returns the memory pools' free blocks to the driver before a session allocates its
    own: each problem's input sets are sized by it, and pools that keep every size seen held
    80 GiB of an H200 after 24 shapes of a shape set, until an allocation failed."""
    import gc
    import sys

    import cupy

    gc.collect()
    cupy.get_default_memory_pool().free_all_blocks()
    cupy.get_default_pinned_memory_pool().free_all_blocks()
    if (torch := sys.modules.get("torch")) is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _rejected(r, suspects: frozenset[str]) -> dict[str, Any]:
    """A contestant failed a check while timed: a kernel's verdict, naming it (the session is
    over), or (a baseline's) an error of the bench."""
    _SESSION.clear()
    if r.contestant not in suspects:
        raise RuntimeError(f"a baseline failed its output check: {r}")
    return {"status": r.status, "error": str(r), "contestant": r.contestant}


def _baselines_job(job: dict[str, Any], environment: dict[str, Any], timer) -> dict[str, Any]:
    import cupy

    from .verify import Numerics, Operands, compare, seed_from_os

    problem = Problem(**job["problem"])
    rng = random.Random(seed_from_os())
    stream = cupy.cuda.Stream(non_blocking=True)
    num = Numerics(problem.dtype)
    with stream:
        if job["settings"].get("protocol") in STUDY_PROTOCOLS:
            return {"status": "ok", **study_job(job, environment, stream, rng, None)}
        run, record = library_calls(problem, job, stream, rng)
        errors = {}
        if job.get("phase") != "cupti":
            ops = Operands(problem, 0, num)
            ops.fill("normal", rng)
            ref = ops.reference()
            for name, call in run.items():  # each baseline against the fp32 reference once
                out = cupy.empty_like(ops.c)
                poison_output(out)
                call(ops.a, ops.b, out)
                errors[name] = compare(out, ref, num)[:2]
        tolerance = {name: 2 * UNIT_ROUNDOFF[problem.dtype] for name in run}
        session = _open("baselines", job, run, problem, stream=stream, timer=timer, environment=environment,
                        rng=rng, tolerance=tolerance)
    return {"status": "ok", "errors": errors, "cublaslt": record, "typical_us": session.typical_us,
            "contestants": len(session.names)}
