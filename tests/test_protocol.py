"""The one rule for "best" (cudal2/protocol.py), as every command sees it."""

from datetime import datetime, timedelta, timezone

import numpy as np
import pandas as pd
import pytest

from cudal2.protocol import BASELINES, COLUMNS, PROTOCOL, SCHEMA, Row, best, best_row, kernel_identity, row_record

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def row(kernel, speedup, minutes, **extra):
    return {"run_id": "r", "time": T0 + timedelta(minutes=minutes), "gpu": "NVIDIA H200", "m": 128, "n": 64,
            "k": 64, "dtype": "fp16", "layout": "nn", "kernel": kernel, "status": "ok", "speedup_offline": speedup,
            "protocol": PROTOCOL, **extra}


def shipped_row(params, speedup, minutes):
    """As the shipped measurements store a row: a template's kernel, no source."""
    return row(f"sm80_mma({params})", speedup, minutes, template="sm80_mma", params=params, source_hash=None)


def results_row(name, speedup, minutes):
    """As a results directory stores a free-form kernel's row: its source by hash."""
    return row(name, speedup, minutes, source_hash=f"hash-of-{name}")


def frame(rows):
    return pd.DataFrame([{c: r.get(c) for c in COLUMNS} for r in rows])


def test_the_schema_is_the_row_record_s():
    assert COLUMNS == [f for f in Row.__dataclass_fields__] and "protocol" in COLUMNS and "bench" not in COLUMNS
    assert str(SCHEMA.field("time").type) == "timestamp[us, tz=UTC]" and str(SCHEMA.field("m").type) == "int64"
    with pytest.raises(ValueError, match="unknown leaderboard columns: \\['speed'\\]"):
        row_record({"kernel": "k", "speed": 1.0})


def test_kernel_identity_is_never_empty():
    ids = kernel_identity(frame([shipped_row("a=1", 1.0, 0), shipped_row("a=2", 1.0, 0),
                                 results_row("x", 1.0, 0), row("named", 1.0, 0, source_hash="")]))
    assert list(ids) == ["template sm80_mma a=1", "template sm80_mma a=2", "source hash-of-x", "kernel named"]


def test_shipped_rows_rank_by_each_kernel_s_latest_measurement_not_the_latest_row():
    """Shipped rows have no source: every configuration is its own kernel, so the best of
    the problem is the fastest configuration, not whichever was measured last."""
    rows = [shipped_row("a=1", 1.136, 0), shipped_row("a=2", 0.448, 5), shipped_row("a=1", 1.10, 1)]
    [winner] = best(frame(rows)).to_dict("records")
    assert (winner["params"], winner["speedup_offline"]) == ("a=1", 1.10)  # its latest measurement counts
    assert list(best(frame(rows), top=2)["speedup_offline"]) == [1.10, 0.448]


def test_shipped_rows_and_results_rows_rank_together():
    rows = [shipped_row("a=1", 1.05, 0), results_row("free", 1.2, 1), results_row("free", 0.9, 2),
            results_row("other", 1.01, 3), row("cuBLAS", 9.0, 4), row("wrong", 3.0, 5, status="wrong"),
            row("elsewhere", 2.0, 6, protocol="fenced")]
    ranked = best(frame(rows), top=3)
    mine = ranked[ranked["protocol"] == PROTOCOL]
    # `free` counts by its latest (0.9): a re-measurement replaces what it re-measures
    assert list(mine["kernel"]) == ["sm80_mma(a=1)", "other", "free"]
    assert list(ranked[ranked["protocol"] == "fenced"]["kernel"]) == ["elsewhere"]  # never ranked with it


def test_a_tuning_run_picks_by_the_same_rule():
    """optimize's best (best_row, over a run's history as dicts in the order measured: its
    own rows not yet written, so without a time) is the leaderboard's."""
    history = [shipped_row("a=1", 1.3, 0), results_row("free", 1.2, 1)]
    run = [{k: v for k, v in results_row("new", 1.25, 0).items() if k != "time"},
           {k: v for k, v in shipped_row("a=1", 1.1, 0).items() if k != "time"}]  # measured again: 1.1 counts
    assert best_row(history + run)["kernel"] == "new"
    assert best(frame(history + [{**r, "time": T0 + timedelta(days=1)} for r in run]))["kernel"].iloc[0] == "new"
    assert best_row([row("cuBLAS", 2.0, 0), row("x", float("nan"), 0)]) is None
    server = [results_row("a", 1.0, 0) | {"speedup_server": 1.5}, results_row("b", 1.2, 0) | {"speedup_server": 1.1}]
    assert best_row(server, "server")["kernel"] == "a" and best_row(server)["kernel"] == "b"


def test_the_shipped_measurements_give_their_best_kernels():
    """The shipped file (no sources) read whole: every problem's best is its fastest
    configuration by its latest measurement; the geomean is that of the best rows (0.93),
    not of each problem's latest row (0.63)."""
    from cudal2.results.leaderboard import shipped

    rows = shipped()
    winners = best(rows)
    assert len(winners) == len(rows.groupby(["gpu", "m", "n", "k", "dtype", "layout"]))
    assert float(np.exp(np.log(winners["speedup_offline"]).mean())) > 0.9
    small = winners[(winners["m"] == 128) & (winners["n"] == 64) & (winners["k"] == 64)]
    assert small["speedup_offline"].iloc[0] > 1.05
    assert not set(winners["kernel"]) & set(BASELINES)
