import os

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cudal2.protocol import PROTOCOL
from cudal2.errors import Cudal2Error
from cudal2.results.leaderboard import COLUMNS, SCHEMA, Leaderboard, best


def row(kernel, speedup, status="ok", m=4096, source_hash=None, **extra):
    return {"run_id": "r1", "gpu": "NVIDIA H200", "m": m, "n": 4096, "k": 4096, "dtype": "fp16",
            "layout": "nn", "kernel": kernel, "status": status, "speedup_offline": speedup,
            "offline_us": 180.0 / speedup if speedup else None, "baseline_offline_us": 180.0,
            "baseline": "cuBLASLt", "source_hash": source_hash or kernel, "protocol": PROTOCOL, **extra}


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


def test_each_part_is_read_once_and_new_or_removed_parts_are_seen(tmp_path, monkeypatch):
    """A shape set reads the leaderboard at every shape: the parts already read are not
    read again, what another writer adds is, and a migration's removals are gone."""
    import importlib

    module = importlib.import_module("cudal2.results.leaderboard")

    reads = []
    real = module._read_part
    monkeypatch.setattr(module, "_read_part", lambda path: reads.append(path.name) or real(path))
    lb = Leaderboard(tmp_path)
    lb.append([row("a", 1.1)])
    lb.append([row("b", 1.2)])
    assert len(lb.read()) == 2 and len(reads) == 2
    assert len(lb.read()) == 2 and len(reads) == 2  # nothing read again
    Leaderboard(tmp_path).append([row("c", 1.3)])  # another writer
    assert sorted(lb.read()["kernel"]) == ["a", "b", "c"] and len(reads) == 3  # only the new part read
    assert lb.migrate() == (3, 3)
    assert sorted(lb.read()["kernel"]) == ["a", "b", "c"] and len(list(lb.parts.glob("*.parquet"))) == 1


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
               row("cuBLAS", 1.0), row("other-shape", 0.7, m=64)])
    top = best(lb.read())
    assert list(top.sort_values("m")["kernel"]) == ["other-shape", "fast"]
    assert list(best(lb.read(), top=2).query("m == 4096")["kernel"]) == ["fast", "slow"]


def test_a_kernel_measured_again_counts_by_its_latest_measurement_not_its_luckiest(tmp_path):
    from datetime import datetime, timedelta, timezone

    first = datetime(2026, 12, 1, tzinfo=timezone.utc)
    lb = Leaderboard(tmp_path)
    lb.append([row("lucky", 1.20, time=first + timedelta(hours=1)), row("steady", 1.05, time=first)])
    lb.append([row("lucky-rechecked", 1.01, source_hash="lucky", time=first + timedelta(hours=2))])
    lb.append([row("old-lucky", 1.30, source_hash="lucky", time=first)])  # written last, measured first
    top = best(lb.read(), top=2)
    assert list(top["kernel"]) == ["steady", "lucky-rechecked"]
    assert list(top["speedup_offline"]) == [1.05, 1.01]


def test_sources_are_stored_by_content_hash(tmp_path):
    lb = Leaderboard(tmp_path)
    digest = lb.store_source("__global__ void k() {}")
    assert lb.store_source("__global__ void k() {}") == digest
    assert lb.source(digest) == "__global__ void k() {}"
    assert os.listdir(tmp_path / "sources") == [f"{digest}.cu"]


def test_parts_from_before_the_protocol_column_read_as_back_to_back(tmp_path):
    """Offline times taken before the fence (cudal2/measure/bench.py) stay marked as such: their
    speedups are not comparable with fenced ones for kernels that launch early."""
    lb = Leaderboard(tmp_path)
    lb.append([row("new", 1.0, protocol="fenced")])
    old = lb.append([row("old", 0.9)])
    pq.write_table(pq.read_table(old).drop_columns(["protocol"]), old)  # as parts were written before
    assert "protocol" not in pq.read_table(old).column_names
    df = lb.read(protocol=None).set_index("kernel")
    assert df.loc["new", "protocol"] == "fenced" and df.loc["old", "protocol"] == "back-to-back"


