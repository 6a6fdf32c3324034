"""Proposers: where candidates come from. One small interface; the loop does not know
which one runs.

A proposer's `propose(problem, history, n)` returns up to n new candidates (and, for
proposers that parse free text, `Invalid` records of proposals that were unusable).
`history` holds the leaderboard rows of this problem on this GPU, newest last.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import json
import math
import operator
import random
import statistics
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from ..kernels.candidate import Candidate
from ..kernels.render import Template, load_templates, recorded_params
from ..problem import Problem
from .cost import predict_us, rank_values


class Proposer(Protocol):
    name: str

    def propose(self, problem: Problem, history: list[dict[str, Any]], n: int) -> list: ...


def tried(history: list[dict[str, Any]]) -> set[tuple[str, str]]:
    """(template, params JSON) of every template candidate already recorded."""
    return {(row["template"], row["params"]) for row in history if row.get("template")}


def problem_distance(a: Problem, b: Problem) -> float:
    """How far apart two problems are for sharing configurations: log2 distance of m, n
    and k, plus 4 (a factor of 16 in one dimension) for another dtype or layout."""
    logs = sum(abs(math.log2(x / y)) for x, y in ((a.m, b.m), (a.n, b.n), (a.k, b.k)))
    return logs + (4.0 if (a.dtype, a.layout) != (b.dtype, b.layout) else 0.0)


def nearest_winners(problem: Problem, rows: list[dict[str, Any]], per_problem: int = 3,
                    same: bool = False) -> list[dict[str, Any]]:
    """The rows of the template configurations that measured fastest on other problems
    (`same`: on this one too, first: a measurement shipped with the package or made on
    another machine of this GPU): the best `per_problem` of each problem (by offline
    speedup), nearest problems first."""
    by_problem: dict[Problem, list[dict[str, Any]]] = {}
    for row in rows:
        speedup = row.get("speedup_offline")
        if (row.get("status") == "ok" and isinstance(row.get("template"), str) and isinstance(row.get("params"), str)
                and speedup is not None and speedup == speedup):
            other = Problem(int(row["m"]), int(row["n"]), int(row["k"]), row["dtype"], row["layout"])
            if same or other != problem:
                by_problem.setdefault(other, []).append(row)
    found: list[dict[str, Any]] = []
    for other in sorted(by_problem, key=lambda o: (problem_distance(problem, o), o.m, o.n, o.k, o.dtype, o.layout)):
        found += sorted(by_problem[other], key=lambda r: -r["speedup_offline"])[:per_problem]
    return found


class Correction:
    """What the measurements of this problem say about the cost model's errors, as a factor
    on its predicted time: per template the median of measured over predicted, times an
    effect per parameter value, fitted to the remaining log ratios as an additive model
    (ridge-shrunk: a value seen in n measured configurations moves by at most n / (n + 1)
    of its mean residual). A value never measured has no effect; before any measurement the
    factor is 1. So one fast split_k=1 kernel lifts every split_k=1 configuration the model
    ranked low."""

    RIDGE = 1.0
    SWEEPS = 4  # backfitting passes

    def __init__(self, measured: list[tuple[str, dict[str, Any], float]]):
        logs: dict[str, list[tuple[dict[str, Any], float]]] = {}
        for name, params, ratio in measured:
            logs.setdefault(name, []).append((params, math.log(ratio)))
        self.base = {name: statistics.median(v for _, v in entries) for name, entries in logs.items()}
        self.effect: dict[tuple[str, str, Any], float] = {}
        for name, entries in logs.items():
            keys = sorted({key for params, _ in entries for key in params})
            for _ in range(self.SWEEPS):
                for key in keys:
                    sums: dict[Any, list[float]] = {}
                    for params, value in entries:
                        rest = value - self.base[name] - sum(self.effect.get((name, k, v), 0.0)
                                                             for k, v in params.items() if k != key)
                        sums.setdefault(params.get(key), []).append(rest)
                    for v, rests in sums.items():
                        self.effect[(name, key, v)] = sum(rests) / (len(rests) + self.RIDGE)

    def __call__(self, name: str, params: dict[str, Any]) -> float:
        if name not in self.base:
            return 1.0
        return math.exp(self.base[name] + sum(self.effect.get((name, k, v), 0.0) for k, v in params.items()))

    def lowest(self) -> float:
        """A factor no configuration's is below: per template its base with each parameter's
        most negative effect (none where that lowers nothing), and 1 for the templates
        never measured."""
        worst: dict[tuple[str, str], float] = {}  # per (template, parameter): its most negative effect, or 0
        for (name, key, _), effect in self.effect.items():
            worst[(name, key)] = min(worst.get((name, key), 0.0), effect)
        low = dict(self.base)
        for (name, _), effect in worst.items():
            low[name] += effect
        # Lowered by a part in 10^9: the factors' own sums, added in another order, may round
        # a unit below this one's.
        return min([1.0, *map(math.exp, low.values())]) * (1 - 1e-9)


class Ranking:
    """One problem's ranked configurations, fastest predicted first, held as three parallel
    columns (predicted us, template name, tuple of values in its space's parameter order):
    each entry read becomes (us, name, params), a dictionary made then. A Hopper ranking holds
    320,000 configurations: 8 MB so, 170 MB as dictionaries."""

    def __init__(self, entries: list[tuple[float, str, tuple[Any, ...]]], templates: dict[str, Template]):
        self.prices = array("d", (entry[0] for entry in entries))
        self.names = [entry[1] for entry in entries]
        self.values = [entry[2] for entry in entries]
        self._params = {name: tuple(template.space.params) for name, template in templates.items()}

    def __len__(self) -> int:
        return len(self.prices)

    def __iter__(self) -> Iterator[tuple[float, str, dict[str, Any]]]:
        for t, name, values in zip(self.prices, self.names, self.values):
            yield t, name, dict(zip(self._params[name], values))

    def templates(self) -> set[str]:
        return set(self.names)

    def corrected(self, correction: Correction) -> Iterator[tuple[float, str, dict[str, Any]]]:
        """The entries by their price times `correction`, lowest first, ties in ranking order:
        sorted() of every entry would say the same, but a batch reads a few hundred of them.
        An entry leaves the heap once no later one can undercut it: a later entry costs at
        least its own prediction times correction.lowest()."""
        low, heap = correction.lowest(), []
        for i, entry in enumerate(self):
            while heap and heap[0][0] <= entry[0] * low:
                yield heapq.heappop(heap)[2]
            heapq.heappush(heap, ((price := entry[0] * correction(entry[1], entry[2])), i, (price, *entry[1:])))
        while heap:
            yield heapq.heappop(heap)[2]


class SearchProposer:
    """Starts from what won on the nearest problems and the cost model's ranking, then
    searches around what measured best.

    Half of each batch alternates between the fastest configurations of the nearest other
    problems (`prior`: leaderboard rows; nearest first) and the neighbours (one parameter
    moved one step in its values list) of this problem's three fastest measured
    configurations: moves to a value never measured on this problem first, then the
    parameters in turn, each one's best move by the cost model (corrected by what was
    measured: `Correction`) first, so a parameter the model misjudges on this problem
    (split_k where the tiles already fill the GPU, say) is still moved. The rest of the
    batch follows the global ranking, one configuration per predicted time first. A
    configuration whose build is not in the compile cache (`cached` says) counts
    UNCACHED_PENALTY slower: a CUTLASS compile costs a minute, a cached one nothing; a
    problem's first batch takes the built ones first, ranked among themselves alone when
    `built` lists enough of them (the prebuilt set), and then warm-starts from built ones only. Ties
    go to the configuration nearest the defaults, then to a seeded shuffle: deterministic
    per --seed.
    """

    name = "search"
    UNCACHED_PENALTY = 1.05
    WINDOW = 256  # ranked configurations re-ordered by the cache preference
    RANKINGS_KEPT = 4  # problems whose ranking is kept (a shape set visits each in turn)

    def __init__(self, device: dict[str, Any], seed: int = 0, templates: dict[str, Template] | None = None,
                 prior: list[dict[str, Any]] | None = None,
                 cached: Callable[[Problem, str, dict], bool] | None = None,
                 within: list[Candidate] | None = None,
                 built: Callable[[Problem], list[tuple[str, dict]]] | None = None):
        self.device = device
        self.seed = seed
        self.within = {(c.template, c.params_json) for c in within} if within else None
        self.templates = templates or load_templates()
        if within:  # search only these configurations (for example a --param grid)
            self.templates = {c.template: self.templates[c.template] for c in within}
        self.prior = prior or []
        self.cached = cached
        self.built = None if within else built  # configurations known built (the prebuilt set's), per problem
        self._ranking: OrderedDict[Problem, Ranking] = OrderedDict()  # the RANKINGS_KEPT latest
        self._penalty: dict[tuple[Problem, str, str], float] = {}

    def ranking(self, problem: Problem) -> Ranking:
        if problem not in self._ranking:
            if self.within is None:
                ranked = rank_values(self.templates, problem, self.device)
            else:
                configs = [(name, json.loads(text)) for name, text in sorted(self.within)
                           if self.templates[name].supports(problem, self.device["cc"])]
                ranked = [(predict_us(self.templates[name], params, problem, self.device), name,
                           tuple(params[key] for key in self.templates[name].space.params)) for name, params in configs]
                ranked = [entry for entry in ranked if math.isfinite(entry[0])]
            self._ranking[problem] = self._tie_broken(ranked)
            while len(self._ranking) > self.RANKINGS_KEPT:
                self._ranking.popitem(last=False)
        return self._ranking[problem]

    def _tie_broken(self, ranked: list[tuple[float, str, tuple[Any, ...]]]) -> Ranking:
        """Ties: the configuration nearest its template's defaults first (the model has no
        term for some parameters, stages say, whose defaults are the measured-good choices),
        then a seeded shuffle."""
        rng = random.Random(self.seed)
        defaults = {name: tuple(t.space.defaults()[key] for key in t.space.params) for name, t in self.templates.items()}
        keyed = [(t, sum(map(operator.ne, values, defaults[name])), rng.random(), name, values)
                 for t, name, values in ranked]
        keyed.sort(key=lambda e: e[:3])
        return Ranking([(t, name, values) for t, _, _, name, values in keyed], self.templates)

    def _correction(self, problem: Problem, history: list[dict[str, Any]]) -> Correction:
        measured = []
        for row in history:
            if row.get("status") == "ok" and row.get("template") in self.templates and row.get("offline_us"):
                params = recorded_params(row, self.templates)
                predicted = predict_us(self.templates[row["template"]], params, problem, self.device) if params else math.inf
                if math.isfinite(predicted):
                    measured.append((row["template"], params, row["offline_us"] / predicted))
        return Correction(measured)

    def _neighbours(self, name: str, params: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        """(parameter, configuration) for each valid one-step move of one parameter."""
        space = self.templates[name].space
        found = []
        for key, spec in space.params.items():
            i = spec.values.index(params[key])
            for j in (i - 1, i + 1):
                if 0 <= j < len(spec.values):
                    moved = {**params, key: spec.values[j]}
                    if not space.violations(moved, self.device["cc"]):
                        found.append((key, moved))
        return found

    def propose(self, problem: Problem, history: list[dict[str, Any]], n: int) -> list[Candidate]:
        seen = tried(history)
        correction = self._correction(problem, history)

        def launched(name: str, params: dict[str, Any]) -> tuple[str, str]:
            # What the configuration runs on this problem (Space.launched): caps above its need
            # launch alike, and one measurement of them tells all.
            space = self.templates[name].space
            return name, space.launch_key(params, self.device["cc"], problem, self.device["sm_count"])

        ran = {launched(row["template"], params) for row in history
               if row.get("template") in self.templates and (params := recorded_params(row, self.templates))}

        def penalty(name: str, params: dict[str, Any]) -> float:
            # Looked up once per configuration and run (a lookup renders the source): a build
            # cached since then is one this run compiled, and so measured, or about to be.
            key = (problem, name, json.dumps(params, sort_keys=True))
            if key not in self._penalty:
                cached = self.cached is None or self.cached(problem, name, params)
                self._penalty[key] = 1.0 if cached else self.UNCACHED_PENALTY
            return self._penalty[key]

        def score(name: str, params: dict[str, Any]) -> float:
            t = predict_us(self.templates[name], params, problem, self.device) * correction(name, params)
            return t * penalty(name, params) if math.isfinite(t) else t

        picks: list[Candidate] = []

        def fresh(name: str, params: dict[str, Any]) -> bool:  # neither measured (nor its launch) nor outside `within`
            key = (name, Candidate.from_template(name, params).params_json)
            return (key not in seen and launched(name, params) not in ran
                    and (self.within is None or key in self.within))

        def take(name: str, params: dict[str, Any]) -> None:
            if len(picks) < n and fresh(name, params):
                candidate = Candidate.from_template(name, params)
                seen.add((name, candidate.params_json))
                ran.add(launched(name, params))
                picks.append(candidate)

        measured, near = self._near(history, fresh, score)
        warm = self._warm(problem, score)
        first = not measured  # nothing of this problem measured yet: what is built goes first
        if first and self.built is not None and self.built(problem):
            # With the prebuilt set here, a first batch compiles nothing: another problem's
            # winner in another dtype or layout is seldom built (a shape set's fp16 nn winners
            # warm-started its bf16 nt decode shape on an H100, with no shipped rows of its
            # own, and its first batch waited 48 s on nvcc). Later batches may still take it.
            warm = [e for e in warm if penalty(e[1], e[2]) <= 1.0]
        elif first:
            warm.sort(key=lambda e: penalty(e[1], e[2]) > 1.0)
        # Half the batch: warm-start picks and neighbours, alternating (warm first).
        alternating = [e for pair in itertools.zip_longest(warm, near) for e in pair if e is not None]
        for t, name, params in alternating:
            if len(picks) >= (n + 1) // 2:
                break
            if math.isfinite(t):
                take(name, params)
        ranking = self._first_ranking(problem, first, n - len(picks), fresh)
        for _, name, params in self._ordered(ranking.corrected(correction), penalty, first):
            if len(picks) >= n:
                break
            take(name, params)
        if first and self.cached is not None and picks:
            self._quick_build(problem, picks, ranking, correction, penalty, fresh)
        return picks

    def _ordered(self, corrected: Iterator[tuple[float, str, dict]], penalty,
                 first: bool) -> Iterator[tuple[float, str, dict]]:
        """The ranked half's order, read from `corrected` (entries by corrected price) only as
        far as a batch takes. One configuration per price first: those the model prices alike
        (they differ in stages, cluster orientation, K depth, ...) tell as much about its
        error as one of them does, and the neighbour moves try their differences around the
        fastest. So a batch spans the model's distinct options, not one tile shape's variants;
        the others follow. Among the first WINDOW of each (the price classes' firsts, then the
        rest) the cache preference may reorder."""
        def cache_first(entries: list) -> list:  # entries carry their corrected price
            def key(e):  # the first batch takes every built configuration before any other
                return (penalty(e[1], e[2]) > 1.0, e[0]) if first else (e[0] * penalty(e[1], e[2]),)
            return sorted(entries, key=key)

        firsts, rest, prices = [], [], set()
        for entry in corrected:
            key = (entry[1], round(math.log(entry[0]), 3))
            if key in prices:
                rest.append(entry)
                continue
            prices.add(key)
            if len(firsts) < self.WINDOW:
                firsts.append(entry)
                if len(firsts) == self.WINDOW:
                    yield from cache_first(firsts)
            else:
                yield entry
        if len(firsts) < self.WINDOW:
            yield from cache_first(firsts)
        yield from cache_first(rest[: self.WINDOW])
        yield from rest[self.WINDOW:]

    def _near(self, history: list[dict[str, Any]], fresh, score) -> tuple[list[dict], list[tuple[float, str, dict]]]:
        """This problem's verified template rows, fastest first, and the fresh neighbours of
        the three fastest (scored): moves to a value never measured on this problem first
        (they tell the most, whatever the model thinks of them), then each parameter's best
        move, each one's second, ..."""
        measured = sorted(
            (row for row in history if row.get("status") == "ok" and row.get("template") in self.templates
             and row.get("offline_us")),
            key=lambda row: row["offline_us"],
        )
        measured_params = [(row["template"], params) for row in measured
                           if (params := recorded_params(row, self.templates)) is not None]
        values_measured = {(name, key, value) for name, params in measured_params for key, value in params.items()}
        novel, by_axis = [], {}
        for name, params in measured_params[:3]:
            for key, moved in self._neighbours(name, params):
                if fresh(name, moved):
                    entry = (score(name, moved), name, moved)
                    if (name, key, moved[key]) not in values_measured:
                        novel.append(entry)
                    else:
                        by_axis.setdefault((name, key), []).append(entry)
        near = sorted(novel, key=lambda e: e[0])
        axes = [sorted(moves, key=lambda e: e[0]) for moves in by_axis.values()]
        for layer in itertools.zip_longest(*axes):
            near += sorted((e for e in layer if e is not None), key=lambda e: e[0])
        return measured, near

    def _warm(self, problem: Problem, score) -> list[tuple[float, str, dict]]:
        """What won on the nearest problems (measured here already: not fresh), in that
        order, if it can run this one (scored)."""
        warm = []
        for row in nearest_winners(problem, self.prior, same=True):
            params, template = recorded_params(row, self.templates), self.templates.get(row["template"])
            if (params is not None and template.supports(problem, self.device["cc"])
                    and not template.space.violations(params, self.device["cc"])):
                warm.append((score(row["template"], params), row["template"], params))
        return warm

    def _first_ranking(self, problem: Problem, first: bool, wanted: int, fresh) -> Ranking:
        """What the batch's ranked half is drawn from: for a first batch with at least
        `wanted` fresh built configurations (`built`), those alone, ranked in milliseconds;
        else the whole ranking (seconds: 320,000 configurations on Hopper), which a later
        batch computes while the first one is on the GPU."""
        if first and self.built is not None and problem not in self._ranking:
            ranked = []
            for name, params in self.built(problem):
                template = self.templates.get(name)
                if (template is not None and template.supports(problem, self.device["cc"]) and fresh(name, params)
                        and math.isfinite(t := predict_us(template, params, problem, self.device))):
                    ranked.append((t, name, tuple(params[key] for key in template.space.params)))
            if len(ranked) >= wanted:
                return Ranking(sorted(ranked, key=lambda e: e[0]), self.templates)
        return self.ranking(problem)

    def _quick_build(self, problem: Problem, picks: list[Candidate], ranking: Ranking, correction: Correction,
                     penalty, fresh) -> None:
        """A first batch with nothing built holds the best configuration of the template that
        compiles fastest (sm80_mma: seconds; a CUTLASS kernel: half a minute and more), so a
        run from an empty cache has a verified kernel while the others compile."""
        if any(penalty(c.template, c.param_dict) <= 1.0 for c in picks):
            return
        ranked = ranking.templates()  # a template that can run this shape (gemv: M or N <= 8)
        quick = min((t for t in self.templates.values() if t.name in ranked and t.supports(problem, self.device["cc"])),
                    key=lambda t: t.space.compile_s, default=None)
        if quick is None or any(c.template == quick.name for c in picks):
            return
        for _, name, params in self._ordered(ranking.corrected(correction), penalty, True):
            if name == quick.name and fresh(name, params):
                picks[-1] = Candidate.from_template(name, params)
                return


class HybridProposer:
    """The first proposer's ideas (an LLM's) plus search around the best so far: each
    batch is split between them, and whatever one leaves unfilled the other fills."""

    name = "hybrid"

    def __init__(self, first: Proposer, second: Proposer):
        self.first, self.second = first, second

    def propose(self, problem: Problem, history: list[dict[str, Any]], n: int) -> list:
        ideas = [from_proposer(idea, self.first.name) for idea in self.first.propose(problem, history, (n + 1) // 2)]
        usable = sum(1 for idea in ideas if isinstance(idea, Candidate))
        extra = [row for idea in ideas if isinstance(idea, Candidate) and idea.template
                 for row in [{"template": idea.template, "params": idea.params_json}]]
        return ideas + [from_proposer(idea, self.second.name)
                        for idea in self.second.propose(problem, history + extra, n - usable)]


def from_proposer(proposal, name: str):
    """The proposal with `name` as its origin, unless it has one (an Invalid stays as it is)."""
    if isinstance(proposal, Candidate) and not proposal.origin:
        return dataclasses.replace(proposal, origin=name)
    return proposal
