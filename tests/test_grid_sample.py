"""scripts/grid_sample.py: the fresh random grid shapes a tuning-speed run is judged on, and
its report of what the run did per shape and over the set."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("grid_sample", ROOT / "scripts" / "grid_sample.py")
grid_sample = importlib.util.module_from_spec(spec)
spec.loader.exec_module(grid_sample)


def test_a_draw_is_fresh_grid_shapes_the_same_for_the_same_seed():
    shapes = grid_sample.draw(10, seed=7, results=None)
    seen = grid_sample.measured_before(None)
    assert len(seen) > 100  # the shipped measurements and the test shape sets
    keys = [(p.m, p.n, p.k, p.dtype, p.layout) for p in shapes]
    assert len(set(keys)) == 10 and not set(keys) & seen
    assert all(v in grid_sample.GRID for p in shapes for v in (p.m, p.n, p.k))
    assert grid_sample.draw(10, seed=7, results=None) == shapes
    assert grid_sample.draw(10, seed=8, results=None) != shapes
    # with the midpoints between the grid's values: the same rules, a pool that shipped samples
    # do not use up (the grid's own fresh shapes are fewer than a 100-shape sample's)
    wide = grid_sample.draw(100, seed=7, results=None, midpoints=True)
    keys = [(p.m, p.n, p.k, p.dtype, p.layout) for p in wide]
    assert len(set(keys)) == 100 and not set(keys) & seen
    assert all(v in grid_sample.REGIME_VALUES for p in wide for v in (p.m, p.n, p.k))
    assert any(v not in grid_sample.GRID for p in wide for v in (p.m, p.n, p.k))
    assert grid_sample.draw(100, seed=7, results=None, midpoints=True) == wide
    for name in ("few-tile long-K", "short-K"):  # a regime's fresh set: the 30 shapes fit
        drawn = grid_sample.draw(30, seed=7, results=None, within=name)
        assert len(drawn) == 30 and {grid_sample.regime(p) for p in drawn} == {name}
        assert not {(p.m, p.n, p.k, p.dtype, p.layout) for p in drawn} & seen
        assert all(v in grid_sample.REGIME_VALUES for p in drawn for v in (p.m, p.n, p.k))
        assert grid_sample.draw(30, seed=7, results=None, within=name) == drawn


def test_a_draw_leaves_out_the_problems_of_every_results_directory_given(tmp_path):
    from cudal2.results.leaderboard import Leaderboard

    first = grid_sample.draw(5, seed=7, results=None, midpoints=True)
    for i, p in enumerate(first[:2]):  # two earlier samples, one shape each
        Leaderboard(tmp_path / f"sample-{i}").append([{"run_id": "r", "m": p.m, "n": p.n, "k": p.k, "dtype": p.dtype,
                                                       "layout": p.layout, "kernel": "cuBLAS", "status": "ok"}])
    both = [tmp_path / "sample-0", tmp_path / "sample-1"]
    key = lambda p: (p.m, p.n, p.k, p.dtype, p.layout)  # noqa: E731
    assert grid_sample.measured_before(both) >= {key(p) for p in first[:2]}
    assert key(first[1]) not in grid_sample.measured_before(both[0])  # one alone leaves the other's in
    for seed in range(7, 27):
        again = grid_sample.draw(60, seed=seed, results=both, midpoints=True)
        assert first[0] not in again and first[1] not in again


def test_asking_for_more_fresh_grid_shapes_than_are_left_says_so_and_names_the_wider_draw():
    # (the test shape sets alone hold grid shapes: fewer than the grid's 1,000 are ever fresh)
    with pytest.raises(SystemExit, match=r"were never measured; asked for 1000 \(--midpoints"):
        grid_sample.draw(1000, seed=7, results=None)


def test_the_report_gives_the_screened_distribution_and_the_shapes_left_without_a_kernel():
    def shape(m, n, k, screened, wall, best, call_us, baselines_s, floor_us=1.0):
        return {"problem": {"m": m, "n": n, "k": k, "dtype": "fp16", "layout": "nn"}, "screened": screened,
                "statuses": {"screened": screened, "ok": 2}, "first_verified_s": 1.5, "wall_s": wall,
                "best": {"speedup_offline": best, "floor_us": floor_us} if best else None, "baseline_us": call_us,
                "baselines_s": baselines_s}

    run = {"shapes": [shape(4096, 4096, 64, 70, 6.0, 1.2, 12.0, 17.0, floor_us=11.7),
                      shape(64, 64, 16384, 10, 5.0, 0.9, 6.5, 0.8),
                      shape(2048, 2048, 2048, 0, 4.0, None, 23.0, 2.5)]}
    text = grid_sample.report(run)
    assert "| 4096x4096x64 fp16 nn | short-K | 70 | 2 | 1.5 | 6.0 | 1.200 |" in text
    assert "3 shapes in 0.2 min" in text and "1 ended without a measured kernel" in text
    assert "mean 5.0 s a shape: 1.39 h for the 1,000-shape grid" in text
    assert "screened per shape: min 0, median 10, max 70; 1 of 3 reached 64" in text
    # and by the fastest library call (a kernel's verification costs calls of that length)
    assert "library call 0-10 us: 1 shapes, screened min 10, median 10, max 10; 0 reached 64" in text
    assert "library call 10-100 us: 2 shapes, screened min 0, median 35, max 70; 1 reached 64" in text
    assert "library call 100-" not in text
    assert "geomean 1.039" in text and "1 wins, 0 ties, 1 losses" in text
    # where the library is within 3% of the floor (12.0 us against 11.7) no kernel could win
    assert "the library within 3% of the floor (no win possible) at 1" in text
    assert "short-K: 1 shapes, geomean 1.200, the library at the floor at 1" in text
    assert "few-tile long-K: 1 shapes, geomean 0.900, the library at the floor at 0" in text
    # baselines at most 2 s a shape: the first shape's start of the workers told apart
    assert "baselines per shape: median 1.65 s, max 2.50 s, 1 over 2 s (after the first shape, whose 17.0 s" in text


def test_a_sample_run_in_parts_reports_as_one(tmp_path, capsys):
    """A 100-shape run split over two device calls: `report a.json b.json` is the report of
    the whole sample (one table, one summary)."""
    import json

    def part(path, *ms):
        path.write_text(json.dumps({"shapes": [
            {"problem": {"m": m, "n": 64, "k": 4096, "dtype": "fp16", "layout": "nn"}, "screened": 64,
             "statuses": {"screened": 64, "ok": 1}, "first_verified_s": 1.0, "wall_s": 6.0,
             "best": {"speedup_offline": 1.1}} for m in ms]}))
        return str(path)

    grid_sample.main(["report", part(tmp_path / "a.json", 64, 128), part(tmp_path / "b.json", 256)])
    text = capsys.readouterr().out
    assert "3 shapes in 0.3 min" in text and "| 256x64x4096 fp16 nn |" in text
    assert "3 wins, 0 ties, 0 losses" in text


def test_compare_gives_the_short_budgets_share_of_the_long_ones_best():
    def run(*bests):
        return {"shapes": [{"problem": {"m": m, "n": 64, "k": 4096, "dtype": "fp16", "layout": "nn"},
                            "best": {"speedup_offline": b} if b else None} for m, b in zip((64, 128, 256), bests)]}

    text = grid_sample.compare(run(1.0, 0.9, None), run(1.0, 1.0, 1.1))
    assert "| 128x64x4096 fp16 nn | 0.900 | 1.000 | 0.900 |" in text and "| 256x64x4096 fp16 nn | - | 1.100 | - |" in text
    assert "2 of 3 shapes measured by both" in text and "0.949 of the long run's best" in text
    assert "1 within 2%, worst 0.900" in text
    with pytest.raises(SystemExit, match="different shapes"):
        grid_sample.compare(run(1.0), run(1.0, 1.0))
    # a long run over some of the short run's shapes (20 of its 100): those shapes alone
    text = grid_sample.compare(run(1.0, 0.9, 1.2), run(1.0, 1.0))
    assert "2 of 2 shapes measured by both" in text and "256x64x4096" not in text


def test_taken_writes_the_first_shapes_a_run_tuned_as_a_shape_set(tmp_path, capsys):
    """What a long budget tunes again (budget-compare with SHORT_JSON): a shape-set CSV that
    read_shapes reads back as the run's first COUNT problems."""
    from cudal2.shapes import read_shapes

    shapes = [{"problem": {"m": m, "n": 64, "k": 4096, "dtype": "bf16", "layout": "nt"}} for m in (64, 128, 256)]
    (tmp_path / "run.json").write_text(json.dumps({"shapes": shapes}))
    grid_sample.main(["taken", str(tmp_path / "run.json"), "--count", "2"])
    (tmp_path / "some.csv").write_text(capsys.readouterr().out)
    assert [(p.m, p.dtype, p.layout) for p in read_shapes(tmp_path / "some.csv")] == [(64, "bf16", "nt"), (128, "bf16", "nt")]
