import json

import pytest
from typer.testing import CliRunner

from cudal2.cli import app
from cudal2.results.leaderboard import Leaderboard

from conftest import gpu_count
from test_leaderboard import row

runner = CliRunner()


def run(*args, env=None):
    return runner.invoke(app, [str(a) for a in args], env=env)


def test_help_lists_the_commands():
    result = run("--help")
    assert result.exit_code == 0
    for command in ("bench", "leaderboard", "compile", "templates"):
        assert command in result.output


def test_version_is_the_packages():
    import cudal2

    result = run("--version")
    assert result.exit_code == 0 and result.output.strip() == f"cudal2 {cudal2.__version__}"


def test_templates_json_describes_the_space():
    result = run("templates", "--json")
    assert result.exit_code == 0
    space = json.loads(result.output)["sm80_mma"]
    assert space["params"]["block_m"]["default"] == 128 and space["dtypes"] == ["fp16", "bf16"]


@pytest.mark.nvcc
def test_compile_without_a_gpu_fills_the_cache(tmp_path):
    env = {"CUDAL2_CACHE_DIR": str(tmp_path)}
    args = ("compile", "--template", "sm80_mma", "--param", "stages=3", "--arch", "sm_90a", "--json")
    first = run(*args, env=env)
    assert first.exit_code == 0, first.output
    [record] = json.loads(first.output)
    assert record["status"] == "ok" and not record["cached"] and record["registers"] > 0
    second = run(*args, env=env)
    assert json.loads(second.output)[0]["cached"] is True


def one_line_error(result, text):
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and text in lines[0], result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("args, text", [
    (("bench", "--m", "0", "--n", "8", "--k", "8"), "m must be >= 1"),
    (("bench", "--m", "abc", "--n", "8", "--k", "8"), "m must be an integer, got 'abc'"),
    (("bench", "--m", "8", "--n", "8", "--k", "8", "--dtype", "fp8"), "unknown dtype 'fp8'"),
    (("bench", "--m", "8", "--n", "8", "--k", "8", "--layout", "tt"), "unknown layout 'tt'"),
    (("bench", "--m", "8", "--n", "8", "--k", "8", "--template", "nope"), "unknown template 'nope'"),
    (("bench", "--m", "8", "--n", "8", "--k", "8", "--param", "block_m=64"), "--param needs --template"),
    (("bench", "--m", "8", "--n", "8", "--k", "8", "--mode", "fast"), "unknown mode 'fast'"),
    (("compile", "--template", "sm80_mma", "--param", "block_m=100", "--arch", "sm_90a"), "outside template sm80_mma's space"),
    (("compile", "--template", "sm80_mma", "--param", "bogus=1", "--arch", "sm_90a"), "unknown parameter bogus"),
    (("compile", "--template", "sm80_mma", "--arch", "gfx90a"), "unknown architecture 'gfx90a'"),
    (("compile", "--kernel", "/no/such/file.cu", "--arch", "sm_90a"), "cannot read kernel file"),
    (("optimize", "--m", "8", "--n", "8", "--k", "8", "--screen", "0"), "--screen must be >= 1, got 0"),
    (("leaderboard", "--format", "xml"), "unknown format 'xml'"),
    (("leaderboard", "--status", "great"), "unknown status 'great'"),
])
def test_bad_input_is_one_line_and_exit_1(args, text, tmp_path):
    one_line_error(run(*args, "--results" if args[0] != "compile" else "--jobs",
                       tmp_path if args[0] != "compile" else 1), text)


@pytest.mark.nvcc
def test_kernel_that_does_not_compile_is_named(tmp_path):
    bad = tmp_path / "bad.cu"
    bad.write_text('extern "C" int cudal2_gemm() { return nope; }\n')
    result = run("bench", "--m", 8, "--n", 8, "--k", 8, "--kernel", bad, "--arch", "sm_90a",
                 "--results", tmp_path, env={"CUDAL2_CACHE_DIR": str(tmp_path / "c")})
    one_line_error(result, "bad.cu does not compile")
    assert "nope" in result.output


@pytest.mark.nvcc
def test_compile_shows_the_compilers_own_error_line(tmp_path):
    bad = tmp_path / "bad.cu"
    bad.write_text('extern "C" int cudal2_gemm() { return nope; }\n')
    result = run("compile", "--kernel", bad, "--arch", "sm_90a", env={"CUDAL2_CACHE_DIR": str(tmp_path / "c")})
    assert result.exit_code == 1 and 'identifier "nope" is undefined' in result.stderr, result.stderr


