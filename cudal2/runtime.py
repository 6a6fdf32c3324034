"""Runtime: an exported dispatch library — this GPU's winning kernels and a table that picks
one per call, or none (then the caller's library call runs).

A library is a directory: `index.json` (the versions it was built and measured with, and
one entry per tuned problem) and `kernels/<source hash>.so` with its source beside it
(`.cu`). The table picks the kernel
tuned for exactly the problem; for a problem never tuned, the kernel tuned for the nearest M
with the same N, K, dtype and layout, but only where M lies within the M values that kernel
was verified at; otherwise none. A problem whose best kernel was measured slower than the
library call or tied with it (a claim below MIN_SPEEDUP) gets no kernel, and is recorded
so that the nearest-M rule never hands it another M's kernel. A table built for another GPU or driver
picks none.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import warnings
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pandas as pd

from .errors import Cudal2Error
from .kernels.compile import Compiler, flags
from .problem import Problem
from .protocol import TIE, best
from .results.leaderboard import Leaderboard

INDEX = "index.json"
VERSION_KEYS = ("gpu", "driver")  # a mismatch in any: every call falls back
# Recorded, for the reader. `cuda` is the runtime the kernels were measured beside (CuPy's):
# a caller's own runtime may differ on the same machine (torch 2.11's 13.0 beside CuPy's 13.2
# on the H200) and does not reach the kernels, which carry nvcc's; the driver pins the rest.
BUILD_KEYS = ("cuda", "nvcc", "cutlass", "arch")
# The lowest claim exported: below it the library call is faster or ties (protocol.TIE; a 1.00x
# kernel dispatched in the Llama MLP example read 0.96x inside the block), so the op runs the
# library call instead.
MIN_SPEEDUP = 1.0 + TIE


@dataclass(frozen=True)
class DispatchEntry:
    """One tuned problem's kernel."""

    m: int
    n: int
    k: int
    dtype: str
    layout: str
    library: str  # relative to the library directory
    kernel: str
    speedup: float  # the claimed speedup measured for this problem
    verified_m: tuple[int, ...]  # the M values this kernel was verified at (same N, K, dtype, layout)


class DispatchTable:
    """Picks the kernel for a call (see the module docstring)."""

    def __init__(self, entries: list[DispatchEntry], versions: dict[str, Any], root: Path | None = None,
                 library_call: frozenset[tuple] = frozenset()):
        self.entries = entries
        self.versions = versions
        self.root = root
        self.library_call = library_call  # (m, n, k, dtype, layout) measured faster by the library
        self._by_shape: dict[tuple, list[DispatchEntry]] = {}
        for entry in entries:
            self._by_shape.setdefault((entry.n, entry.k, entry.dtype, entry.layout), []).append(entry)

    @classmethod
    def load(cls, root: Path) -> DispatchTable:
        index = Path(root) / INDEX
        if not index.is_file():
            raise Cudal2Error(f"{root} is not a cudal2 library (no {INDEX}; make one with `cudal2 export --library`)")
        try:
            data = json.loads(index.read_text())
            entries = [DispatchEntry(**{**e, "verified_m": tuple(e["verified_m"])}) for e in data["entries"]]
            library_call = frozenset(tuple(p) for p in data.get("library_call", []))
        except (ValueError, KeyError, TypeError) as exc:
            raise Cudal2Error(f"{index} is not a readable cudal2 library index: {exc}") from None
        return cls(entries, data["versions"], Path(root), library_call)

    def mismatch(self, environment: dict[str, Any]) -> str | None:
        """Why this table does not serve `environment` (GPU, driver), or None."""
        for key in VERSION_KEYS:
            if str(self.versions.get(key)) != str(environment.get(key)):
                return f"built for {key} {self.versions.get(key)!r}, this machine has {environment.get(key)!r}"
        return None

    def choose(self, m: int, n: int, k: int, dtype: str, layout: str) -> DispatchEntry | None:
        if (m, n, k, dtype, layout) in self.library_call:
            return None
        candidates = self._by_shape.get((n, k, dtype, layout), [])
        for entry in sorted(candidates, key=lambda e: (abs(e.m - m), e.m)):
            if entry.m == m or min(entry.verified_m) <= m <= max(entry.verified_m):
                return entry
        return None


