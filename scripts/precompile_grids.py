"""Compile every configuration of grid files into the compile cache, in parallel (nvcc needs
no GPU): afterwards `scripts/gpu_session.sh devset-grids` (or `cudal2 bench` on those lines)
compiles nothing. Also compiles the sm90_cutlass configurations of the GPU tests.

    python scripts/precompile_grids.py [--jobs N] [--arch sm_90a] [--leaderboard-top N SHAPES] [GRIDS_FILE...]
      (lines: M N K DTYPE LAYOUT TEMPLATE name=v1,v2 ...; the cache is cudal2's own:
       CUDAL2_CACHE_DIR, cudal2.toml or ~/.cache/cudal2)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cudal2.api import known_candidates  # noqa: E402
from cudal2.cli import parse_params  # noqa: E402
from cudal2.compile import Compiler  # noqa: E402
from cudal2.config import load_settings  # noqa: E402
from cudal2.leaderboard import Leaderboard  # noqa: E402
from cudal2.problem import Problem  # noqa: E402
from cudal2.render import arch_cc, render, template_candidate, template_grid  # noqa: E402
from cudal2.shapes import read_shapes  # noqa: E402


def grid_sources(path: Path, cc: int) -> list[str]:
    sources = []
    for line in path.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        f = line.split()
        problem = Problem(int(f[0]), int(f[1]), int(f[2]), f[3], f[4])
        sources += [render(c, problem) for c in template_grid(f[5], parse_params(f[6:]), cc)]
    return sources


def test_sources(cc: int) -> list[str]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from test_gpu import SM90_CONFIGS

    return [render(template_candidate("sm90_cutlass", params, cc), Problem(1, 1, 1, *v)) for params, v in SM90_CONFIGS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("grids", nargs="*", type=Path)
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--leaderboard-top", nargs=2, metavar=("N", "SHAPES"),
                        help="also the leaderboard's N best kernels of each protocol for every row of the "
                             "shape set SHAPES (what `cudal2 bench --top N` measures)")
    args = parser.parse_args()
    cc = arch_cc(args.arch)
    sources = test_sources(cc) + [s for path in args.grids for s in grid_sources(path, cc)]
    if args.leaderboard_top:
        top, shapes = int(args.leaderboard_top[0]), Path(args.leaderboard_top[1])
        board = Leaderboard(load_settings().results)
        rows = board.read(bench=None)
        sources += [render(c, p) for p in read_shapes(shapes) for c in known_candidates(p, board, rows, cc, top)]
    compiler = Compiler(args.arch, load_settings().cache_dir, jobs=args.jobs)
    todo = [s for s in dict.fromkeys(sources) if compiler.lookup(s) is None]
    print(f"{len(set(sources))} configurations, {len(todo)} to compile with {args.jobs} jobs", flush=True)
    start = time.perf_counter()
    builds = compiler.compile_all(todo)
    failed = [b for b in builds if b.status != "ok"]
    print(f"compiled {len(builds) - len(failed)} in {time.perf_counter() - start:.0f} s; {len(failed)} failed", flush=True)
    for build in failed:
        print(build.status, build.log[-2000:], file=sys.stderr)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
