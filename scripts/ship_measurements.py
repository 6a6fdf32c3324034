"""Writes what the package keeps of past runs (cudal2/data/measurements.parquet: every
verified template configuration's row, without logs or sources) from a results directory.

    python scripts/ship_measurements.py [RESULTS_DIR]      (default: results)
"""

from __future__ import annotations

import sys
from pathlib import Path

import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cudal2.leaderboard import SHIPPED, Leaderboard, compact  # noqa: E402

results = Path(sys.argv[1] if len(sys.argv) > 1 else "results")
table = compact(Leaderboard(results).read(bench=None))
SHIPPED.parent.mkdir(parents=True, exist_ok=True)
pq.write_table(table, SHIPPED, compression="zstd")
print(f"{SHIPPED}: {table.num_rows} rows, {SHIPPED.stat().st_size / 1024:.0f} KiB")
