"""Bench: device time of launches, interleaved, warm (offline) or cold after idle gaps (server).

Runs in the worker process that owns the GPU. Every contestant is timed on the same
stream, round by round in a shuffled order, so that clock and thermal drift fall on all
of them alike; speedups are ratios within one call of `bench`.

Offline timing is fenced: every launch is followed by an empty kernel (the fence), whose
own time, measured in the same rounds, is subtracted. A kernel launched with programmatic
dependent launch (PDL) may start its set-up before the kernel ahead of it on the stream has
finished; back to back, the kernel ahead is a copy of itself that releases it early, which
a model's other kernels do not. Behind the fence it gets only what PDL gives behind any
kernel. Measured on an H200 (docs/h200-2026-11-30.md, "Sixth round"): cuBLAS and kernels
without PDL lose nothing to the fence (under 0.05 us from 2 to 180 us), PDL kernels of the
sm90 template 0.65-1.4 us of their back-to-back gain.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

# Busy-waits on the GPU for `ns` nanoseconds. Queued ahead of a batch, it keeps the GPU
# busy while the host enqueues the batch, so the events around the batch measure the
# launches back to back and none of the host's per-call overhead.
SPIN_SOURCE = r"""
extern "C" __global__ void cudal2_spin(unsigned long long ns) {
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < ns);
}
"""


# The offline protocol, as the leaderboard's `bench` column records it, and the one before it
# (launches timed back to back, without the fence).
PROTOCOL, EARLIER_PROTOCOL = "fenced", "back-to-back"
# An empty kernel, launched without PDL after every timed launch (see the module docstring).
FENCE_SOURCE = 'extern "C" __global__ void cudal2_fence() {}'
FENCE = "fence"  # its entry among the contestants (internal; not in the result)


@dataclass(frozen=True)
class Timing:
    median_us: float
    p20_us: float
    p80_us: float
    samples: int


def summarize(samples_us: list[float]) -> Timing:
    q = statistics.quantiles(samples_us, n=10, method="inclusive") if len(samples_us) > 1 else samples_us * 9
    return Timing(statistics.median(samples_us), q[1], q[7], len(samples_us))


def bench(
    launches: dict[str, Callable[[], None]],
    *,
    stream,
    mode: str = "offline",
    budget_s: float = 1.0,
    qps: float = 200.0,
    flush: Callable[[], None] | None = None,
    before: Callable[[str], None] | None = None,
    after: Callable[[str], None] | None = None,
    min_rounds: int = 5,
    seed: int | None = None,
    fenced: bool = True,
) -> dict[str, Timing]:
    """Median, p20 and p80 device microseconds per launch of each entry of `launches`.

    offline: warm, back to back, fenced; each sample is one batch (its size randomised around
      ~300 us of work) divided by its launch count, less the fence's median time per launch.
      Each batch is preceded by one untimed launch of its own, so that it starts from its own
      working set in L2, not from what the contestant before it left there.
    server: one call per sample after an exponential idle gap at `qps` and `flush()`
      (which should evict L2), timed alone.
    `before(name)` and `after(name)` run around every batch (outside the timed region, after
    the untimed launch), for poisoning and checking outputs. Rounds continue until `budget_s`
    of wall time is spent and at least `min_rounds` are done. `fenced=False` times offline
    launches truly back to back, with neither fence nor untimed launch (for probes).
    """
    import cupy

    spin = cupy.RawKernel(SPIN_SOURCE, "cudal2_spin")
    rng = random.Random(seed)
    names = list(launches)
    contestants = set(launches)
    fenced = fenced and mode == "offline"
    if fenced:
        if FENCE in launches:
            raise ValueError(f"{FENCE!r} is the bench's own entry")
        fence_kernel = cupy.RawKernel(FENCE_SOURCE, "cudal2_fence")

        def fence() -> None:
            fence_kernel((1,), (1,), (), stream=stream)

        launches = {name: (lambda run=run: (run(), fence())) for name, run in launches.items()}
        launches[FENCE] = fence
        names.append(FENCE)

    def timed(name: str, count: int, spin_ns: int) -> tuple[float, float, bool]:
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        spin((1,), (1,), (cupy.uint64(spin_ns),), stream=stream)
        start.record(stream)
        t0 = time.perf_counter()
        for _ in range(count):
            launches[name]()
        host_s = time.perf_counter() - t0
        starved = start.done  # the GPU reached the batch before the host had queued it all
        end.record(stream)
        end.synchronize()
        return cupy.cuda.get_elapsed_time(start, end) * 1e3 / count, host_s / count, starved

    # Warm-up, then estimates of device and host time per launch.
    for name in names:
        for _ in range(3):
            launches[name]()
    stream.synchronize()
    device_us, host_us = {}, {}
    for name in names:
        device_us[name], host_s, _ = timed(name, 3, 2_000_000)
        host_us[name] = host_s * 1e6

    samples: dict[str, list[float]] = {name: [] for name in names}
    deadline = time.perf_counter() + budget_s
    rounds = 0
    while rounds < min_rounds or time.perf_counter() < deadline:
        rounds += 1
        for name in rng.sample(names, len(names)):
            hooks = name in contestants
            if fenced and hooks:
                launches[name]()
            if before and hooks:
                before(name)
            if mode == "offline":
                count = max(1, min(2000, round(300.0 / max(device_us[name], 0.05) * rng.uniform(0.75, 1.25))))
                spin_ns = int(1000 * (1.5 * host_us[name] * count + 50))
                per_launch, host_s, starved = timed(name, count, spin_ns)
                host_us[name] = max(host_us[name], host_s * 1e6)
                if starved:  # queueing outran the spin: this sample includes host gaps
                    host_us[name] *= 2
                else:
                    samples[name].append(per_launch)
            else:
                time.sleep(rng.expovariate(qps))
                if flush:
                    flush()
                per_call, _, _ = timed(name, 1, int(1000 * (2 * host_us[name] + 20)))
                samples[name].append(per_call)
            if after and hooks:
                after(name)
    if fenced:
        fence_samples = samples.pop(FENCE)
        fence_us = statistics.median(fence_samples) if fence_samples else device_us[FENCE]
        samples = {name: [v - fence_us for v in values] for name, values in samples.items()}
    return {name: summarize(values) for name, values in samples.items() if values}
