"""Worker: a child process that owns the GPU and runs verify and bench for the parent.

Candidate kernels are untrusted code. A kernel that crashes, corrupts the CUDA context or
hangs costs its worker process, never the run: the parent records `crash` or `timeout`
and the next request starts a fresh worker.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import traceback
from dataclasses import asdict
from typing import Any

from .errors import Cudal2Error
from .problem import Problem


class Worker:
    """The parent's handle on the GPU worker process (started on first use)."""

    def __init__(self, device: int = 0):
        self.device = device
        self._ctx = multiprocessing.get_context("spawn")
        self._proc = None
        self._conn = None
        self.environment: dict[str, Any] | None = None

    def _start(self) -> None:
        parent, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=_serve, args=(child, self.device), daemon=True)
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

    def start(self) -> dict[str, Any]:
        """Starts the worker if needed; returns the device description."""
        if self._proc is None or not self._proc.is_alive():
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

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------- in the child process

def _serve(conn, device: int) -> None:
    try:
        import cupy

        from .environment import describe_device

        if cupy.cuda.runtime.getDeviceCount() <= device:
            raise RuntimeError(f"device {device} does not exist")
        cupy.cuda.Device(device).use()
        environment = describe_device(device)
        try:  # no persisting-L2 carve-out survives from earlier work
            cupy.cuda.runtime.deviceSetLimit(0x06, 0)  # cudaLimitPersistingL2CacheSize
        except cupy.cuda.runtime.CUDARuntimeError:
            pass
    except Exception as exc:  # no driver, no device, no CuPy
        conn.send({"fatal": f"no usable CUDA device: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"})
        return
    conn.send({"environment": environment})
    handlers = {"kernel": _kernel_job, "baselines": _baselines_job}
    while True:
        job = conn.recv()
        if job is None:
            return
        try:
            result = handlers[job["op"]](job, environment)
        except (cupy.cuda.runtime.CUDARuntimeError, cupy.cuda.driver.CUDADriverError) as exc:
            # The context may be unusable (illegal address, launch failure): report and die.
            conn.send({"status": "crash", "error": str(exc)})
            os._exit(3)
        except Exception:
            if job["op"] == "kernel":
                # After untrusted code ran, any failure (a cuBLAS or CuPy error from a broken
                # context, say) is the kernel's: a crash, with the traceback as its reason.
                conn.send({"status": "crash", "error": traceback.format_exc()[-2000:]})
                os._exit(3)
            conn.send({"status": "error", "error": traceback.format_exc()})
        else:
            conn.send(result)


CUDA_R_16F, CUDA_R_16BF = 2, 14
CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT = 68, -1


def cublas_gemm(problem: Problem, stream):
    """C = A @ B (or A @ W^T) through cublasGemmEx with fp32 compute: the cuBLAS baseline.

    The returned function takes the shape from its arrays (A is M x K, C is M x N), so one
    baseline serves every shape of the problem's dtype and layout. cuBLAS is column-major;
    a row-major C[M,N] is C^T in its eyes, so it computes C^T = B^T A^T: (N x K)(K x M),
    with W's transpose taking op T.
    """
    import cupy
    import numpy as np
    from cupy_backends.cuda.libs import cublas

    handle = cupy.cuda.device.get_cublas_handle()
    dtype = CUDA_R_16F if problem.dtype == "fp16" else CUDA_R_16BF
    alpha, beta = np.ones(1, np.float32), np.zeros(1, np.float32)
    transposed = problem.layout == "nt"

    def run(a, b, c) -> None:
        (m, k), n = a.shape, c.shape[1]
        op_b, ldb = (cublas.CUBLAS_OP_T, k) if transposed else (cublas.CUBLAS_OP_N, n)
        cublas.setStream(handle, stream.ptr)
        cublas.gemmEx(handle, op_b, cublas.CUBLAS_OP_N, n, m, k, alpha.ctypes.data,
                      b.data.ptr, dtype, ldb, a.data.ptr, dtype, k, beta.ctypes.data,
                      c.data.ptr, dtype, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)

    return run


def torch_gemm(problem: Problem, stream):
    """torch.mm with its default settings on the same buffers and stream, or None."""
    try:
        import torch
    except ImportError:
        return None
    ext = torch.cuda.ExternalStream(stream.ptr)

    def as_torch(x):
        if problem.dtype == "fp16":
            return torch.from_dlpack(x)
        return torch.from_dlpack(x.view("int16")).view(torch.bfloat16)

    def run(a, b, c) -> None:
        ta, tb, tc = as_torch(a), as_torch(b), as_torch(c)
        with torch.cuda.stream(ext):
            torch.mm(ta, tb if problem.layout == "nn" else tb.t(), out=tc)

    return run


