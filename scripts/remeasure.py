"""An independent re-measurement of the leaderboard's claims (needs a GPU and torch).

    python scripts/remeasure.py SHAPES.csv [RESULTS] [--out FILE.json] [--calls N]

For every row of the shape set, the leaderboard's best kernel of this version's protocol is
loaded with ctypes into two child processes that share nothing with cudal2's worker: torch
owns the memory and streams there. One child replays CUDA graphs and never loads CUPTI
(with CUPTI attached, every kernel replayed from a graph reads 0.2-0.9 us more on an H200);
the other reads device time with torch.profiler (CUPTI through Kineto). Each contestant is
timed both ways, on three input sets cycled in turn:

- graph: up to 20 x (the protocol's neighbour kernel, an in-place sin over 512 KB, + the
  call; fewer for long calls) captured, replayed, minus the graph of the neighbours alone,
  per call; per round every contestant's graph replayed once, in a rotating order;
- profiler: per round `--calls`/ROUNDS calls of each contestant in a rotating order, each
  call followed by a device sync, inside one profiler session per row; the device events
  (kernels, memsets) inside each contestant's record_function range per call, those of a
  call that overlap counted once (the union of their intervals).

ROUNDS rounds of each; the median. For calls of 20 us or more the two children's rounds
alternate, so that the clock (long GEMMs run the GPU at its power cap, and it falls over
seconds) is the same for both methods; shorter calls run each child's rounds in one block.
Calls of 100 us or more are timed after 1.5 s of untimed replays, at the clock a GPU busy
with them settles at, as cudal2's protocol times them, and first with the GPU brought within
2 C of the temperature the protocol's row records (idle to cool, replays to heat): at the
power cap the clock depends on it.

Against torch.matmul (F.linear for nt) and cuBLASLt autotuned here (the heuristic's top 32
algorithms of cudal2's shim, all timed together by the graph method, the fastest kept). Prints a
markdown table: both methods, both baselines, the speedup (the lower of the two ratios
against the faster baseline), and the leaderboard's claim beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import statistics
import sys
import time
import traceback
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cudal2.measure.baselines import build_baselines  # noqa: E402
from cudal2.protocol import PROTOCOL  # noqa: E402
from cudal2.kernels.compile import Compiler  # noqa: E402
from cudal2.config import load_settings  # noqa: E402
from cudal2.measure.environment import gpu_temperature  # noqa: E402
from cudal2.measure.measure import busy_per_window  # noqa: E402
from cudal2.results.leaderboard import Leaderboard, best, select  # noqa: E402
from cudal2.problem import Problem  # noqa: E402
from cudal2.shapes import read_shapes  # noqa: E402
# The protocol's thresholds, so that both sides time a call in the same state: rounds
# alternated from INTERLEAVE_US, a soak first from SOAK_US.
from cudal2.measure.worker import INTERLEAVE_US, SOAK_S, SOAK_US  # noqa: E402

SETS, GRAPH_CALLS, ROUNDS = 3, 20, 10
SETTLE_C, COOL_S, HEAT_S = 2, 120.0, 30.0  # a long row is timed within 2 C of the protocol's
TAG = "cudal2-remeasure:"


# ---- in the children (torch is imported there only) ----

def abi_call(kernel, p: Problem):
    """run(a, b, c) for a library implementing the kernel ABI, on torch's current stream."""
    import torch

    size = kernel.workspace_bytes(p.m, p.n, p.k)
    workspace = torch.empty(max(1, size), dtype=torch.uint8, device="cuda")

    def run(a, b, c):
        code = kernel.gemm(a.data_ptr(), b.data_ptr(), c.data_ptr(), p.m, p.n, p.k, workspace.data_ptr(),
                           workspace.numel(), torch.cuda.current_stream().cuda_stream)
        if code:
            raise RuntimeError(f"cudal2_gemm returned {code}")

    return run


def input_sets(p: Problem):
    import torch

    dtype = torch.float16 if p.dtype == "fp16" else torch.bfloat16
    sets = []
    for _ in range(SETS):
        a = torch.randn(p.m, p.k, device="cuda").to(dtype)
        b = torch.randn(*p.b_shape, device="cuda").to(dtype)
        sets.append((a, b, torch.empty(p.m, p.n, device="cuda", dtype=dtype)))
    return sets


def rotated(names: list[str], r: int) -> list[str]:
    return names[r % len(names):] + names[:r % len(names)]


