"""Leaderboard: a directory of Parquet part files, the single source of truth for results."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import threading
import uuid
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import Cudal2Error
from ..protocol import BASELINES, COLUMNS, PROTOCOL, SCHEMA, STATUSES, best, row_record

__all__ = ["BASELINES", "COLUMNS", "PROTOCOL", "SCHEMA", "STATUSES", "Leaderboard", "best", "select"]

# Columns added since parts were first written, and the value old parts read for them (null
# if not named): parts written before the protocol was recorded were timed back to back.
ADDED_COLUMNS = {"protocol": "back-to-back"}
# Columns renamed since: their old name -> their name.
RENAMED_COLUMNS = {"bench": "protocol"}
# The columns every cudal2 part has had; a file without them is not a leaderboard part.
CORE_COLUMNS = ("run_id", "time", "gpu", "m", "n", "k", "dtype", "layout", "kernel", "status")


# What the product keeps of past runs: the verified template configurations' rows (the
# search's priors on a GPU measured before, the cost model's checks), without logs, sources
# or per-baseline columns, as one part file shipped in the package. Written from a results
# directory by scripts/ship_measurements.py; read by shipped().
SHIPPED = Path(__file__).resolve().parent.parent / "data" / "measurements.parquet"
SHIPPED_COLUMNS = (
    "run_id", "time", "gpu", "cc", "sm_count", "sm_clock_mhz", "max_sm_clock_mhz", "driver", "cuda", "nvcc",
    "cutlass", "arch", "m", "n", "k", "dtype", "layout", "kernel", "template", "params", "status", "registers",
    "smem_bytes", "spill_bytes", "dynamic_smem_bytes", "producer_registers", "consumer_registers", "offline_us",
    "offline_p20_us", "offline_p80_us", "speedup_offline", "tflops", "protocol", "kernel_us", "graph_us",
    "speedup_kernel", "speedup_graph", "baseline", "baseline_offline_us", "floor_us", "floor_fraction",
)


def compact(df: pd.DataFrame) -> pa.Table:
    """The rows of `df` that SHIPPED keeps (verified template configurations), the other
    columns null, in the leaderboard's schema."""
    keep = df[(df["status"] == "ok") & df["template"].notna()]
    columns = {c: keep[c] if c in SHIPPED_COLUMNS else pd.Series([None] * len(keep), index=keep.index, dtype=object)
               for c in COLUMNS}
    return pa.Table.from_pandas(pd.DataFrame(columns), schema=SCHEMA, preserve_index=False)


def shipped(protocol: str | None = PROTOCOL, path: Path = SHIPPED) -> pd.DataFrame:
    """The shipped measurements (SHIPPED) timed by `protocol` (None: every one)."""
    if not path.is_file():
        return SCHEMA.empty_table().to_pandas()
    df = _read_part(path).to_pandas()
    return df if protocol is None else df[df["protocol"] == protocol].reset_index(drop=True)


def shown(results: Path, protocol: str | None = PROTOCOL, use_shipped: bool = False) -> tuple[pd.DataFrame, bool]:
    """The rows `cudal2 leaderboard` and `cudal2 report` show, and whether they are the
    shipped measurements: those when asked (`use_shipped`) or when `results` holds no
    leaderboard part yet (a new user sees what was measured before), else the directory's."""
    board = Leaderboard(results)
    if use_shipped or not board.parts.exists() or (board.parts.is_dir() and not any(board.parts.glob("*.parquet"))):
        return shipped(protocol), True
    return board.read(protocol), False


def with_shipped(recorded: pd.DataFrame, gpu: str | None = None, protocol: str | None = None) -> pd.DataFrame:
    """`recorded` (a results directory's rows) and the shipped measurements, those of `gpu`
    and timed by `protocol` (None: every GPU, every protocol)."""
    rows = pd.concat([df for df in (recorded, shipped(protocol)) if len(df)] or [recorded])
    if gpu is not None:
        rows = rows[rows["gpu"] == gpu]
    return rows if protocol is None else rows[rows["protocol"] == protocol]


PRIOR_KEY = ("m", "n", "k", "dtype", "layout", "template", "params")  # one configuration on one problem


