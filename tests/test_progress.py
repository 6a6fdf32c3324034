"""What `cudal2 optimize` shows while it runs: on a terminal a bar over the shape set and a
line per shape (best so far, candidates measured, what is on the GPU and compiling); in a
pipe plain lines; under --json nothing but the JSON."""

from __future__ import annotations

import io
import json
import threading

import pytest
from rich.console import Console
from rich.text import Text
from typer.testing import CliRunner

from cudal2.measure.baselines import cublas_location
from cudal2.cli import app, progress
from cudal2.problem import Problem

from test_optimize import StandInWorker


def terminal(width: int = 150) -> tuple[Console, io.StringIO]:
    screen = io.StringIO()
    return Console(file=screen, force_terminal=True, width=width, highlight=False), screen


def seen(screen: io.StringIO) -> str:
    """The characters a user saw, terminal control codes stripped."""
    return Text.from_ansi(screen.getvalue()).plain


def row(kernel: str, status: str = "ok") -> dict:
    return {"kernel": kernel, "status": status}


def shape_events(index: int, of: int, problem: Problem, speedups: list[float]):
    """The events one shape's run emits: its baselines, one batch, each kernel measured."""
    yield "shape", {"index": index, "of": of, "problem": problem, "worker": 0}
    yield "baseline", {"name": "cuBLASLt", "us": 95.0}
    yield "batch", {"iteration": 1, "candidates": len(speedups), "invalid": 0}
    best = 0.0
    for i, speedup in enumerate(speedups):
        best = max(best, speedup)
        yield "measured", {"row": row(f"k{index}-{i}"), "speedup": speedup, "best_speedup": best}


def test_a_terminal_shows_a_bar_over_the_set_and_a_live_line_per_shape():
    screen, out = terminal()
    first, second = Problem(256, 256, 256), Problem(128, 512, 64)
    with progress.progress_display(False, 2, 3, screen=screen) as view:
        events = shape_events(1, 2, first, [0.9, 1.25, 1.1])
        for kind, info in list(events)[:4]:  # baseline, batch 1, one kernel measured
            view(kind, info)
        view.live.refresh()
        now = seen(out).splitlines()
        [line] = [l for l in now if l.startswith("[1/2] 256x256x256")]
        assert "best 0.900x" in line and "1 measured (1 ok)" in line and "batch 1: 3 on the GPU, batch 2 compiling" in line
        assert any("0/2" in l for l in now)  # the set's bar: no shape done yet
        for kind, info in list(shape_events(1, 2, first, [0.9, 1.25, 1.1]))[4:]:
            view(kind, info)
        for kind, info in shape_events(2, 2, second, [0.5]):  # the next shape: the first is done
            view(kind, info)
        view("failed", {"index": 2, "problem": second, "error": "CUDA out of memory"})
    lines = seen(out).splitlines()
    assert any(l.startswith("[1/2] 256x256x256 fp16 nn: best 1.250x k1-1; 3 measured (3 ok); ") for l in lines)
    assert "[2/2] 128x512x64 fp16 nn: failed: CUDA out of memory" in lines
    assert any("2/2" in l and "━" in l for l in lines[-3:])  # the bar ends full


