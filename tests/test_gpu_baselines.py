"""On a GPU: a problem's baselines (cuBLAS, cuBLASLt autotuned, torch.matmul) take at most
2 s, the first time (the autotuning and its finalists) and with the choice kept on this
machine. Run with `pytest -m gpu -s` to see the times."""

from __future__ import annotations

import json
import time

import pytest

from cudal2.config import Settings
from cudal2.measure.baselines import PICKS, build_baselines
from cudal2.measure.worker import Worker
from cudal2.problem import Problem
from cudal2.results.leaderboard import Leaderboard
from cudal2.tune.pipeline import Context, measure_baselines

pytestmark = pytest.mark.gpu

# one per regime: few tiles and long K, short K, decode, large (a 1.4 ms call), unaligned
SHAPES = [(64, 64, 16384), (4096, 4096, 128), (16, 4096, 4096), (8192, 8192, 8192), (4097, 4095, 4093)]
LIMIT_S = 2.0


@pytest.fixture(scope="module")
def worker(compiler):
    with Worker() as gpu:
        gpu.start()
        yield gpu


def timed_baselines(tmp_path, worker, compiler, problem: Problem) -> tuple[float, dict]:
    settings = Settings(results=tmp_path / "results", cache_dir=tmp_path / "cache")  # the default budget
    ctx = Context(problem, settings, worker, compiler, Leaderboard(settings.results), "baselines",
                  libraries=build_baselines(compiler, problem))  # built (cached) before the clock starts
    start = time.perf_counter()
    rows = measure_baselines(ctx)
    seconds = time.perf_counter() - start
    assert {row["status"] for row in rows} == {"ok"}, rows
    return seconds, json.loads(rows[0]["cublaslt_algo"])


def test_the_baselines_take_at_most_2_s_per_shape_first_and_with_the_kept_choice(tmp_path, worker, compiler):
    timed_baselines(tmp_path / "warm", worker, compiler, Problem(256, 256, 256))  # both processes, torch, handles
    report = {}
    for shape in SHAPES:
        problem = Problem(*shape)
        first, autotuned = timed_baselines(tmp_path, worker, compiler, problem)
        again, kept = timed_baselines(tmp_path, worker, compiler, problem)  # a new run: the kept choice
        report[shape] = (round(first, 2), round(again, 2), autotuned["of"], autotuned["offered"])
        print(f"baselines {problem}: {first:.2f} s first (autotuned {autotuned['of']} of "
              f"{autotuned['offered']} algorithms), {again:.2f} s with the kept choice")
        assert kept == autotuned  # not autotuned again
    assert json.loads((tmp_path / "cache" / PICKS).read_text())["entries"]
    assert all(first <= LIMIT_S and again <= LIMIT_S for first, again, _, _ in report.values()), report


@pytest.mark.xfail(strict=True, reason="the grid's longest call (16384^3, about 12 ms) took 2.46 s first and "
                   "2.01 s with the kept choice on the H200 with 3 rounds a process (baselines.SESSION_MIN_ROUNDS): "
                   "the sessions' opening and soak are not yet bounded for such calls")
def test_the_baselines_of_the_grids_longest_call_take_at_most_2_s(tmp_path, worker, compiler):
    problem = Problem(16384, 16384, 16384)
    first, autotuned = timed_baselines(tmp_path, worker, compiler, problem)
    again, kept = timed_baselines(tmp_path, worker, compiler, problem)
    print(f"baselines {problem}: {first:.2f} s first (autotuned {autotuned['of']} of {autotuned['offered']} "
          f"algorithms), {again:.2f} s with the kept choice")
    assert kept == autotuned and first <= LIMIT_S and again <= LIMIT_S, (first, again)