def neighbour(torch):
    """The protocol's own neighbour kernel (cudal2.measure.measure: an in-place sin over 512 KB, in
    the same launch shape), on memory torch owns, launched through CuPy on torch's current
    stream. What runs ahead of a kernel launched with PDL moves its in-graph time by up to
    0.5 us (scripts/protocol_probe.py --graphs); behind torch's sin_, this check's graph read
    the six smallest dev rows' kernels 0.24-0.43 us under the protocol's graph. So the check
    and the protocol use the same neighbour."""
    import cupy

    from cudal2.measure.measure import NEIGHBOUR_FLOATS, NEIGHBOUR_SOURCE

    kernel = cupy.RawKernel(NEIGHBOUR_SOURCE, "cudal2_neighbour")
    scratch = torch.ones(NEIGHBOUR_FLOATS, device="cuda")
    shared = cupy.asarray(scratch)  # torch's memory, seen by CuPy

    def run() -> None:
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
        kernel((NEIGHBOUR_FLOATS // 256,), (256,), (shared, cupy.uint32(NEIGHBOUR_FLOATS)), stream=stream)

    run.scratch = scratch  # kept alive with the launcher
    return run


class GraphTimer:
    """Per-call time of each contestant in a graph of `calls` x (neighbour + call) less the
    graph of the neighbours alone; the neighbour (the protocol's in-place sin over 512 KB)
    fills the SMs for a moment and touches too little memory for a call to slow it."""

    def __init__(self, contestants: dict, sets, calls: int):
        import torch

        self.torch, self.calls = torch, calls
        self.neighbour = neighbour(torch)
        self.graphs = {name: self.capture(run, sets) for name, run in contestants.items()}
        self.alone = self.capture(None, sets)
        for graph in [self.alone, *self.graphs.values()]:
            self.replay(graph)
        self.samples = {name: [] for name in self.graphs}

    def capture(self, run, sets):
        torch = self.torch
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for i in range(3):  # warm on the capture stream
                self.neighbour()
                if run is not None:
                    run(*sets[i % SETS])
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            for i in range(self.calls):
                self.neighbour()
                if run is not None:
                    run(*sets[i % SETS])
        return graph

    def replay(self, graph) -> float:
        torch = self.torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3

    def round(self, r: int) -> None:
        base = self.replay(self.alone)
        for name in rotated(list(self.graphs), r):
            self.samples[name].append((self.replay(self.graphs[name]) - base) / self.calls)

    def soak(self, seconds: float) -> None:
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            for graph in self.graphs.values():
                self.replay(graph)

    def finish(self) -> dict[str, float]:
        return {name: statistics.median(v) for name, v in self.samples.items()}


class ProfilerTimer:
    """Device time per call of each contestant: per round, `calls` calls of every
    contestant in a rotating order, a device sync after each call, inside one profiler
    session; a record_function range around each contestant's calls of a round collects
    the device events (kernels, memsets) that start in it."""

    def __init__(self, contestants: dict, sets, calls: int):
        import torch

        self.torch, self.contestants, self.sets, self.calls = torch, contestants, sets, calls
        for run in contestants.values():
            for i in range(3):
                run(*sets[i % SETS])
        torch.cuda.synchronize()
        self.profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                          torch.profiler.ProfilerActivity.CUDA])
        self.profile.start()

    def round(self, r: int) -> None:
        torch = self.torch
        for name in rotated(list(self.contestants), r):
            with torch.profiler.record_function(f"{TAG}{name}{TAG}{r}"):
                for i in range(self.calls):
                    self.contestants[name](*self.sets[(r * self.calls + i) % SETS])
                    torch.cuda.synchronize()

    def finish(self) -> dict[str, float]:
        from torch.autograd import DeviceType

        self.profile.stop()
        events = self.profile.events()
        windows = sorted((e.time_range.start, e.time_range.end, e.name.split(TAG)[1]) for e in events
                         if e.name.startswith(TAG) and e.device_type == DeviceType.CPU)
        records = [(e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == DeviceType.CUDA and not e.name.startswith(TAG)]
        # the device time of each window's calls (us): kernels of one call that overlap count once
        totals = busy_per_window([(start, end) for start, end, _ in windows], records)
        per_round = {name: [] for name in self.contestants}
        for (_, _, name), total in zip(windows, totals):
            per_round[name].append(total / self.calls)
        return {name: statistics.median(v) for name, v in per_round.items()}


def open_row(method: str, job: dict):
    """The row's contestants and the method's timer; the graph child autotunes cuBLASLt
    (the heuristic's algorithms timed together in graphs) and the profiler child uses the
    algorithm it chose."""
    import torch
    import torch.nn.functional as F

    from cudal2.measure.baselines import CublasLt
    from cudal2.measure.verify import Kernel

    p = Problem(**job["problem"])
    sets = input_sets(p)
    kernel = abi_call(Kernel(job["kernel"]), p)
    lt = CublasLt(job["cublaslt"])
    count = lt.algorithms(p)
    lt_run = abi_call(lt.kernel, p)
    index = job.get("lt_index")
    if index is None:
        def algorithm(i):
            def call(a, b, c):
                lt.select(i)
                lt_run(a, b, c)
            return call

        timer = GraphTimer({str(i): algorithm(i) for i in range(count)}, sets, job["calls"])
        for r in range(5):
            timer.round(r)
        times = timer.finish()
        index = int(min(times, key=times.get))
        del timer
    lt.select(index)
    torch_run = ((lambda a, b, c: torch.matmul(a, b, out=c)) if p.layout == "nn"
                 else (lambda a, b, c: F.linear(a, b)))
    contestants = {"kernel": kernel, "torch": torch_run, "cublaslt": lt_run}
    a, b, c = sets[0]
    c.fill_(float("nan"))
    kernel(a, b, c)
    ref = a.float() @ (b.float() if p.layout == "nn" else b.float().t())
    error = float((c.float() - ref).abs().max() / ref.abs().max())
    timer = (GraphTimer if method == "graph" else ProfilerTimer)(contestants, sets, job["calls"])
    return timer, {"lt_index": index, "lt_of": count, "error": error}


def child(conn, method: str) -> None:
    """Serves requests (op, job) over a pipe: device, open, round, finish."""
    import torch

    timer = None
    while True:
        op, job = conn.recv()
        try:
            if op == "device":
                answer = {"gpu": torch.cuda.get_device_name(), "cc": torch.cuda.get_device_capability()}
            elif op == "open":
                timer, answer = open_row(method, job)
            elif op == "soak":
                timer.soak(job)
                answer = {}
            elif op == "round":
                timer.round(job)
                answer = {}
            elif op == "finish":
                answer = timer.finish()
                timer = None
                torch.cuda.empty_cache()
            else:
                return
        except Exception:
            answer = {"failed": traceback.format_exc()}
            timer = None
        conn.send(answer)


# ---- in the parent (no CUDA here) ----

class Child:
    def __init__(self, method: str):
        context = multiprocessing.get_context("spawn")
        self.conn, theirs = context.Pipe()
        self.process = context.Process(target=child, args=(theirs, method), daemon=True)
        self.process.start()
        self.method = method

    def ask(self, op: str, job=None) -> dict:
        self.conn.send((op, job))
        answer = self.conn.recv()
        if "failed" in answer:
            raise RuntimeError(f"the {self.method} child failed on {op}:\n{answer['failed']}")
        return answer

    def close(self) -> None:
        self.conn.send(("close", None))
        self.process.join(timeout=30)


def settle(graph: Child, target_c: int) -> int | None:
    """Brings the GPU within SETTLE_C of the temperature the protocol's rounds began at:
    idle while it is hotter (up to COOL_S), the row's graphs replayed while it is cooler (up
    to HEAT_S). At the power cap the clock falls as the GPU heats, by 10-19% between 50 and
    62 C on an H200, so a check whose rows run back to back reads every long call slower
    than a tuning run does. Returns the temperature reached."""
    start = time.perf_counter()
    while (now := gpu_temperature()) is not None:
        spent = time.perf_counter() - start
        if now > target_c + SETTLE_C and spent < COOL_S:
            time.sleep(1.0)
        elif now < target_c - SETTLE_C and spent < HEAT_S:
            graph.ask("soak", 1.0)
        else:
            break
    return now


def measure(graph: Child, profiler: Child, job: dict, typical_us: float, profiler_calls: int,
            target_c: int | None = None) -> dict:
    """Both methods' medians for one row: the graph child opens first (it autotunes
    cuBLASLt), then the profiler child with the same algorithm; for long calls the GPU
    settled at the protocol's temperature (`target_c`, when the row has one) and the graphs
    replayed for SOAK_S; rounds alternate for long calls, run in one block per child for
    short ones."""
    rec = {**graph.ask("open", job)}
    profiler.ask("open", {**job, "lt_index": rec["lt_index"], "calls": profiler_calls})
    if typical_us >= SOAK_US:
        if target_c is not None:
            settle(graph, target_c)
        graph.ask("soak", SOAK_S)
        rec["temperature_c"] = gpu_temperature()
    if typical_us >= INTERLEAVE_US:
        for r in range(ROUNDS):
            graph.ask("round", r)
            profiler.ask("round", r)
    else:
        for child_ in (graph, profiler):
            for r in range(ROUNDS):
                child_.ask("round", r)
    for method, child_ in (("graph", graph), ("profiler", profiler)):
        for name, us in child_.ask("finish").items():
            rec[f"{name}_{method}_us"] = us
    return rec


def agrees(r: dict) -> bool:
    """Within 3% of the claimed speedup; for calls under 5 us, within 0.15 us on both times."""
    if r["kernel_profiler_us"] < 5.0:
        return (abs(r["kernel_profiler_us"] - r["claimed_kernel_us"]) <= 0.15 and
                abs(r["kernel_graph_us"] - r["claimed_graph_us"]) <= 0.15)
    return abs(r["speedup"] / r["claimed"] - 1) <= 0.03


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", type=Path)
    parser.add_argument("results", type=Path, nargs="?", default=Path("results"))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--calls", type=int, default=60, help="profiler calls of each contestant per row")
    parser.add_argument("--cache", type=Path, default=load_settings().cache_dir,
                        help="compile cache (default: cudal2's own: CUDAL2_CACHE_DIR, cudal2.toml or ~/.cache/cudal2)")
    args = parser.parse_args()

    graph, profiler = Child("graph"), Child("profiler")
    device = graph.ask("device")
    cc = device["cc"]
    compiler = Compiler(f"sm_{cc[0]}{cc[1]}a" if cc[0] in (9, 10) else f"sm_{cc[0]}{cc[1]}", args.cache)
    board = Leaderboard(args.results)
    winners = best(select(board.read(), protocol=PROTOCOL, gpu=device["gpu"]), 1)
    records = []
    for p in read_shapes(args.shapes):
        found = select(winners, m=p.m, n=p.n, k=p.k, dtype=p.dtype, layout=p.layout)
        if found.empty:
            print(f"{p}: no kernel of {PROTOCOL} in the leaderboard", file=sys.stderr)
            continue
        claim = found.iloc[0]
        library = compiler.compile(board.source(claim["source_hash"])).library
        shim = build_baselines(compiler, p)["cuBLASLt"]
        calls = max(3, min(GRAPH_CALLS, round(2000 / (float(claim["graph_us"]) + 3))))
        profiler_calls = max(1, round((args.calls if claim["kernel_us"] < 1000 else 10) / ROUNDS))
        job = {"problem": {"m": p.m, "n": p.n, "k": p.k, "dtype": p.dtype, "layout": p.layout},
               "kernel": str(library), "cublaslt": str(shim), "calls": calls}
        target = claim.get("temperature_c")
        target = None if target is None or pd.isna(target) else int(target)
        rec = {"shape": str(p), "kernel_name": claim["kernel"], "claimed": float(claim["speedup_offline"]),
               "claimed_kernel_us": float(claim["kernel_us"]), "claimed_graph_us": float(claim["graph_us"]),
               "claimed_temperature_c": target,
               **measure(graph, profiler, job, float(claim["kernel_us"]), profiler_calls, target)}
        rec["speedup"] = min(min(rec[f"torch_{m}_us"], rec[f"cublaslt_{m}_us"]) / rec[f"kernel_{m}_us"]
                             for m in ("profiler", "graph"))
        records.append(rec)
        print(json.dumps(rec), file=sys.stderr, flush=True)
    graph.close()
    profiler.close()

    print("| shape | kernel us (profiler / graph) | torch.matmul | cuBLASLt autotuned | speedup here | "
          "leaderboard | kernel us there (CUPTI / graph) | C here / there | agree |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in records:
        print(f"| {r['shape']} | {r['kernel_profiler_us']:.2f} / {r['kernel_graph_us']:.2f} | "
              f"{r['torch_profiler_us']:.2f} / {r['torch_graph_us']:.2f} | "
              f"{r['cublaslt_profiler_us']:.2f} / {r['cublaslt_graph_us']:.2f} | {r['speedup']:.3f} | "
              f"{r['claimed']:.3f} | {r['claimed_kernel_us']:.2f} / {r['claimed_graph_us']:.2f} | "
              f"{r.get('temperature_c') or '-'} / {r.get('claimed_temperature_c') or '-'} | "
              f"{'yes' if agrees(r) else 'no'} |")
    if records:
        geo = lambda key: math.exp(sum(math.log(r[key]) for r in records) / len(records))
        print(f"\n{len(records)} rows; geometric mean here {geo('speedup'):.3f}, leaderboard {geo('claimed'):.3f}; "
              f"minimum here {min(r['speedup'] for r in records):.3f}; {sum(map(agrees, records))} of "
              f"{len(records)} agree (within 3% of the speedup; 0.15 us of both times for calls under 5 us)")
    if args.out:
        args.out.write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
