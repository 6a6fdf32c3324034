"""Two cuBLAS references for the same runs: per dev-set row, the best kernel's speedup as the
bench records it (cuBLAS timed beside the kernel, in the kernel's job) and against the cuBLAS
of that run's baselines job (timed first in the process, beside torch.matmul).

    python scripts/reference_check.py [SHAPES_CSV] [RESULTS_DIR] [GPU] [BENCH]
      (default: ../shared/shapes/dev.csv, results, NVIDIA H200, rows of every bench protocol;
       BENCH = fenced or back-to-back: that protocol's rows only)
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from cudal2_cli.cli import read_shapes
from cudal2_cli.leaderboard import Leaderboard, select

problems = read_shapes(Path(sys.argv[1] if len(sys.argv) > 1 else "../shared/shapes/dev.csv"))
df = Leaderboard(Path(sys.argv[2] if len(sys.argv) > 2 else "results")).read()
gpu = sys.argv[3] if len(sys.argv) > 3 else "NVIDIA H200"
df = df[(df["status"] == "ok") & (df["gpu"] == gpu)]
df = select(df, bench=sys.argv[4] if len(sys.argv) > 4 else None).reset_index(drop=True)
baselines_job = df[df["kernel"] == "cuBLAS"].groupby("run_id")["offline_us"].first()
kernels = df[df["template"].notna() & df["speedup_offline"].notna()]
paired, apart = [], []
for p in problems:
    mine = select(kernels, m=p.m, n=p.n, k=p.k, dtype=p.dtype, layout=p.layout)
    if mine.empty:
        continue
    best, best_apart = mine["speedup_offline"].max(), (mine["run_id"].map(baselines_job) / mine["offline_us"]).max()
    paired.append(best)
    apart.append(best_apart)
    print(f"{p.m}x{p.n}x{p.k} {p.dtype} {p.layout}: beside the kernel {best:.3f}, baselines job {best_apart:.3f}")

def geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values))


print(f"{len(paired)} rows: geometric mean {geomean(paired):.3f} (minimum {min(paired):.3f}) against cuBLAS timed "
      f"beside the kernel, {geomean(apart):.3f} (minimum {min(apart):.3f}) against the baselines job's cuBLAS")
