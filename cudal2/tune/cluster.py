"""Tune a shape set on every GPU of a cluster, through Dask distributed.

Dask rather than Ray: the job is a queue of independent, coarse tasks (one shape's tuning,
minutes each) over long-lived workers, one per GPU; Dask's worker resources
(`--resources GPU=1`) place exactly that, its scheduler and workers are pure Python
(`pip install distributed`, a few MB, where Ray is an 80 MB native wheel with its own object
store), and dask-jobqueue starts the same workers from a Slurm allocation.

Each Dask worker owns one GPU (start one per GPU, with CUDA_VISIBLE_DEVICES set). Before any
task runs, every worker reports its GPU: model, driver and clocks must be the same on all of
them, as Kernel Tuner requires of its runners, or the run is refused (a faster clock on one
node would make its shapes' speedups incomparable with the others'). Each task tunes one
shape with cudal2's own optimize loop into a results directory of its own on the worker and
returns every new row and kernel source; the head appends them to its leaderboard, one part
per shape, so nothing is lost when a worker or the head stops half-way (a re-run skips
nothing: rows only accumulate). Each task starts from the head's verified rows on that GPU,
as a run on the head would (the search's priors).
"""

from __future__ import annotations

import dataclasses
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import api
from ..config import Settings
from ..errors import Cudal2Error
from ..measure.environment import describe_device
from ..problem import Problem
from ..results.leaderboard import COLUMNS, Leaderboard, compact

UNIFORM_KEYS = ("gpu", "driver", "max_sm_clock_mhz")  # must be the same on every worker


def gpu_facts() -> dict[str, Any]:
    """This worker's GPU (device 0 of what it sees), as describe_device reports it."""
    facts = describe_device(0)
    return {**{k: facts.get(k) for k in (*UNIFORM_KEYS, "sm_clock_mhz", "cc")}, "host": socket.gethostname()}


def tune_task(problem: dict[str, Any], options: dict[str, Any], settings: Settings, seed=None) -> dict[str, Any]:
    """On a worker: cudal2's optimize loop on one shape, into a fresh results directory
    holding `seed` (the head's verified rows on this GPU, a leaderboard.compact table: the
    search's priors, as on the head); returns its new rows and the sources they name."""
    import pyarrow.parquet as pq

    # (a Dask worker's process is a daemon; the GPU worker's processes are plain subprocesses,
    # which a daemon may start)
    with tempfile.TemporaryDirectory(prefix="cudal2-cluster-") as scratch:
        local = dataclasses.replace(settings, results=Path(scratch), device=0)
        board = Leaderboard(local.results)
        seeded: set[str] = set()
        if seed is not None and seed.num_rows:
            board.parts.mkdir(parents=True)
            pq.write_table(seed, board.parts / "part-seed.parquet")
            seeded = set(seed.column("run_id").to_pylist())
        api.optimize([Problem(**problem)], settings=local, **options)
        rows = board.read(protocol=None)
        rows = rows[~rows["run_id"].isin(seeded)]
        sources = {h: board.source(h) for h in set(rows["source_hash"].dropna())}
        rows = rows.astype(object).where(rows.notna(), None)  # missing values as None, not NaN
        return {"rows": rows.to_dict("records"), "sources": sources, "host": socket.gethostname()}


def check_uniform(facts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The one GPU configuration of all workers ({address: gpu_facts()}), or Cudal2Error
    naming the workers that differ."""
    if not facts:
        raise Cudal2Error("the cluster has no workers with a GPU (start them with --resources GPU=1)")
    kinds: dict[tuple, list[str]] = {}
    for address, f in sorted(facts.items()):
        kinds.setdefault(tuple(f.get(k) for k in UNIFORM_KEYS), []).append(f"{address} ({f.get('host')})")
    if len(kinds) > 1:
        listed = "; ".join(f"{dict(zip(UNIFORM_KEYS, kind))}: {', '.join(workers)}" for kind, workers in kinds.items())
        raise Cudal2Error(f"the cluster's GPUs differ in model, driver or clock, so their speedups would not "
                          f"compare: {listed}")
    return dict(zip(UNIFORM_KEYS, next(iter(kinds))))


def optimize_on_cluster(problems: list[Problem], address: str | Any, *, settings: Settings,
                        options: dict[str, Any] | None = None,
                        on_done: Callable[[Problem, dict[str, Any]], None] | None = None,
                        task: Callable = tune_task, facts: Callable = gpu_facts,
                        connect_s: float = 20.0) -> list[dict[str, Any]]:
    """Tunes every problem on the cluster at `address` (a scheduler address, or a Dask
    Client), one task per problem on a worker with a free GPU; each problem's rows land in
    `settings.results` as its task finishes (`on_done(problem, result)` hears of it).
    Returns each task's result (its rows, sources and host), in the order they finished."""
    from distributed import Client, as_completed

    if isinstance(address, Client):
        client = address
    else:
        try:
            client = Client(address, timeout=connect_s)
        except (OSError, TimeoutError, ValueError) as exc:  # nothing listening, a wrong address
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise Cudal2Error(f"no Dask scheduler answers at {address} within {connect_s:g} s ({reason})") from None
    try:
        workers = {a: w for a, w in client.scheduler_info()["workers"].items() if w.get("resources", {}).get("GPU")}
        reports = client.run(facts, workers=list(workers), on_error="return") if workers else {}
        broken = {a: r for a, r in reports.items() if isinstance(r, BaseException)}
        if broken:
            raise Cudal2Error("GPU workers that cannot describe their GPU: " + "; ".join(
                f"{a}: {type(r).__name__}: {str(r).splitlines()[0] if str(r) else ''}" for a, r in broken.items()))
        kind = check_uniform(reports)
        board = Leaderboard(settings.results)
        here = board.read()
        seed = client.scatter(compact(here[here["gpu"] == kind["gpu"]]) if len(here) else None, broadcast=True)
        futures = {client.submit(task, dataclasses.asdict(p), dict(options or {}), settings, seed,
                                 resources={"GPU": 1}, pure=False, key=f"cudal2-tune-{p}-{i}"): p
                   for i, p in enumerate(problems)}
        done, columns = [], set(COLUMNS)
        for future in as_completed(futures):
            if future.status == "error":  # one shape's failure is that shape's, not the run's
                result = {"problem": str(futures[future]), "error": repr(future.exception()), "rows": [], "sources": {}}
                done.append(result)
                if on_done:
                    on_done(futures[future], result)
                continue
            result = future.result()
            for source in result["sources"].values():
                board.store_source(source)
            board.append([{k: v for k, v in row.items() if k in columns} for row in result["rows"]])
            done.append(result)
            if on_done:
                on_done(futures[future], result)
        return done
    finally:
        if client is not address:
            client.close()

