"""Measure, in the GPU worker: a candidate and the baselines timed alike, by the protocol's
two methods (cudal2/bench.py), on rotating input sets whose every output is checked.

The kernel method reads CUPTI activity records through cupti-python: it needs no torch
(CuPy owns the GPU here, torch is only one of the baselines) and sees every kernel, memset
and copy on any stream, so a call's work on a stream of its own is counted, not hidden.
"""

from __future__ import annotations

import bisect
import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from .bench import INPUT_SETS, kernel_rounds, graph_rounds, summarize
from .problem import Problem
from .verify import UNIT_ROUNDOFF, Numerics, Rejected, compare, poison_output

# A model's neighbour of a GEMM: an elementwise pass over 8 MB (an activation, a residual
# add), so that a call in the graph starts behind real work, as in a model.
NEIGHBOUR_SOURCE = r"""
extern "C" __global__ void cudal2_neighbour(float* x, unsigned n) {
  for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    x[i] = x[i] * 0.5f + 1.0f;
}
"""
NEIGHBOUR_FLOATS = 2 << 20  # 8 MB
GRAPH_TARGET_US = 2000.0  # device time of one graph replay to aim for


class CuptiTimer:
    """Device time of calls made between device syncs, from CUPTI activity records."""

    KINDS = ("CONCURRENT_KERNEL", "MEMSET", "MEMCPY")

    def __init__(self):
        try:
            from cupti import cupti
        except ImportError as exc:
            raise RuntimeError(f"cupti-python is needed for device timing (pip install cupti-python): {exc}") from None
        import cupy

        self.cupti, self.device = cupti, cupy.cuda.Device()
        self._records: list[tuple[int, int]] = []
        self._windows: list[tuple[int, int]] = []
        cupti.activity_register_callbacks(lambda: (8 << 20, 0), self._completed)
        for kind in self.KINDS:
            cupti.activity_enable(getattr(cupti.ActivityKind, kind))

    @contextlib.contextmanager
    def paused(self):
        """No activity records within: tracing kernels replayed from a CUDA graph costs each
        of them device time (measured on an H200: graph times 12-26% above an untraced run)."""
        for kind in self.KINDS:
            self.cupti.activity_disable(getattr(self.cupti.ActivityKind, kind))
        try:
            yield
        finally:
            for kind in self.KINDS:
                self.cupti.activity_enable(getattr(self.cupti.ActivityKind, kind))

    def _completed(self, activities) -> None:
        self._records.extend((a.start, a.end) for a in activities)

    def time(self, fn: Callable[[], None]) -> None:
        self.device.synchronize()
        start = self.cupti.get_timestamp()
        fn()
        self.device.synchronize()
        self._windows.append((start, self.cupti.get_timestamp()))

    def collect(self) -> list[float]:
        """Microseconds of device work in each window since the last collect, in order."""
        self.cupti.activity_flush_all(1)
        windows, self._windows = self._windows, []
        records, self._records = self._records, []
        return window_totals(windows, records)


def window_totals(windows: list[tuple[int, int]], records: list[tuple[int, int]]) -> list[float]:
    """Microseconds of the activity records (start, end in ns) that start inside each of the
    ordered, disjoint windows (start, end in ns); records outside every window (the bench's
    own refills, poisoning and checks) count for none."""
    starts = [w[0] for w in windows]
    totals = [0] * len(windows)
    for start, end in records:
        i = bisect.bisect_right(starts, start) - 1
        if i >= 0 and start <= windows[i][1]:
            totals[i] += end - start
    return [ns / 1e3 for ns in totals]


class InputSets:
    """`count` input sets (A, B at their own addresses) and each contestant's output for
    each set; refresh() gives a set fresh random contents."""

    def __init__(self, problem: Problem, numerics: Numerics, names: list[str], rng: random.Random,
                 count: int = INPUT_SETS):
        import cupy

        self.cp, self.num, self.problem = cupy, numerics, problem
        self.gen = cupy.random.Generator(cupy.random.XORWOW(seed=rng.getrandbits(63)))
        p = problem
        self.a = [cupy.empty((p.m, p.k), numerics.storage) for _ in range(count)]
        self.b = [cupy.empty(p.b_shape, numerics.storage) for _ in range(count)]
        self.c = {name: [cupy.empty((p.m, p.n), numerics.storage) for _ in range(count)] for name in names}
        for s in range(count):
            self.refresh(s)

    def refresh(self, s: int) -> None:
        self.num.cast(self.gen.standard_normal(self.a[s].shape, dtype=self.cp.float32), self.a[s])
        self.num.cast(self.gen.standard_normal(self.b[s].shape, dtype=self.cp.float32), self.b[s])


def neighbour_kernel(stream) -> Callable[[], None]:
    """Launches the protocol's neighbour kernel on `stream`."""
    import cupy

    kernel = cupy.RawKernel(NEIGHBOUR_SOURCE, "cudal2_neighbour")
    scratch = cupy.ones(NEIGHBOUR_FLOATS, cupy.float32)
    return lambda: kernel((264,), (256,), (scratch, cupy.uint32(NEIGHBOUR_FLOATS)), stream=stream)