def export_library(board: Leaderboard, rows: pd.DataFrame, compiler: Compiler, out: Path,
                   min_speedup: float = MIN_SPEEDUP) -> DispatchTable:
    """Writes the library of the best kernel per problem of `rows` (one protocol, one GPU)
    into `out`: each kernel's stored source compiled (from the cache when built before) and
    copied, and the index with the versions of the rows' measurements. Problems whose best
    claim is below `min_speedup` are left to the library call."""
    winners = best(rows, 1)
    if winners.empty:
        raise Cudal2Error("no verified kernel to export")
    gpus = sorted(set(winners["gpu"].dropna()))
    if len(gpus) != 1:
        raise Cudal2Error(f"the rows are of {len(gpus)} GPUs ({', '.join(gpus)}); choose one with --gpu")
    first = winners.iloc[0]
    versions = {key: None if pd.isna(first.get(key)) else first.get(key) for key in VERSION_KEYS + BUILD_KEYS}
    slower = winners["speedup_offline"] < min_speedup
    library_call = sorted((int(r.m), int(r.n), int(r.k), r.dtype, r.layout) for r in winners[slower].itertuples())
    winners = winners[~slower]
    ok = rows[rows["status"] == "ok"]
    kernels = Path(out) / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    entries = []
    for row in winners.itertuples():
        build = compiler.compile(board.source(row.source_hash))
        if build.status != "ok":
            raise Cudal2Error(f"{row.kernel} no longer compiles: {build.log.strip().splitlines()[-1:]}")
        target = kernels / f"{row.source_hash}.so"
        shutil.copyfile(build.library, target)
        target.with_suffix(".cu").write_text(board.source(row.source_hash))  # what it is, for a reader and `check`
        same = ok[(ok["source_hash"] == row.source_hash) & (ok["n"] == row.n) & (ok["k"] == row.k)
                  & (ok["dtype"] == row.dtype) & (ok["layout"] == row.layout)]
        entries.append(DispatchEntry(int(row.m), int(row.n), int(row.k), row.dtype, row.layout, f"kernels/{target.name}",
                             row.kernel, float(row.speedup_offline), tuple(sorted({int(v) for v in same["m"]}))))
    index = {"versions": versions, "entries": [asdict(e) for e in entries], "library_call": library_call}
    (Path(out) / INDEX).write_text(json.dumps(index, indent=1, default=str))
    return DispatchTable(entries, versions, Path(out), frozenset(library_call))


def serving(table: DispatchTable, environment: dict[str, Any]) -> bool:
    """Whether `table` serves this machine; warns once (with the reason) when it does not."""
    reason = table.mismatch(environment)
    if reason is not None:
        warnings.warn(f"cudal2 library {table.root}: {reason}; every call falls back to the library call",
                      stacklevel=2)
    return reason is None


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "gpu"


def export_best(leaderboard: Leaderboard, results: Path, row: dict[str, Any], mode: str = "offline") -> Path:
    """A measured kernel (a leaderboard row) as a self-contained .cu file under
    results/best/<gpu>/<dtype>_<layout>/<m>_<n>_<k>.cu, with a header saying what it is and
    how it measured."""
    p = Problem(int(row["m"]), int(row["n"]), int(row["k"]), row["dtype"], row["layout"])
    path = results / "best" / _slug(row.get("gpu") or "gpu") / f"{p.dtype}_{p.layout}" / f"{p.m}_{p.n}_{p.k}.cu"
    origin = (f"template {row['template']} {row['params']}" if isinstance(row.get("template"), str)
              else f"proposer {row.get('proposer')} model {row.get('model')}")
    header = "\n".join([
        f"// cudal2 best kernel for C[{p.m},{p.n}] = A[{p.m},{p.k}] @ {'B' if p.layout == 'nn' else 'W^T'} "
        f"({p.dtype}, layout {p.layout}, fp32 accumulation)",
        f"// speedup {row[f'speedup_{mode}']:.3f}x over the fastest library call, {row.get('baseline')} "
        f"({row[f'baseline_{mode}_us']:.2f} us -> {row[f'{mode}_us']:.2f} us, {mode}, protocol {row.get('protocol')}) "
        f"on {row.get('gpu')} ({row.get('arch')})",
        f"// measured {row['time'] if 'time' in row else datetime.now(timezone.utc)}; {origin}",
        f"// build (the flags cudal2 compiles with): {shlex.join(['nvcc', *flags(row.get('arch') or 'sm_90a'), 'kernel.cu', '-o', 'kernel.so'])}",
        "",
    ])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(header + leaderboard.source(row["source_hash"]))
    tmp.replace(path)
    return path
