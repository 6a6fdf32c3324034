"""scripts/performance_page.py: docs/performance.md is the page the shipped measurements give,
and its counts say where a kernel can still win."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from cudal2.protocol import BASELINES, PROTOCOL, TIE
from cudal2.results.leaderboard import shipped
from cudal2.results.roofline import floor_us, roof
from cudal2.search.cost import recorded_device

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("performance_page", ROOT / "scripts" / "performance_page.py")
performance_page = importlib.util.module_from_spec(spec)
spec.loader.exec_module(performance_page)


def test_the_committed_page_is_the_one_the_shipped_measurements_give():
    page = performance_page.page(shipped(PROTOCOL), "cudal2/data/measurements.parquet")
    assert (ROOT / "docs" / "performance.md").read_text() == page, "run python scripts/performance_page.py"


def test_each_gpu_has_its_section_whose_summary_counts_its_problems_and_those_at_the_floor():
    """Measurements of several GPUs ship together (the H200's and the H100's): each GPU's
    section counts its own problems, and the library at the floor by that GPU's roof."""
    rows = performance_page.measured(shipped(PROTOCOL))
    on = performance_page.gpus(rows)
    assert on[0] == "NVIDIA H200" and "NVIDIA H100 80GB HBM3" in on
    text = performance_page.page(shipped(PROTOCOL), "shipped")
    assert [line[3:] for line in text.splitlines() if line.startswith("## ")] == on
    for gpu in on:
        mine = rows[rows["gpu"] == gpu]
        at = roof(recorded_device(rows, gpu))
        # at the floor: the fastest library call within the tie band of the floor, by hand
        by_hand = sum(r.baseline_offline_us <= floor_us(performance_page.Problem(int(r.m), int(r.n), int(r.k), r.dtype, r.layout),
                                                        at) * (1 + TIE) for r in mine.itertuples())
        assert 0 < by_hand < len(mine), gpu
        last = performance_page.summary(mine)[-1].split("|")
        assert last[1].strip() == "all" and int(last[2]) == len(mine) and int(last[-3]) == by_hand
        # wins, ties and losses split the problems
        assert sum(int(last[i]) for i in (4, 5, 6)) == len(mine)
    # the H100's floor is priced by its own (lower) bandwidth: the same problem's floor is longer there
    h100 = roof(recorded_device(rows, "NVIDIA H100 80GB HBM3"))
    assert floor_us(performance_page.Problem(1, 4096, 4096), h100) > floor_us(performance_page.Problem(1, 4096, 4096),
                                                                              roof({"gpu": "NVIDIA H200"}))


def test_each_shape_says_how_many_kernels_were_measured_on_it():
    """A problem tuned for a few seconds holds one or two verified kernels, one studied in depth
    dozens: each row counts its problem's distinct verified kernels (a kernel measured twice
    counts once; baselines and failed kernels not at all), and the summary gives their median."""
    df = shipped(PROTOCOL)
    rows = performance_page.measured(df)
    ok = df[(df["status"] == "ok") & ~df["kernel"].isin(BASELINES)]
    for r in rows.sample(20, random_state=3).itertuples():
        mine = ok[(ok.gpu == r.gpu) & (ok.m == r.m) & (ok.n == r.n) & (ok.k == r.k) & (ok.dtype == r.dtype) & (ok.layout == r.layout)]
        assert r.kernels == len(set(zip(mine.template, mine.params))) >= 1, (r.m, r.n, r.k)
    assert rows["kernels"].max() > 10 and rows["kernels"].min() == 1
    last = performance_page.summary(rows)[-1].split("|")
    assert float(last[-2]) == rows["kernels"].median()