def _settings_modes(job) -> list[str]:
    mode = job["settings"].get("mode", "offline")
    return ["offline", "server"] if mode == "both" else [mode]


def _bench_all(launches, outputs, ref, job, environment, stream, num, rng) -> dict[str, Any]:
    """Bench `launches` in each requested mode. Every contestant's output (`outputs[name]`)
    is poisoned before and checked against `ref` after every batch, so a kernel that behaves
    differently while timed is caught. Only outputs are poisoned, the same way for all: a
    kernel's workspace is as its last call left it (verify() calls it on random workspaces).
    Refilling it before each batch charged the kernel alone for the writes, and proved
    nothing: every call of a batch after the first sees what the call before it left."""
    import cupy

    from .bench import bench
    from .verify import Rejected, compare, poison_output

    settings = job["settings"]
    l2 = cupy.empty(2 * environment["l2_bytes"], dtype=cupy.uint8)

    def before(name: str) -> None:
        poison_output(outputs[name])

    def after(name: str) -> None:
        _, _, why = compare(outputs[name], ref, num)
        if why:
            raise Rejected("cheat" if name == "kernel" else "wrong",
                           f"output of timed calls differs from the verified result ({why})")

    timings = {}
    for mode in _settings_modes(job):
        timings[mode] = {
            name: asdict(t) for name, t in bench(
                launches, stream=stream, mode=mode, budget_s=settings.get("budget_s", 1.0),
                qps=settings.get("qps", 200.0), flush=lambda: l2.fill(0), before=before,
                after=after, seed=rng.getrandbits(32),
            ).items()
        }
    return timings


def _kernel_job(job: dict[str, Any], environment: dict[str, Any]) -> dict[str, Any]:
    import cupy

    from .verify import Kernel, Numerics, Operands, Rejected, physical_floor_us, seed_from_os, verify

    problem = Problem(**job["problem"])
    rng = random.Random(seed_from_os())
    stream = cupy.cuda.Stream(non_blocking=True)
    kernel = Kernel(job["library"])
    gemm = cublas_gemm(problem, stream)
    with stream:
        verdict = verify(kernel, problem, stream, gemm, rng)
        result = {"status": verdict.status, "error": verdict.reason,
                  "max_error": verdict.max_error, "tolerance": verdict.tolerance}
        if verdict.status != "ok":
            return result
        num = Numerics(problem.dtype)
        ops = Operands(problem, kernel.workspace_bytes(problem.m, problem.n, problem.k), num)
        ops.fill("normal", rng)
        ref = ops.reference()
        out = cupy.empty_like(ops.c)
        launches = {"kernel": lambda: ops.call(kernel, stream), "cuBLAS": lambda: gemm(ops.a, ops.b, out)}
        try:
            timings = _bench_all(launches, {"kernel": ops.c, "cuBLAS": out}, ref, job, environment, stream, num, rng)
        except Rejected as r:
            return {**result, "status": r.status, "error": str(r)}
    for mode, entries in timings.items():
        floor = physical_floor_us(problem, environment, cold_l2=mode == "server")
        if entries["kernel"]["median_us"] < 0.9 * floor:
            return {**result, "status": "cheat", "error": (
                f"{mode} time {entries['kernel']['median_us']:.2f} us is below the physical limit "
                f"{floor:.2f} us of this GPU")}
    return {**result, "timings": timings}


def _baselines_job(job: dict[str, Any], environment: dict[str, Any]) -> dict[str, Any]:
    import cupy

    from .verify import Numerics, Operands, compare, seed_from_os

    problem = Problem(**job["problem"])
    rng = random.Random(seed_from_os())
    stream = cupy.cuda.Stream(non_blocking=True)
    num = Numerics(problem.dtype)
    runners = {"cuBLAS": cublas_gemm(problem, stream), "torch.matmul": torch_gemm(problem, stream)}
    runners = {name: run for name, run in runners.items() if run is not None}
    with stream:
        ops = Operands(problem, 0, num)
        ops.fill("normal", rng)
        ref = ops.reference()
        outs = {name: cupy.empty_like(ops.c) for name in runners}
        errors = {}
        for name, run in runners.items():
            run(ops.a, ops.b, outs[name])
            errors[name] = compare(outs[name], ref, num)[:2]
        launches = {name: (lambda run=run, out=outs[name]: run(ops.a, ops.b, out)) for name, run in runners.items()}
        timings = _bench_all(launches, outs, ref, job, environment, stream, num, rng)
    return {"status": "ok", "errors": errors, "timings": timings}
