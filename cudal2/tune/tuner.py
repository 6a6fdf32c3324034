"""A tuning run's wiring: the GPU workers (one per device), a compiler for each sharing the
machine's cores, the proposers (search, LLM, or both) and the budget. `Tuner.run` tunes a
list of problems through optimize_shapes, one ShapeRun (cudal2/tune/optimize.py) per problem."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

from ..config import Settings
from ..errors import Cudal2Error
from ..kernels import prebuilt
from ..kernels import render as render_stage
from ..kernels.candidate import Candidate
from ..kernels.compile import Compiler
from ..measure.environment import default_arch
from ..problem import Problem
from ..results.leaderboard import Leaderboard, priors, with_shipped
from ..search.llm import LLMProposer, LLMSettings
from ..search.propose import HybridProposer, Proposer, SearchProposer
from .optimize import Budget, Event, Outcome, optimize_shapes
from .pipeline import Context, new_run_id


@dataclass(frozen=True)
class Search:
    """What proposes: `proposer` search | llm | hybrid; the search's `seed`, and its
    restriction to one `template` (and a `grid` of its parameters); the LLM's settings and a
    stand-in client (`replies`: saved replies, ReplayClient)."""

    proposer: str = "search"
    seed: int = 0
    template: str | None = None
    grid: dict[str, list[str]] | None = None
    llm: LLMSettings | None = None
    replies: Any = None


class Tuner:
    """One tuning run over started GPU `workers` (all of one GPU model and driver): each
    gets a compiler (sharing the compile slots: settings.jobs, or every core) and, with an
    LLM, its own LLM proposer; every shape gets a search proposer warm-started from the
    shapes measured before it (here and shipped). Rows go to `leaderboard` (default: the
    results directory's)."""

    def __init__(self, settings: Settings, workers: list, search: Search, budget: Budget, *,
                 mode: str = "offline", remeasure: bool = False, leaderboard: Leaderboard | None = None):
        self.settings, self.workers, self.search, self.budget = settings, workers, search, budget
        self.mode, self.remeasure = mode, remeasure
        envs = [w.start() for w in workers]
        if len({(e["gpu"], e["cc"], e.get("driver")) for e in envs}) > 1:
            raise Cudal2Error("--gpus names GPUs of different models or drivers: " +
                              ", ".join(f"{w.device}: {e['gpu']} ({e.get('driver')})" for w, e in zip(workers, envs)))
        self.environment = env = envs[0]
        slots = threading.BoundedSemaphore(settings.jobs or os.cpu_count() or 1)
        self.compilers = [Compiler(settings.arch or default_arch(env["cc"]), settings.cache_dir, settings.jobs,
                                   settings.timeout, slots) for _ in workers]
        self.leaderboard = leaderboard or Leaderboard(settings.results)
        self.run_id = new_run_id()
        self.within = self._within(search, env["cc"])
        self.llms = [self._llm(w.device) for w in workers] if search.llm is not None else [None] * len(workers)
        self._built: dict[tuple[str, str], list[tuple[str, dict]]] = {}  # per dtype and layout
        self._prebuilt: list[prebuilt.Entry] | None = None
        self._prebuilt_lock = threading.Lock()
        if search.proposer != "llm":  # read while the first shape's baselines run (a search asks for it first)
            threading.Thread(target=self._read_prebuilt_set_ahead, name="cudal2-prebuilt-set", daemon=True).start()

    def run(self, problems: list[Problem], on_event: Event | None = None) -> list[Outcome]:
        """Tunes every problem (optimize_shapes: each worker takes the next untuned shape)."""
        return optimize_shapes(problems, self.context, self.proposer_for, self.budget, workers=len(self.workers),
                               remeasure=self.remeasure, on_event=on_event)

    @property
    def llm_tokens(self) -> int | None:
        """The LLM proposers' tokens over the run (None: no LLM)."""
        if self.search.llm is None:
            return None
        return sum(u.get("total_tokens") or 0 for llm in self.llms if llm for u in llm.usage)

    def context(self, problem: Problem, slot: int) -> Context:
        """What every row of `problem` on worker number `slot` shares."""
        llm = self.search.llm
        return Context(problem, self.settings, self.workers[slot], self.compilers[slot], self.leaderboard,
                       self.run_id, mode=self.mode, proposer=self.search.proposer,
                       model=llm.model if llm else None)

    def proposer_for(self, ctx: Context) -> Proposer:
        """The proposer of one shape: the shapes tuned before it, here and in the shipped
        measurements, are its priors."""
        prior = priors(self.leaderboard.read(), self.environment["gpu"])
        search = SearchProposer(self.environment, seed=self.search.seed, prior=prior, cached=self._cached,
                                within=self.within, built=self._built_here)
        llm = self.llms[self.compilers.index(ctx.compiler)]
        if llm is None:
            return search
        llm.prior = prior  # its warm start: the nearest problems' fastest
        return llm if self.search.proposer == "llm" else HybridProposer(llm, search)

    def _llm(self, device: int) -> LLMProposer:
        return LLMProposer(self.search.llm, run_dir=self.settings.results / "runs" / self.run_id / f"gpu{device}",
                           cc=self.environment["cc"], device=self.environment, client=self.search.replies)

    @staticmethod
    def _within(search: Search, cc: int) -> list[Candidate] | None:
        """With a template: every configuration of its grid (or of its whole space) valid here."""
        if not search.template:
            return None
        if search.grid:
            return render_stage.template_grid(search.template, search.grid, cc)
        space = render_stage.get_template(search.template).space
        return [Candidate.from_template(search.template, p) for p in space.configurations(cc)]

    def _cached(self, target: Problem, name: str, params: dict[str, Any]) -> bool:
        """Whether this template configuration's binary for `target` is in the compile cache."""
        return self.compilers[0].lookup(render_stage.render(Candidate.from_template(name, params), target)) is not None

    def _prebuilt_set(self) -> list[prebuilt.Entry]:
        """The prebuilt set as this machine may hold it, read once: by a thread the run starts
        (an LLM-only run never reads it), so that the first shape's first batch does not wait
        for it (1-3 s of one core: on the H200 the first shape of a --time-budget 5 run waited
        about 2.4 s for its proposal and screened 15 kernels, where the others screened 64)."""
        with self._prebuilt_lock:
            if self._prebuilt is None:
                measured = with_shipped(self.leaderboard.read(protocol=None))
                self._prebuilt = prebuilt.available(self.settings.cache_dir, self.compilers[0].arch, measured)
            return self._prebuilt

    def _read_prebuilt_set_ahead(self) -> None:
        try:
            self._prebuilt_set()
        except Exception:  # (an unreadable cache, say) the first search to ask reads it again and reports it
            pass

    def _built_here(self, target: Problem) -> list[tuple[str, dict]]:
        """The prebuilt set as far as it is built here (what a first batch can rank in
        milliseconds): what the cache's manifest lists (a `prebuild` or its unpacked tarball:
        the cost model's region picks with the measured near-best) and the measured part of
        the set; per dtype and layout, whose builds serve every shape."""
        variant = (target.dtype, target.layout)
        if variant not in self._built:
            self._built[variant] = [
                (e.candidate.template, e.candidate.param_dict) for e in self._prebuilt_set()
                if (e.dtype, e.layout) == variant and self._cached(target, e.candidate.template, e.candidate.param_dict)]
        return self._built[variant]

