"""A Llama-3-8B MLP block (gate and up fused, SiLU(gate) * up, down) at a few token counts:
its GEMMs tuned with cudal2, exported to a dispatch library, then run through
torch.ops.cudal2.linear eagerly and in a CUDA graph against plain PyTorch. Needs a GPU.

    python examples/llama_mlp.py [--tokens 1,16,128] [--iterations 2 (0: no tuning)] [--results DIR] [--library DIR]

Prints a markdown table: per token count, the output's error against PyTorch's (relative to
its largest value), the block's time with and without cudal2, eager and in a graph, and the
host time of one down-projection call: through F.linear and through the op, and through the
nn.Linear layer and the patched one (what the model runs).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import cudal2
import cudal2.torch as ops
from cudal2.config import load_settings
from cudal2.shapes import MODELS
from cudal2.verify import UNIT_ROUNDOFF

GATE_UP = MODELS["llama3-8b"].projections["gate_up_proj"]  # (N, K) = (2 x 14336, 4096)
DOWN = MODELS["llama3-8b"].projections["down_proj"]  # (4096, 14336)


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up = torch.nn.Linear(GATE_UP[1], GATE_UP[0], bias=False)
        self.down = torch.nn.Linear(DOWN[1], DOWN[0], bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


def device_us(fn, graph: bool, repeats: int = 20) -> float:
    """Median device time of fn(): eager calls, or replays of it captured in a CUDA graph."""
    for _ in range(3):
        fn()
    if graph:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            fn()
        run = captured.replay
    else:
        run = fn
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def host_us(fn, calls: int = 200) -> float:
    """Host time per call of fn(): the calls are queued behind a long sleep kernel, so none
    waits for the GPU and the wall time is the host's work alone."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s at the H200's clock: longer than the calls take to queue
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,16,128")
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--results", type=Path, default=None)
    parser.add_argument("--library", type=Path, default=Path("llama-mlp-library"))
    args = parser.parse_args()

    settings = load_settings({"results": args.results})
    tokens = [int(t) for t in args.tokens.split(",")]
    problems = [cudal2.Problem(t, n, k, "bf16", "nt") for t in tokens for n, k in (GATE_UP, DOWN)]
    if args.iterations:  # 0: use what the leaderboard already holds for these shapes
        cudal2.optimize(problems, iterations=args.iterations, batch=4, settings=settings)
    cudal2.export(args.library, gpu=torch.cuda.get_device_name(), shapes=problems, settings=settings)
    ops.use(args.library)

    torch.manual_seed(0)
    model = MLP().cuda().to(torch.bfloat16)
    tuned = copy.deepcopy(model)
    print(f"{ops.patch(tuned)} of 2 Linear layers go through torch.ops.cudal2.linear")
    print("| tokens | error / max | tolerance | PyTorch eager us | cudal2 eager us | PyTorch graph us | "
          "cudal2 graph us | speedup (graph) | host us per down_proj call: F.linear / torch.ops.cudal2.linear | "
          "nn.Linear / patched |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with torch.no_grad():
        for t in tokens:
            x = torch.randn(t, GATE_UP[1], device="cuda", dtype=torch.bfloat16)
            ref, out = model(x).float(), tuned(x).float()
            error = float((out - ref).abs().max() / ref.abs().max())
            tolerance = 4 * UNIT_ROUNDOFF["bf16"]  # two GEMMs, each within the verifier's 2 roundoffs
            times = [device_us(lambda m=m: m(x), graph) for graph in (False, True) for m in (model, tuned)]
            h = torch.randn(t, DOWN[1], device="cuda", dtype=torch.bfloat16)
            host = [host_us(lambda: F.linear(h, model.down.weight)),
                    host_us(lambda: torch.ops.cudal2.linear(h, model.down.weight)),
                    host_us(lambda: model.down(h)), host_us(lambda: tuned.down(h))]
            print(f"| {t} | {error:.2e} | {tolerance:.2e} | {times[0]:.1f} | {times[1]:.1f} | {times[2]:.1f} | "
                  f"{times[3]:.1f} | {times[2] / times[3]:.3f} | {host[0]:.1f} / {host[1]:.1f} | "
                  f"{host[2]:.1f} / {host[3]:.1f} |")


if __name__ == "__main__":
    main()
