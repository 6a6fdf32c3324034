"""Jobs: what a GPU worker process does with each request of its parent (cudal2/measure/worker.py).

It owns the GPU through CuPy, verifies kernels, opens a timing session (measure.Session)
and times its rounds. Anything that fails after untrusted code ran is that code's crash:
the process reports it and exits, so the parent starts a fresh one.
"""

from __future__ import annotations

import os
import random
import traceback
from multiprocessing.connection import Connection
from typing import Any

from ..problem import Problem
from .baselines import FINALIST, abi_call, cublas_gemm, library_calls
from .environment import describe_device, device_error
from .measure import CuptiTimer, Session
from .verify import (UNIT_ROUNDOFF, Kernel, Numerics, Operands, Rejected, ScreenInputs, compare, physical_floor_us,
                     poison_output, seed_from_os, verify)


def main(fd: str, device: str, cupti: str) -> None:
    """The worker process's entry (cudal2/measure/worker.py starts it): serves the parent's requests
    on the connection `fd` for the GPU `device`, with CUPTI loaded if `cupti` is "1"."""
    serve(Connection(int(fd)), int(device), cupti == "1")


def _preload_torch(device: int) -> None:
    """torch (the torch.matmul baseline's) imported and its CUDA state made on `device` as
    the process starts, where the first baselines' session would otherwise pay for both out of
    the first shape's time budget. Without torch, or with a CPU build of it, nothing: the
    baseline is left out as before (baselines.torch_gemm)."""
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(device)
        torch.cuda.init()


def serve(conn, device: int, cupti: bool) -> None:
    """Answers the parent's jobs until it sends None or goes away."""
    try:
        import cupy

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
        conn.send({"fatal": device_error(exc)})
        return
    _preload_torch(device)
    conn.send({"environment": environment})
    handlers = {"kernel": _kernel_job, "kernels": _kernels_job, "baselines": _baselines_job, "round": _round_job,
                "soak": _soak_job, "finish": _finish_job, "memory": _memory_job}
    while True:
        try:
            job = conn.recv()
        except EOFError:  # the parent is gone
            return
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
    """Verifies one kernel (graph process): in full, or a screening session's checks (verify's
    `screen`, on the process's shared inputs: _screen_inputs) where the job's settings say `screen`."""
    import cupy

    problem = Problem(**job["problem"])
    rng = random.Random(seed_from_os())
    stream = cupy.cuda.Stream(non_blocking=True)
    kernel = Kernel(job["library"])
    screen = bool(job["settings"].get("screen"))
    if not screen:
        _drop_screen_inputs()
    with stream:
        inputs = _screen_inputs(problem, kernel, stream, rng) if screen else None
        verdict = verify(kernel, problem, stream, cublas_gemm(problem, stream), rng, screen=screen, inputs=inputs)
        result = {"status": verdict.status, "error": verdict.reason,
                  "max_error": verdict.max_error, "tolerance": verdict.tolerance, "left_error": kernel.left_error}
    return result


# The screening checks' inputs of this process (verify.ScreenInputs), shared by the kernels it
# screens on one problem: built by the first, checked intact before each next one, dropped by a
# full verification or the next session. At most SCREEN_INPUTS_SHARE of the device's free memory;
# where they would take more, each kernel's checks draw inputs of their own.
_SCREEN: dict[str, ScreenInputs] = {}
SCREEN_INPUTS_SHARE = 0.25


def _screen_inputs(problem: Problem, kernel: Kernel, stream, rng) -> ScreenInputs | None:
    import cupy

    workspace = kernel.workspace_bytes(problem.m, problem.n, problem.k)
    kept = _SCREEN.get("inputs")
    if kept is not None and kept.serves(problem, workspace) and kept.intact():
        return kept
    if kept is not None and kept.problem == problem:
        workspace = max(workspace, kept.workspace_bytes)  # a wider one for this kernel and those before
    _drop_screen_inputs()
    if ScreenInputs.nbytes(problem, workspace) > SCREEN_INPUTS_SHARE * cupy.cuda.runtime.memGetInfo()[0]:
        return None
    inputs = _SCREEN["inputs"] = ScreenInputs(problem, workspace, cublas_gemm(problem, stream), rng)
    return inputs


def _drop_screen_inputs() -> None:
    if _SCREEN:
        _SCREEN.clear()
        _release_memory()


