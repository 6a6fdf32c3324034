"""Writes what the package keeps of past runs (cudal2/data/measurements.parquet: every
verified template configuration's row, without logs or sources) from a results directory.

    python scripts/ship_measurements.py [RESULTS_DIR ...]      (default: results)
    python scripts/ship_measurements.py --add RESULTS_DIR ...  (the shipped rows kept, these added)
    python scripts/ship_measurements.py --add RESULTS_DIR --drop QUERY  (the shipped rows that match the
        pandas query dropped first: a kernel whose code changed since, say
        "template == 'sm90_splitk' and layout == 'nn' and params.str.contains('\"block_n\": 128')")
    python scripts/ship_measurements.py --add --current RESULTS_DIR ...  (of these directories' rows, only
        those whose configuration renders today the source it was measured with: results of earlier
        versions join without their stale kernels)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cudal2.kernels.candidate import Candidate  # noqa: E402
from cudal2.kernels.render import load_templates, recorded_params, render  # noqa: E402
from cudal2.problem import Problem  # noqa: E402
from cudal2.results.leaderboard import SHIPPED, Leaderboard, compact, shipped, source_hash  # noqa: E402


def current(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows whose template configuration renders today the source they were measured with
    (its hash, `source_hash`); a free-form kernel's rows and those of a template or parameters
    no longer known are left out too."""
    templates = load_templates()

    def renders_alike(row: dict) -> bool:
        params = recorded_params(row, templates)
        if params is None or not isinstance(row.get("source_hash"), str):
            return False
        problem = Problem(int(row["m"]), int(row["n"]), int(row["k"]), row["dtype"], row["layout"])
        return source_hash(render(Candidate.from_template(row["template"], params), problem)) == row["source_hash"]

    verified = rows[(rows["status"] == "ok") & rows["template"].notna()]  # what compact() would ship
    return verified[[renders_alike(row) for row in verified.to_dict("records")]]


parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("results", type=Path, nargs="*", default=[Path("results")])
parser.add_argument("--add", action="store_true", help="keep the shipped rows and add these directories' rows")
parser.add_argument("--drop", metavar="QUERY", help="with --add: drop the shipped rows this pandas query selects")
parser.add_argument("--current", action="store_true",
                    help="only the rows whose configuration renders today the source they were measured with")
parser.add_argument("--to", type=Path, default=SHIPPED, help="the file written (default: the package's)")
args = parser.parse_args()
for results in args.results:
    if not (results / "leaderboard").is_dir():
        sys.exit(f"{results} holds no leaderboard: nothing to ship (the shipped file is left as it was)")
frames = [Leaderboard(results).read(protocol=None) for results in args.results]
if args.current:
    read = sum(len(compact(frame)) for frame in frames)
    frames = [current(frame) for frame in frames]
    print(f"{read - sum(len(frame) for frame in frames)} verified template rows left out: their configuration renders another source today")
added = compact(pd.concat(frames, ignore_index=True)).num_rows
if added == 0:
    sys.exit(f"{', '.join(map(str, args.results))}: no verified template rows; the shipped file is left as it was")
if args.drop and not args.add:
    sys.exit("--drop applies to the shipped rows kept by --add")
if args.add:
    kept = shipped(protocol=None, path=args.to)
    if args.drop:
        stale = kept.query(args.drop, engine="python")
        kept = kept.drop(stale.index)
        print(f"{len(stale)} shipped rows dropped ({args.drop})")
    frames.insert(0, kept)
table = compact(pd.concat(frames, ignore_index=True))
args.to.parent.mkdir(parents=True, exist_ok=True)
pq.write_table(table, args.to, compression="zstd")
print(f"{args.to}: {table.num_rows} rows ({added} from {len(args.results)} results directories), {args.to.stat().st_size / 1024:.0f} KiB")
