"""Proposers: where candidates come from. One small interface; the loop does not know
which one runs.

A proposer's `propose(problem, history, n)` returns up to n new candidates (and, for
proposers that parse free text, `Invalid` records of proposals that were unusable).
`history` holds the leaderboard rows of this problem on this GPU, newest last.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from typing import Any, Protocol

from .candidate import Candidate
from .cost import predict_us, rank
from .problem import Problem
from .render import Template, load_templates


class Proposer(Protocol):
    name: str

    def propose(self, problem: Problem, history: list[dict[str, Any]], n: int) -> list: ...


def tried(history: list[dict[str, Any]]) -> set[tuple[str, str]]:
    """(template, params JSON) of every template candidate already recorded."""
    return {(row["template"], row["params"]) for row in history if row.get("template")}


class SearchProposer:
    """Starts from the cost model's ranking, then searches around what measured best.

    Each round: the neighbours (one parameter moved one step in its values list) of the
    three fastest measured configurations, ranked by the cost model rescaled per template
    by how far its predictions were from the measurements; the rest of the batch follows
    the global ranking. Ties are broken by a seeded shuffle: deterministic per --seed.
    """

    name = "search"

    def __init__(self, device: dict[str, Any], seed: int = 0, templates: dict[str, Template] | None = None):
        self.device = device
        self.seed = seed
        self.templates = templates or load_templates()
        self._ranking: dict[Problem, list[tuple[float, str, dict]]] = {}

    def ranking(self, problem: Problem) -> list[tuple[float, str, dict]]:
        if problem not in self._ranking:
            ranked = rank(self.templates, problem, self.device)
            rng = random.Random(self.seed)
            keyed = [(t, rng.random(), name, params) for t, name, params in ranked]
            keyed.sort(key=lambda e: (e[0], e[1]))
            self._ranking[problem] = [(t, name, params) for t, _, name, params in keyed]
        return self._ranking[problem]

    def _scales(self, problem: Problem, history: list[dict[str, Any]]) -> dict[str, float]:
        """Measured over predicted time, per template (1.0 before any measurement)."""
        ratios: dict[str, list[float]] = {}
        for row in history:
            if row.get("status") == "ok" and row.get("template") in self.templates and row.get("offline_us"):
                template = self.templates[row["template"]]
                predicted = predict_us(template, json.loads(row["params"]), problem, self.device)
                if math.isfinite(predicted):
                    ratios.setdefault(row["template"], []).append(row["offline_us"] / predicted)
        return {name: statistics.median(values) for name, values in ratios.items()}

    def _neighbours(self, name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        space = self.templates[name].space
        found = []
        for key, spec in space.params.items():
            i = spec.values.index(params[key])
            for j in (i - 1, i + 1):
                if 0 <= j < len(spec.values):
                    moved = {**params, key: spec.values[j]}
                    if not space.violations(moved, self.device["cc"]):
                        found.append(moved)
        return found

    def propose(self, problem: Problem, history: list[dict[str, Any]], n: int) -> list[Candidate]:
        seen = tried(history)
        scales = self._scales(problem, history)

        def score(name: str, params: dict[str, Any]) -> float:
            return predict_us(self.templates[name], params, problem, self.device) * scales.get(name, 1.0)

        picks: list[Candidate] = []

        def take(name: str, params: dict[str, Any]) -> None:
            candidate = Candidate.from_template(name, params)
            key = (name, candidate.params_json)
            if key not in seen and len(picks) < n:
                seen.add(key)
                picks.append(candidate)

        measured = sorted(
            (row for row in history if row.get("status") == "ok" and row.get("template") in self.templates
             and row.get("offline_us")),
            key=lambda row: row["offline_us"],
        )
        near = []
        for row in measured[:3]:
            for params in self._neighbours(row["template"], json.loads(row["params"])):
                t = score(row["template"], params)
                if math.isfinite(t):
                    near.append((t, row["template"], params))
        near.sort(key=lambda e: e[0])
        for _, name, params in near[: (n + 1) // 2]:
            take(name, params)
        for _, name, params in sorted(self.ranking(problem), key=lambda e: e[0] * scales.get(e[1], 1.0)):
            if len(picks) >= n:
                break
            take(name, params)
        return picks


class HybridProposer:
    """The first proposer's ideas (an LLM's) plus search around the best so far: each
    batch is split between them, and whatever one leaves unfilled the other fills."""

    name = "hybrid"

    def __init__(self, first: Proposer, second: Proposer):
        self.first, self.second = first, second

    def propose(self, problem: Problem, history: list[dict[str, Any]], n: int) -> list:
        ideas = self.first.propose(problem, history, (n + 1) // 2)
        usable = sum(1 for idea in ideas if isinstance(idea, Candidate))
        extra = [row for idea in ideas if isinstance(idea, Candidate) and idea.template
                 for row in [{"template": idea.template, "params": idea.params_json}]]
        return ideas + self.second.propose(problem, history + extra, n - usable)
