"""What a measurement means, in one place: the bench protocol's name, the tie band, the
baselines, the leaderboard row's schema, and the one rule for which kernel is best.

A leaf module: storage (leaderboard.py), export (runtime.py), the tables and the report
import it without importing any GPU code; the bench (bench.py, measure.py) and the
baselines (baselines.py) import it too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pandas as pd
import pyarrow as pa

# How this version times contestants (cudal2/measure/bench.py); every row records it in its
# `protocol` column, and rows of two protocols are never ranked together.
PROTOCOL = "cupti-graph-3"
# Protocols of earlier versions whose rows a leaderboard may still hold (readable, never
# measured again); parts written before the protocol was recorded were timed back to back.
EARLIER_PROTOCOLS = ("fenced", "back-to-back")
PROTOCOLS = (PROTOCOL, *EARLIER_PROTOCOLS)
# The optimize loop's first pass (cudal2/tune/optimize.py, successive halving): candidates
# verified by the screening checks (verify's `screen`), then timed by the graph method alone
# for a few rounds. Its rows say
# which candidates the full protocol confirms; they are never ranked, exported, shown to a
# model or used as priors: their status is SCREENED, never "ok", and their protocol this one.
SCREEN_PROTOCOL = "screen-graph-1"
SCREENED = "screened"
# A kernel's claim repeats within about 2% between runs of the protocol (3% for calls under
# 5 us; the independent check agrees within the same): a speedup within TIE of 1.0 is a tie
# with the library call, neither a win nor a loss.
TIE = 0.03
# The protocol's two offline timing methods; the claimed speedup is the lower of the two.
OFFLINE_METHODS = ("kernel", "graph")

# The library calls every kernel is measured against, and each one's column prefix
# (cublas_kernel_us, cublaslt_graph_us, ...).
BASELINES = ("cuBLAS", "cuBLASLt", "torch.matmul")
BASELINE_COLUMN = {"cuBLAS": "cublas", "cuBLASLt": "cublaslt", "torch.matmul": "torch"}

STATUSES = ("ok", "unsupported", "compile_error", "wrong", "cheat", "crash", "timeout", "invalid", SCREENED)


@dataclass
class Row:
    """One measurement (or one rejected candidate), as the leaderboard stores it. Every
    field may be missing (None); the Parquet schema (SCHEMA) is derived from these fields."""

    run_id: str | None = None
    time: datetime | None = None
    # environment
    gpu: str | None = None
    cc: int | None = None
    sm_count: int | None = None
    sm_clock_mhz: int | None = None
    max_sm_clock_mhz: int | None = None
    driver: str | None = None
    cuda: str | None = None
    nvcc: str | None = None
    cupy: str | None = None
    cutlass: str | None = None
    arch: str | None = None
    # problem
    m: int | None = None
    n: int | None = None
    k: int | None = None
    dtype: str | None = None
    layout: str | None = None
    # candidate
    kernel: str | None = None
    candidate_id: str | None = None
    template: str | None = None
    params: str | None = None
    source_hash: str | None = None
    proposer: str | None = None
    model: str | None = None
    # outcome
    status: str | None = None
    error: str | None = None
    registers: int | None = None
    smem_bytes: int | None = None
    spill_bytes: int | None = None
    stack_bytes: int | None = None
    # what a template's kernel declares beyond ptxas's report (compile.declared_resources):
    # its dynamic shared memory, its warpgroups' registers per thread after setmaxnreg
    dynamic_smem_bytes: int | None = None
    producer_registers: int | None = None
    consumer_registers: int | None = None
    compile_s: float | None = None
    max_error: float | None = None
    tolerance: float | None = None
    # the claimed timing (offline: the method whose ratio is the lower) and server mode
    offline_us: float | None = None
    offline_p20_us: float | None = None
    offline_p80_us: float | None = None
    offline_samples: int | None = None
    server_us: float | None = None
    server_p20_us: float | None = None
    server_p80_us: float | None = None
    server_samples: int | None = None
    cublas_offline_us: float | None = None
    cublas_server_us: float | None = None
    speedup_offline: float | None = None
    speedup_server: float | None = None
    tflops: float | None = None
    # the problem's hardware floor on this GPU (cudal2/results/roofline.py) and the share of it the
    # claimed time reaches (floor / offline_us; 1.0 is the hardware's limit)
    floor_us: float | None = None
    floor_fraction: float | None = None
    # how times were taken: PROTOCOL, one of EARLIER_PROTOCOLS, or SCREEN_PROTOCOL (a screening pass)
    protocol: str | None = None
    # the protocol's two methods: CUPTI device time per call, and in a CUDA graph between
    # neighbour kernels
    kernel_us: float | None = None
    kernel_p20_us: float | None = None
    kernel_p80_us: float | None = None
    kernel_samples: int | None = None
    graph_us: float | None = None
    graph_p20_us: float | None = None
    graph_p80_us: float | None = None
    graph_samples: int | None = None
    # every baseline by every method, from the same run as the row
    cublas_kernel_us: float | None = None
    cublaslt_kernel_us: float | None = None
    torch_kernel_us: float | None = None
    cublas_graph_us: float | None = None
    cublaslt_graph_us: float | None = None
    torch_graph_us: float | None = None
    cublaslt_server_us: float | None = None
    torch_server_us: float | None = None
    # speedups: per method against the fastest baseline, and (the lower of the two methods)
    # against each baseline; `baseline` names the fastest in the claimed method
    speedup_kernel: float | None = None
    speedup_graph: float | None = None
    speedup_vs_cublas: float | None = None
    speedup_vs_cublaslt: float | None = None
    speedup_vs_torch: float | None = None
    baseline: str | None = None
    baseline_offline_us: float | None = None
    baseline_server_us: float | None = None
    cublaslt_algo: str | None = None  # the autotuned cuBLASLt algorithm (JSON: index, of, id, tile, ...)
    device: int | None = None  # the GPU's index on its host (rows of a multi-GPU run)
    temperature_c: int | None = None  # the GPU's temperature when a soaked (long) call's timed rounds began


_ARROW = {"str | None": pa.string(), "int | None": pa.int64(), "float | None": pa.float64(),
          "datetime | None": pa.timestamp("us", tz="UTC")}
SCHEMA = pa.schema([(f.name, _ARROW[f.type]) for f in dataclasses.fields(Row)])
COLUMNS = SCHEMA.names


def row_record(row: dict[str, Any]) -> Row:
    """`row` as a Row; ValueError naming any key that is not a leaderboard column."""
    unknown = set(row) - set(COLUMNS)
    if unknown:
        raise ValueError(f"unknown leaderboard columns: {sorted(unknown)}")
    return Row(**row)


# What makes two rows "the same problem on the same GPU, measured the same way".
PROBLEM_KEYS = ["gpu", "m", "n", "k", "dtype", "layout", "protocol"]


def kernel_identity(df: pd.DataFrame) -> pd.Series:
    """Which kernel each row measured, never empty: a template's kernel is its template and
    parameters (the shipped measurements store no source), a free-form kernel its source
    hash, anything else its name."""
    named = df["kernel"].astype(object).where(df["kernel"].notna(), "")
    source = df["source_hash"].astype(object)
    by_source = ("source " + source).where(source.notna() & (source != ""), "kernel " + named)
    template = df["template"].astype(object)
    params = df["params"].astype(object).where(df["params"].notna(), "{}")
    return ("template " + template + " " + params).where(template.notna() & (template != ""), by_source)


def verified(df: pd.DataFrame) -> pd.DataFrame:
    """The rows that measured a verified kernel (no baseline) with a speedup, each with its
    kernel_identity in `_kernel`: what best() ranks, and what a problem's kernels count."""
    ok = df[(df["status"] == "ok") & ~df["kernel"].isin(BASELINES) & df["speedup_offline"].notna()]
    return ok.assign(_kernel=kernel_identity(ok))