@pytest.mark.nvcc
def test_kernel_without_the_entry_point_is_named(tmp_path):
    bad = tmp_path / "noabi.cu"
    bad.write_text('extern "C" int gemm(void) { return 0; }\n')
    result = run("compile", "--kernel", bad, "--arch", "sm_90a", env={"CUDAL2_CACHE_DIR": str(tmp_path)})
    assert result.exit_code == 1 and "does not export cudal2_gemm" in result.output


@pytest.mark.skipif(gpu_count() > 0, reason="this machine has a GPU")
def test_bench_without_a_gpu_says_so(tmp_path):
    one_line_error(run("bench", "--m", 64, "--n", 64, "--k", 64, "--results", tmp_path), "no usable CUDA device")


def test_no_nvcc_is_named(tmp_path):
    result = run("compile", "--template", "sm80_mma", "--arch", "sm_90a",
                 env={"PATH": str(tmp_path), "CUDA_HOME": str(tmp_path), "CUDAL2_NVCC": ""})
    one_line_error(result, "nvcc not found")


def test_unreadable_leaderboard_is_named(tmp_path):
    (tmp_path / "leaderboard").write_text("not a directory")
    one_line_error(run("leaderboard", "--results", tmp_path), "is not a directory")


@pytest.fixture
def results(tmp_path):
    lb = Leaderboard(tmp_path)
    lb.append([row("sm80_mma(a)", 0.7, tflops=500.0), row("sm80_mma(b)", 0.9, tflops=600.0),
               row("cheater", 5.0, status="cheat", error="wrote outside C"),
               row("small", 1.3, m=64)])
    return tmp_path


def test_leaderboard_formats(results):
    as_json = json.loads(run("leaderboard", "--results", results, "--format", "json").output)
    assert [(r["m"], r["kernel"]) for r in as_json] == [(64, "small"), (4096, "sm80_mma(b)")]
    csv = run("leaderboard", "--results", results, "--format", "csv").output.splitlines()
    assert csv[0].startswith("gpu,m,n,k,dtype,layout,kernel") and len(csv) == 3
    md = run("leaderboard", "--results", results, "--format", "markdown").output.splitlines()
    assert md[0].startswith("| gpu | m |") and md[1].startswith("|---|") and "sm80_mma(b)" in md[3]
    table = run("leaderboard", "--results", results).output
    assert "sm80_mma(b)" in table and "cheater" not in table


def test_leaderboard_reports_a_shape_set_with_its_geometric_mean(results, tmp_path):
    shapes = tmp_path / "shapes.csv"
    shapes.write_text("m,n,k,dtype,layout,group\n4096,4096,4096,fp16,nn,big\n64,4096,4096,fp16,nn,small\n"
                      "7,7,7,fp16,nn,never\n")
    report = json.loads(run("leaderboard", "--results", results, "--shapes", shapes, "--format", "json").output)
    assert [(r["m"], r["kernel"]) for r in report["rows"]] == [(4096, "sm80_mma(b)"), (64, "small"), (7, "(none measured)")]
    summary = report["summary"]
    assert (summary["shapes"], summary["measured"], summary["missing"]) == (3, 2, 1)
    assert summary["geomean_speedup"] == pytest.approx((0.9 * 1.3) ** 0.5) and summary["min_speedup"] == 0.9
    assert (summary["wins"], summary["ties"], summary["losses"]) == (1, 0, 1)  # 1.3 and 0.9
    printed = run("leaderboard", "--results", results, "--shapes", shapes).output
    assert "geometric mean 1.082, minimum 0.900; 1 win(s), 0 tie(s), 1 loss(es)" in printed
    one_line_error(run("leaderboard", "--results", results, "--shapes", tmp_path / "nope.csv"), "cannot read shape set")


def test_a_tuned_shape_sets_summary_counts_ties_apart_from_wins_and_losses():
    from cudal2.results.tables import set_summary, verdict_line

    runs = [{"best": {"speedup_offline": v}, "wall_s": 1.0} for v in (1.05, 1.02, 0.99, 0.96)] + [{"best": None, "wall_s": 2.0}]
    total = set_summary(runs, "offline")
    assert (total["tuned"], total["wins"], total["ties"], total["losses"]) == (4, 1, 2, 1) and total["wall_s"] == 6.0
    assert verdict_line(total).startswith("1 win(s), 2 tie(s), 1 loss(es) (within 3% of 1.0 is a tie")


