"""Fresh random shapes of the 1,000-shape grid (M, N, K each one of 64 ... 16384, fp16 nn: the
grid CUDA-L2 tunes), and what a tuning run over them did.

    python3 scripts/grid_sample.py draw --count 100 --seed S [--results DIR ...] [--regime R] [--midpoints] > shapes.csv
    cudal2 optimize --shapes shapes.csv --time-budget 5 --json > run.json
    python3 scripts/grid_sample.py report run.json [part2.json ...]   # a run made in several calls: one report
    python3 scripts/grid_sample.py compare short.json long.json   # the same shapes (or some of them), two budgets
    python3 scripts/grid_sample.py taken run.json --count 20 > some.csv   # the first 20 shapes a run tuned

`draw` leaves out every shape measured before: the project's test shape sets, the shipped
measurements and, with --results (repeatable), those leaderboards' problems; the same seed draws the same
shapes; --regime draws one regime's shapes (few-tile long-K, short-K: a regime's fresh set) from
the grid's values and the midpoints between them, and --midpoints draws any shape of those values
(19 a side): the 1,000-shape grid's own fresh shapes run out as samples are shipped.
`report` prints, per shape and over the set, the candidates screened and measured (over the
set also by the shape's fastest library call, which a kernel's verification costs a multiple
of), the time to the first verified kernel, the baselines' time, the wall time (and what 1,000
shapes would take at its mean) and the best speedup (by regime too). `compare` prints, per
shape of two runs over the same shapes, each run's best speedup and their ratio, and over the
set the geometric mean of the ratios and the shapes within 2%.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cudal2.problem import Problem  # noqa: E402
from cudal2.protocol import TIE  # noqa: E402
from cudal2.results.leaderboard import Leaderboard, shipped  # noqa: E402
from cudal2.results.roofline import REGIMES, at_floor, regime  # noqa: E402
from cudal2.results.tables import speedup_summary  # noqa: E402
from cudal2.shapes import read_shapes  # noqa: E402

GRID = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 12288, 16384)
# A regime's draw takes the grid's values and the midpoints of neighbouring ones (96, 192, ...,
# 1536, 3072, ..., 14336): the grid holds 108 short-K shapes (K <= 256, M and N >= 1024), of
# which the shipped measurements left 29 fresh (526 of these values), and 30 are asked for.
REGIME_VALUES = tuple(sorted(set(GRID) | {(a + b) // 2 for a, b in zip(GRID, GRID[1:])}))


def measured_before(results: Path | list[Path] | None) -> set[tuple[int, int, int, str, str]]:
    """The problems of the test shape sets, the shipped measurements and the results
    directories `results` (one or several)."""
    results = [results] if isinstance(results, Path) else list(results or [])
    seen = {(p.m, p.n, p.k, p.dtype, p.layout) for csv in sorted((ROOT / "tests" / "shapes").glob("*.csv"))
            for p in read_shapes(csv)}
    # Every protocol's rows: a shape measured by an earlier protocol was measured all the same.
    for rows in [shipped(None)] + [Leaderboard(r).read(None) for r in results]:
        if not rows.empty:
            seen |= set(rows[["m", "n", "k", "dtype", "layout"]].itertuples(index=False, name=None))
    return seen


def draw(count: int, seed: int, results: Path | list[Path] | None, within: str | None = None,
         midpoints: bool = False) -> list[Problem]:
    """`count` grid shapes never measured before, drawn with `seed`; of one regime, `within`,
    or with `midpoints`, shapes of REGIME_VALUES."""
    seen = measured_before(results)
    values = REGIME_VALUES if within is not None or midpoints else GRID
    fresh = [(m, n, k) for m in values for n in values for k in values if (m, n, k, "fp16", "nn") not in seen
             and (within is None or regime(Problem(m, n, k)) == within)]
    if count > len(fresh):
        raise SystemExit(f"only {len(fresh)} {f'{within} shapes' if within else 'grid shapes'} "
                         f"were never measured; asked for {count}"
                         + ("" if values is REGIME_VALUES else " (--midpoints draws from the midpoints between the grid's values too)"))
    return [Problem(m, n, k) for m, n, k in random.Random(seed).sample(fresh, count)]


CALL_BANDS = ((0, 10), (10, 100), (100, 1000), (1000, math.inf))  # us


def report(run: dict) -> str:
    shapes = run["shapes"]
    lines = ["| shape | regime | screened | measured | first verified s | wall s | best speedup |", "|---|---|---|---|---|---|---|"]
    by_regime: dict[str, list[float]] = {}
    # Shapes whose fastest library call is already at the floor: no kernel can win there, so
    # the count bounds the wins a run can reach.
    floored: dict[str, int] = {}
    for s in shapes:
        p = Problem(**s["problem"])
        floor, library = (s.get("best") or {}).get("floor_us"), s.get("baseline_us")
        if floor and library and at_floor(library, floor):
            floored[regime(p)] = floored.get(regime(p), 0) + 1
        best = (s.get("best") or {}).get("speedup_offline")
        measured = sum(count for status, count in (s.get("statuses") or {}).items() if status != "screened")
        lines.append(f"| {p} | {regime(p)} | {s.get('screened', 0)} | {measured} | {s.get('first_verified_s')} | "
                     f"{s['wall_s']:.1f} | {'-' if best is None else f'{best:.3f}'} |")
        if best:
            by_regime.setdefault(regime(p), []).append(best)
    screened = sorted(s.get("screened", 0) for s in shapes)
    walls = [s["wall_s"] for s in shapes]
    all_best = [v for values in by_regime.values() for v in values]
    lines += ["", f"{len(shapes)} shapes in {sum(walls) / 60:.1f} min of tuning (mean {statistics.mean(walls):.1f} s a shape: "
              f"{statistics.mean(walls) * 1000 / 3600:.2f} h for the 1,000-shape grid); "
              f"{len(shapes) - len(all_best)} ended without a measured kernel.",
              f"screened per shape: min {screened[0]}, median {statistics.median(screened):g}, max {screened[-1]}; "
              f"{sum(v >= 64 for v in screened)} of {len(shapes)} reached 64."]
    # the baselines' session of each shape; the run's first also starts the GPU workers and builds
    # the library shims, so it is told apart
    if baselines := [s["baselines_s"] for s in shapes if s.get("baselines_s") is not None]:
        rest = sorted(baselines[1:]) or baselines
        lines.append(f"baselines per shape: median {statistics.median(rest):.2f} s, max {rest[-1]:.2f} s, "
                     f"{sum(v > 2.0 for v in rest)} over 2 s (after the first shape, whose {baselines[0]:.1f} s "
                     "start the GPU workers)")
    # by the shape's fastest library call: what a kernel's verification costs follows it
    for low, high in CALL_BANDS:
        band = sorted(s.get("screened", 0) for s in shapes if low <= (s.get("baseline_us") or 0.0) < high)
        if band:
            lines.append(f"  library call {low:g}-{high:g} us: {len(band)} shapes, screened min {band[0]}, "
                         f"median {statistics.median(band):g}, max {band[-1]}; {sum(v >= 64 for v in band)} reached 64")
    summary = speedup_summary(all_best)
    if all_best:
        lines.append(f"best speedup: geomean {summary['geomean_speedup']:.3f}, min {summary['min_speedup']:.3f}, "
                     f"{summary['wins']} wins, {summary['ties']} ties, {summary['losses']} losses; "
                     f"the library within {TIE:.0%} of the floor (no win possible) at {sum(floored.values())}")
    for name in REGIMES:
        if by_regime.get(name):
            values = by_regime[name]
            lines.append(f"  {name}: {len(values)} shapes, geomean {math.exp(statistics.mean(map(math.log, values))):.3f}, "
                         f"the library at the floor at {floored.get(name, 0)}")
    return "\n".join(lines)


def compare(short: dict, long: dict) -> str:
    """Two runs over the same shapes (a short budget's and a long one's; the long one may tune
    some of the short one's shapes, say 20 of a 100-shape run): each shape's best speedup in
    both and the short run's share of the long run's, and over the shapes both measured, the
    geometric mean of those shares and how many are within 2%."""
    def best(run: dict) -> dict[str, float | None]:
        return {str(Problem(**s["problem"])): (s.get("best") or {}).get("speedup_offline") for s in run["shapes"]}

    first, second = best(short), best(long)
    if not set(second) <= set(first):
        raise SystemExit(f"the runs tuned different shapes: {sorted(set(second) - set(first))} only in the long run")
    first = {shape: first[shape] for shape in second}  # the long run may take some of the short run's shapes
    lines = ["| shape | short run's best | long run's best | short / long |", "|---|---|---|---|"]
    shares = []
    for shape, a in first.items():
        b = second[shape]
        share = a / b if a and b else None
        if share is not None:
            shares.append(share)
        lines.append(f"| {shape} | {'-' if a is None else f'{a:.3f}'} | {'-' if b is None else f'{b:.3f}'} | "
                     f"{'-' if share is None else f'{share:.3f}'} |")
    if shares:
        geomean = math.exp(statistics.mean(map(math.log, shares)))
        lines += ["", f"{len(shares)} of {len(first)} shapes measured by both: the short run reached "
                      f"{geomean:.3f} of the long run's best (geometric mean); "
                      f"{sum(v >= 0.98 for v in shares)} within 2%, worst {min(shares):.3f}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("draw", help="print COUNT fresh grid shapes as a shape-set CSV")
    d.add_argument("--count", type=int, default=100)
    d.add_argument("--seed", type=int, required=True, help="record it: the same seed draws the same shapes")
    d.add_argument("--results", type=Path, action="append",
                   help="also leave out this results directory's problems (repeatable: earlier samples' too)")
    d.add_argument("--regime", choices=REGIMES, help="only shapes of this regime (cudal2/results/roofline.py)")
    d.add_argument("--midpoints", action="store_true",
                   help="shapes of the grid's values and the midpoints between them (96, 192, ..., 14336)")
    r = sub.add_parser("report", help="summarise `cudal2 optimize --shapes ... --json` output")
    r.add_argument("run", type=Path, nargs="+", help="one run's output, or the parts of a sample run in several calls")
    t = sub.add_parser("taken", help="the first COUNT shapes a `--json` run tuned, as a shape-set CSV (to tune them again)")
    t.add_argument("run", type=Path)
    t.add_argument("--count", type=int, default=20)
    c = sub.add_parser("compare", help="two `--json` runs over the same shapes: the short one's share of the long one's best")
    c.add_argument("short", type=Path)
    c.add_argument("long", type=Path)
    args = parser.parse_args(argv)
    if args.command in ("draw", "taken"):
        problems = (draw(args.count, args.seed, args.results, args.regime, args.midpoints) if args.command == "draw" else
                    [Problem(**shape["problem"]) for shape in json.loads(args.run.read_text())["shapes"][:args.count]])
        print("m,n,k,dtype,layout")
        for p in problems:
            print(f"{p.m},{p.n},{p.k},{p.dtype},{p.layout}")
    elif args.command == "compare":
        print(compare(json.loads(args.short.read_text()), json.loads(args.long.read_text())))
    else:
        runs = [json.loads(path.read_text()) for path in args.run]
        print(report({"shapes": [shape for run in runs for shape in run["shapes"]]}))


if __name__ == "__main__":
    main()