def priors(recorded: pd.DataFrame, gpu: str, protocol: str = PROTOCOL) -> list[dict[str, Any]]:
    """The search's priors on `gpu`: the verified rows timed by `protocol` among `recorded`
    (the results directory's) and the shipped ones, each configuration once per problem
    (its best), best first. The shipped part is made once per process (a shape set asks at
    every shape: 0.43 s a shape for the 7,615 shipped rows' records, made anew each time)."""
    here = _best_first(recorded[(recorded["gpu"] == gpu) & (recorded["protocol"] == protocol)]) if len(recorded) else []
    there = _shipped_priors(gpu, protocol, SHIPPED.stat().st_mtime_ns if SHIPPED.is_file() else 0)
    merged = sorted([*here, *there], key=_speedup_first)  # stable: a tie keeps this directory's row first
    seen: set[tuple] = set()
    # copies: a caller's change to a row never reaches the next shape's priors
    return [dict(r) for r in merged if (key := tuple(r[c] for c in PRIOR_KEY)) not in seen and not seen.add(key)]


def _best_first(rows: pd.DataFrame) -> list[dict[str, Any]]:
    rows = rows[rows["status"] == "ok"].sort_values("speedup_offline", ascending=False, na_position="last", kind="stable")
    return rows.drop_duplicates(list(PRIOR_KEY)).to_dict("records")


def _speedup_first(row: dict[str, Any]) -> tuple[bool, float]:
    speedup = row.get("speedup_offline")
    known = speedup is not None and speedup == speedup
    return (not known, -speedup if known else 0.0)


@functools.lru_cache(maxsize=8)
def _shipped_priors(gpu: str, protocol: str, stamp: int) -> tuple[dict[str, Any], ...]:
    """The shipped rows' priors on `gpu` (`stamp`: the file's mtime, so a rewritten file is read again)."""
    rows = shipped(protocol)
    return tuple(_best_first(rows[rows["gpu"] == gpu]))


def _read_part(path: Path) -> pa.Table:
    """One part file in the current schema (columns added since it was written: their
    default or null); ValueError for a file that is not a leaderboard part."""
    table = pq.read_table(path)
    if not set(CORE_COLUMNS) <= set(table.column_names):
        raise ValueError("not a cudal2 leaderboard part (columns differ)")
    table = table.rename_columns([RENAMED_COLUMNS.get(c, c) if RENAMED_COLUMNS.get(c) not in table.column_names else c
                                  for c in table.column_names])
    for field in SCHEMA:
        if field.name not in table.column_names:
            value = ADDED_COLUMNS.get(field.name)
            table = table.append_column(field.name, pa.array([value] * table.num_rows, field.type))
    return table.select(COLUMNS).cast(SCHEMA)


