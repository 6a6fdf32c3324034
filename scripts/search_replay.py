"""Replay searches against an exhaustive measurement: how many kernels each search measures
before it holds one within 2% of the best of the grid, with the recorded times standing in
for the GPU. Compares the built-in search proposer (as `cudal2 optimize` runs it: batches
of 8, patience 3) with optuna's TPE sampler and uniform random sampling over the same
configurations, ten seeds each.

    python scripts/search_replay.py RESULTS_DIR M N K [DTYPE LAYOUT]

RESULTS_DIR holds a leaderboard with a whole grid measured for that problem in one run (for
example by `scripts/gpu_session.sh search-vs-exhaustive`); the run that measured the most
configurations of the problem is replayed, with its offline times. optuna is optional.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import sys
from pathlib import Path

import pandas as pd

from cudal2.candidate import Candidate
from cudal2.cost import recorded_device
from cudal2.leaderboard import Leaderboard
from cudal2.problem import Problem
from cudal2.propose import SearchProposer
from cudal2.render import load_templates, recorded_params

WITHIN = 0.98  # of the best speedup: "within 2%"
BATCH, PATIENCE = 8, 3


def measured_grid(df: pd.DataFrame, problem: Problem) -> tuple[dict[tuple[str, str], float], str | None]:
    """(template, params JSON) -> offline microseconds, from the run that measured most
    configurations of the problem; and that run's GPU."""
    rows = df[(df["status"] == "ok") & (df["m"] == problem.m) & (df["n"] == problem.n) & (df["k"] == problem.k)
              & (df["dtype"] == problem.dtype) & (df["layout"] == problem.layout) & df["template"].notna()]
    if rows.empty:
        return {}, None
    rows = rows[rows["run_id"] == rows["run_id"].value_counts().idxmax()]
    templates = load_templates()
    times: dict[tuple[str, str], float] = {}
    for row in rows.to_dict("records"):
        if (params := recorded_params(row, templates)) is not None:
            key = (row["template"], Candidate.from_template(row["template"], params).params_json)
            times[key] = min(times.get(key, math.inf), float(row["offline_us"]))
    return times, rows["gpu"].iloc[0]


def replay_search(problem: Problem, times: dict, device: dict, seed: int) -> tuple[int | None, int]:
    """(kernels measured when within 2% first held, or None; kernels measured in all)."""
    grid = [Candidate.from_template(name, json.loads(text)) for name, text in times]
    search = SearchProposer(device, seed=seed, within=grid)
    best_possible, best, history, stale, reached = min(times.values()), math.inf, [], 0, None
    while stale < PATIENCE:
        picks = search.propose(problem, history, BATCH)
        if not picks:
            break
        before = best
        for cand in picks:
            us = times[(cand.template, cand.params_json)]
            history.append({"status": "ok", "template": cand.template, "params": cand.params_json,
                            "offline_us": us, "kernel": str(cand)})
            best = min(best, us)
            if reached is None and best_possible / best >= WITHIN:
                reached = len(history)
        stale = 0 if best < before else stale + 1
    return reached, len(history)


def replay_sampler(times: dict, seed: int, sampler: str) -> int:
    """Kernels measured until within 2% by optuna's TPE or uniform random sampling, over the
    grid's parameters as categorical choices; combinations outside the grid (invalid ones)
    cost nothing and count as failed trials."""
    best_possible = min(times.values())
    keys = list(times)
    if sampler == "random":
        order = random.Random(seed).sample(keys, len(keys))
        return next(i + 1 for i, key in enumerate(order) if best_possible / times[key] >= WITHIN)
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    (template,) = {name for name, _ in keys}
    choices: dict[str, list] = {}
    for _, text in keys:
        for name, value in json.loads(text).items():
            if value not in choices.setdefault(name, []):
                choices[name].append(value)
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=seed))
    measured: set[str] = set()
    best = math.inf
    for _ in range(5000):
        trial = study.ask()
        params = {name: trial.suggest_categorical(name, values) for name, values in choices.items()}
        text = Candidate.from_template(template, params).params_json
        if text not in {t for _, t in keys}:
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
            continue
        us = times[(template, text)]
        if text not in measured:
            measured.add(text)
            best = min(best, us)
            if best_possible / best >= WITHIN:
                return len(measured)
        study.tell(trial, us)
    return len(measured)


def main() -> None:
    results, m, n, k = Path(sys.argv[1]), *map(int, sys.argv[2:5])
    problem = Problem(m, n, k, *(sys.argv[5:7] or ["fp16", "nn"]))
    df = Leaderboard(results).read(bench=None)
    times, gpu = measured_grid(df, problem)
    if not times:
        sys.exit(f"no measured configurations of {problem} in {results}")
    device = recorded_device(df, gpu)
    print(f"{problem}: {len(times)} configurations, best {min(times.values()):.3f} us")
    seeds = range(10)
    searched = [replay_search(problem, times, device, s) for s in seeds]
    reached = [r for r, _ in searched]
    print(f"  search (batch {BATCH}, patience {PATIENCE}): within 2% after {reached} kernels; "
          f"stopped after {[total for _, total in searched]}")
    for sampler in ("random", "tpe"):
        try:
            counts = [replay_sampler(times, s, sampler) for s in seeds]
        except ImportError:
            print("  tpe: optuna is not installed")
            continue
        print(f"  {sampler}: within 2% after {counts} kernels (median {statistics.median(counts)})")


if __name__ == "__main__":
    main()