def _kernels_job(job: dict[str, Any], environment: dict[str, Any], timer) -> dict[str, Any]:
    """Opens this process's session of verified kernels (job["kernels"]: name, library,
    tolerance) beside the baselines."""
    import cupy

    problem = Problem(**job["problem"])
    rng = random.Random(seed_from_os())
    stream = cupy.cuda.Stream(non_blocking=True)
    _close_session()
    with stream:
        run, record = library_calls(problem, job, stream, rng)
        tolerance = {name: 2 * UNIT_ROUNDOFF[problem.dtype] for name in run}
        kernels, calls = {}, {}
        for entry in job["kernels"]:
            kernel = kernels[entry["name"]] = Kernel(entry["library"])
            workspace = cupy.empty(max(1, kernel.workspace_bytes(problem.m, problem.n, problem.k)), cupy.uint8)
            calls[entry["name"]] = abi_call(kernel, workspace, problem, stream, entry["name"])
            tolerance[entry["name"]] = entry["tolerance"]
        try:
            session = _open("kernels", job, {**calls, **run}, problem, stream=stream, timer=timer,
                            environment=environment, rng=rng, tolerance=tolerance)
        except Rejected as r:
            return _rejected(r, frozenset(kernels))
        _SESSION["kernels"] = kernels
    return {"status": "ok", "cublaslt": record, "typical_us": session.typical_us, "contestants": len(session.names)}


def _open(kind: str, job: dict[str, Any], run: dict, problem: Problem, **timing: Any):
    """This process's timing session of the job (its phase's methods), kept for the rounds
    and the finish that follow; `kind`: "kernels" (their contestants the suspects) or
    "baselines". The job closed the earlier session first (_close_session)."""
    suspects = frozenset(name for name in run if name.startswith("kernel:")) if kind == "kernels" else frozenset()
    session = Session(run, problem, settings=job["settings"], methods=_methods(job), suspects=suspects, **timing)
    _SESSION.update(session=session, kind=kind, problem=problem)
    return session


def _round_job(job: dict[str, Any], environment: dict[str, Any], timer) -> dict[str, Any]:
    """One round of the open session's methods."""
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
    """The open session's timings, the kernels it rejects (`rejected`: name -> status,
    reason): one faster than this GPU's physical limit is a cheat; and the CUDA errors its
    kernels' calls left pending (`left_errors`: name -> error; each was cleared before the
    next call, and the parent starts a fresh process for what follows)."""
    session, problem = _SESSION["session"], _SESSION["problem"]
    try:
        timings = session.finish()
    except Rejected as r:
        return _rejected(r, session.suspects)
    left = {name: kernel.left_error for name, kernel in _SESSION.get("kernels", {}).items() if kernel.left_error}
    _SESSION.clear()
    rejected = {}
    for method, entries in timings.items():
        floor = physical_floor_us(problem, environment, cold_l2=method == "server")
        for name in sorted(session.suspects - set(rejected)):
            if entries[name]["median_us"] < 0.9 * floor:
                rejected[name] = ("cheat", f"{method} time {entries[name]['median_us']:.2f} us is below the "
                                           f"physical limit {floor:.2f} us of this GPU")
    return {"status": "ok", "timings": timings, "rejected": rejected, "left_errors": left}


def _memory_job(job: dict[str, Any], environment: dict[str, Any], timer) -> dict[str, Any]:
    """The bytes this process's CuPy memory pool holds, in use or kept free."""
    import cupy

    return {"status": "ok", "pool_bytes": cupy.get_default_memory_pool().total_bytes()}


def _close_session() -> None:
    """Drops this process's open session (one the other process's failure left open, say),
    its buffers and the screening checks' inputs, before a new one allocates."""
    _SESSION.clear()
    _SCREEN.clear()
    _release_memory()


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

    problem = Problem(**job["problem"])
    rng = random.Random(seed_from_os())
    stream = cupy.cuda.Stream(non_blocking=True)
    num = Numerics(problem.dtype)
    _close_session()
    with stream:
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
            # a cuBLASLt finalist outside the tolerance is no candidate for the baseline: it
            # leaves (the CUPTI process times the finalists the record lists)
            wrong = [name for name in run if name.startswith(FINALIST.format("")) and errors[name][0] > errors[name][1]]
            for name in wrong:
                del run[name], errors[name]
            if wrong:
                record = {**record, "finalists": [i for i in record["finalists"] if FINALIST.format(i) not in wrong]}
        tolerance = {name: 2 * UNIT_ROUNDOFF[problem.dtype] for name in run}
        session = _open("baselines", job, run, problem, stream=stream, timer=timer, environment=environment,
                        rng=rng, tolerance=tolerance)
    return {"status": "ok", "errors": errors, "cublaslt": record, "typical_us": session.typical_us,
            "contestants": len(session.names)}
