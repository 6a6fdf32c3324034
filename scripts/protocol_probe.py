"""GPU: what moves the protocol's two times, for the rows where they and the independent
check (scripts/remeasure.py) disagree, or where the two methods disagree with each other
(the h200-2026-12-01-protocol report (in git history)).

    python scripts/protocol_probe.py SHAPES.csv [RESULTS] [--rows 0,1,2] [--out FILE.json]

For the chosen rows (0-based data rows) of the shape set, the leaderboard's best kernel,
cuBLASLt (the heuristic's first algorithm) and torch.matmul are timed through the
protocol's own code (cudal2/measure/measure.py) in these variants:

- `graph, no CUPTI`: the graph method before CUPTI is ever enabled in this process, behind
  the protocol's neighbour, and behind a neighbour that touches no memory (`compute`);
- `kernel, fresh` (the protocol: each round's set refreshed and C poisoned just before the
  calls), `kernel, reused` (the sets keep their contents, as the independent check's) and
  `kernel, sustained` (each timed call right behind three untimed calls of the same
  contestant on the other sets, so the clock is that of a busy GPU);
- `graph, CUPTI paused` and `graph, CUPTI finalized` (cuptiFinalize before, re-attached after),
  behind both neighbours, and `graph, set blocks` (each set's calls consecutive).

With `--graphs`, instead: the graph method behind every neighbour the protocol has had
(8 MB grid-stride, 6 us of compute, 512 KB sin) and a 512 KB grid-stride one and none, with
the protocol's calls per graph and with 21 (the independent check's 20), and behind the
protocol's with the graphs captured by torch on a torch stream (as the check captures), before
CUPTI is loaded; then the kernel method.

With `--timeline`, instead: where a call's time in the protocol's graph goes, for the `--top`
best kernels of each row (each with its configuration) and the baselines. Each contestant's
graph (and the neighbours' alone) is replayed with CUPTI recording every kernel, and each call
splits into the gap from its neighbour's end to its first kernel's start (`launch`), its
kernels (`call`, the union of their intervals), the gap to the next neighbour's start
(`drain`) and that neighbour (`neighbour`, against its time in the neighbours' own graph);
the kernel method's median beside them (`kernel`). A call that reads more in the graph than by
CUPTI shows in which part. `--synthetic` adds, to the first row's contestants, kernels that differ
in one property each (benchmarks/launch_probe.cu: threads, registers, setmaxnreg, shared memory,
code size, a TMA load through a descriptor in the kernel's parameters or in global memory), built
here with nvcc, each waiting about 2 us on every SM.

Prints one markdown table (median device us per variant) and the wall-clock window of each
variant (for a clock log taken beside it, e.g. nvidia-smi -lms 50).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import cupy  # noqa: E402

from cudal2.measure.baselines import CublasLt, abi_call, build_baselines, torch_gemm  # noqa: E402
from cudal2.measure.bench import graph_rounds, kernel_rounds  # noqa: E402
from cudal2.kernels.compile import Compiler  # noqa: E402
from cudal2.config import load_settings  # noqa: E402
from cudal2.measure.environment import default_arch  # noqa: E402
from cudal2.results.leaderboard import Leaderboard, best, select  # noqa: E402
from cudal2.measure.measure import CuptiTimer, InputSets  # noqa: E402
from cudal2.shapes import read_shapes  # noqa: E402
from cudal2.measure.verify import Kernel, poison_output  # noqa: E402
import cudal2.measure.measure as measure  # noqa: E402

# The neighbour the protocol first used (and these variants' default): an elementwise pass
# over 8 MB in 264 grid-stride blocks; the protocol's own is one over 512 KB.
MEMORY_NEIGHBOUR = r"""
extern "C" __global__ void cudal2_memory_neighbour(float* x, unsigned n) {
  for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    x[i] = x[i] * 0.5f + 1.0f;
}
"""


# The protocol's second neighbour (cupti-graph-2): every SM filled for about 6 us, no memory.
COMPUTE_NEIGHBOUR = r"""
extern "C" __global__ void cudal2_compute_neighbour(float* out, unsigned iterations) {
  float x = threadIdx.x * 1e-3f, y = blockIdx.x * 1e-3f;
  for (unsigned i = 0; i < iterations; ++i) { x = fmaf(x, 0.999f, y); y = fmaf(y, 0.999f, x); }
  if (x == 12345.0f) out[0] = y;  // never true: keeps the loop
}
"""


def memory_neighbour(stream, floats: int = 2 << 20):
    """The grid-stride pass over `floats` (8 MB: the first protocol's neighbour) in 264 blocks."""
    kernel = cupy.RawKernel(MEMORY_NEIGHBOUR, "cudal2_memory_neighbour")
    scratch = cupy.ones(floats, cupy.float32)
    return lambda: kernel((264,), (256,), (scratch, cupy.uint32(floats)), stream=stream)


def compute_neighbour(stream):
    kernel = cupy.RawKernel(COMPUTE_NEIGHBOUR, "cudal2_compute_neighbour")
    out = cupy.zeros(1, cupy.float32)
    blocks = 4 * cupy.cuda.Device().attributes["MultiProcessorCount"]
    return lambda: kernel((blocks,), (256,), (out, cupy.uint32(600)), stream=stream)


@contextlib.contextmanager
def paused(timer):
    """CUPTI attached, every activity kind of the timer disabled."""
    for kind in timer.KINDS:
        timer.cupti.activity_disable(getattr(timer.cupti.ActivityKind, kind))
    try:
        yield
    finally:
        for kind in timer.KINDS:
            timer.cupti.activity_enable(getattr(timer.cupti.ActivityKind, kind))


def contestants(problem, claims, board, compiler, stream):
    """run(a, b, c) of each claimed kernel ("kernel", then "kernel 2", ... in the claims' order),
    cuBLASLt (the heuristic's first algorithm) and torch.matmul."""
    libraries = {"kernel" if i == 1 else f"kernel {i}": Kernel(str(compiler.compile(board.source(claim["source_hash"])).library))
                 for i, claim in enumerate(claims, 1)}
    lt = CublasLt(build_baselines(compiler, problem)["cuBLASLt"])
    lt.algorithms(problem)
    libraries["cuBLASLt"] = lt.kernel
    run = {name: abi_call(k, cupy.empty(max(1, k.workspace_bytes(problem.m, problem.n, problem.k)), cupy.uint8),
                          problem, stream, name) for name, k in libraries.items()}
    if (torch_run := torch_gemm(problem, stream)) is not None:
        run["torch.matmul"] = torch_run
    return run


SYNTHETIC_CYCLES = 3500  # about 2 us at the H200's clock under load


def synthetic_contestants(stream, arch: str) -> dict:
    """run(a, b, c) of each kernel of benchmarks/launch_probe.cu (the inputs unused), one CTA an
    SM, launched through its library, built here with nvcc for `arch`."""
    import ctypes
    import subprocess
    import tempfile

    library = Path(tempfile.mkdtemp()) / "launch_probe.so"
    subprocess.run(["nvcc", "-O3", "-shared", "-Xcompiler", "-fPIC", f"-arch={arch}", "-o", str(library),
                    str(ROOT / "benchmarks" / "launch_probe.cu")], check=True)
    lib = ctypes.CDLL(str(library))
    lib.probe_setup.argtypes, lib.probe_setup.restype = [ctypes.c_longlong], ctypes.c_int
    lib.probe_name.argtypes, lib.probe_name.restype = [ctypes.c_int], ctypes.c_char_p
    lib.probe_launch.argtypes, lib.probe_launch.restype = [ctypes.c_int, ctypes.c_void_p], ctypes.c_int
    count = lib.probe_setup(SYNTHETIC_CYCLES)
    if count < 0:
        raise RuntimeError(f"launch_probe set-up failed ({count})")

    def launcher(i: int):
        def run(a, b, c) -> None:
            if lib.probe_launch(i, stream.ptr) != 0:
                raise RuntimeError(f"launch_probe kernel {lib.probe_name(i).decode()} failed to launch")
        return run

    return {f"probe {lib.probe_name(i).decode()}": launcher(i) for i in range(count)}


def warm(run, sets) -> None:
    """Every contestant called once on every set (module load, handles, autotuned plans)."""
    for s in range(len(sets.a)):
        for name, call in run.items():
            call(sets.a[s], sets.b[s], sets.c[name][s])


def block_graphs(names, run, sets, stream, calls, neighbour):
    """measure.graphs, but each set's calls consecutive (calls/3 on set 0, then set 1, ...)."""
    class Blocked:
        def __init__(self, sets):
            self.a, self.b, self.c = sets.a, sets.b, sets.c
    per = calls // len(sets.a)
    order = [s for s in range(len(sets.a)) for _ in range(per)]
    view = Blocked(sets)
    view.a = [sets.a[s] for s in order]
    view.b = [sets.b[s] for s in order]
    view.c = {n: [sets.c[n][s] for s in order] for n in names}
    return measure.graphs(names, run, view, stream, len(order), neighbour)


def graph_medians(run, sets, stream, calls, neighbour, rng, blocks=False, make=None) -> dict[str, float]:
    """Median per-call graph time of each contestant; `make` captures the graphs and returns
    replay (default: measure.graphs, or block_graphs with `blocks`)."""
    make = make or (block_graphs if blocks else measure.graphs)
    replay = make(list(run), run, sets, stream, calls, neighbour)
    samples = graph_rounds(list(run), replay=replay, calls=calls, budget_s=0.1, rng=rng, min_rounds=7)
    out = {name: statistics.median(v) for name, v in samples.items()}
    out["(neighbour)"] = statistics.median(replay(None) for _ in range(5)) / calls
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", type=Path)
    parser.add_argument("results", type=Path, nargs="?", default=Path("results"))
    parser.add_argument("--rows", default="0,1,2,3,4,5")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--leads", help="instead: the graph method and the kernel method with these numbers of "
                                        "lead calls (e.g. 2,6,12,24), in two passes, for long calls")
    parser.add_argument("--graphs", action="store_true",
                        help="instead: the graph method behind each neighbour the protocol has had and none, "
                             "with the protocol's calls per graph and with 21, then the kernel method")
    parser.add_argument("--timeline", action="store_true",
                        help="instead: each call's time in the protocol's graph split into launch gap, kernels, "
                             "drain and neighbour, from CUPTI's kernel records")
    parser.add_argument("--top", type=int, default=1, help="the best kernels of each row to time (default 1)")
    parser.add_argument("--synthetic", action="store_true",
                        help="with --timeline: benchmarks/launch_probe.cu's kernels as contestants of the first row")
    args = parser.parse_args()

    board = Leaderboard(args.results)
    rows = board.read(protocol=None)
    winners = best(rows[rows["kernel_us"].notna()], args.top)  # the best of every protocol that has CUPTI times
    props = cupy.cuda.runtime.getDeviceProperties(0)
    compiler = Compiler(default_arch(props["major"] * 10 + props["minor"]), load_settings().cache_dir)
    stream = cupy.cuda.Stream(non_blocking=True)
    rng = random.Random(0)
    shapes = read_shapes(args.shapes)
    cases, makers = [], {}
    for problem in [shapes[int(i)] for i in args.rows.split(",")]:
        found = select(winners, m=problem.m, n=problem.n, k=problem.k, dtype=problem.dtype, layout=problem.layout)
        if found.empty:
            continue
        claim = found.iloc[0]
        claims = found.to_dict("records")  # the best, and with --top the runners-up
        run = contestants(problem, claims, board, compiler, stream)
        for i, row in enumerate(claims, 1):
            print(f"kernel{'' if i == 1 else f' {i}'}: {row['kernel']}", file=sys.stderr, flush=True)
        if args.synthetic and not cases:
            run.update(synthetic_contestants(stream, compiler.arch))
        sets = InputSets(problem, measure.Numerics(problem.dtype), list(run), rng)
        calls = 3 * max(1, min(20, round(2000 / (float(claim["kernel_us"]) + 5) / 3)))
        cases.append((problem, run, sets, calls, {}))
        makers[problem] = lambda on, problem=problem, claims=claims: contestants(problem, claims, board, compiler, on)
        print(f"{problem}: {claim['kernel']}, {calls} calls per graph", file=sys.stderr, flush=True)

    windows = []

    def variant(label, out, fn):
        t0 = time.time()
        out[label] = fn()
        windows.append((label, t0, time.time()))

    compute, memory = compute_neighbour(stream), memory_neighbour(stream)
    if args.timeline:
        with stream:
            timeline_study(cases, stream, rng, variant, compute)
    elif args.leads:
        with stream:
            lead_study(cases, [int(x) for x in args.leads.split(",")], stream, rng, variant)
    elif args.graphs:
        with stream:
            graph_study(cases, stream, rng, variant, compute, memory, makers)
    else:
        with stream:
            variant_study(cases, stream, rng, variant, compute, memory)
    report(cases, windows, args.out)