def write_old_part(lb, rows, columns):
    """A part as an earlier version wrote it: only `columns` of today's schema, the
    protocol's name in a column then called `bench`."""
    fields = [SCHEMA.field(c).with_name("bench" if c == "protocol" else c) for c in columns]
    table = pa.Table.from_pylist([{f.name: r.get(c) for f, c in zip(fields, columns)} for r in rows],
                                 schema=pa.schema(fields))
    lb.parts.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, lb.parts / f"part-old-{len(list(lb.parts.iterdir()))}.parquet")


def test_old_parts_migrate_into_one_part_of_the_current_schema(tmp_path):
    """Parts of earlier versions (without the protocol's columns, one without even the
    protocol's name, one with it in a column named `bench`) become one part with today's
    schema: pandas, pyarrow and polars-style readers of the directory see every row with
    every column, the protocol's name under `protocol`."""
    lb = Leaderboard(tmp_path)
    before_protocol = COLUMNS[:COLUMNS.index("protocol")]
    write_old_part(lb, [row("ancient", 0.9)], before_protocol)
    write_old_part(lb, [row("fenced", 1.1, protocol="fenced")], before_protocol + ["protocol"])
    assert "bench" in pq.read_schema(sorted(lb.parts.glob("*.parquet"))[-1]).names
    lb.append([row("new", 1.05, kernel_us=171.0, graph_us=172.0)])
    assert sorted(lb.read(protocol=None)["protocol"]) == ["back-to-back", PROTOCOL, "fenced"]  # read as today's
    assert lb.migrate() == (3, 3)
    [part] = lb.parts.glob("*.parquet")
    assert pq.read_schema(part).names == COLUMNS and "bench" not in COLUMNS
    direct = pd.read_parquet(lb.parts).set_index("kernel")
    assert direct.loc["ancient", "protocol"] == "back-to-back" and direct.loc["fenced", "protocol"] == "fenced"
    assert direct.loc["new", "graph_us"] == 172.0 and pd.isna(direct.loc["fenced", "graph_us"])
    assert list(lb.read()["kernel"]) == ["new"]  # the protocol's rows only, unless asked
    assert lb.migrate() == (1, 3)  # idempotent


def test_the_shipped_measurements_are_in_the_current_schema():
    from cudal2.results.leaderboard import SHIPPED

    assert pq.read_schema(SHIPPED).names == COLUMNS


def test_rows_of_earlier_protocols_are_never_ranked_with_the_protocols(tmp_path):
    lb = Leaderboard(tmp_path)
    lb.append([row("fenced 2x", 2.0, protocol="fenced"), row("honest", 1.02)])
    assert list(best(lb.read())["kernel"]) == ["honest"]
    both = best(lb.read(protocol=None))
    assert sorted(zip(both["protocol"], both["kernel"])) == [("cupti-graph-3", "honest"), ("fenced", "fenced 2x")]


def test_the_shipped_measurements_keep_verified_configurations_without_logs_or_sources(tmp_path):
    from cudal2.results.leaderboard import _read_part, compact

    lb = Leaderboard(tmp_path)
    lb.append([row("fast", 1.2, template="sm80_mma", params='{"split_k": 1}', error=None, registers=128,
                   dynamic_smem_bytes=131072),
               row("broken", None, status="compile_error", template="sm80_mma", params="{}", error="nvcc: 9 errors"),
               row("cuBLAS", 1.0)])
    path = tmp_path / "shipped.parquet"
    pq.write_table(compact(lb.read()), path)
    shipped = _read_part(path).to_pandas()
    assert list(shipped["kernel"]) == ["fast"] and shipped["registers"].iloc[0] == 128
    assert shipped["dynamic_smem_bytes"].iloc[0] == 131072  # what the prompt shows of a prior's resources
    assert shipped["source_hash"].isna().all() and shipped["error"].isna().all()
    assert pq.read_schema(path).names == COLUMNS  # a leaderboard part like any other