def source_hash(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


class Leaderboard:
    """Rows under `root/leaderboard/*.parquet`, kernel sources under `root/sources/<hash>.cu`.

    Each append writes one part file under a temporary name and renames it, so an
    interrupted run or a concurrent writer never leaves a half-written part behind. A part
    is never written again once in place, so each is read once per Leaderboard: a shape set
    reads the leaderboard at every shape, and reading every part each time grew with the
    run (1.2 s for 264 parts, 4.5 ms a part; a 1,000-shape grid writes about 3,000).
    """

    def __init__(self, root: Path):
        self.root = Path(root)
        self.parts = self.root / "leaderboard"
        self.sources = self.root / "sources"
        self._read: dict[Path, tuple[tuple[int, int], pa.Table]] = {}  # part -> (size, mtime), table
        self._lock = threading.Lock()

    def append(self, rows: list[dict[str, Any]]) -> Path | None:
        if not rows:
            return None
        now = datetime.now(timezone.utc)
        table = pa.Table.from_pylist([vars(row_record({"time": now, **row})) for row in rows], schema=SCHEMA)
        self._mkdir(self.parts)
        name = f"part-{now:%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}.parquet"
        tmp = self.parts / f".{name}.tmp"
        pq.write_table(table, tmp)
        os.replace(tmp, self.parts / name)
        return self.parts / name

    def store_source(self, source: str) -> str:
        """Keeps a kernel source by content hash; returns the hash."""
        digest = source_hash(source)
        path = self.sources / f"{digest}.cu"
        if not path.exists():
            self._mkdir(self.sources)
            tmp = path.with_suffix(f".{uuid.uuid4().hex[:8]}.tmp")
            tmp.write_text(source)
            os.replace(tmp, path)
        return digest

    def source(self, digest: str | None) -> str:
        """A kernel's stored source; a row with none (a shipped measurement keeps no sources)
        is one line that says how to get one."""
        path = self.sources / f"{digest}.cu"
        if not isinstance(digest, str) or not path.is_file():
            raise Cudal2Error(
                "a kernel to export or check has no stored source "
                + (f"({path} is missing)" if isinstance(digest, str) else "(a shipped measurement keeps none)")
                + ": `cudal2 bench --m M --n N --k K --top 1` measures the best recorded kernel here and stores it")
        return path.read_text()

    def read(self, protocol: str | None = PROTOCOL) -> pd.DataFrame:
        """Rows timed by `protocol` (None: every protocol). Parts written before a
        column existed read it as null; a part that is not a readable leaderboard part is
        skipped with a warning."""
        tables = [table for _, table in self._tables()]
        if not tables:
            return SCHEMA.empty_table().to_pandas()
        df = pa.concat_tables(tables).to_pandas()
        return df if protocol is None else df[df["protocol"] == protocol].reset_index(drop=True)

    def _tables(self) -> list[tuple[Path, pa.Table]]:
        if self.parts.exists() and not self.parts.is_dir():
            raise Cudal2Error(f"leaderboard path {self.parts} is not a directory")
        if self.parts.exists() and not os.access(self.parts, os.R_OK | os.X_OK):
            raise Cudal2Error(f"cannot read leaderboard directory {self.parts}")
        tables = []
        with self._lock:
            present = sorted(self.parts.glob("*.parquet")) if self.parts.exists() else []
            for gone in set(self._read) - set(present):
                del self._read[gone]
            for path in present:
                try:
                    stat = path.stat()
                except FileNotFoundError:  # removed meanwhile (a migration)
                    continue
                key = (stat.st_size, stat.st_mtime_ns)
                if path not in self._read or self._read[path][0] != key:
                    try:
                        self._read[path] = (key, _read_part(path))
                    except Exception as exc:  # a corrupt or foreign file costs itself, nothing else
                        warnings.warn(f"skipping {path.name}: {exc}", stacklevel=3)
                        continue
                tables.append((path, self._read[path][1]))
        return tables

    def migrate(self) -> tuple[int, int]:
        """Rewrites every readable part into one part of the current schema (so that pandas,
        duckdb and polars read the directory whole); returns (parts replaced, rows). The new
        part is in place before any old one is removed, and a part written meanwhile by
        another process is left alone."""
        found = self._tables()
        if not found:
            return 0, 0
        merged = pa.concat_tables([table for _, table in found])
        self._mkdir(self.parts)
        name = f"part-{datetime.now(timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}.parquet"
        tmp = self.parts / f".{name}.tmp"
        pq.write_table(merged, tmp)
        os.replace(tmp, self.parts / name)
        for path, _ in found:
            path.unlink()
        return len(found), merged.num_rows

    def _mkdir(self, path: Path) -> None:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise Cudal2Error(f"cannot write leaderboard directory {path}: {exc.strerror}") from None


def select(df: pd.DataFrame, **filters: Any) -> pd.DataFrame:
    """Rows whose columns equal the given values (None means no filter)."""
    for column, value in filters.items():
        if value is not None:
            df = df[df[column] == value]
    return df


def contributions(df: pd.DataFrame, results: Path) -> pd.DataFrame:
    """What each proposer contributed to the rows `df` (one protocol): candidates measured
    or rejected, how many verified, its best speedup, the problems where it holds the best
    kernel, and the LLM tokens its runs spent (llm-usage.jsonl under results/runs/<run id>/)."""
    kernels = df[~df["kernel"].isin(BASELINES)]
    winners = best(kernels, 1)
    tokens: dict[str, int] = {}
    for run_id in kernels["run_id"].dropna().unique():
        for log in (Path(results) / "runs" / str(run_id)).glob("**/llm-usage.jsonl"):
            tokens[run_id] = tokens.get(run_id, 0) + sum(
                json.loads(line).get("total_tokens") or 0 for line in log.read_text().splitlines() if line.strip())
    rows = []
    for proposer, group in kernels.groupby(kernels["proposer"].fillna("-"), sort=True):
        ok = group[group["status"] == "ok"]
        runs = set(group["run_id"].dropna())
        rows.append({"proposer": proposer, "candidates": len(group), "ok": len(ok),
                     "best_speedup": ok["speedup_offline"].max() if len(ok) else None,
                     "best_kernels": int((winners["proposer"].fillna("-") == proposer).sum()),
                     "llm_tokens": sum(tokens.get(r, 0) for r in runs) if proposer == "llm" else 0})
    return pd.DataFrame(rows, columns=["proposer", "candidates", "ok", "best_speedup", "best_kernels", "llm_tokens"])
