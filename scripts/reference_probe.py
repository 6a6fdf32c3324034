"""On a GPU: where the two cuBLAS timings of a bench process part (scripts/reference_check.py).
First, in single bench() calls at one shape, cuBLAS on plain CuPy arrays beside: cuBLAS on
the verifier's guard-banded operands; the same with C and a workspace poisoned before each
batch (as a kernel's job does); and a kernel of the template space (poisoned the same way).
Then the worker's own jobs in turn, as `cudal2 bench` runs them (budget 0.2 s): baselines,
the kernel's job, and the kernel's job with verify() skipped; the cuBLAS each one times.

    python scripts/reference_probe.py [M N K DTYPE LAYOUT TEMPLATE k=v ...]
      (default: 1024 128 16384 fp16 nn, the parallel split-K 64x128x128 with 8 slices)
"""

from __future__ import annotations

import json
import random
import sys

import cupy

import cudal2_cli.verify as verify_module
from cudal2_cli.bench import bench
from cudal2_cli.compile import Compiler
from cudal2_cli.environment import default_arch, describe_device
from cudal2_cli.problem import Problem
from cudal2_cli.render import render, template_candidate
from cudal2_cli.verify import Kernel, Numerics, Operands
from cudal2_cli.worker import _baselines_job, _kernel_job, cublas_gemm

args = sys.argv[1:] or ["1024", "128", "16384", "fp16", "nn", "sm90_cutlass", "kernel_schedule=warpspecialized",
                        "tile_m=64", "tile_n=128", "tile_k=128", "cluster_m=1", "splits=8", "reduction=parallel"]
problem = Problem(int(args[0]), int(args[1]), int(args[2]), args[3], args[4])
params = dict(a.split("=", 1) for a in args[6:])
cc = int(cupy.cuda.Device().compute_capability)
build = Compiler(default_arch(cc)).compile(
    render(template_candidate(args[5], params, cc), problem))
assert build.status == "ok", build.log[-2000:]
kernel = Kernel(str(build.library))
rng = random.Random(1)
stream = cupy.cuda.Stream(non_blocking=True)
num = Numerics(problem.dtype)
with stream:
    gemm = cublas_gemm(problem, stream)
    workspace = kernel.workspace_bytes(problem.m, problem.n, problem.k)
    guarded, poisoned, mine = (Operands(problem, workspace, num) for _ in range(3))
    for ops in (guarded, poisoned, mine):
        ops.fill("normal", rng)
    a, b = guarded.a.copy(), guarded.b.copy()
    out, out_g = cupy.empty_like(guarded.c), cupy.empty_like(guarded.c)
    launches = {
        "cuBLAS plain": lambda: gemm(a, b, out),
        "cuBLAS guarded": lambda: gemm(guarded.a, guarded.b, out_g),
        "cuBLAS guarded, poisoned": lambda: gemm(poisoned.a, poisoned.b, poisoned.c),
        "kernel, poisoned": lambda: mine.call(kernel, stream),
    }
    poison = {"cuBLAS guarded, poisoned": poisoned, "kernel, poisoned": mine}

    def before(name: str) -> None:
        if name in poison:
            poison[name].poison(rng)

    for pair in (("cuBLAS plain", "cuBLAS guarded"), ("cuBLAS plain", "cuBLAS guarded, poisoned"),
                 ("cuBLAS plain", "kernel, poisoned"), ("cuBLAS guarded", "kernel, poisoned"),
                 tuple(launches)):
        for repeat in range(2):
            timings = bench({name: launches[name] for name in pair}, stream=stream, budget_s=1.0,
                            before=before, seed=repeat)
            print(json.dumps({"problem": str(problem), "pair": list(pair),
                              "median_us": {name: round(t.median_us, 3) for name, t in timings.items()}}), flush=True)

# The worker's jobs, in one process as in a bench run; "kernel, no verify" skips verify().
environment = describe_device(0)
job = {"problem": {"m": problem.m, "n": problem.n, "k": problem.k, "dtype": problem.dtype, "layout": problem.layout},
       "settings": {"mode": "offline", "budget_s": 0.2, "qps": 200.0}, "library": str(build.library)}
real_verify = verify_module.verify
for step in ("baselines", "kernel", "kernel, no verify", "baselines", "kernel", "kernel, no verify", "baselines"):
    verify_module.verify = real_verify if step != "kernel, no verify" else (
        lambda *args, **kwargs: verify_module.Verdict("ok", max_error=0.0, tolerance=0.0))
    result = (_baselines_job if step == "baselines" else _kernel_job)({**job, "op": step.split(",")[0]}, environment)
    timings = result["timings"]["offline"]
    print(json.dumps({"problem": str(problem), "job": step,
                      "median_us": {name: round(t["median_us"], 3) for name, t in timings.items()}}), flush=True)
verify_module.verify = real_verify
