"""An independent re-measurement of the leaderboard's claims (needs a GPU and torch).

    python scripts/remeasure.py SHAPES.csv [RESULTS] [--out FILE.json] [--calls N]

For every row of the shape set, the leaderboard's best kernel (this version's protocol) is
loaded with ctypes into this process, which shares nothing with cudal2's worker: torch owns
the memory and streams, torch.profiler (CUPTI through Kineto) reads device time, and
torch.cuda.CUDAGraph replays. Each contestant is timed two ways, on three input sets
cycled in turn:

- profiler: `--calls` calls, each followed by a device sync, inside one profiler session;
  every device event (kernels and memsets) summed, divided by the calls (a mean);
- graph: up to 20 x (an elementwise kernel over 8 MB + the call; fewer for calls over 100 us)
  captured and replayed, minus the graph of the elementwise kernels alone, per call (the
  median of 15 replays; the profiler is not running).

Against torch.matmul (F.linear for nt) and cuBLASLt autotuned here (the heuristic's top 32
algorithms of cudal2's shim, each timed by the profiler method, the fastest kept). Prints a
markdown table: both methods, both baselines, the speedup (the lower of the two ratios
against the faster baseline), and the leaderboard's claim beside it with the difference.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.autograd import DeviceType

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cudal2.baselines import CublasLt, build_baselines  # noqa: E402
from cudal2.shapes import read_shapes  # noqa: E402
from cudal2.verify import Kernel  # noqa: E402
from cudal2.compile import Compiler, default_cache_dir  # noqa: E402
from cudal2.leaderboard import Leaderboard, best, select  # noqa: E402
from cudal2.problem import Problem  # noqa: E402

SETS, GRAPH_CALLS, GRAPH_REPLAYS = 3, 20, 15


def abi_call(kernel: Kernel, p: Problem):
    """run(a, b, c) for a library implementing the kernel ABI, on torch's current stream."""
    size = kernel.workspace_bytes(p.m, p.n, p.k)
    workspace = torch.empty(max(1, size), dtype=torch.uint8, device="cuda")

    def run(a, b, c):
        code = kernel.gemm(a.data_ptr(), b.data_ptr(), c.data_ptr(), p.m, p.n, p.k, workspace.data_ptr(),
                           workspace.numel(), torch.cuda.current_stream().cuda_stream)
        if code:
            raise RuntimeError(f"cudal2_gemm returned {code}")

    return run


def profiler_us(run, sets, calls: int) -> float:
    """Mean device time per call: all device events in the session over the calls."""
    for i in range(3):
        run(*sets[i % SETS])
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            run(*sets[i % SETS])
            torch.cuda.synchronize()
    device = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    return sum(e.time_range.elapsed_us() for e in device) / calls


def graph_us(run, sets, calls: int) -> float:
    scratch = torch.ones(2 << 20, device="cuda")

    def capture(with_call: bool):
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for i in range(3):  # warm on the capture stream
                scratch.mul_(0.5).add_(1.0)
                if with_call:
                    run(*sets[i % SETS])
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            for i in range(calls):
                torch.add(scratch, 1.0, alpha=0.5, out=scratch)
                if with_call:
                    run(*sets[i % SETS])
        return graph

    def replay(graph) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3

    with_calls, alone = capture(True), capture(False)
    replay(with_calls), replay(alone)
    samples = []
    for _ in range(GRAPH_REPLAYS):
        samples.append((replay(with_calls) - replay(alone)) / calls)
    return statistics.median(samples)


def input_sets(p: Problem):
    dtype = torch.float16 if p.dtype == "fp16" else torch.bfloat16
    sets = []
    for _ in range(SETS):
        a = torch.randn(p.m, p.k, device="cuda").to(dtype)
        b = torch.randn(*p.b_shape, device="cuda").to(dtype)
        sets.append((a, b, torch.empty(p.m, p.n, device="cuda", dtype=dtype)))
    return sets


def autotuned_lt(lt: CublasLt, p: Problem, sets):
    """cuBLASLt with the fastest of its heuristic's algorithms here (each timed by the
    profiler method): (run, index, count)."""
    count = lt.algorithms(p)
    run = abi_call(lt.kernel, p)
    times = {}
    for i in range(count):
        lt.select(i)
        times[i] = profiler_us(run, sets, 6)
    fastest = min(times, key=times.get)
    lt.select(fastest)
    return run, fastest, count