def graphs(names, run, sets: InputSets, stream, calls: int, neighbour: Callable[[], None] | None = None):
    """Captures each contestant's graph (`calls` x neighbour + call, cycling the sets) and
    the neighbours' alone; returns replay(name or None) -> device us. `neighbour` launches
    the kernel ahead of each call (default: the protocol's, neighbour_kernel)."""
    import cupy

    neighbour = neighbour or neighbour_kernel(stream)

    def capture(name: str | None):
        stream.begin_capture(cupy.cuda.runtime.streamCaptureModeRelaxed)
        for i in range(calls):
            neighbour()
            if name is not None:
                s = i % len(sets.a)
                run[name](sets.a[s], sets.b[s], sets.c[name][s])
        return stream.end_capture()

    graphs = {name: capture(name) for name in [None, *names]}
    start, end = cupy.cuda.Event(), cupy.cuda.Event()

    def replay(name: str | None) -> float:
        start.record(stream)
        graphs[name].launch(stream)
        end.record(stream)
        end.synchronize()
        return cupy.cuda.get_elapsed_time(start, end) * 1e3

    for name in graphs:  # warm: first replays upload the graph
        replay(name)
    return replay


def time_contestants(run: dict[str, Callable], problem: Problem, *, stream, timer: CuptiTimer,
                     environment: dict[str, Any], settings: dict[str, Any], rng: random.Random,
                     tolerance: dict[str, float], suspect: str = "kernel") -> dict[str, dict[str, dict]]:
    """{method: {name: Timing as dict}} for every contestant of `run` (name -> run(a, b, c)).

    "cuBLAS" must be among them: every output of every timed call is compared with cuBLAS's
    on the same inputs, within `tolerance[name]` (relative to max |C|) plus cuBLAS's own;
    a `suspect` whose output differs is a cheat (it was verified first), a baseline wrong.
    """
    import cupy

    num = Numerics(problem.dtype)
    names = list(run)
    sets = InputSets(problem, num, names, rng)
    l2 = cupy.empty(2 * environment["l2_bytes"], dtype=cupy.uint8)

    def call(name: str, s: int) -> None:
        run[name](sets.a[s], sets.b[s], sets.c[name][s])

    def refresh(s: int) -> None:
        sets.refresh(s)
        for name in names:
            poison_output(sets.c[name][s])

    def check(name: str, s: int) -> None:
        if name == "cuBLAS":
            return
        ref = num.f32(sets.c["cuBLAS"][s])
        # compare() allows max(2 roundoffs, 4 x calibration): here the contestant's own
        # tolerance plus 2 roundoffs for cuBLAS's error
        _, _, why = compare(sets.c[name][s], ref, num, (tolerance[name] + 2 * UNIT_ROUNDOFF[num.dtype]) / 4)
        if why:
            raise Rejected("cheat" if name == suspect else "wrong",
                           f"{name}: output of a timed call differs from cuBLAS's on the same inputs ({why})")

    budget = settings.get("budget_s", 1.0)
    seed = rng.getrandbits(32)
    with stream:
        for name in names:  # warm-up: module load, handles, cuBLAS workspaces, autotuned plans
            call(name, 0)
        stream.synchronize()
        timings: dict[str, dict[str, dict]] = {}
        mode = settings.get("mode", "offline")
        if mode in ("offline", "both"):
            kernel = kernel_rounds(names, call=call, refresh=refresh, check=check, timer=timer,
                                   budget_s=budget, rng=random.Random(seed))
            timings["kernel"] = {n: asdict(summarize(v)) for n, v in kernel.items()}
            typical = sorted(t["median_us"] for t in timings["kernel"].values())[len(names) // 2]
            per_call = typical + 5.0  # the neighbour takes about 4-5 us
            calls = INPUT_SETS * max(1, min(20, round(GRAPH_TARGET_US / per_call / INPUT_SETS)))
            for s in range(INPUT_SETS):
                refresh(s)
            with timer.paused():
                replay = graphs(names, run, sets, stream, calls)
                graph = graph_rounds(names, replay=replay, calls=calls, budget_s=budget, rng=random.Random(seed + 1))
            for name in names:
                for s in range(INPUT_SETS):
                    check(name, s)
            timings["graph"] = {n: asdict(summarize(v)) for n, v in graph.items()}
        if mode in ("server", "both"):
            qps = settings.get("qps", 200.0)
            gaps = random.Random(seed + 2)

            def pause() -> None:
                time.sleep(gaps.expovariate(qps))
                l2.fill(0)

            server = kernel_rounds(names, call=call, refresh=refresh, check=check, timer=timer,
                                   budget_s=budget, rng=random.Random(seed + 3), pause=pause)
            timings["server"] = {n: asdict(summarize(v)) for n, v in server.items()}
    return timings


def interleaved_medians(run: Callable[[str, object, object, object], None], names: list[str], problem: Problem, *,
                        stream, timer: CuptiTimer, rng: random.Random, warmup: int = 5,
                        rounds: int = 4 * INPUT_SETS) -> dict[str, float]:
    """The kernel method's median for each of `names` (run(name, a, b, c) calls one), all
    timed in the same shuffled rounds on rotating sets after `warmup` untimed calls each,
    so that the clock's ramp and drift fall on all alike (the cuBLASLt autotuning)."""
    sets = InputSets(problem, Numerics(problem.dtype), ["it"], rng)
    with stream:
        for _ in range(warmup):
            for name in names:
                run(name, sets.a[0], sets.b[0], sets.c["it"][0])
        samples = kernel_rounds(names, call=lambda name, s: run(name, sets.a[s], sets.b[s], sets.c["it"][s]),
                                refresh=sets.refresh, check=lambda *_: None, timer=timer, budget_s=0.0,
                                rng=rng, min_rounds=rounds)
    return {name: summarize(values).median_us for name, values in samples.items()}