def kernel_medians(run, sets, timer, rng, refresh, leads=0, budget_s=0.2) -> dict[str, float]:
    """The kernel method's median per contestant (bench.kernel_rounds), each timed call
    right behind `leads` untimed calls of the same contestant on the other sets."""
    def call(name, s):
        run[name](sets.a[s], sets.b[s], sets.c[name][s])

    def before(name, s):
        for t in range(leads):
            call(name, (s + 1 + t % (len(sets.a) - 1)) % len(sets.a))

    samples = kernel_rounds(list(run), call=call, refresh=refresh, check=lambda *_: None, timer=timer,
                            budget_s=budget_s, rng=rng, before=before if leads else None)
    return {name: statistics.median(v) for name, v in samples.items()}


def lead_study(cases, leads, stream, rng, variant):
    timer = CuptiTimer()
    for problem, run, sets, calls, out in cases:
        for p in (1, 2):
            with paused(timer):
                variant(f"graph {p}", out, lambda: graph_medians(run, sets, stream, calls, None, rng))
            for count in leads:
                variant(f"kernel, {count} leads, {p}", out,
                        lambda: kernel_medians(run, sets, timer, rng, sets.refresh, count, budget_s=0.4))


def torch_graphs(names, run, sets, torch_stream, calls, neighbour):
    """measure.graphs, but each graph captured by torch (torch.cuda.graph on a torch stream,
    as the independent check captures) instead of CuPy's relaxed-mode capture; `run` and
    `neighbour` launch on that stream. Returns replay(name or None) -> device us."""
    import torch

    def capture(name):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=torch_stream):
            for i in range(calls):
                neighbour()
                if name is not None:
                    s = i % len(sets.a)
                    run[name](sets.a[s], sets.b[s], sets.c[name][s])
        return graph

    graphs = {name: capture(name) for name in [None, *names]}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def replay(name) -> float:
        start.record(torch_stream)
        graphs[name].replay()
        end.record(torch_stream)
        end.synchronize()
        return start.elapsed_time(end) * 1e3

    for name in graphs:  # warm: first replays upload the graph
        replay(name)
    return replay


