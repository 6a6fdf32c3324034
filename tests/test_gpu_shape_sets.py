"""On a GPU: a shape set tuned in one run from the prebuilt kernel set, over every GPU of the
host (`--gpus all`) and over a real Dask cluster whose one worker owns this GPU. Both need
the prebuilt set as a tarball (`cudal2 prebuild --pack FILE`), named by $CUDAL2_PREBUILT:
without it the search would wait minutes on nvcc, which is what the set is for."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cudal2.cli import app
from cudal2.results.leaderboard import BASELINES, Leaderboard

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not os.environ.get("CUDAL2_PREBUILT"), reason="no prebuilt kernel set ($CUDAL2_PREBUILT: a `prebuild --pack` tarball)")]

# Shapes of the kinds a model runs, in no shape file of the project: mid-sized, decode-sized
# nt, and unaligned.
SHAPES = "m,n,k,dtype,layout\n384,1536,768,fp16,nn\n8,3072,2048,bf16,nt\n999,1000,1001,fp16,nn\n"


@pytest.fixture(scope="module")
def prebuilt_cache(tmp_path_factory) -> Path:
    """A fresh compile cache holding only the prebuilt set, unpacked by the CLI."""
    cache = tmp_path_factory.mktemp("prebuilt-cache")
    out = CliRunner(env={"CUDAL2_CACHE_DIR": str(cache)}).invoke(app, [
        "prebuild", "--unpack", os.environ["CUDAL2_PREBUILT"]])
    assert out.exit_code == 0 and "kernel build(s) added" in out.output, out.output
    assert int(out.output.split()[0]) >= 50, out.output  # the H200 set holds 180
    return cache


def tuned_rows(results: Path):
    rows = Leaderboard(results).read()
    return rows[~rows["kernel"].isin(BASELINES)]


def test_a_shape_set_runs_on_every_gpu_from_the_prebuilt_set_without_nvcc(tmp_path, prebuilt_cache):
    """`optimize --shapes F --gpus all`: every shape ends with a verified kernel, measured
    from the prebuilt set alone (its first batch favours what is built: nothing compiled),
    each row names its device, and a re-run measures nothing twice."""
    shapes = tmp_path / "shapes.csv"
    shapes.write_text(SHAPES)
    results = tmp_path / "results"
    runner = CliRunner(env={"CUDAL2_CACHE_DIR": str(prebuilt_cache)})
    args = ["optimize", "--shapes", str(shapes), "--gpus", "all", "--iterations", "1", "--batch", "4",
            "--budget", "0.1", "--results", str(results), "--json"]
    out = runner.invoke(app, args)
    assert out.exit_code == 0, out.output
    summary = json.loads(out.output)
    assert summary["summary"]["tuned"] == 3, summary["summary"]
    for shape in summary["shapes"]:
        assert shape["best"]["status"] == "ok" and shape["best"]["speedup_offline"] > 0, shape
        assert shape["compile_s"] == 0, shape  # every candidate came from the prebuilt set
        assert shape["wall_s"] <= 60, shape
    rows = tuned_rows(results)
    assert set(rows["device"]) <= set(range(16)) and rows["device"].notna().all()
    # A re-run resumes the search: what it measures is new (it compiles beyond the set, so it is bounded).
    again = runner.invoke(app, [*args, "--time-budget", "15"])
    assert again.exit_code == 0, again.output
    kernels = tuned_rows(results)
    assert len(kernels) >= len(rows)
    assert not kernels.duplicated(["m", "n", "k", "dtype", "layout", "source_hash"]).any()  # nothing measured twice


def test_a_shape_is_tuned_on_a_dask_cluster_whose_worker_owns_this_gpu(tmp_path, prebuilt_cache, monkeypatch):
    """`optimize --shapes F --cluster ADDRESS` against a real local Dask cluster of one
    worker process that owns the GPU: the worker tunes on it, the head's leaderboard gets the
    rows with their sources."""
    distributed = pytest.importorskip("distributed")
    monkeypatch.setenv("CUDAL2_CACHE_DIR", str(prebuilt_cache))  # the worker process inherits it
    shapes = tmp_path / "shapes.csv"
    shapes.write_text("m,n,k\n384,1536,768\n")
    results = tmp_path / "results"
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True, resources={"GPU": 1},
                                  dashboard_address=":0") as cluster:
        out = CliRunner().invoke(app, ["optimize", "--shapes", str(shapes), "--cluster", cluster.scheduler_address,
                                       "--iterations", "1", "--batch", "2", "--budget", "0.1",
                                       "--results", str(results)])
    assert out.exit_code == 0, out.output
    assert "1 of 1 shapes tuned on the cluster" in out.output
    rows = tuned_rows(results)
    ok = rows[rows["status"] == "ok"]
    assert len(ok) >= 1 and (ok["speedup_offline"] > 0).all(), rows
    board = Leaderboard(results)
    assert all(board.source(h) for h in ok["source_hash"])  # the kernels' sources came back with the rows
