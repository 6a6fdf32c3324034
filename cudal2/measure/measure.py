"""Measure, in the GPU worker: a candidate and the baselines timed alike, by the protocol's
two methods (cudal2/measure/bench.py), on rotating input sets whose every output is checked.

The kernel method reads CUPTI activity records through cupti-python: it needs no torch
(CuPy owns the GPU here, torch is only one of the baselines) and sees every kernel, memset
and copy on any stream, so a call's work on a stream of its own is counted, not hidden.
The graph method must not run where CUPTI is loaded: with CUPTI attached, each kernel
replayed from a graph costs 0.4-0.9 us more with every activity kind disabled, 0.15-0.35 us
after cuptiFinalize (measured on an H200), so cudal2/measure/worker.py times it in a process of its own.
"""

from __future__ import annotations

import bisect
import random
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from ..problem import Problem
from ..protocol import OFFLINE_METHODS
from .bench import INPUT_SETS, graph_rounds, kernel_rounds, summarize
from .verify import UNIT_ROUNDOFF, Numerics, Rejected, compare, poison_output
from .worker import LONG_SCREEN_US, SOAK_US

# The graph method's neighbour of each call: an in-place elementwise pass (sin) over 512 KB,
# as an activation between two GEMMs of a model is. Measured on an H200 with the earlier
# neighbours: one streaming 8 MB ran slower after a call that evicted its data, and the
# subtraction charged that to the call (64x8192x8192: 44.6 us in the graph, 36.0 us by CUPTI);
# one that touched no memory but filled every SM for 6 us made every kernel launched with
# PDL read 0.3-0.5 us more than its CUPTI time (128x64x64: 1.83 against 1.54 us), and the
# libraries' kernels 0.05 us more. Behind torch's sin_ over 512 KB (the independent check,
# scripts/remeasure.py) every contestant of the dev set's calls under 5 us read within
# 0.15 us of its CUPTI time. After a call that evicted it, re-reading 512 KB costs about
# 0.15 us, under 1% of any call large enough to evict it.
NEIGHBOUR_SOURCE = r"""
extern "C" __global__ void cudal2_neighbour(float* x, unsigned n) {
  unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = sinf(x[i]);
}
"""
NEIGHBOUR_FLOATS = 1 << 17  # 512 KB
GRAPH_TARGET_US = 2000.0  # device time of one graph replay to aim for
LEAD_CALLS = INPUT_SETS - 1  # untimed calls ahead of each timed call (kernel method)


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
    """Microseconds in which the device ran the activity records (start, end in ns) that start
    inside each of the ordered, disjoint windows (start, end in ns): the union of their
    intervals, so that two kernels of one call that overlap (the second launched with
    programmatic dependent launch, resident while it waits for the first) count once, as the
    device ran them; records that do not overlap add up. Records outside every window (the
    bench's own refills, poisoning and checks) count for none."""
    return [busy / 1e3 for busy in busy_per_window(windows, records)]