def graph_study(cases, stream, rng, variant, compute, memory, makers):
    """Why our PDL kernels read 0.3-0.5 us over their CUPTI time in the protocol's graph on
    calls under 5 us, and at it in the independent check's (the h200-2026-12-01-protocol-3 report (in git history)):
    the neighbour's kind and the graph's length, before CUPTI is ever loaded; the capture
    (CuPy's relaxed mode on this non-blocking stream, or torch's on a torch stream); then CUPTI."""
    neighbours = {"sin 512 KB (protocol)": measure.neighbour_kernel(stream),
                  "grid-stride 512 KB": memory_neighbour(stream, 1 << 17), "grid-stride 8 MB": memory,
                  "compute 6 us": compute, "none": lambda: None}
    for problem, run, sets, calls, out in cases:
        warm(run, sets)
        for label, neighbour in neighbours.items():
            variant(f"graph, {label}, {calls} calls", out,
                    lambda: graph_medians(run, sets, stream, calls, neighbour, rng))
            variant(f"graph, {label}, 21 calls", out, lambda: graph_medians(run, sets, stream, 21, neighbour, rng))
        try:
            import torch
        except ImportError:
            continue
        torch_stream = torch.cuda.Stream()
        on_torch = cupy.cuda.ExternalStream(torch_stream.cuda_stream)
        run_torch = makers[problem](on_torch)
        for name, call in run_torch.items():
            call(sets.a[0], sets.b[0], sets.c[name][0])
        torch.cuda.synchronize()
        for n in (calls, 21):
            variant(f"graph, sin 512 KB (protocol), {n} calls, torch capture", out,
                    lambda n=n: graph_medians(run_torch, sets, torch_stream, n, measure.neighbour_kernel(on_torch),
                                              rng, make=torch_graphs))
    timer = CuptiTimer()
    for problem, run, sets, calls, out in cases:
        variant("kernel", out, lambda: kernel_medians(run, sets, timer, rng, sets.refresh))


