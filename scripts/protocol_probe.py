"""GPU: what moves the protocol's two times, for the rows where they and the independent
check (scripts/remeasure.py) disagree (docs/h200-2026-12-01-protocol.md).

    python scripts/protocol_probe.py SHAPES.csv [RESULTS] [--rows 6]

For the first `--rows` rows of the shape set, the leaderboard's best kernel, cuBLASLt (the
heuristic's first algorithm) and torch.matmul are timed through the protocol's own code
(cudal2/measure.py) in these variants:

- `graph, no CUPTI`: the graph method before CUPTI is ever enabled in this process, behind
  the protocol's neighbour (264 blocks, grid-stride) and behind a torch-like elementwise
  kernel (a float4 per thread, 2048 blocks);
- `kernel, fresh` (the protocol: each round's set refreshed and C poisoned just before the
  calls) and `kernel, reused` (the sets keep their contents, as the independent check's);
- `graph, CUPTI paused`: the protocol's graph method, both neighbours.

Prints one markdown table: median device us per variant.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import cupy  # noqa: E402

from cudal2.baselines import CublasLt, build_baselines, torch_gemm  # noqa: E402
from cudal2.bench import graph_rounds, kernel_rounds  # noqa: E402
from cudal2.compile import Compiler  # noqa: E402
from cudal2.config import load_settings  # noqa: E402
from cudal2.environment import default_arch  # noqa: E402
from cudal2.leaderboard import Leaderboard, best, select  # noqa: E402
from cudal2.measure import CuptiTimer, InputSets, graphs  # noqa: E402
from cudal2.shapes import read_shapes  # noqa: E402
from cudal2.verify import Kernel, Numerics, poison_output  # noqa: E402
from cudal2.worker import _abi_call  # noqa: E402

VECTOR_NEIGHBOUR = r"""
extern "C" __global__ void cudal2_vector_neighbour(float4* x, unsigned n4) {
  unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n4) { float4 v = x[i]; x[i] = make_float4(v.x * 0.5f + 1.f, v.y * 0.5f + 1.f, v.z * 0.5f + 1.f, v.w * 0.5f + 1.f); }
}
"""
FLOATS = 2 << 20


def vector_neighbour(stream):
    kernel = cupy.RawKernel(VECTOR_NEIGHBOUR, "cudal2_vector_neighbour")
    scratch = cupy.ones(FLOATS, cupy.float32)
    n4 = FLOATS // 4
    return lambda: kernel(((n4 + 255) // 256,), (256,), (scratch, cupy.uint32(n4)), stream=stream)


def contestants(problem, claim, board, compiler, stream):
    kernel = Kernel(str(compiler.compile(board.source(claim["source_hash"])).library))
    lt = CublasLt(build_baselines(compiler, problem)["cuBLASLt"])
    lt.algorithms(problem)
    workspace = {name: cupy.empty(max(1, k.workspace_bytes(problem.m, problem.n, problem.k)), cupy.uint8)
                 for name, k in (("kernel", kernel), ("cuBLASLt", lt.kernel))}
    run = {"kernel": _abi_call(kernel, workspace["kernel"], problem, stream, "kernel"),
           "cuBLASLt": _abi_call(lt.kernel, workspace["cuBLASLt"], problem, stream, "cuBLASLt")}
    if (torch_run := torch_gemm(problem, stream)) is not None:
        run["torch.matmul"] = torch_run
    return run


def graph_medians(run, sets, stream, calls, neighbour, rng) -> dict[str, float]:
    replay = graphs(list(run), run, sets, stream, calls, neighbour)
    samples = graph_rounds(list(run), replay=replay, calls=calls, budget_s=0.1, rng=rng, min_rounds=9)
    return {name: statistics.median(v) for name, v in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", type=Path)
    parser.add_argument("results", type=Path, nargs="?", default=Path("results"))
    parser.add_argument("--rows", type=int, default=6)
    args = parser.parse_args()

    board = Leaderboard(args.results)
    winners = best(board.read(), 1)
    props = cupy.cuda.runtime.getDeviceProperties(0)
    compiler = Compiler(default_arch(props["major"] * 10 + props["minor"]), load_settings().cache_dir)
    stream = cupy.cuda.Stream(non_blocking=True)
    rng = random.Random(0)
    cases = []
    for problem in read_shapes(args.shapes)[:args.rows]:
        found = select(winners, m=problem.m, n=problem.n, k=problem.k, dtype=problem.dtype, layout=problem.layout)
        if found.empty:
            continue
        claim = found.iloc[0]
        run = contestants(problem, claim, board, compiler, stream)
        sets = InputSets(problem, Numerics(problem.dtype), list(run), rng)
        calls = 3 * max(1, min(20, round(2000 / (float(claim["kernel_us"]) + 5) / 3)))
        cases.append((problem, run, sets, calls, {}))

    with stream:
        for problem, run, sets, calls, out in cases:  # before CUPTI is enabled in this process
            for s in range(len(sets.a)):
                for name, call in run.items():
                    call(sets.a[s], sets.b[s], sets.c[name][s])
            out["graph, no CUPTI"] = graph_medians(run, sets, stream, calls, None, rng)
            out["graph, no CUPTI, vector neighbour"] = graph_medians(run, sets, stream, calls, vector_neighbour(stream), rng)
        timer = CuptiTimer()
        for problem, run, sets, calls, out in cases:
            def call(name, s, run=run, sets=sets):
                run[name](sets.a[s], sets.b[s], sets.c[name][s])

            def fresh(s, sets=sets):
                sets.refresh(s)
                for outputs in sets.c.values():
                    poison_output(outputs[s])

            for label, refresh in (("kernel, fresh", fresh), ("kernel, reused", lambda s: None)):
                samples = kernel_rounds(list(run), call=call, refresh=refresh, check=lambda *_: None, timer=timer,
                                        budget_s=0.2, rng=rng)
                out[label] = {name: statistics.median(v) for name, v in samples.items()}
            with timer.paused():
                out["graph, CUPTI paused"] = graph_medians(run, sets, stream, calls, None, rng)
                out["graph, CUPTI paused, vector neighbour"] = graph_medians(run, sets, stream, calls,
                                                                              vector_neighbour(stream), rng)

    variants = list(cases[0][4]) if cases else []
    print("| shape | contestant | " + " | ".join(variants) + " |")
    print("|---|---|" + "---|" * len(variants))
    for problem, run, _, _, out in cases:
        for name in run:
            print(f"| {problem} | {name} | " + " | ".join(f"{out[v][name]:.2f}" for v in variants) + " |")


if __name__ == "__main__":
    main()
