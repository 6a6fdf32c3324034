"""A shape set over a Dask cluster: every shape tuned once on a worker that owns a GPU, the
rows merged into the head's leaderboard with their sources, and a cluster of unlike GPUs
refused. The cluster is real (a local Dask cluster of two workers, each declaring one GPU);
the tuning task stands in for cudal2's optimize loop, which needs the GPU."""

import threading
import time

import pytest

distributed = pytest.importorskip("distributed")

from cudal2.tune.cluster import check_uniform, optimize_on_cluster  # noqa: E402
from cudal2.config import Settings  # noqa: E402
from cudal2.errors import Cudal2Error  # noqa: E402
from cudal2.results.leaderboard import Leaderboard, source_hash  # noqa: E402
from cudal2.problem import Problem  # noqa: E402

from conftest import gpu_count  # noqa: E402

H200 = {"gpu": "NVIDIA H200", "driver": "580.159.04", "max_sm_clock_mhz": 1980, "host": "node"}


def facts():
    return H200


SEEDS = []


def stand_in_task(problem, options, settings, seed=None):
    """What tune_task returns, for a fake kernel: one row and its source."""
    worker = distributed.get_worker().address
    SEEDS.append(seed.num_rows if seed is not None else 0)
    time.sleep(0.2)  # long enough that both workers take shapes
    if problem["m"] == 13:
        raise RuntimeError("the GPU worker failed")
    source = f"// kernel for {problem}"
    row = {"run_id": "r", "gpu": "NVIDIA H200", "m": problem["m"], "n": problem["n"], "k": problem["k"],
           "dtype": problem["dtype"], "layout": problem["layout"], "kernel": "k", "status": "ok",
           "speedup_offline": 1.0, "source_hash": source_hash(source), "protocol": "cupti-graph-3",
           "proposer": worker, "registers": None}
    return {"rows": [row], "sources": {source_hash(source): source}, "host": worker}


@pytest.fixture(scope="module")
def client():
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False, resources={"GPU": 1},
                                  dashboard_address=":0") as cluster, distributed.Client(cluster) as client:
        yield client


def test_every_shape_is_tuned_once_on_a_gpu_worker_and_merged_at_the_head(client, tmp_path):
    problems = [Problem(m, 256, 256) for m in (64, 128, 256, 512)]
    # the head's verified rows on this GPU go to every task as its priors
    Leaderboard(tmp_path).append([{"run_id": "earlier", "gpu": "NVIDIA H200", "m": 32, "n": 32, "k": 32,
                                   "dtype": "fp16", "layout": "nn", "kernel": "old", "status": "ok",
                                   "template": "sm80_mma", "params": "{}", "speedup_offline": 1.0,
                                   "protocol": "cupti-graph-3"}])
    SEEDS.clear()
    heard = []
    lock = threading.Lock()

    def on_done(problem, result):
        with lock:
            heard.append(problem)

    done = optimize_on_cluster(problems, client, settings=Settings(results=tmp_path), options={"iterations": 1},
                               on_done=on_done, task=stand_in_task, facts=facts)
    assert sorted(p.m for p in heard) == [64, 128, 256, 512] and len(done) == 4
    board = Leaderboard(tmp_path)
    rows = board.read()
    assert sorted(rows["m"]) == [32, 64, 128, 256, 512]  # each once, nothing lost
    assert len(list((tmp_path / "leaderboard").glob("*.parquet"))) == 1 + 4  # one part per shape, as it finished
    assert SEEDS == [1] * 4
    rows = rows[rows["m"] != 32]
    assert len(set(rows["proposer"])) == 2  # both GPU workers took shapes
    for r in rows.to_dict("records"):
        assert board.source(r["source_hash"]).startswith("// kernel for")


def test_a_failed_shape_costs_that_shape_only(client, tmp_path):
    done = optimize_on_cluster([Problem(13, 64, 64), Problem(64, 64, 64)], client, settings=Settings(results=tmp_path),
                               task=stand_in_task, facts=facts)
    assert [d.get("error") is not None for d in sorted(done, key=lambda d: "error" in d)] == [False, True]
    assert list(Leaderboard(tmp_path).read()["m"]) == [64]