def busy_per_window(windows: list[tuple[float, float]], records: list[tuple[float, float]]) -> list[float]:
    """For each of the ordered, disjoint windows (start, end), the time in which the records
    (start, end, in the windows' unit) that start inside it ran: the union of their intervals."""
    starts = [w[0] for w in windows]
    spans: list[list[tuple[float, float]]] = [[] for _ in windows]
    for start, end in records:
        i = bisect.bisect_right(starts, start) - 1
        if i >= 0 and start <= windows[i][1]:
            spans[i].append((start, end))
    return [busy_time(intervals) for intervals in spans]


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of the intervals (start, end): the time in which at least one
    of them ran, in their unit."""
    busy, reach = 0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy


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
    x = cupy.ones(NEIGHBOUR_FLOATS, cupy.float32)
    return lambda: kernel((NEIGHBOUR_FLOATS // 256,), (256,), (x, cupy.uint32(NEIGHBOUR_FLOATS)), stream=stream)


def graph_calls(names, run, sets: InputSets, stream, reference: str | None = None,
                target_us: float = GRAPH_TARGET_US) -> tuple[int, float]:
    """Calls per graph (a multiple of the sets) so that one replay takes about
    `target_us`, and the time per call they come from: the `reference` contestant's
    (so that the problem, not the company a kernel keeps, decides), else the median
    contestant's, by events around a call on each set (an upper bound: the host's launch
    time is in it)."""
    import cupy

    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for name in names:
        start.record(stream)
        for s in range(len(sets.a)):
            run[name](sets.a[s], sets.b[s], sets.c[name][s])
        end.record(stream)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / len(sets.a))
    typical = times[names.index(reference)] if reference in names else sorted(times)[len(times) // 2]
    return calls_per_graph(typical, target_us), typical


def graph_rest(settings: dict[str, Any], typical_us: float) -> float:
    """The GPU's idle time after each graph replay of a session, as a share of its device
    time: a screening session's `screen_rest` (worker.SCREEN_REST) where calls take SOAK_US
    or more (back to back, they run at the power cap), else none."""
    return settings.get("screen_rest", 0.0) if settings.get("screen") and typical_us >= SOAK_US else 0.0


def calls_per_graph(call_us: float, target_us: float = GRAPH_TARGET_US) -> int:
    """Calls in a graph of calls of `call_us` each (a multiple of the sets): one replay
    takes about `target_us`."""
    per_call = call_us + 2.0  # the neighbour takes about 2 us
    return INPUT_SETS * max(1, min(20, round(target_us / per_call / INPUT_SETS)))


def graphs(names, run, sets: InputSets, stream, calls: int, neighbour: Callable[[], None] | None = None,
           warm: bool = True):
    """Captures each contestant's graph (`calls` x neighbour + call, cycling the sets) and
    the neighbours' alone; returns replay(name or None) -> device us. `neighbour` launches
    the kernel ahead of each call (default: the protocol's, neighbour_kernel). Each graph is
    replayed once, untimed (`warm`), else only uploaded to the device."""
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
        if warm:
            replay(name)
        else:
            graphs[name].upload(stream)
    stream.synchronize()
    return replay


class Session:
    """One process's side of timing the contestants of `run` (name -> run(a, b, c)): those
    of `methods` ("graph", "kernel", "server") that the settings' mode asks for, one round
    at a time (`round()`), so that the parent can alternate the rounds of the two processes
    and clock and thermal drift fall on both methods alike; `finish()` returns
    {method: {name: Timing as dict}}. "kernel" and "server" need the CUPTI `timer`.

    "cuBLAS" must be among the contestants: every output of every timed call is compared
    with cuBLAS's on the same inputs, within `tolerance[name]` (relative to max |C|) plus
    cuBLAS's own; one of the `suspects` whose output differs is a cheat (it was verified
    first), a baseline wrong (Rejected, naming the contestant, from round() or finish()).
    """

    def __init__(self, run: dict[str, Callable], problem: Problem, *, stream, environment: dict[str, Any],
                 settings: dict[str, Any], rng: random.Random, tolerance: dict[str, float],
                 methods: tuple[str, ...], timer: CuptiTimer | None = None, suspects: frozenset[str] = frozenset()):
        import cupy

        self.run, self.stream, self.timer, self.tolerance, self.suspects = run, stream, timer, tolerance, suspects
        self.num = Numerics(problem.dtype)
        self.names = list(run)
        self.sets = InputSets(problem, self.num, self.names, rng)
        mode = settings.get("mode", "offline")
        offline, server = mode in ("offline", "both"), mode in ("server", "both")
        self.methods = [m for m in methods if (offline and m in OFFLINE_METHODS) or (server and m == "server")]
        self.samples: dict[str, dict[str, list[float]]] = {m: {n: [] for n in self.names} for m in self.methods}
        self.rounds = 0
        self.rest = 0.0  # idle time after each graph replay, as a share of its device time
        self.typical_us: float | None = None  # cuBLAS's time per call, roughly (the graph method's set-up)
        seed = rng.getrandbits(32)
        self.rng = {m: random.Random(seed + i) for i, m in enumerate(("kernel", "graph", "server"))}
        with stream:
            for name in self.names:  # warm-up: module load, handles, cuBLAS workspaces, autotuned plans
                self.call(name, 0)
            stream.synchronize()
            if "graph" in self.methods:
                # cuBLAS's time decides the regime (soak, alternation) and the graphs' length: it
                # alone is timed for it (each other contestant's three calls were a kernel's
                # tenth of a screening session)
                timed = ["cuBLAS"] if "cuBLAS" in self.names else self.names
                self.calls, self.typical_us = graph_calls(timed, run, self.sets, stream, reference="cuBLAS")
                for s in range(INPUT_SETS):
                    self.refresh(s)
                # a screening session of long calls times one round: its graphs are uploaded,
                # not replayed first (three calls of a millisecond or more each)
                long_screen = bool(settings.get("screen")) and self.typical_us >= LONG_SCREEN_US
                self.rest = graph_rest(settings, self.typical_us)
                self.replay = graphs(self.names, run, self.sets, stream, self.calls, warm=not long_screen)
        if "server" in self.methods:
            qps, gaps = settings.get("qps", 200.0), random.Random(seed + 3)
            l2 = cupy.empty(2 * environment["l2_bytes"], dtype=cupy.uint8)

            def pause(name: str, s: int) -> None:
                time.sleep(gaps.expovariate(qps))
                l2.fill(0)

            self.pause = pause

    def call(self, name: str, s: int) -> None:
        self.run[name](self.sets.a[s], self.sets.b[s], self.sets.c[name][s])

    def refresh(self, s: int) -> None:
        self.sets.refresh(s)
        for name in self.names:
            poison_output(self.sets.c[name][s])

    def check(self, name: str, s: int) -> None:
        if name == "cuBLAS":
            return
        ref = self.num.f32(self.sets.c["cuBLAS"][s])
        # compare() allows max(2 roundoffs, 4 x calibration): here the contestant's own
        # tolerance plus 2 roundoffs for cuBLAS's error
        bound = (self.tolerance[name] + 2 * UNIT_ROUNDOFF[self.num.dtype]) / 4
        _, _, why = compare(self.sets.c[name][s], ref, self.num, bound)
        if why:
            raise Rejected("cheat" if name in self.suspects else "wrong",
                           f"{name}: output of a timed call differs from cuBLAS's on the same inputs ({why})", name)

    def lead(self, name: str, s: int) -> None:
        """The other sets' calls, untimed, right before a timed call on set `s`."""
        for t in range(1, LEAD_CALLS + 1):
            self.call(name, (s + t) % len(self.sets.a))

    def round(self) -> None:
        with self.stream:
            for method in self.methods:
                if method == "graph":
                    found = graph_rounds(self.names, replay=self.replay, calls=self.calls, budget_s=0.0,
                                         rng=self.rng[method], min_rounds=1, rest=self.rest)
                else:
                    found = kernel_rounds(self.names, call=self.call, refresh=self.refresh, check=self.check,
                                          timer=self.timer, budget_s=0.0, rng=self.rng[method], min_rounds=1,
                                          first_round=self.rounds,
                                          before=self.lead if method == "kernel" else self.pause)
                for name, values in found.items():
                    self.samples[method][name] += values
        self.rounds += 1

    def soak(self, seconds: float) -> None:
        """Replays the contestants' graphs in turn, untimed, for `seconds`: a long call's
        rounds then run at the clock a GPU busy with such calls settles at."""
        deadline = time.perf_counter() + seconds
        with self.stream:
            while time.perf_counter() < deadline:
                for name in self.names:
                    self.replay(name)

    def finish(self) -> dict[str, dict[str, dict]]:
        if "graph" in self.methods:  # the graphs' outputs, as the last replay left them
            for name in self.names:
                for s in range(INPUT_SETS):
                    self.check(name, s)
        return {m: {n: asdict(summarize(v)) for n, v in by_name.items()} for m, by_name in self.samples.items()}


