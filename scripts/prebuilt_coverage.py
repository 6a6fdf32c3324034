"""How well the prebuilt set covers a shape set, as the cost model prices it: per shape, the
model's best price among the set's configurations (in the shape's dtype and layout) over its
best price in the whole space. A time-budgeted run's first batch is drawn from the built
configurations alone, so where this ratio is well above 1 its first batch cannot hold the
model's pick, and a short budget never measures it.

    python scripts/prebuilt_coverage.py SHAPES.csv SET.json [--gpu "NVIDIA H200"] [--worst N]

SET.json: `cudal2 prebuild --list --json` (choosing the set ranks whole spaces: minutes).
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict

from pathlib import Path

from cudal2.search.cost import predict_us, rank, recorded_device
from cudal2.results.leaderboard import shipped
from cudal2.kernels.render import load_templates
from cudal2.results.roofline import regime
from cudal2.shapes import read_shapes


def coverage(problems, entries, templates, device):
    """Per problem: (problem, the set's best, the space's best), each best as (predicted us,
    template, params); the set's is (inf, None, None) where it holds nothing that runs it."""
    built = defaultdict(list)
    for entry in entries:
        if entry["template"]:  # a free-form kernel is priced by no template
            built[entry["dtype"], entry["layout"]].append((entry["template"], entry["params"]))
    rows = []
    for problem in problems:
        prices = [(predict_us(templates[name], params, problem, device), name, params)
                  for name, params in built[problem.dtype, problem.layout]
                  if name in templates and templates[name].supports(problem, device["cc"])]
        in_set = min(prices, key=lambda e: e[0], default=(math.inf, None, None))
        rows.append((problem, in_set, rank(templates, problem, device)[0]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shapes")
    parser.add_argument("set", help="`cudal2 prebuild --list --json` output")
    parser.add_argument("--gpu", default="NVIDIA H200", help="whose recorded facts price the configurations")
    parser.add_argument("--worst", type=int, default=10, help="list this many shapes the set covers worst")
    args = parser.parse_args()
    templates = load_templates()
    device = recorded_device(shipped(None), args.gpu)
    with open(args.set) as f:
        entries = json.load(f)
    rows = coverage(read_shapes(Path(args.shapes)), entries, templates, device)
    gaps = sorted(((in_set[0] / best[0], problem, in_set, best) for problem, in_set, best in rows),
                  key=lambda e: -e[0])
    for gap, problem, in_set, best in gaps[: args.worst]:
        print(f"{problem.m}x{problem.n}x{problem.k} {problem.dtype} {problem.layout} ({regime(problem)}): "
              f"set {in_set[0]:.2f} us ({in_set[1]}), space {best[0]:.2f} us ({best[1]} {json.dumps(best[2])}), {gap:.3f}x")
    finite = [g for g, *_ in gaps if math.isfinite(g)]
    geomean = math.exp(sum(map(math.log, finite)) / len(finite)) if finite else math.nan
    print(f"{len(gaps)} shapes: the set's best priced {geomean:.3f}x the space's (geometric mean), "
          f"worst {max(finite, default=math.nan):.3f}x; {len(gaps) - len(finite)} with nothing in the set")


if __name__ == "__main__":
    main()