def test_unlike_gpus_are_refused_before_anything_runs():
    check_uniform({"tcp://a": H200, "tcp://b": H200})
    with pytest.raises(Cudal2Error, match="differ in model, driver or clock"):
        check_uniform({"tcp://a": H200, "tcp://b": {**H200, "max_sm_clock_mhz": 1755}})
    with pytest.raises(Cudal2Error, match="no workers with a GPU"):
        check_uniform({})


def test_a_cluster_without_gpu_workers_is_refused(tmp_path):
    with distributed.LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as cluster, \
            distributed.Client(cluster) as plain:
        with pytest.raises(Cudal2Error, match="no workers with a GPU"):
            optimize_on_cluster([Problem(64, 64, 64)], plain, settings=Settings(results=tmp_path),
                                task=stand_in_task, facts=facts)


@pytest.mark.skipif(gpu_count() > 0, reason="this machine has a GPU: its workers can see it")
def test_the_cli_refuses_a_cluster_whose_workers_cannot_see_a_gpu(client, tmp_path):
    from typer.testing import CliRunner

    from cudal2.cli import app

    address = client.scheduler.address
    args = ["optimize", "--m", "64", "--n", "64", "--k", "64", "--cluster", address, "--results", str(tmp_path)]
    out = CliRunner().invoke(app, args)  # the real gpu_facts, on workers of a machine without a GPU
    assert out.exit_code == 1 and "cannot describe their GPU" in out.output, out.output
    out = CliRunner().invoke(app, [*args, "--proposer", "llm"])
    assert out.exit_code == 1 and "search proposer" in out.output


def test_a_task_starts_from_the_head_s_rows_and_returns_only_its_own(tmp_path, monkeypatch):
    """tune_task around the optimize loop (stood in: it needs the GPU), on real part files."""
    import cudal2.api
    from cudal2.tune.cluster import tune_task
    from cudal2.results.leaderboard import compact

    head = Leaderboard(tmp_path / "head")
    head.append([{"run_id": "earlier", "gpu": "NVIDIA H200", "m": 32, "n": 32, "k": 32, "dtype": "fp16",
                  "layout": "nn", "kernel": "old", "status": "ok", "template": "sm80_mma", "params": "{}",
                  "speedup_offline": 1.0, "protocol": "cupti-graph-3"}])
    seen = {}

    def optimize(problems, settings, **options):
        board = Leaderboard(settings.results)
        seen["priors"] = list(board.read()["kernel"])  # what the search would start from
        board.store_source("// new")
        board.append([{"run_id": "new", "gpu": "NVIDIA H200", "m": problems[0].m, "n": 64, "k": 64,
                       "dtype": "fp16", "layout": "nn", "kernel": "new", "status": "ok", "protocol": "cupti-graph-3",
                       "source_hash": source_hash("// new")}])

    monkeypatch.setattr(cudal2.api, "optimize", optimize)
    result = tune_task({"m": 64, "n": 64, "k": 64, "dtype": "fp16", "layout": "nn"}, {}, Settings(),
                       compact(head.read()))
    assert seen["priors"] == ["old"]
    assert [r["kernel"] for r in result["rows"]] == ["new"] and list(result["sources"].values()) == ["// new"]


def test_a_cluster_address_that_does_not_answer_is_one_line(tmp_path):
    import socket

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(Cudal2Error, match=f"no Dask scheduler answers at tcp://127.0.0.1:{port} within 2 s"):
        optimize_on_cluster([Problem(64, 64, 64)], f"tcp://127.0.0.1:{port}", settings=Settings(results=tmp_path),
                            connect_s=2.0)
    assert not (tmp_path / "leaderboard").exists()  # nothing written


@pytest.mark.nvcc
@pytest.mark.skipif(gpu_count() > 0, reason="with a GPU, the GPU test tunes on a Dask worker for real")
def test_a_task_on_a_dask_worker_process_starts_the_gpu_workers_processes(tmp_path):
    """Dask runs tasks in daemon processes, which multiprocessing lets start no children;
    the real task starts the GPU worker's anyway (here, with no GPU, they say so)."""
    from cudal2.tune.cluster import tune_task

    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster, \
            distributed.Client(cluster) as client:
        future = client.submit(tune_task, {"m": 64, "n": 64, "k": 64, "dtype": "fp16", "layout": "nn"},
                               {"iterations": 1, "batch": 1}, Settings(results=tmp_path / "head"))
        with pytest.raises(Exception) as caught:
            future.result(timeout=180)
    assert "no usable CUDA device" in str(caught.value), caught.value
