"""The dispatch library: what it picks for a call, what it refuses, and its export."""

import json
import warnings

import pytest

from cudal2.runtime import DispatchEntry, DispatchTable, serving
from cudal2.errors import Cudal2Error

from conftest import ROOT
from test_leaderboard import row

VERSIONS = {"gpu": "NVIDIA H200", "driver": "580.159.04", "cuda": "13.0", "nvcc": "13.0.88", "cutlass": "4.2.0",
            "arch": "sm_90a"}


def entry(m, verified=None, n=4096, k=4096):
    return DispatchEntry(m, n, k, "bf16", "nt", f"kernels/{m}.so", f"kernel-{m}", 1.05, tuple(verified or (m,)))


def test_the_exact_problem_first_then_the_nearest_m_where_verified_else_none():
    table = DispatchTable([entry(16, verified=(1, 16, 32)), entry(4096, verified=(2048, 4096)), entry(512)], VERSIONS)
    assert table.choose(16, 4096, 4096, "bf16", "nt").m == 16  # exact
    assert table.choose(8, 4096, 4096, "bf16", "nt").m == 16  # nearest M, inside 1..32 where it was verified
    assert table.choose(3000, 4096, 4096, "bf16", "nt").m == 4096  # nearest is 4096, verified 2048..4096
    assert table.choose(600, 4096, 4096, "bf16", "nt") is None  # nearest 512 was verified at 512 only
    assert table.choose(16, 4096, 4096, "fp16", "nt") is None  # other dtype
    assert table.choose(16, 4096, 14336, "bf16", "nt") is None  # other K


def test_a_library_of_another_gpu_or_driver_serves_nothing_with_one_warning():
    table = DispatchTable([entry(16)], VERSIONS)
    here = {"gpu": "NVIDIA H200", "driver": "580.159.04", "cuda": "13.0"}
    assert table.mismatch(here) is None
    assert "driver" in table.mismatch({**here, "driver": "590.1"})
    # the caller's own CUDA runtime (torch's 13.0 beside CuPy's 13.2, measured on one H200)
    # does not reach the kernels: still served
    assert table.mismatch({**here, "cuda": "13.2"}) is None
    with pytest.warns(UserWarning, match="built for gpu 'NVIDIA H200'"):
        assert not serving(table, {**here, "gpu": "NVIDIA H100 80GB HBM3"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert serving(table, here)


def test_an_unknown_library_path_is_a_clear_error(tmp_path):
    with pytest.raises(Cudal2Error, match="is not a cudal2 library"):
        DispatchTable.load(tmp_path)
    (tmp_path / "index.json").write_text("{not json")
    with pytest.raises(Cudal2Error, match="not a readable cudal2 library index"):
        DispatchTable.load(tmp_path)


@pytest.mark.nvcc
def test_export_writes_the_best_kernels_and_a_table_that_loads(tmp_path, cache_dir):
    from typer.testing import CliRunner

    from cudal2.cli import app
    from cudal2.results.leaderboard import Leaderboard

    board = Leaderboard(tmp_path / "results")
    source = (ROOT / "examples" / "simt_gemm_fp16_nn.cu").read_text()
    digest = board.store_source(source)
    facts = {**{k: VERSIONS[k] for k in ("driver", "cuda", "arch")}, "source_hash": digest, "n": 4096, "k": 4096}
    board.append([row("simt", 1.06, m=64, **facts), row("simt", 1.04, m=128, **facts),
                  row("simt", 1.01, m=96, **facts),  # a tie with the library call there: no win
                  row("other-gpu", 1.5, m=64, **{**facts, "gpu": "NVIDIA A100-SXM4-80GB"})])
    out = tmp_path / "lib"
    result = CliRunner(env={"CUDAL2_CACHE_DIR": str(cache_dir)}).invoke(
        app, ["export", "--library", str(out), "--gpu", "h200", "--results", str(tmp_path / "results"), "--json"])
    assert result.exit_code == 0, result.output
    table = DispatchTable.load(out)
    assert table.versions["gpu"] == "NVIDIA H200" and len(table.entries) == 2
    chosen = table.choose(100, 4096, 4096, "fp16", "nn")  # between the tuned Ms, all verified 64..128
    assert chosen.m == 128 and chosen.verified_m == (64, 96, 128) and (out / chosen.library).is_file()
    # M=96 only tied the library call: neither its own kernel nor a neighbour's serves it
    assert table.choose(96, 4096, 4096, "fp16", "nn") is None
    assert DispatchTable.load(out).choose(96, 4096, 4096, "fp16", "nn") is None
    assert json.loads(result.output)["library_call"] == [[96, 4096, 4096, "fp16", "nn"]]
    lower = CliRunner(env={"CUDAL2_CACHE_DIR": str(cache_dir)}).invoke(
        app, ["export", "--library", str(tmp_path / "all"), "--gpu", "h200", "--results", str(tmp_path / "results"),
              "--min-speedup", "0.9"])
    assert lower.exit_code == 0, lower.output
    assert DispatchTable.load(tmp_path / "all").choose(96, 4096, 4096, "fp16", "nn").m == 96
    assert json.loads(result.output)["versions"]["driver"] == "580.159.04"
    both = CliRunner(env={"CUDAL2_CACHE_DIR": str(cache_dir)}).invoke(
        app, ["export", "--library", str(out), "--results", str(tmp_path / "results")])
    assert both.exit_code == 1 and "choose one with --gpu" in both.output
