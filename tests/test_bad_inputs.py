"""A new user's mistakes, swept through the real `cudal2` entry point: each is one line that
names the mistake, with exit code 1 (2 for a usage error), before any GPU is touched, and
never a traceback; under --json the line is a JSON object on stdout."""

import json
import shutil
import tarfile

import pytest

from cudal2.cli import main
from cudal2.results.leaderboard import SHIPPED, Leaderboard

from conftest import gpu_count
from test_leaderboard import row


def run(capsys, *args):
    """`cudal2 ARGS`: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as stopped:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return stopped.value.code, out, err


def assert_one_line(code, out, err, expected_code, text):
    lines = [line for line in (out + err).splitlines() if line.strip()]
    assert code == expected_code, out + err
    assert len(lines) == 1 and lines[0].startswith("error: ") and text in lines[0], out + err
    assert "Traceback" not in out + err


@pytest.fixture
def places(tmp_path):
    """A file where a directory is expected, a path under a file (unwritable, even for root),
    a results directory holding shipped-format rows (no sources), a non-tarball."""
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory\n")
    shipped_results = tmp_path / "shipped-results"
    (shipped_results / "leaderboard").mkdir(parents=True)
    shutil.copy(SHIPPED, shipped_results / "leaderboard" / "part-shipped.parquet")
    return {"file": a_file, "under_file": a_file / "sub", "shipped": shipped_results, "empty": tmp_path / "empty"}


SWEEP = [
    # validated against the template's space before a GPU is started (no --arch, no GPU: the newest target)
    (("bench", "--m", 128, "--n", 64, "--k", 64, "--template", "sm80_mma", "--param", "block_m=17"),
     "block_m=17 is outside template sm80_mma's space"),
    (("optimize", "--m", 128, "--n", 64, "--k", 64, "--template", "sm80_mma", "--param", "warps_m=3"),
     "outside template sm80_mma's space"),
    (("bench", "--m", 128, "--n", 64, "--k", 64, "--arch", "sm_99z"), "unknown architecture 'sm_99z'"),
    (("compile", "--template", "sm80_mma", "--arch", "sm_99z"), "unknown architecture 'sm_99z'"),
    (("bench", "--m", 128, "--n", 64, "--k", 64, "--results", "{file}"), "is a file, not a directory"),
    (("optimize", "--m", 128, "--n", 64, "--k", 64, "--patience", -1), "--patience must be >= 1, got -1"),
    (("optimize", "--m", 128, "--n", 64, "--k", 64, "--time-budget", -5), "--time-budget must be > 0 seconds"),
    (("optimize", "--m", 128, "--n", 64, "--k", 64, "--gpus", "abc"), "--gpus takes 'all' or comma-separated"),
    (("optimize", "--m", 128, "--n", 64, "--k", 64, "--gpus", "-1"), "--gpus takes device indices >= 0"),
    (("bench", "--m", 99999999999, "--n", 64, "--k", 64), "m must be < 2^31"),
    (("bench", "--m", 64, "--n", 64, "--k", 2**31), "k must be < 2^31"),
    (("optimize", "--model", "llama3-8b", "--tokens", 0), "tokens must be >= 1"),
    (("optimize", "--model", "llama3-8b", "--tokens", "1,x"), "tokens take comma-separated integers"),
    (("leaderboard", "--m", -5, "--dtype", "fp8"), "m must be >= 1, got -5"),
    (("leaderboard", "--dtype", "fp8"), "unknown dtype 'fp8'"),
    (("leaderboard", "--layout", "tt"), "unknown layout 'tt'"),
    # what cannot be written or read
    (("report", "--out", "{file}"), "is a file: give a directory"),
    (("report", "--out", "{under_file}"), "cannot write the report into"),
    (("prebuild", "--unpack", "{empty}/nope.tar.gz"), "no such file or directory"),
    (("prebuild", "--unpack", "{file}"), "not a tarball"),
    (("leaderboard", "--results", "{under_file}"), "is a file"),
    # shipped-format rows (no kernel source) in a results directory: refused, not sources/nan.cu
    (("leaderboard", "--results", "{shipped}", "--export"), "has no stored source"),
    (("export", "--library", "{empty}/lib", "--results", "{shipped}", "--gpu", "NVIDIA H200"), "has no stored source"),
    # one library is one GPU's: rows of several (the shipped H200 and H100 rows) need --gpu
    (("export", "--library", "{empty}/lib", "--results", "{shipped}"), "the rows are of 2 GPUs"),
    (("check", "--results", "{shipped}"), "has no stored source"),
    (("leaderboard", "--export"), "keep no kernel sources"),  # the shipped rows shown for an empty directory
]


@pytest.mark.parametrize("args, text", SWEEP, ids=[" ".join(map(str, a)) for a, _ in SWEEP])
def test_a_mistake_is_one_line_and_exit_1(args, text, places, capsys, monkeypatch):
    monkeypatch.chdir(places["empty"].parent)
    args = [str(a).format(**places) for a in args]
    if "--results" not in args and args[0] in ("bench", "optimize", "leaderboard", "export"):
        args += ["--results", str(places["empty"])]
    assert_one_line(*run(capsys, *args), 1, text)


def test_an_unwritable_kernel_cache_is_one_line(places, capsys, monkeypatch):
    monkeypatch.setenv("CUDAL2_CACHE_DIR", str(places["under_file"]))
    assert_one_line(*run(capsys, "compile", "--template", "sm80_mma", "--arch", "sm_90a"), 1, "is a file, not a directory")
    monkeypatch.setenv("CUDAL2_CACHE_DIR", "/proc/cudal2-cache")  # a directory nobody, root included, can write in
    assert_one_line(*run(capsys, "compile", "--template", "sm80_mma", "--arch", "sm_90a"), 1, "cannot use kernel cache")
    tarball = places["empty"].parent / "set.tar.gz"
    with tarfile.open(tarball, "w:gz"):
        pass
    assert_one_line(*run(capsys, "prebuild", "--unpack", tarball), 1, "cannot use kernel cache")


def test_a_leaderboard_export_into_an_unwritable_place_is_one_line(tmp_path, capsys):
    board = Leaderboard(tmp_path)
    board.append([row("fast.cu", 1.2, source_hash=board.store_source('extern "C" int cudal2_gemm() { return 0; }\n'),
                      arch="sm_90a")])
    (tmp_path / "best").write_text("a file where the exported kernels go\n")
    code, out, err = run(capsys, "leaderboard", "--results", tmp_path, "--export")
    assert_one_line(code, "", err, 1, str(tmp_path / "best"))


@pytest.mark.skipif(gpu_count() > 0, reason="this machine has a GPU")
def test_no_driver_is_named(capsys, tmp_path):
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
        pytest.skip("this machine has an NVIDIA driver (and no GPU)")
    except OSError:
        pass
    assert_one_line(*run(capsys, "bench", "--m", 64, "--n", 64, "--k", 64, "--results", tmp_path), 1,
                    "no NVIDIA driver found")


@pytest.mark.parametrize("args, text", [
    (("bench", "--m", 1), "Missing option '--n'"),
    (("leaderboard", "--bogus"), "No such option: --bogus"),
    (("leaderboard", "--m", "x"), "'--m'"),
    (("nope",), "No such command 'nope'"),
])
def test_a_usage_error_is_one_line_and_exit_2(args, text, capsys):
    assert_one_line(*run(capsys, *args), 2, text)


def test_errors_under_json_are_json(capsys, tmp_path):
    for args, code in ((("leaderboard", "--json", "--status", "great"), 1), (("report", "--out", tmp_path / "r", "--json",
                                                                                "--bench", "x"), 1),
                       (("leaderboard", "--json", "--bogus"), 2), (("leaderboard", "--format", "json", "--m", "x"), 2)):
        got, out, err = run(capsys, *args, "--results", tmp_path)
        assert got == code and not err.strip(), (args, out, err)
        answer = json.loads(out)
        assert answer["exit_code"] == code and answer["error"], answer


def test_help_and_version_exit_0(capsys):
    code, out, _ = run(capsys)
    assert code == 0 and "leaderboard" in out  # `cudal2` alone: the help
    assert run(capsys, "--version")[0] == 0
