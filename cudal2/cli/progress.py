"""What `cudal2 optimize` shows while it runs, from the loop's events (cudal2/tune/optimize.py:
"shape", "baseline", "batch", "measured", "failed"). On a terminal: a bar over the shape set
and a live line per shape being tuned (its best so far, the candidates measured, what is
on the GPU and what is compiling), left as one summary line when the shape ends. Piped or
logged: one plain line per event. Under --json: nothing."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..protocol import SCREEN_PROTOCOL, SCREENED
from ..results.tables import console, fmt
from ..tune.optimize import Event


@dataclass
class ShapeLine:
    """One shape's state as its events tell it."""

    index: int
    of: int
    problem: Any
    iterations: int
    began: float = field(default_factory=time.monotonic)
    baseline: str = ""
    screened: int = 0  # through the screening pass (its rejections included)
    passed: int = 0  # of those, passed it
    measured: int = 0  # through the full protocol
    ok: int = 0
    best: float = 0.0
    best_kernel: str = ""
    doing: str = "measuring the baselines"
    error: str = ""
    task: Any = None  # its line in the live display

    def on(self, kind: str, info: dict[str, Any]) -> None:
        if kind == "baseline":
            self.baseline = f"{info.get('name') or '-'} {fmt(info.get('us'))} us"
            self.doing = "compiling batch 1"
        elif kind == "batch":
            i = info["iteration"]
            self.doing = f"batch {i}: {info['candidates']} on the GPU" + (
                f", batch {i + 1} compiling" if i < self.iterations else "")
        elif kind == "measured":
            row = info["row"]
            if row.get("protocol") == SCREEN_PROTOCOL:
                self.screened += 1
                self.passed += row["status"] == SCREENED
                return
            self.measured += 1
            self.ok += row["status"] == "ok"
            if row["status"] == "ok" and info.get("speedup") is not None and info["speedup"] >= info["best_speedup"]:
                self.best_kernel = row["kernel"]
            self.best = info["best_speedup"] or self.best
        elif kind == "failed":
            self.error = info["error"]

    def text(self, final: bool = False) -> str:
        head = f"[{self.index}/{self.of}] {self.problem}"
        if self.error:
            return f"{head}: failed: {self.error}"
        best = f"best {self.best:.3f}x" if self.best else "no verified kernel yet"
        if final:
            best = f"best {self.best:.3f}x {self.best_kernel}" if self.best else "no verified kernel"
        counts = f"{self.measured} measured ({self.ok} ok)"
        if self.screened:
            counts = f"{self.screened} screened ({self.passed} passed), {counts}"
        if final:
            return f"{head}: {best}; {counts}; {time.monotonic() - self.began:.0f} s"
        return f"{head}  {best}  {counts}  {self.doing}  (baseline {self.baseline or '-'})"


class LiveProgress:
    """The terminal's view: the set's bar over the lines of the shapes being tuned (one per
    GPU worker; each worker's events come on its own thread)."""

    def __init__(self, screen: Console, shapes: int, iterations: int):
        self.iterations = iterations
        self.lock = threading.Lock()
        self.lines: dict[int, ShapeLine] = {}  # by the thread tuning it
        self.bar = Progress(TextColumn("shapes"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            console=screen)
        self.task = self.bar.add_task("shapes", total=shapes)
        self.shown = Progress(TextColumn("{task.description}"), TimeElapsedColumn(), console=screen)
        self.live = Live(Group(self.bar, self.shown), console=screen, refresh_per_second=4)

    def __call__(self, kind: str, info: dict[str, Any]) -> None:
        thread = threading.get_ident()
        with self.lock:
            if kind == "shape":
                self._end(thread)
                self.lines[thread] = ShapeLine(info["index"], info["of"], info["problem"], self.iterations)
                self.lines[thread].task = self.shown.add_task("")
            line = self.lines.get(thread)
            if line is None:
                return
            line.on(kind, info)
            if kind == "failed":
                self._end(thread)
            else:
                self.shown.update(line.task, description=line.text())

    def _end(self, thread: int) -> None:
        """The thread's shape is done: its summary line stays above the live display."""
        line = self.lines.pop(thread, None)
        if line is not None:
            self.shown.remove_task(line.task)
            self.live.console.print(line.text(final=True))
            self.bar.advance(self.task)

    def close(self) -> None:
        with self.lock:
            for thread in list(self.lines):
                self._end(thread)


def plain_progress(kind: str, info: dict[str, Any]) -> None:
    """One line per event, for logs and pipes."""
    if kind == "shape":
        print(f"[{info['index']}/{info['of']}] {info['problem']}", flush=True)
    elif kind == "baseline":
        print(f"fastest baseline: {info['name'] or '-'} {fmt(info['us'])} us", flush=True)
    elif kind == "batch":
        print(f"batch {info['iteration']}: {info['candidates']} to measure, {info['invalid']} invalid", flush=True)
    elif kind == "measured":
        row = info["row"]
        if row["status"] == SCREENED:  # no claim: the screening session's graph ratio, which only ranks the batch
            detail = f"{fmt(row.get('speedup_graph'), 3)} (graph)"
        elif row["status"] == "ok":
            detail = fmt(info["speedup"], 3)
        else:
            detail = ((row.get("error") or "").strip().splitlines() or [""])[0][:100]
        print(f"  {row['status']:<13} {detail:<12} {row['kernel']}  (best {info['best_speedup']:.3f}x)", flush=True)
    elif kind == "failed":
        print(f"[{info['index']}] {info['problem']} failed: {info['error']}", flush=True)


@contextlib.contextmanager
def progress_display(quiet: bool, shapes: int, iterations: int, screen: Console | None = None) -> Iterator[Event | None]:
    """The loop's event callback for `shapes` shapes of up to `iterations` batches: live on a
    terminal, plain lines otherwise, None (nothing shown) when `quiet` (--json)."""
    screen = screen or console
    if quiet:
        yield None
    elif not screen.is_terminal:
        yield plain_progress
    else:
        view = LiveProgress(screen, shapes, iterations)
        with view.live:
            try:
                yield view
            finally:
                view.close()
