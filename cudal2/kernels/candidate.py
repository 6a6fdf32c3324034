"""A candidate kernel: a template with parameters, or a free-form CUDA source."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Candidate:
    """A frozen, hashable proposal. Exactly one of `template` and `source` is set.

    `params` is a sorted tuple of (name, value) pairs so that equal parameter sets are
    equal candidates; `label` names a free-form source for people (its file name) and
    `origin` the proposer that made it (its leaderboard `proposer`); neither takes part in
    identity.
    """

    template: str | None = None
    params: tuple[tuple[str, Any], ...] = ()
    source: str | None = None
    label: str = field(default="", compare=False)
    origin: str = field(default="", compare=False)

    @classmethod
    def from_template(cls, template: str, params: dict[str, Any]) -> Candidate:
        return cls(template=template, params=tuple(sorted(params.items())))

    @classmethod
    def from_source(cls, source: str, label: str = "free-form") -> Candidate:
        return cls(source=source, label=label)

    @property
    def param_dict(self) -> dict[str, Any]:
        return dict(self.params)

    @property
    def id(self) -> str:
        """A short stable id: the template and parameters, or the source's hash."""
        text = self.source if self.source is not None else f"{self.template}{self.params_json}"
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    @property
    def params_json(self) -> str:
        return json.dumps(self.param_dict, sort_keys=True)

    def __str__(self) -> str:
        if self.template is None:
            return self.label or f"source:{self.id}"
        inner = ",".join(f"{k}={v}" for k, v in self.params)
        return f"{self.template}({inner})"


@dataclass(frozen=True)
class Invalid:
    """A proposal rejected before anything was compiled (a leaderboard row of status
    "invalid"): why, and the offending part of the proposal, both shown to its author."""

    reason: str
    text: str