def best(df: pd.DataFrame, top: int = 1) -> pd.DataFrame:
    """THE rule for "best": the `top` fastest verified kernels per problem, GPU and protocol
    (rows of two protocols are never ranked together), by the claimed offline speedup.

    A kernel measured more than once counts by its latest measurement, not its best: the best
    of its noisy repeats would flatter it, and a re-check (`bench --top`, `check`, a re-run
    after a driver upgrade) is meant to replace what it re-measures. Kernels are told apart
    by kernel_identity, so shipped rows (no source) and a results directory's rows rank
    alike, and together."""
    ok = verified(df)
    latest = ok.sort_values("time", kind="stable").drop_duplicates(PROBLEM_KEYS + ["_kernel"], keep="last")
    ranked = latest.sort_values("speedup_offline", ascending=False, kind="stable")
    return ranked.groupby(PROBLEM_KEYS, sort=True, dropna=False).head(top).drop(columns="_kernel").reset_index(drop=True)


def best_row(rows: list[dict[str, Any]], mode: str = "offline") -> dict[str, Any] | None:
    """best() over one problem's rows on one GPU, as dicts in the order they were measured
    (a tuning run's history), ranked by the speedup of `mode` (offline or server): the best
    row, or None without a verified kernel."""
    key = f"speedup_{mode}"
    found = [r for r in rows if r.get("status") == "ok" and r.get("kernel") not in BASELINES
             and r.get(key) is not None and r[key] == r[key]]
    if not found:
        return None
    columns = {c: [r.get(c) for r in found] for c in ("kernel", "status", "template", "params", "source_hash")}
    df = pd.DataFrame({**columns, **{c: "" for c in PROBLEM_KEYS}, "speedup_offline": [r[key] for r in found],
                       "time": range(len(found))})  # the order measured stands for the time
    return found[int(best(df, 1)["time"].iloc[0])]
