"""Bench: how contestants are timed, as round logic that needs no GPU of its own.

The protocol (protocol.PROTOCOL, what the leaderboard's `protocol` column records) times every
contestant, candidate and baselines alike, in one process by two independent methods:

- `kernel`: device time per call from CUPTI activity records (every kernel, memset and copy
  the call launched: the union of their intervals, so two of its kernels that overlap count
  once), each call alone between device syncs, so no other call overlaps it and no launch
  gap or host time is counted (`kernel_rounds`). Each timed call comes right
  behind untimed calls of the same contestant on the other input sets, so that the clock
  it runs at is a busy GPU's, as in the graph (measured on an H200: long calls right after
  the bench's own lighter work read up to 15% faster than the same calls in a graph);
- `graph`: the call replayed in a CUDA graph between neighbour kernels (an elementwise pass
  over activations, as between two GEMMs of a model), less the graph of the neighbours
  alone, per call (`graph_rounds`). A kernel launched with programmatic dependent launch
  (PDL) gets what PDL gives behind a real kernel, no more. The graph method runs in a
  process that never loads CUPTI (cudal2/measure/worker.py).

Long calls are timed on a GPU at its steady state: large GEMMs run an H200 at its power
cap, where the clock falls from 1.98 to about 1.4 GHz within a second or two of sustained
load, and kernels that spend more energy per FLOP fall further. A job's first rounds would
otherwise run at the boost clock of an idle GPU, which no model running such GEMMs back to
back sees (cudal2/measure/worker.py: SOAK_US, SOAK_S).

The claimed speedup is the lower of the two ratios against the fastest baseline
(`claimed`). Inputs rotate: every `kernel` round gives one of at least three input sets
(different addresses) fresh contents and calls every contestant on it, and every output is
checked, so no cache keyed on pointers or contents can pay. Contestants run round by round
in a shuffled order, so that clock and thermal drift fall on all of them alike.

`server` mode is the kernel method with an idle gap at a target QPS and L2 flushed before
each call. Earlier versions timed offline by CUDA events around batches of launches, each
followed by an empty kernel (`fenced`) or truly back to back (`back-to-back`); a kernel
launched with PDL hides its launch behind an empty fence, which the baseline pays (measured
on an H200, 128x64x64 read 2.01x fenced, 1.29x by CUPTI and 1.05x in a graph). Their rows
stay readable in a leaderboard, never ranked with this protocol's.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..protocol import OFFLINE_METHODS

INPUT_SETS = 3  # input sets a timed loop rotates through (each its own addresses)


@dataclass(frozen=True)
class Timing:
    median_us: float
    p20_us: float
    p80_us: float
    samples: int


def summarize(samples_us: list[float]) -> Timing:
    q = statistics.quantiles(samples_us, n=10, method="inclusive") if len(samples_us) > 1 else samples_us * 9
    return Timing(statistics.median(samples_us), q[1], q[7], len(samples_us))


def kernel_rounds(
    names: list[str],
    *,
    call: Callable[[str, int], None],
    refresh: Callable[[int], None],
    check: Callable[[str, int], None],
    timer,
    budget_s: float,
    rng: random.Random,
    sets: int = INPUT_SETS,
    min_rounds: int = 5,
    before: Callable[[str, int], None] | None = None,
    first_round: int = 0,
) -> dict[str, list[float]]:
    """Device microseconds of every call of every contestant, the kernel method.

    Round r refreshes input set r % `sets` (fresh contents at that set's addresses), then
    calls each contestant once on it in a shuffled order, each call timed alone:
    `timer.time(fn)` runs `fn` between device syncs and `timer.collect()` returns the device
    time of each timed call, in order. `before(name, set)` runs before each call, untimed
    (the offline methods' lead calls on the other sets; server mode's idle gap and L2 flush). After the round `check(name, set)` checks each output
    (raising if it is wrong). Rounds go on until `budget_s` of wall time is spent and at
    least `min_rounds` rounds are done; `first_round` continues the
    rotation of an earlier call (a session that times one round at a time).
    """
    if sets < 1:
        raise ValueError("at least one input set")
    order: list[str] = []
    deadline = time.perf_counter() + budget_s
    rounds = 0
    while rounds < min_rounds or time.perf_counter() < deadline:
        current = (first_round + rounds) % sets
        refresh(current)
        shuffled = rng.sample(names, len(names))
        for name in shuffled:
            if before:
                before(name, current)
            timer.time(lambda name=name: call(name, current))
            order.append(name)
        for name in shuffled:
            check(name, current)
        rounds += 1
    samples: dict[str, list[float]] = {name: [] for name in names}
    for name, us in zip(order, timer.collect(), strict=True):
        samples[name].append(us)
    return samples


def graph_rounds(
    names: list[str],
    *,
    replay: Callable[[str | None], float],
    calls: int,
    budget_s: float,
    rng: random.Random,
    min_rounds: int = 5,
    rest: float = 0.0,
) -> dict[str, list[float]]:
    """Device microseconds per call, the graph method.

    `replay(name)` replays that contestant's graph (`calls` calls, each behind a neighbour
    kernel) and returns its device time; `replay(None)` replays the graph of the neighbours
    alone. Each round replays the neighbours' graph, then every contestant's in a shuffled
    order; a sample is (contestant's graph - neighbours' graph) / calls. `rest`: after each
    contestant's replay the GPU idles that many times its device time.
    """
    samples: dict[str, list[float]] = {name: [] for name in names}
    deadline = time.perf_counter() + budget_s
    rounds = 0
    while rounds < min_rounds or time.perf_counter() < deadline:
        alone = replay(None)
        for name in rng.sample(names, len(names)):
            took = replay(name)
            samples[name].append((took - alone) / calls)
            if rest > 0:
                time.sleep(rest * took * 1e-6)
        rounds += 1
    return samples


def claimed(ratios: dict[str, float | None]) -> tuple[str, float] | None:
    """The method whose speedup counts, and that speedup: the lower of the offline methods'
    ratios (a method that gave none does not count; neither gives none)."""
    given = [(ratios[m], i, m) for i, m in enumerate(OFFLINE_METHODS) if ratios.get(m) is not None]
    if not given:
        return None
    ratio, _, method = min(given)  # a tie goes to the kernel method
    return method, ratio