def test_the_search_starts_from_this_gpu_s_measurements_here_and_shipped(tmp_path):
    from cudal2.results.leaderboard import priors, shipped

    lb = Leaderboard(tmp_path)
    lb.append([row("here", 1.3, m=300, template="sm80_mma", params='{"split_k": 2}'),
               row("here, slower copy", 1.1, m=300, template="sm80_mma", params='{"split_k": 2}'),
               row("elsewhere", 2.0, m=300, template="sm80_mma", params='{"split_k": 4}', gpu="NVIDIA A100")])
    found = priors(lb.read(), "NVIDIA H200")
    mine = [r for r in found if r["m"] == 300]
    assert [r["kernel"] for r in mine] == ["here"]  # one row per configuration, its best; no other GPU
    # the shipped measurements of this protocol on this GPU come along (a fresh machine starts from them)
    ours = shipped()
    assert len(ours) and set(ours["protocol"]) == {PROTOCOL}
    assert len(found) - len(mine) == len(ours[ours["gpu"] == "NVIDIA H200"].drop_duplicates(
        ["m", "n", "k", "dtype", "layout", "template", "params"]))
    assert priors(lb.read(), "NVIDIA B200") == []
    # made once per process from the shipped file, yet each call's rows are its own
    kernel = found[-1]["kernel"]
    found[-1]["kernel"] = "changed by a caller"
    again = priors(lb.read(), "NVIDIA H200")
    assert len(again) == len(found) and again[-1]["kernel"] == kernel
    # without this directory's rows: the shipped ones alone, best first, as they came beside them
    alone = priors(Leaderboard(tmp_path / "empty").read(), "NVIDIA H200")
    key = ["m", "n", "k", "dtype", "layout", "template", "params"]
    assert [[r[c] for c in key] for r in alone] == [[r[c] for c in key] for r in again if r["m"] != 300]
    speedups = [r["speedup_offline"] for r in alone]
    assert speedups == sorted(speedups, reverse=True)


def test_a_fresh_machine_re_measures_what_was_shipped_for_its_gpu(tmp_path):
    from cudal2.api import known_candidates
    from cudal2.results.leaderboard import shipped
    from cudal2.problem import Problem

    rows = shipped(protocol=None)
    rows = rows[rows["gpu"] == "NVIDIA H200"]
    problem = Problem(128, 64, 64)  # a dev-set row measured by every protocol
    found = known_candidates(problem, Leaderboard(tmp_path), rows, 90, top=1)
    protocols = set(rows[(rows["m"] == 128) & (rows["n"] == 64) & (rows["k"] == 64)]["protocol"])
    assert 1 <= len(found) <= len(protocols) and all(c.template for c in found)


def test_the_leaderboard_says_what_each_proposer_contributed(tmp_path):
    import json

    from typer.testing import CliRunner

    from cudal2.cli import app

    lb = Leaderboard(tmp_path)
    lb.append([row("cuBLAS", 1.0, proposer="baseline"), row("s1", 0.9, proposer="search"),
               row("s2", 1.2, proposer="search", m=2048), row("l1", 1.1, proposer="llm", run_id="r2"),
               row("l2", None, status="wrong", proposer="llm", run_id="r2", error="max error"),
               row("old", 3.0, proposer="llm", run_id="r0", protocol="fenced")])  # another protocol: not counted
    usage = tmp_path / "runs" / "r2" / "gpu0" / "llm-usage.jsonl"
    usage.parent.mkdir(parents=True)
    usage.write_text('{"round": 1, "total_tokens": 9000}\n{"round": 2, "total_tokens": 7000}\n')
    out = CliRunner().invoke(app, ["leaderboard", "--proposers", "--results", str(tmp_path), "--format", "json"])
    assert out.exit_code == 0, out.output
    by = {r["proposer"]: r for r in json.loads(out.output)}
    assert set(by) == {"llm", "search"}  # baselines are not proposals
    assert (by["search"]["candidates"], by["search"]["ok"], by["search"]["best_speedup"]) == (2, 2, 1.2)
    assert (by["llm"]["candidates"], by["llm"]["ok"], by["llm"]["best_speedup"]) == (2, 1, 1.1)
    assert by["llm"]["best_kernels"] == 1 and by["search"]["best_kernels"] == 1  # 4096^3 and 2048x4096x4096
    assert by["llm"]["llm_tokens"] == 16000 and by["search"]["llm_tokens"] == 0