def time_alone(session: Session, budget_s: float, min_rounds: int = 5) -> dict[str, dict[str, dict]]:
    """A session's rounds until `budget_s` of wall time is spent (at least `min_rounds`)."""
    deadline = time.perf_counter() + budget_s
    while session.rounds < min_rounds or time.perf_counter() < deadline:
        session.round()
    return session.finish()


def graph_medians(run: Callable[[str, object, object, object], None], names: list[str], problem: Problem, *,
                  stream, rng: random.Random, budget_s: float, rounds: int = 7, warmup_rounds: int = 3,
                  target_us: float = 500.0) -> dict[str, float]:
    """The graph method's median for each of `names` (run(name, a, b, c) calls one) that
    `budget_s` of device time allows, in their order (the first sizes the graphs: each
    replay about `target_us`); all replayed in the same shuffled rounds on rotating sets, so
    that the clock's drift falls on all alike (the cuBLASLt autotuning: the algorithm a
    model's graph would run fastest), after `warmup_rounds` untimed ones (an idle GPU's first
    rounds run at a higher clock than a busy one's). Where all of them do not fit, one
    warm-up and three timed rounds, and as many names as fit then (two at least). A
    contestant's choice must be made when its call is captured: run() makes it."""
    sets = InputSets(problem, Numerics(problem.dtype), ["shared"], rng)
    contestants = {name: (lambda a, b, c, name=name: run(name, a, b, c)) for name in names}
    with stream:
        reference = names[0]
        sets.c[reference] = sets.c["shared"]
        contestants[reference](sets.a[0], sets.b[0], sets.c[reference][0])
        calls, typical = graph_calls([reference], contestants, sets, stream, target_us=target_us)
        replay_us = calls * (typical + 2.0)  # the neighbour takes about 2 us

        def cost_s(count: int, passes: int) -> float:  # a warm call, an upload and the rounds each, the neighbours' too
            return ((count + 1) * (1 + passes) * replay_us + count * typical) * 1e-6

        if cost_s(len(names), warmup_rounds + rounds) > budget_s:
            warmup_rounds, rounds = 1, 3
            fit = int((budget_s * 1e6 - 5 * replay_us) // (5 * replay_us + typical))  # cost_s(fit, 4) <= budget_s
            names = names[:max(2, fit)]
        sets.c = {name: sets.c["shared"] for name in names}  # one output per set, whoever writes it
        for name in names[1:]:
            contestants[name](sets.a[0], sets.b[0], sets.c[name][0])
        replay = graphs(names, contestants, sets, stream, calls)
        graph_rounds(names, replay=replay, calls=calls, budget_s=0.0, rng=rng, min_rounds=warmup_rounds)
        samples = graph_rounds(names, replay=replay, calls=calls, budget_s=0.0, rng=rng, min_rounds=rounds)
    return {name: summarize(values).median_us for name, values in samples.items()}