def test_each_gpu_worker_s_shape_has_its_own_line():
    """With --gpus, two threads tune two shapes at once: each event counts for the shape of
    the thread it comes from."""
    screen, out = terminal()
    problems = [Problem(256, 256, 256), Problem(64, 64, 1000)]
    started, measured = threading.Barrier(2), threading.Barrier(2)

    with progress.progress_display(False, 2, 1, screen=screen) as view:
        def tune(index: int, speedups: list[float]) -> None:
            events = list(shape_events(index, 2, problems[index - 1], speedups))
            for kind, info in events[:3]:
                view(kind, info)
            started.wait()  # both shapes are on: their events interleave from here
            for kind, info in events[3:]:
                view(kind, info)
            measured.wait()

        threads = [threading.Thread(target=tune, args=(1, [1.5, 1.2])),
                   threading.Thread(target=tune, args=(2, [0.7, 0.8, 0.6, 0.75]))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        view.live.refresh()
        live = seen(out).splitlines()
        assert any(l.startswith("[1/2] 256x256x256") and "best 1.500x  2 measured" in l for l in live)
        assert any(l.startswith("[2/2] 64x64x1000") and "best 0.800x  4 measured" in l for l in live)
        assert "batch 2 compiling" not in seen(out)  # one batch is all the budget holds
    lines = seen(out).splitlines()
    assert any(l.startswith("[1/2] 256x256x256 fp16 nn: best 1.500x k1-0; 2 measured") for l in lines)
    assert any(l.startswith("[2/2] 64x64x1000 fp16 nn: best 0.800x k2-1; 4 measured") for l in lines)


def test_screened_kernels_are_counted_apart_from_those_measured_by_the_full_protocol(capsys):
    # A budget run screens eight candidates for each it measures in full: "9 measured" would
    # say nine claims where there is one.
    from cudal2.protocol import SCREEN_PROTOCOL

    screen, out = terminal()
    p = Problem(256, 256, 256)
    screened = [{"kernel": f"s{i}", "status": "screened", "protocol": SCREEN_PROTOCOL, "speedup_graph": 1.0 + i / 10}
                for i in range(7)] + [{"kernel": "bad", "status": "wrong", "protocol": SCREEN_PROTOCOL, "error": "max error"}]
    with progress.progress_display(False, 1, 3, screen=screen) as view:
        view("shape", {"index": 1, "of": 1, "problem": p, "worker": 0})
        for r in screened:
            view("measured", {"row": r, "speedup": None, "best_speedup": 0.0})
        view("measured", {"row": row("s6"), "speedup": 1.5, "best_speedup": 1.5})
        view.live.refresh()
        [line] = [l for l in seen(out).splitlines() if l.startswith("[1/1] 256x256x256")]
        assert "8 screened (7 passed), 1 measured (1 ok)" in line and "best 1.500x" in line
    progress.plain_progress("measured", {"row": screened[6], "speedup": None, "best_speedup": 0.0})
    assert "screened      1.600 (graph) s6" in capsys.readouterr().out


def test_a_pipe_gets_plain_lines_and_json_gets_nothing():
    screen, out = terminal()
    with progress.progress_display(True, 1, 1, screen=screen) as view:
        assert view is None
    assert out.getvalue() == ""
    piped = Console(file=io.StringIO(), force_terminal=False)
    with progress.progress_display(False, 1, 1, screen=piped) as view:
        assert view is progress.plain_progress


@pytest.mark.nvcc
@pytest.mark.skipif(cublas_location() is None, reason="cuBLAS headers not installed (pip install nvidia-cublas)")
def test_optimize_shows_progress_on_a_terminal_plain_lines_in_a_pipe_and_json_alone(tmp_path, cache_dir, monkeypatch):
    """`cudal2 optimize --shapes` with the GPU worker stood in for (the baselines' shims and
    two sm80_mma configurations compiled for real)."""
    from cudal2 import api

    monkeypatch.setattr(api, "Worker", lambda device: StandInWorker(device=device))
    shapes = tmp_path / "shapes.csv"
    shapes.write_text("m,n,k\n256,256,256\n128,256,512\n")
    env = {"CUDAL2_CACHE_DIR": str(cache_dir), "CUDAL2_ARCH": "sm_90a"}
    args = ["optimize", "--shapes", str(shapes), "--iterations", "1", "--batch", "2", "--template", "sm80_mma",
            "--param", "stages=3,4"]

    piped = CliRunner(env=env).invoke(app, [*args, "--results", str(tmp_path / "piped")])
    assert piped.exit_code == 0, piped.output
    lines = piped.output.splitlines()
    assert lines[0] == "[1/2] 256x256x256 fp16 nn" and lines[1] == "fastest baseline: cuBLASLt 95.00 us"
    assert "[2/2] 128x256x512 fp16 nn" in lines and not any("\x1b[" in l for l in lines)

    screen, out = terminal(width=400)  # a summary line names its kernel: whole lines
    monkeypatch.setattr(progress, "console", screen)
    shown = CliRunner(env=env).invoke(app, [*args, "--results", str(tmp_path / "shown")])
    assert shown.exit_code == 0, shown.output
    assert [l for l in seen(out).splitlines() if l.startswith("[")] == [
        l for l in seen(out).splitlines() if l.startswith(("[1/2] 256x256x256 fp16 nn: best ", "[2/2] 128x256x512 fp16 nn: best "))]
    assert "2 measured (2 ok)" in seen(out) and "2/2" in seen(out)
    assert "2 of 2 shapes with a verified kernel" in shown.output  # the summary, as before

    quiet = CliRunner(env=env).invoke(app, [*args, "--results", str(tmp_path / "json"), "--json"])
    assert quiet.exit_code == 0 and [s["problem"] for s in json.loads(quiet.stdout)["shapes"]]