def call_timeline(records: list[tuple[int, int]], calls: int, replays: int, neighboured: bool = True) -> dict[str, float]:
    """Medians over the calls of `replays` replays of a graph of `calls` x (neighbour, call), from
    its kernels' CUPTI records (start, end in ns), in us: the gap from a neighbour's end to its
    call's first kernel (`launch`), the call's kernels (`call`: the union of their intervals), the
    gap to the next neighbour (`drain`), the neighbour (`neighbour`), and the replay's span per
    call (`per call`). A neighbours-only graph (`records` of one kernel a call) gives the
    neighbour and the gap between two of them (`drain`). Without neighbours (`neighboured`
    False), `launch` is the gap from the call before's last kernel to the call's first."""
    records = sorted(records)
    per = len(records) // (calls * replays)  # kernels a call launches, its neighbour included
    if per < 1 or len(records) != per * calls * replays:
        raise RuntimeError(f"{len(records)} kernel records for {replays} replays of {calls} calls")
    parts: dict[str, list[float]] = {"launch": [], "call": [], "drain": [], "neighbour": [], "per call": []}
    for r in range(replays):
        run = records[r * calls * per:(r + 1) * calls * per]
        parts["per call"].append((run[-1][1] - run[0][0]) / calls / 1e3)
        for c in range(calls):
            group = run[c * per:(c + 1) * per]
            if not neighboured:
                parts["call"].append(measure.busy_time(group) / 1e3)
                if c:
                    parts["launch"].append((group[0][0] - max(e for _, e in run[(c - 1) * per:c * per])) / 1e3)
                continue
            neighbour, own = group[0], group[1:]
            parts["neighbour"].append((neighbour[1] - neighbour[0]) / 1e3)
            after = run[(c + 1) * per][0] if c + 1 < calls else None
            if own:
                parts["launch"].append((own[0][0] - neighbour[1]) / 1e3)
                parts["call"].append(measure.busy_time(own) / 1e3)
                if after is not None:
                    parts["drain"].append((after - max(e for _, e in own)) / 1e3)
            elif after is not None:
                parts["drain"].append((after - neighbour[1]) / 1e3)
    return {part: statistics.median(v) for part, v in parts.items() if v}


