"""On a GPU: which kernels a GEMM call runs, and how long each takes on the device.

Per line of SPEC_FILE (`M N K DTYPE LAYOUT [TEMPLATE k=v ...]`), under torch.profiler (CUPTI):
cuBLAS (cublasGemmEx, the bench's baseline), torch.mm (cuBLASLt) and, where the line names
a template configuration, that kernel. Each contestant is launched CALLS times, each call
followed by the bench's fence kernel, after a few untimed calls. For each it prints the
kernels one call runs (names as the driver reports them: cuBLAS's say their tile, cluster
and split-K scheme), each kernel's median duration, the gap from one kernel's end to the
next one's start within a call (negative: programmatic dependent launch let it start
early), the span of a call (first start to last end, the fence excluded) and the gaps to
the fences around it. CUPTI adds its own cost to launches, so gaps read here are upper bounds.

    python scripts/kernel_profile.py SPEC_FILE [CALLS] [--clocks SECONDS | --plain]

With --plain, no profiler and no torch.matmul: cuBLAS and the line's kernel each run CALLS
fenced calls, for an outside profiler to attach to, e.g. Nsight Compute:
    ncu --clock-control none --set full -k regex:'nvjet|device_kernel' -o prof \
        python scripts/kernel_profile.py SPEC_FILE 2 --plain

One JSON line per (problem, contestant) on stdout. With --clocks, no profiler: each
contestant runs fenced calls back to back for SECONDS while nvidia-smi samples the SM clock,
the power draw and the active clock-limit reasons every 50 ms (the first half second of each
run dropped): whether a kernel runs the GPU into its power limit, and at what clock.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import subprocess
import time

import cupy
import torch
from torch.profiler import ProfilerActivity, profile

from cudal2.bench import FENCE_SOURCE
from cudal2.compile import Compiler
from cudal2.config import load_settings
from cudal2.environment import default_arch
from cudal2.problem import Problem
from cudal2.render import render, template_candidate
from cudal2.verify import Kernel, Numerics, Operands
from cudal2.baselines import cublas_gemm, torch_gemm

FENCE_NAME = "cudal2_fence"
FENCE = cupy.RawKernel(FENCE_SOURCE, FENCE_NAME)


def kernel_intervals(run, stream, calls: int) -> list[tuple[str, float, float]]:
    """(name, start_us, end_us) of every kernel of `calls` fenced calls of `run`, in start order."""
    for _ in range(5):
        run()
        FENCE((1,), (1,), (), stream=stream)
    stream.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
            FENCE((1,), (1,), (), stream=stream)
        stream.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
              and e.time_range.end > e.time_range.start and "memcpy" not in e.name.lower()]
    return sorted(((e.name, float(e.time_range.start), float(e.time_range.end)) for e in events),
                  key=lambda t: t[1])


def summarize(intervals: list[tuple[str, float, float]]) -> dict:
    """Split the kernel sequence into calls at the fences; per kernel position: name, median
    duration, median gap before it; the median span of a call; and around it, the gap from the
    fence before to its first kernel (`lead_gap_us`), from its last kernel to the fence after
    (`tail_gap_us`), and fence start to fence start (`cycle_us`, what the bench's per-launch
    time is before it subtracts the fence's own)."""
    calls, current, fences = [], [], []
    for name, start, end in intervals:
        if FENCE_NAME in name:
            if current and fences:  # a call with a fence on both sides
                calls.append((fences[-1], current, (name, start, end)))
            fences.append((name, start, end))
            current = []
        else:
            current.append((name, start, end))
    shapes = {tuple(k[0] for k in call) for _, call, _ in calls}
    # Where calls differ (a memset in some only), keep the commonest sequence.
    common = max(shapes, key=lambda s: sum(tuple(k[0] for k in c) == s for _, c, _ in calls))
    calls = [c for c in calls if tuple(k[0] for k in c[1]) == common]
    med = statistics.median
    kernels = []
    for i, name in enumerate(common):
        kernels.append({"name": name[:240], "median_us": round(med(c[i][2] - c[i][1] for _, c, _ in calls), 3)})
        if i:
            kernels[-1]["gap_before_us"] = round(med(c[i][1] - c[i - 1][2] for _, c, _ in calls), 3)
    return {"calls": len(calls), "call_shapes": len(shapes),
            "span_us": round(med(max(k[2] for k in c) - c[0][1] for _, c, _ in calls), 3),
            "lead_gap_us": round(med(c[0][1] - before[2] for before, c, _ in calls), 3),
            "tail_gap_us": round(med(after[1] - max(k[2] for k in c) for _, c, after in calls), 3),
            "fence_us": round(med(after[2] - after[1] for _, _, after in calls), 3),
            "cycle_us": round(med(after[1] - before[1] for before, _, after in calls), 3),
            "kernels": kernels}


@functools.cache
def smi_fields() -> str:
    """nvidia-smi's query fields: SM clock, power, clock-limit reasons (the field's newer name
    where the driver knows it)."""
    for reasons in ("clocks_event_reasons.active", "clocks_throttle_reasons.active"):
        fields = f"clocks.sm,power.draw,{reasons}"
        probe = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True)
        if probe.returncode == 0:
            return fields
    raise RuntimeError("nvidia-smi cannot report clocks, power and clock-limit reasons here")


