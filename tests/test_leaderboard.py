import os

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cudal2_cli.errors import Cudal2Error
from cudal2_cli.leaderboard import Leaderboard, best


def row(kernel, speedup, status="ok", m=4096, source_hash=None, **extra):
    return {"run_id": "r1", "gpu": "NVIDIA H200", "m": m, "n": 4096, "k": 4096, "dtype": "fp16",
            "layout": "nn", "kernel": kernel, "status": status, "speedup_offline": speedup,
            "offline_us": 180.0 / speedup if speedup else None, "source_hash": source_hash or kernel, **extra}


def test_parts_are_plain_parquet_readable_by_pandas(tmp_path):
    lb = Leaderboard(tmp_path)
    lb.append([row("a", 0.9), row("b", 1.1)])
    lb.append([row("c", 0.5, status="wrong", error="max error")])
    direct = pd.read_parquet(tmp_path / "leaderboard")
    assert sorted(direct["kernel"]) == ["a", "b", "c"]
    assert list(lb.read().sort_values("kernel")["status"]) == ["ok", "ok", "wrong"]
    assert not list((tmp_path / "leaderboard").glob(".*"))  # no temporary files left


def test_corrupt_and_foreign_files_are_skipped_with_a_warning(tmp_path):
    lb = Leaderboard(tmp_path)
    lb.append([row("a", 0.9)])
    (tmp_path / "leaderboard" / "part-broken.parquet").write_bytes(b"PAR1 not really")
    pq.write_table(pa.table({"x": [1, 2]}), tmp_path / "leaderboard" / "foreign.parquet")
    with pytest.warns(UserWarning) as caught:
        df = lb.read()
    assert list(df["kernel"]) == ["a"]
    messages = " ".join(str(w.message) for w in caught)
    assert "part-broken.parquet" in messages and "foreign.parquet" in messages


def test_unknown_columns_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown leaderboard columns"):
        Leaderboard(tmp_path).append([{"kernel": "a", "speed": 3}])


def test_unreadable_leaderboard_is_a_clear_error(tmp_path):
    (tmp_path / "leaderboard").write_text("a file where the directory should be")
    with pytest.raises(Cudal2Error, match="is not a directory"):
        Leaderboard(tmp_path).read()


def test_best_picks_the_fastest_verified_kernel_per_problem(tmp_path):
    lb = Leaderboard(tmp_path)
    lb.append([row("slow", 0.8), row("fast", 1.2), row("cheat", 9.0, status="cheat"),
               row("cuBLAS", 1.0), row("other-shape", 0.7, m=64), row("fast-again", 1.1, source_hash="fast")])
    top = best(lb.read())
    assert list(top.sort_values("m")["kernel"]) == ["other-shape", "fast"]
    assert list(best(lb.read(), top=2).query("m == 4096")["kernel"]) == ["fast", "slow"]


def test_sources_are_stored_by_content_hash(tmp_path):
    lb = Leaderboard(tmp_path)
    digest = lb.store_source("__global__ void k() {}")
    assert lb.store_source("__global__ void k() {}") == digest
    assert lb.source(digest) == "__global__ void k() {}"
    assert os.listdir(tmp_path / "sources") == [f"{digest}.cu"]


def test_reference_check_reports_both_cublas_references(tmp_path):
    """scripts/reference_check.py: the best kernel per shape against cuBLAS timed beside it
    (the recorded speedup) and against the baselines job's cuBLAS of the same run."""
    import subprocess
    import sys

    from conftest import ROOT

    lb = Leaderboard(tmp_path / "results")
    # cuBLAS 10 us in the baselines job, 11 us beside the kernel (10.5 us): 1.048x recorded, 0.952x apart.
    lb.append([row("cuBLAS", 1.0, offline_us=10.0, template=None),
               row("k", 11.0 / 10.5, offline_us=10.5, cublas_offline_us=11.0, template="sm90_cutlass")])
    shapes = tmp_path / "shapes.csv"
    shapes.write_text("m,n,k,dtype,layout,group\n4096,4096,4096,fp16,nn,square\n")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "reference_check.py"), str(shapes),
                          str(tmp_path / "results")], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    assert "4096x4096x4096 fp16 nn: beside the kernel 1.048, baselines job 0.952" in out
    assert "1 rows: geometric mean 1.048 (minimum 1.048)" in out and "0.952 (minimum 0.952)" in out


def test_parts_from_before_the_bench_column_read_as_back_to_back(tmp_path):
    """Offline times taken before the fence (cudal2_cli/bench.py) stay marked as such: their
    speedups are not comparable with fenced ones for kernels that launch early."""
    lb = Leaderboard(tmp_path)
    lb.append([row("new", 1.0, bench="fenced")])
    old = lb.append([row("old", 0.9)])
    pq.write_table(pq.read_table(old).drop_columns(["bench"]), old)  # as parts were written before
    assert "bench" not in pq.read_table(old).column_names
    df = lb.read().set_index("kernel")
    assert df.loc["new", "bench"] == "fenced" and df.loc["old", "bench"] == "back-to-back"