class NamingTimer(CuptiTimer):
    """CuptiTimer that also keeps each kernel record's name (by its start and end), and hands
    over the raw records (`records`) as well as the timed windows' totals."""

    def __init__(self):
        self.names: dict[tuple[int, int], str] = {}
        super().__init__()

    def _completed(self, activities) -> None:
        super()._completed(activities)
        self.names.update(((a.start, a.end), getattr(a, "name", "") or "") for a in activities)

    def records(self) -> list[tuple[int, int]]:
        """The (start, end) of every activity since the last call (or collect), flushed first."""
        self.cupti.activity_flush_all(1)
        records, self._records, self._windows = self._records, [], []
        return records


def timeline_study(cases, stream, rng, variant, compute):
    """`--timeline`: each contestant's graph replayed under CUPTI (call_timeline) behind the
    protocol's neighbour, behind one that touches no memory (`compute`) and behind none, then the
    kernel method's median (its lead calls as the protocol's). The kernels each contestant's
    calls ran are named on stderr (which library kernel a baseline ran, say)."""
    timer = NamingTimer()
    replays = 5
    neighbours = {"": measure.neighbour_kernel(stream), "compute, ": compute, "none, ": None}
    for problem, run, sets, calls, out in cases:
        warm(run, sets)
        for label, neighbour in neighbours.items():
            replay = measure.graphs(list(run), run, sets, stream, calls, neighbour or (lambda: None))
            for name in [*([None] if neighbour else []), *run]:
                timer.records()  # drop what came before
                for _ in range(replays):
                    replay(name)  # (waits for the replay's end)
                records = timer.records()
                if not label and name is not None:  # behind the protocol's neighbour: what the call ran
                    ran = sorted({timer.names.get(r, "") for r in records} - {"cudal2_neighbour"})
                    print(f"{problem} {name}: {', '.join(ran)}", file=sys.stderr, flush=True)
                for part, us in call_timeline(records, calls, replays, neighbour is not None).items():
                    out.setdefault(f"graph, {label}{part}", {})[name or "(neighbour)"] = us
        # The protocol's kernel method: each timed call behind calls of its own on the other sets.
        variant("kernel", out, lambda: kernel_medians(run, sets, timer, rng, sets.refresh, leads=measure.LEAD_CALLS))