def test_leaderboard_exports_the_best_kernels_as_self_contained_files(tmp_path):
    lb = Leaderboard(tmp_path)
    source = 'extern "C" int cudal2_gemm() { return 0; }\n'
    common = {"cublas_offline_us": 180.0, "arch": "sm_90a", "proposer": "user"}
    lb.append([row("fast.cu", 1.2, source_hash=lb.store_source(source), **common),
               row("slow.cu", 0.8, source_hash=lb.store_source(source + "// slower\n"), **common)])
    result = run("leaderboard", "--results", tmp_path, "--export", "--format", "csv")
    assert result.exit_code == 0 and "exported 1 kernel(s)" in result.stderr
    assert result.stdout.splitlines()[1].startswith("NVIDIA H200,4096,4096,4096,fp16,nn,fast.cu")
    text = (tmp_path / "best" / "NVIDIA_H200" / "fp16_nn" / "4096_4096_4096.cu").read_text()
    assert "speedup 1.200x over the fastest library call, cuBLASLt (180.00 us -> 150.00 us" in text
    assert "-Xlinker -Bsymbolic" in text and "-gencode=arch=compute_90a,code=sm_90a" in text  # the real flags
    assert text.endswith(source)
    one_line_error(run("leaderboard", "--results", tmp_path, "--export", "--status", "ok"), "does not combine")


def test_leaderboard_filters_top_and_status(results):
    top2 = json.loads(run("leaderboard", "--results", results, "--m", 4096, "--top", 2, "--format", "json").output)
    assert [r["kernel"] for r in top2] == ["sm80_mma(b)", "sm80_mma(a)"]
    cheats = json.loads(run("leaderboard", "--results", results, "--status", "cheat", "--format", "json").output)
    assert [(r["kernel"], r["error"]) for r in cheats] == [("cheater", "wrote outside C")]
    assert "no results match" in run("leaderboard", "--results", results, "--gpu", "A100").output
    shown = json.loads(run("leaderboard", "--results", results, "--gpu", "h200", "--format", "json").output)
    assert {r["gpu"] for r in shown} == {"NVIDIA H200"}  # part of the name, any case


def test_a_results_directory_without_a_leaderboard_shows_the_shipped_measurements(tmp_path):
    from cudal2.results.leaderboard import shipped

    table = run("leaderboard", "--results", tmp_path / "nowhere")
    assert table.exit_code == 0 and "measurements shipped with cudal2" in table.stderr and "128" in table.stdout
    # a script asks for them by name: JSON of an empty results directory is [] (nothing measured here)
    result = run("leaderboard", "--results", tmp_path / "nowhere", "--shipped", "--json")
    assert result.exit_code == 0 and "measurements shipped with cudal2" in result.stderr
    rows = json.loads(result.stdout)
    recorded = shipped()
    assert len(rows) == len(recorded.groupby(["gpu", "m", "n", "k", "dtype", "layout"])) > 200  # one per problem
    assert {r["source"] for r in rows} == {"shipped"}
    asked = json.loads(run("leaderboard", "--shipped", "--m", 128, "--n", 64, "--k", 64, "--json").stdout)
    assert [(r["m"], r["n"], r["k"], r["source"]) for r in asked] == [(128, 64, 64, "shipped")]
    one_line_error(run("leaderboard", "--results", tmp_path, "--export"), "keep no kernel sources")


def test_a_script_reads_an_empty_results_directory_as_an_empty_list(tmp_path):
    """`--format json` tells "nothing measured yet" (an empty list, exit 0) from an error."""
    result = run("leaderboard", "--results", tmp_path / "nowhere", "--format", "json")
    assert result.exit_code == 0 and json.loads(result.output) == []


def test_leaderboard_shows_one_protocol_and_never_mixes_them(tmp_path):
    lb = Leaderboard(tmp_path)
    lb.append([row("before", 1.4, protocol="back-to-back"), row("fenced", 1.1, protocol="fenced"),
               row("only before", 1.2, m=64, protocol="back-to-back"), row("now", 1.01)])
    # The protocol's rows alone by default: a problem measured only by an earlier protocol
    # is not shown, and its flattering number never stands beside the protocol's.
    shown = json.loads(run("leaderboard", "--results", tmp_path, "--format", "json").output)
    assert [(r["kernel"], r["protocol"]) for r in shown] == [("now", "cupti-graph-3")]
    before = json.loads(run("leaderboard", "--results", tmp_path, "--bench", "back-to-back", "--format", "json").output)
    assert [r["kernel"] for r in before] == ["only before", "before"]
    shapes = tmp_path / "shapes.csv"
    shapes.write_text("m,n,k,dtype,layout\n64,4096,4096,fp16,nn\n4096,4096,4096,fp16,nn\n")
    report = json.loads(run("leaderboard", "--results", tmp_path, "--shapes", shapes, "--format", "json").output)
    assert [r["kernel"] for r in report["rows"]] == ["(none measured)", "now"]
    assert report["summary"]["geomean_speedup"] == pytest.approx(1.01)
    assert (report["summary"]["wins"], report["summary"]["ties"]) == (0, 1)  # 1.01 is inside the runs' spread
    one_line_error(run("leaderboard", "--results", tmp_path, "--protocol", "warm"), "unknown --protocol 'warm'")


