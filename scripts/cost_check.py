"""How well the cost model ranks what was measured: for every problem of the leaderboard
with at least 6 measured template configurations on one GPU, the best measured speedup
among the model's top 1 and top 3 over the best measured, and the rank correlation.

    python scripts/cost_check.py [RESULTS_DIR or -] [GPU] [--screened]
      (default: the measurements shipped in the package, cudal2/data/; NVIDIA H200;
       --screened: a time-budgeted run's screened rows, ranked by their graph ratio)
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

from cudal2.kernels.render import get_template
from cudal2.results.leaderboard import Leaderboard, shipped
from cudal2.search.cost import measured_configurations, predict_us, recorded_device

screened = "--screened" in sys.argv
args = [a for a in sys.argv[1:] if a != "--screened"]
gpu = args[1] if len(args) > 1 else "NVIDIA H200"
df = Leaderboard(Path(args[0])).read(protocol=None) if args and args[0] != "-" else shipped(None)
device = recorded_device(df, gpu)
top1, top3, rhos = [], [], []
for problem, measured in sorted(measured_configurations(df, gpu, screened).items(), key=lambda e: (e[0].m, e[0].n, e[0].k)):
    if len(measured) < 6:
        continue
    predicted = {key: predict_us(get_template(key[0]), json.loads(key[1]), problem, device) for key in measured}
    by_model = sorted(measured, key=lambda key: predicted[key])
    by_measure = sorted(measured, key=lambda key: -measured[key])
    best = max(measured.values())
    a, b = measured[by_model[0]] / best, max(measured[key] for key in by_model[:3]) / best
    place = {key: i for i, key in enumerate(by_measure)}
    size = len(measured)
    rho = 1 - 6 * sum((i - place[key]) ** 2 for i, key in enumerate(by_model)) / (size * (size * size - 1))
    top1.append(a), top3.append(b), rhos.append(rho)
    print(f"{problem.m}x{problem.n}x{problem.k} {problem.dtype} {problem.layout}: {size} configurations, top 1 {a:.3f}, top 3 {b:.3f}, rank correlation {rho:+.2f}")
if not top1:
    sys.exit("no problem with 6 or more measured configurations" + ("" if screened else " (a time-budgeted run's: --screened)"))
geomean = lambda values: math.exp(sum(map(math.log, values)) / len(values))
print(f"{len(top1)} problems: geometric mean top 1 {geomean(top1):.3f}, top 3 {geomean(top3):.3f}, "
      f"mean rank correlation {statistics.mean(rhos):+.3f}")
