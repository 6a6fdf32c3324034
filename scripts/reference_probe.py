"""On a GPU: where the two cuBLAS timings of a bench process part (scripts/reference_check.py).
In single bench() calls at one shape, cuBLAS on plain CuPy arrays beside: cuBLAS on the
verifier's guard-banded operands; the same with C and a workspace poisoned before each batch
(as a kernel's job does); and a kernel of the template space (poisoned the same way).

    python scripts/reference_probe.py [M N K DTYPE LAYOUT TEMPLATE k=v ...]
      (default: 1024 128 16384 fp16 nn, the parallel split-K 64x128x128 with 8 slices)
"""

from __future__ import annotations

import json
import random
import sys

import cupy

from cudal2_cli.bench import bench
from cudal2_cli.compile import Compiler
from cudal2_cli.problem import Problem
from cudal2_cli.render import render, template_candidate
from cudal2_cli.verify import Kernel, Numerics, Operands
from cudal2_cli.worker import cublas_gemm

args = sys.argv[1:] or ["1024", "128", "16384", "fp16", "nn", "sm90_cutlass", "kernel_schedule=warpspecialized",
                        "tile_m=64", "tile_n=128", "tile_k=128", "cluster_m=1", "splits=8", "reduction=parallel"]
problem = Problem(int(args[0]), int(args[1]), int(args[2]), args[3], args[4])
params = dict(a.split("=", 1) for a in args[6:])
cc = int(cupy.cuda.Device().compute_capability)
build = Compiler(f"sm_{cc}a" if cc == 90 else f"sm_{cc}").compile(
    render(template_candidate(args[5], params, cc), problem))
assert build.status == "ok", build.log[-2000:]
kernel = Kernel(str(build.library))
rng = random.Random(1)
stream = cupy.cuda.Stream(non_blocking=True)
num = Numerics(problem.dtype)
with stream:
    gemm = cublas_gemm(problem, stream)
    guarded = Operands(problem, kernel.workspace_bytes(problem.m, problem.n, problem.k), num)
    guarded.fill("normal", rng)
    poisoned = Operands(problem, kernel.workspace_bytes(problem.m, problem.n, problem.k), num)
    poisoned.fill("normal", rng)
    mine = Operands(problem, kernel.workspace_bytes(problem.m, problem.n, problem.k), num)
    mine.fill("normal", rng)
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
