"""On a GPU: how back-to-back launches chain, and whether the two cuBLAS timings of a bench
process part because of the order of its jobs (scripts/reference_check.py).

Per line of SPEC_FILE (`M N K DTYPE LAYOUT TEMPLATE k=v ...`):

1. bench() (offline, fenced=False: truly back to back, no poisoning) over: cuBLAS, the kernel, a one-thread empty
   `fence` kernel, and each of the first two followed by the fence. A launch that overlaps
   the one before it (programmatic dependent launch) loses that overlap when the fence
   stands between them: `chain_cost` = t(x + fence) - t(fence) - t(x) is ~0 for a launch
   that does not overlap, and the time it gained from overlapping otherwise. (Its first run,
   before the templates launched with PDL, also timed each sm90 kernel with PDL added by
   text substitution: commit 230ebfa.)
2. The worker's own jobs, as `cudal2 bench` runs them (budget 0.2 s), alternated: baselines,
   kernel, baselines, kernel, ... (ROUNDS of each, default 4). If the baselines job's cuBLAS
   is faster only when it runs first, the gap between the two references is the order.

    python scripts/launch_probe.py SPEC_FILE [ROUNDS]

One JSON line per measurement on stdout.
"""

from __future__ import annotations

import json
import random
import statistics
import sys

import cupy

from cudal2_cli.bench import FENCE_SOURCE, bench
from cudal2_cli.compile import Compiler
from cudal2_cli.config import load_settings
from cudal2_cli.environment import default_arch, describe_device
from cudal2_cli.problem import Problem
from cudal2_cli.render import render, template_candidate
from cudal2_cli.verify import Kernel, Numerics, Operands
from cudal2_cli.worker import _baselines_job, _kernel_job, cublas_gemm

FENCE = cupy.RawKernel(FENCE_SOURCE, "cudal2_fence")


def main(spec_path: str, rounds: int) -> None:
    cc = int(cupy.cuda.Device().compute_capability)
    compiler = Compiler(default_arch(cc), load_settings().cache_dir)
    environment = describe_device(0)
    specs = [line.split() for line in open(spec_path) if line.strip() and not line.startswith("#")]
    for spec in specs:
        problem = Problem(int(spec[0]), int(spec[1]), int(spec[2]), spec[3], spec[4])
        params = dict(a.split("=", 1) for a in spec[6:])
        source = render(template_candidate(spec[5], params, cc), problem)
        build = compiler.compile(source)
        assert build.status == "ok", build.log[-2000:]
        libraries = {"kernel": str(build.library)}
        stream = cupy.cuda.Stream(non_blocking=True)
        num = Numerics(problem.dtype)
        with stream:
            gemm = cublas_gemm(problem, stream)
            kernels = {name: Kernel(library) for name, library in libraries.items()}
            operands = {name: Operands(problem, kernel.workspace_bytes(problem.m, problem.n, problem.k), num)
                        for name, kernel in kernels.items()}
            for ops in operands.values():
                ops.fill("normal", random.Random(1))
            a, b, out = operands["kernel"].a, operands["kernel"].b, cupy.empty_like(operands["kernel"].c)
            launches = {"cuBLAS": lambda: gemm(a, b, out), "fence": lambda: FENCE((1,), (1,), (), stream=stream)}
            for name, kernel in kernels.items():
                launches[name] = lambda ops=operands[name], kernel=kernel: ops.call(kernel, stream)
            for name in ["cuBLAS", *kernels]:
                launches[f"{name} + fence"] = lambda run=launches[name]: (run(), launches["fence"]())
            for repeat in range(2):
                t = {name: timing.median_us for name, timing in
                     bench(launches, stream=stream, budget_s=2.0, seed=repeat, fenced=False).items()}
                chain = {name: round(t[f"{name} + fence"] - t["fence"] - t[name], 3) for name in ["cuBLAS", *kernels]}
                print(json.dumps({"problem": str(problem), "spec": " ".join(spec[5:]), "part": "chain",
                                  "median_us": {name: round(v, 3) for name, v in t.items()},
                                  "chain_cost_us": chain,
                                  "speedup": {name: round(t["cuBLAS"] / t[name], 4) for name in kernels}}),
                      flush=True)

        job = {"problem": {"m": problem.m, "n": problem.n, "k": problem.k, "dtype": problem.dtype,
                           "layout": problem.layout},
               "settings": {"mode": "offline", "budget_s": 0.2, "qps": 200.0}, "library": libraries["kernel"]}
        cublas = {"baselines": [], "kernel": []}
        for step in ["baselines", "kernel"] * rounds:
            result = (_baselines_job if step == "baselines" else _kernel_job)({**job, "op": step}, environment)
            timings = result["timings"]["offline"]
            cublas[step].append(timings["cuBLAS"]["median_us"])
            print(json.dumps({"problem": str(problem), "part": "jobs", "job": step,
                              "median_us": {name: round(v["median_us"], 3) for name, v in timings.items()}}),
                  flush=True)
        print(json.dumps({"problem": str(problem), "part": "jobs summary",
                          "cuBLAS_mean_us": {step: round(statistics.mean(v), 3) for step, v in cublas.items()},
                          "baselines_first_us": round(cublas["baselines"][0], 3),
                          "baselines_later_mean_us": round(statistics.mean(cublas["baselines"][1:]), 3)}),
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 4)