def check(run, sets, p: Problem) -> float:
    a, b, c = sets[0]
    c.fill_(float("nan"))
    run(a, b, c)
    ref = a.float() @ (b.float() if p.layout == "nn" else b.float().t())
    return float((c.float() - ref).abs().max() / ref.abs().max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", type=Path)
    parser.add_argument("results", type=Path, nargs="?", default=Path("results"))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--cache", type=Path, default=default_cache_dir())
    args = parser.parse_args()

    board = Leaderboard(args.results)
    winners = best(board.read(), 1)
    cc = torch.cuda.get_device_capability()
    compiler = Compiler(f"sm_{cc[0]}{cc[1]}a" if cc[0] in (9, 10) else f"sm_{cc[0]}{cc[1]}", args.cache)
    records = []
    for p in read_shapes(args.shapes):
        found = select(winners, m=p.m, n=p.n, k=p.k, dtype=p.dtype, layout=p.layout,
                       gpu=torch.cuda.get_device_name())
        if found.empty:
            print(f"{p}: no kernel of this protocol in the leaderboard", file=sys.stderr)
            continue
        claim = found.iloc[0]
        build = compiler.compile(board.source(claim["source_hash"]))
        sets = input_sets(p)
        kernel = abi_call(Kernel(str(build.library)), p)
        lt, lt_index, lt_count = autotuned_lt(CublasLt(build_baselines(compiler, p)["cuBLASLt"]), p, sets)
        torch_run = ((lambda a, b, c: torch.matmul(a, b, out=c)) if p.layout == "nn"
                     else (lambda a, b, c: F.linear(a, b)))
        contestants = {"kernel": kernel, "torch": torch_run, "cublaslt": lt}
        error = check(kernel, sets, p)
        us_hint = float(claim["kernel_us"])
        rec = {"shape": str(p), "kernel_name": claim["kernel"], "error": error, "lt_index": lt_index, "lt_of": lt_count}
        for name, run in contestants.items():
            rec[f"{name}_profiler_us"] = us = profiler_us(run, sets, args.calls if us_hint < 1000 else 9)
            rec[f"{name}_graph_us"] = graph_us(run, sets, max(3, min(GRAPH_CALLS, round(2000 / max(us, 1.0)))))
        ratios = {m: min(rec[f"torch_{m}_us"], rec[f"cublaslt_{m}_us"]) / rec[f"kernel_{m}_us"] for m in ("profiler", "graph")}
        rec["speedup"] = min(ratios.values())
        rec.update(claimed=float(claim["speedup_offline"]), claimed_kernel_us=float(claim["kernel_us"]),
                   claimed_graph_us=float(claim["graph_us"]))
        records.append(rec)
        print(json.dumps(rec), file=sys.stderr, flush=True)
        del sets
        torch.cuda.empty_cache()

    print("| shape | kernel us (profiler / graph) | torch.matmul | cuBLASLt autotuned | speedup here | "
          "leaderboard | kernel us there (CUPTI / graph) | agree |")
    print("|---|---|---|---|---|---|---|---|")
    agree = 0
    for r in records:
        small = r["kernel_profiler_us"] < 5.0
        close = (abs(r["kernel_profiler_us"] - r["claimed_kernel_us"]) <= 0.15 and
                 abs(r["kernel_graph_us"] - r["claimed_graph_us"]) <= 0.15) if small else \
            abs(r["speedup"] / r["claimed"] - 1) <= 0.03
        agree += close
        print(f"| {r['shape']} | {r['kernel_profiler_us']:.2f} / {r['kernel_graph_us']:.2f} | "
              f"{r['torch_profiler_us']:.2f} / {r['torch_graph_us']:.2f} | "
              f"{r['cublaslt_profiler_us']:.2f} / {r['cublaslt_graph_us']:.2f} | {r['speedup']:.3f} | "
              f"{r['claimed']:.3f} | {r['claimed_kernel_us']:.2f} / {r['claimed_graph_us']:.2f} | "
              f"{'yes' if close else 'no'} |")
    if records:
        geo = lambda key: math.exp(sum(math.log(r[key]) for r in records) / len(records))
        print(f"\n{len(records)} rows; geometric mean here {geo('speedup'):.3f}, leaderboard {geo('claimed'):.3f}; "
              f"minimum here {min(r['speedup'] for r in records):.3f}; {agree} of {len(records)} agree "
              "(within 3% of the speedup; 0.15 us of both times for calls under 5 us)")
    if args.out:
        args.out.write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
