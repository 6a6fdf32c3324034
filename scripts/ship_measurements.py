"""Writes what the package keeps of past runs (cudal2/data/measurements.parquet: every
verified template configuration's row, without logs or sources) from a results directory.

    python scripts/ship_measurements.py [RESULTS_DIR]      (default: results)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cudal2.leaderboard import SHIPPED, Leaderboard, compact  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("results", type=Path, nargs="?", default=Path("results"))
args = parser.parse_args()
if not (args.results / "leaderboard").is_dir():
    sys.exit(f"{args.results} holds no leaderboard: nothing to ship (the shipped file is left as it was)")
table = compact(Leaderboard(args.results).read(protocol=None))
if table.num_rows == 0:
    sys.exit(f"{args.results}'s leaderboard has no verified template rows: the shipped file is left as it was")
SHIPPED.parent.mkdir(parents=True, exist_ok=True)
pq.write_table(table, SHIPPED, compression="zstd")
print(f"{SHIPPED}: {table.num_rows} rows, {SHIPPED.stat().st_size / 1024:.0f} KiB")