def clocks(run, stream, seconds: float) -> dict:
    """Median SM clock (MHz) and power (W) while `run` and the fence repeat for `seconds`,
    and the clock-limit reason bit masks seen."""
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={smi_fields()}", "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=subprocess.PIPE, text=True)
    began = time.monotonic()
    calls = 0
    while time.monotonic() - began < seconds:
        for _ in range(20):
            run()
            FENCE((1,), (1,), (), stream=stream)
        stream.synchronize()
        calls += 20
    smi.terminate()
    lines = smi.communicate()[0].strip().splitlines()
    samples = [line.split(", ") for line in lines[10:]]  # 50 ms apart: the first half second dropped
    samples = [s for s in samples if len(s) == 3]
    med = statistics.median
    return {"seconds": seconds, "calls": calls, "samples": len(samples),
            "sm_clock_mhz": med(float(s[0]) for s in samples) if samples else None,
            "power_w": med(float(s[1]) for s in samples) if samples else None,
            "limit_reasons": sorted({s[2] for s in samples})}


def plain(run, stream, calls: int) -> dict:
    """`calls` fenced calls of `run` with nothing watching but an outside profiler."""
    for _ in range(calls):
        run()
        FENCE((1,), (1,), (), stream=stream)
    stream.synchronize()
    return {"calls": calls}


def main(spec_path: str, calls: int, clock_seconds: float, plain_calls: bool = False) -> None:
    cc = int(cupy.cuda.Device().compute_capability)
    compiler = Compiler(default_arch(cc), load_settings().cache_dir)
    specs = [line.split() for line in open(spec_path) if line.strip() and not line.startswith("#")]
    for spec in specs:
        problem = Problem(int(spec[0]), int(spec[1]), int(spec[2]), spec[3], spec[4])
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            kernel, workspace = None, 0
            if len(spec) > 5:
                params = dict(a.split("=", 1) for a in spec[6:])
                build = compiler.compile(render(template_candidate(spec[5], params, cc), problem))
                assert build.status == "ok", build.log[-2000:]
                kernel = Kernel(str(build.library))
                workspace = kernel.workspace_bytes(problem.m, problem.n, problem.k)
            ops = Operands(problem, workspace, Numerics(problem.dtype))
            ops.fill("normal", random.Random(1))
            contestants = {"cuBLAS": cublas_gemm(problem, stream)}
            if not plain_calls:
                contestants["torch.matmul"] = torch_gemm(problem, stream)
            launches = {name: (lambda gemm=gemm: gemm(ops.a, ops.b, ops.c)) for name, gemm in contestants.items()
                        if gemm is not None}
            if kernel is not None:
                launches[" ".join(spec[5:])] = lambda: ops.call(kernel, stream)
            for name, run in launches.items():
                measured = plain(run, stream, calls) if plain_calls else \
                    clocks(run, stream, clock_seconds) if clock_seconds else \
                    summarize(kernel_intervals(run, stream, calls))
                print(json.dumps({"problem": str(problem), "contestant": name, **measured}), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("spec")
    parser.add_argument("calls", type=int, nargs="?", default=50)
    parser.add_argument("--clocks", type=float, default=0.0, metavar="SECONDS")
    parser.add_argument("--plain", action="store_true", help="no profiler: calls only (for ncu)")
    args = parser.parse_args()
    main(args.spec, args.calls, args.clocks, args.plain)