def variant_study(cases, stream, rng, variant, compute, memory):
    with stream:
        for problem, run, sets, calls, out in cases:  # before CUPTI is enabled in this process
            warm(run, sets)
            variant("graph, no CUPTI", out, lambda: graph_medians(run, sets, stream, calls, memory, rng))
            variant("graph, no CUPTI, compute", out, lambda: graph_medians(run, sets, stream, calls, compute, rng))
        timer = CuptiTimer()
        for problem, run, sets, calls, out in cases:
            def fresh(s, sets=sets):
                sets.refresh(s)
                for outputs in sets.c.values():
                    poison_output(outputs[s])

            variant("kernel, fresh", out, lambda: kernel_medians(run, sets, timer, rng, fresh))
            variant("kernel, reused", out, lambda: kernel_medians(run, sets, timer, rng, lambda s: None))
            variant("kernel, sustained", out, lambda: kernel_medians(run, sets, timer, rng, fresh, leads=3))
            with paused(timer):
                variant("graph, CUPTI paused", out, lambda: graph_medians(run, sets, stream, calls, memory, rng))
                variant("graph, CUPTI paused, compute", out,
                        lambda: graph_medians(run, sets, stream, calls, compute, rng))
                variant("graph, CUPTI paused, set blocks", out,
                        lambda: graph_medians(run, sets, stream, calls, memory, rng, blocks=True))
                variant("graph, CUPTI paused, compute, set blocks", out,
                        lambda: graph_medians(run, sets, stream, calls, compute, rng, blocks=True))
            timer.cupti.activity_flush_all(1)
            timer.cupti.finalize()
            variant("graph, CUPTI finalized", out, lambda: graph_medians(run, sets, stream, calls, memory, rng))
            variant("graph, CUPTI finalized, compute", out,
                    lambda: graph_medians(run, sets, stream, calls, compute, rng))
            timer = CuptiTimer()


def report(cases, windows, out_path):
    variants = list(cases[0][4]) if cases else []
    print("| shape | contestant | " + " | ".join(variants) + " |")
    print("|---|---|" + "---|" * len(variants))
    for problem, run, _, _, out in cases:
        for name in [*run, "(neighbour)"]:
            print(f"| {problem} | {name} | " + " | ".join(
                f"{out[v][name]:.2f}" if name in out[v] else "" for v in variants) + " |")
    print("\nvariant windows (unix time):")
    for label, t0, t1 in windows:
        print(f"{label}\t{t0:.3f}\t{t1:.3f}")
    if out_path:
        out_path.write_text(json.dumps({"rows": [(str(p), out) for p, _, _, _, out in cases], "windows": windows}))


if __name__ == "__main__":
    main()