def test_leaderboard_reports_a_model_preset(tmp_path):
    lb = Leaderboard(tmp_path)
    lb.append([row("decode-kernel", 1.08, m=16, n=4096, k=4096, dtype="bf16", layout="nt")])
    report = json.loads(run("leaderboard", "--results", tmp_path, "--model", "llama3-8b", "--tokens", "16",
                            "--format", "json").output)
    assert [(r["n"], r["k"], r["kernel"]) for r in report["rows"]] == [
        (6144, 4096, "(none measured)"), (4096, 4096, "decode-kernel"), (28672, 4096, "(none measured)"),
        (4096, 14336, "(none measured)")]
    assert report["summary"]["measured"] == 1
    one_line_error(run("leaderboard", "--results", tmp_path, "--model", "gpt-9"), "unknown model 'gpt-9'")


def test_report_writes_a_self_contained_page_summary_first(tmp_path):
    lb = Leaderboard(tmp_path)
    common = {"kernel_us": 150.0, "graph_us": 152.0, "speedup_vs_cublas": 1.1, "speedup_vs_cublaslt": 1.05,
              "tflops": 800.0, "sm_count": 132, "max_sm_clock_mhz": 1980, "cc": 90,
              "compile_s": 60.0, "template": "sm90_cutlass"}
    lb.append([row("fast", 1.05, **common), row("decode", 0.97, m=16, **{**common, "template": "sm80_mma"}),
               row("old", 2.0, m=8, protocol="fenced", **common)])
    out = tmp_path / "report"
    result = run("report", "--out", out, "--results", tmp_path)
    assert result.exit_code == 0, result.output
    page = (out / "index.html").read_text()
    assert "1 win(s)" in page  # 1.05 wins; the fenced row's 2.0 is another protocol's
    for plot in ("speedups", "regimes", "roofline", "templates", "tuning"):
        assert (out / f"{plot}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f'alt="{plot}" src="data:image/png;base64,' in page  # embedded: the page stands alone
    assert "4096x4096x4096 fp16" in page and "16x4096x4096 fp16" in page and "8x4096x4096" not in page
    assert "geometric mean\n<b>1.009</b>, minimum <b>0.970</b>" in page
    # the summary (per regime) comes before the plots, the long table last
    assert page.index("<th>regime</th><th>shapes</th><th>geomean</th>") < page.index('alt="speedups"') < page.index(
        "Every shape")
    summary = json.loads((out / "summary.json").read_text())
    assert [(r["regime"], r["shapes"], r["wins"], r["losses"]) for r in summary["regimes"]] == [
        ("decode", 1, 0, 1), ("large", 1, 1, 0), ("all", 2, 1, 1)]  # 0.97: at the tie band's edge, a loss
    # only the baselines the rows carry: no torch.matmul column when no row has it
    assert "vs cuBLASLt autotuned" in page and "vs torch.matmul" not in page
    printed = json.loads(run("report", "--out", out, "--results", tmp_path, "--json").stdout)
    assert printed["page"] == str(out / "index.html") and printed["regimes"] == summary["regimes"]


def test_report_on_an_empty_results_directory_is_of_the_shipped_measurements(tmp_path):
    out = tmp_path / "report"
    result = run("report", "--out", out, "--results", tmp_path / "none", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["source"] == "cudal2/data/measurements.parquet" and summary["shapes"] > 200
    assert {r["regime"] for r in summary["regimes"]} >= {"few-tile long-K", "short-K", "decode", "large", "unaligned"}
    page = (out / "index.html").read_text()
    assert "measurements shipped with cudal2" in page
    assert not (out / "tuning.png").exists() and "no tuning-cost plot" in page  # shipped rows keep no compile times


def test_plain_tables_keep_within_columns(monkeypatch, tmp_path):
    """A pipe or a log gets whole lines; with COLUMNS set, tables and descriptions wrap to it."""
    for args, width in ((("templates",), 100), (("leaderboard", "--shipped"), 160)):
        lines = run(*args, env={"COLUMNS": str(width)}).stdout.splitlines()
        assert len(lines) > 10 and max(map(len, lines)) <= width, max(lines, key=len)
    assert max(map(len, run("templates", env={"COLUMNS": "wide"}).stdout.splitlines())) > 200