def test_ship_measurements_adds_new_results_to_what_was_shipped(tmp_path):
    """A GPU session's results join the shipped file (--add) without losing what it held;
    only verified template configurations are kept."""
    import subprocess
    import sys
    from pathlib import Path

    from cudal2.results.leaderboard import _read_part

    first, second, out = tmp_path / "a", tmp_path / "b", tmp_path / "shipped.parquet"
    Leaderboard(first).append([row("old", 1.1, template="sm80_mma", params='{"split_k": 1}')])
    Leaderboard(second).append([row("new", 1.3, template="gemv", params='{"loads": "bulk"}'),
                                row("cuBLAS", 1.0), row("bad", None, status="wrong", template="gemv", params="{}")])
    script = [sys.executable, str(Path(__file__).resolve().parent.parent / "scripts" / "ship_measurements.py")]
    subprocess.run([*script, str(first), "--to", str(out)], check=True, capture_output=True)
    assert list(_read_part(out).to_pandas()["kernel"]) == ["old"]
    done = subprocess.run([*script, "--add", str(second), "--to", str(out)], check=True, capture_output=True, text=True)
    assert sorted(_read_part(out).to_pandas()["kernel"]) == ["new", "old"], done.stdout
    assert pq.read_schema(out).names == COLUMNS
    refused = subprocess.run([*script, "--add", str(tmp_path / "none"), "--to", str(out)], capture_output=True, text=True)
    assert refused.returncode != 0 and "no leaderboard" in refused.stderr
    assert len(_read_part(out).to_pandas()) == 2  # left as it was
    # rows of a kernel whose code changed since are dropped as the new ones join
    third = tmp_path / "c"
    Leaderboard(third).append([row("newer", 1.2, template="sm80_mma", params='{"split_k": 2}')])
    done = subprocess.run([*script, "--add", str(third), "--to", str(out), "--drop",
                           "template == 'sm80_mma' and params.str.contains('\"split_k\": 1')"],
                          check=True, capture_output=True, text=True)
    assert sorted(_read_part(out).to_pandas()["kernel"]) == ["new", "newer"] and "1 shipped rows dropped" in done.stdout


def test_ship_measurements_current_keeps_only_rows_whose_configuration_renders_the_source_measured(tmp_path):
    """Results of an earlier version join (--current) without the rows of kernels whose code
    changed since: a row is kept where its configuration renders today the source it was
    measured with, and left out where it renders another (a free-form kernel is never shipped)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from cudal2.kernels.candidate import Candidate
    from cudal2.results.leaderboard import _read_part, source_hash
    from cudal2.problem import Problem
    from cudal2.kernels.render import get_template, render

    params = get_template("sm80_mma").space.complete({"split_k": 2})
    today = source_hash(render(Candidate.from_template("sm80_mma", params), Problem(4096, 4096, 4096)))
    params = json.dumps(params)
    results, out = tmp_path / "r", tmp_path / "shipped.parquet"
    Leaderboard(results).append([row("as-today", 1.2, template="sm80_mma", params=params, source_hash=today),
                                 row("since-changed", 1.3, template="sm80_mma", params=params, source_hash="0" * 64),
                                 row("free-form", 1.4)])
    script = [sys.executable, str(Path(__file__).resolve().parent.parent / "scripts" / "ship_measurements.py")]
    done = subprocess.run([*script, str(results), "--current", "--to", str(out)], check=True, capture_output=True, text=True)
    assert list(_read_part(out).to_pandas()["kernel"]) == ["as-today"]
    assert "1 verified template rows left out" in done.stdout  # the free-form one is never shipped
