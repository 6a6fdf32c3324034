"""The `llm` proposer: asks an OpenAI-compatible endpoint for candidates, as CUDA-L1 does.

Each round renders a contrastive prompt (cudal2/search/prompt.py, prompts/*.md.j2). The reply's
fenced blocks become candidates (template parameter sets or free-form sources) or `Invalid`
proposals, whose reasons the next round shows.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from ..config import _coerce, config_table
from ..errors import Cudal2Error
from ..kernels.candidate import Candidate, Invalid
from ..kernels.render import get_template, template_candidate
from ..problem import Problem
from .prompt import round_prompt

if TYPE_CHECKING:
    import openai


@dataclass(frozen=True)
class LLMSettings:
    base_url: str | None = None  # None = the openai client's default
    model: str = "gpt-4o-mini"
    api_key_env: str = "OPENAI_API_KEY"  # the variable holding the key; the key is never stored
    temperature: float = 0.7
    max_tokens: int = 16384  # per request; the prompt states it (a reply with a kernel runs to 5-6 K)
    timeout: float = 120.0  # seconds per request
    max_rounds: int = 20  # requests per optimize run; past it propose() returns []
    max_retries: int = 4  # the client's retries, with exponential backoff, on 429 / 5xx / no connection


_KINDS = {
    "base_url": str, "model": str, "api_key_env": str, "temperature": float, "max_tokens": int,
    "timeout": float, "max_rounds": int, "max_retries": int,
}


def load_llm_settings(cli: dict[str, Any] | None = None, config: Path | None = None) -> LLMSettings:
    """Settings from the command line (None = not given), the environment (OPENAI_BASE_URL,
    CUDAL2_LLM_<FIELD>) and cudal2.toml's [llm] table (CUDAL2_CONFIG or ./cudal2.toml)."""
    values = config_table("llm", _KINDS, config)
    for name, kind in _KINDS.items():
        env = "OPENAI_BASE_URL" if name == "base_url" else f"CUDAL2_LLM_{name.upper()}"
        if env in os.environ:
            values[name] = _coerce(name, os.environ[env], kind, env)
    for name, raw in (cli or {}).items():
        if raw is not None:
            values[name] = _coerce(name, raw, _KINDS[name], "command line")
    for name in ("temperature", "max_retries"):
        if name in values and values[name] < 0:
            raise Cudal2Error(f"setting {name} must be >= 0, got {values[name]}")
    for name in ("max_tokens", "timeout", "max_rounds"):
        if name in values and values[name] <= 0:
            raise Cudal2Error(f"setting {name} must be > 0, got {values[name]}")
    return dataclasses.replace(LLMSettings(), **values)


class LLMProposer:
    """Proposes candidates by asking a chat model; one request per round.

    Every round's prompt and reply are kept under `run_dir` (llm-round-<k>-prompt.md,
    llm-round-<k>-reply.md) and its token use is appended to llm-usage.jsonl.
    """

    name = "llm"

    def __init__(self, settings: LLMSettings, *, run_dir: Path, cc: int, device: dict[str, Any], client=None):
        self.settings = settings
        self.run_dir = Path(run_dir)
        self.cc = cc
        self.device = device
        self.client = client or _client(settings)
        self.endpoint = str(getattr(self.client, "base_url", None) or settings.base_url or "the default endpoint")
        self.rounds = 0
        self.usage: list[dict[str, Any]] = []
        # Verified rows of other problems on this GPU (leaderboard.priors): a problem with few
        # measurements of its own is shown the nearest problems' fastest, as the search starts.
        self.prior: list[dict[str, Any]] = []

    def propose(self, problem: Problem, history: list[dict[str, Any]], n: int) -> list[Candidate | Invalid]:
        """Up to `n` new candidates, plus the reply's rejected proposals; [] once the
        round budget is spent."""
        if self.rounds >= self.settings.max_rounds:
            return []
        self.rounds += 1
        system, user = round_prompt(problem, history, n, cc=self.cc, device=self.device, prior=self.prior,
                                    max_tokens=self.settings.max_tokens)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        stem = self.run_dir / f"llm-round-{self.rounds}"
        Path(f"{stem}-prompt.md").write_text(f"<!-- system -->\n{system}\n<!-- user -->\n{user}")
        reply, usage = self._ask(system, user)
        Path(f"{stem}-reply.md").write_text(reply)
        self.usage.append(usage)
        with open(self.run_dir / "llm-usage.jsonl", "a") as log:
            log.write(json.dumps({"round": self.rounds, "model": self.settings.model, **usage}) + "\n")
        return parse_reply(reply, problem, self.cc, n, label=f"llm-r{self.rounds}")

    def _ask(self, system: str, user: str) -> tuple[str, dict[str, Any]]:
        """The model's reply; one cut off at the token limit is continued (up to
        CONTINUATIONS more requests), so a block cut mid-way is completed, not lost."""
        start = time.perf_counter()
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        reply, usage, cut = "", {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}, False
        for request in range(1 + CONTINUATIONS):
            if request:
                messages = [*messages[:2], {"role": "assistant", "content": reply}, {"role": "user", "content": CONTINUE}]
            response = self._request(messages)
            choice = response.choices[0] if response.choices else None
            reply += (choice.message.content if choice else None) or ""
            for name in usage:
                usage[name] += getattr(response.usage, name, None) or 0
            cut = bool(choice) and choice.finish_reason == "length"
            if not cut:
                break
        return reply, {**usage, "cost": getattr(response.usage, "cost", None),  # some endpoints report it
                       "requests": request + 1, "cut_off": cut, "seconds": round(time.perf_counter() - start, 3)}

    def _request(self, messages: list[dict[str, str]]):
        import openai  # its client takes ~0.5 s to import: only when an LLM is asked

        try:
            return self.client.chat.completions.create(
                model=self.settings.model, messages=messages, temperature=self.settings.temperature,
                max_tokens=self.settings.max_tokens,
            )
        except openai.APITimeoutError:
            raise Cudal2Error(
                f"llm endpoint {self.endpoint} timed out after {self.settings.timeout:g} s "
                f"({self.settings.max_retries} retries)"
            ) from None
        except openai.APIConnectionError as exc:
            cause = exc.__cause__ or exc
            raise Cudal2Error(f"cannot reach llm endpoint {self.endpoint}: {self._scrub(str(cause))}") from None
        except openai.APIStatusError as exc:
            raise Cudal2Error(
                f"llm endpoint {self.endpoint} answered HTTP {exc.status_code}: {self._scrub(exc.message)}"
            ) from None

    def _scrub(self, text: str) -> str:
        """One line, without the API key (an endpoint may echo it in an error)."""
        key = os.environ.get(self.settings.api_key_env)
        text = " ".join(text.split())[:300]
        return text.replace(key, "***") if key else text


# Sent when a reply stopped at the token limit (finish_reason "length").
CONTINUE = "Your reply was cut off at the token limit. Continue exactly where it stopped, repeating nothing."
CONTINUATIONS = 2


class ReplayClient:
    """Saved replies standing in for the endpoint: round k answers with `llm-round-<k>-reply.md`
    of `directory` (the files an earlier run saved), so a round is reproducible offline."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise Cudal2Error(f"no replay directory {self.directory}")
        self.base_url = f"replay of {self.directory}"
        self.served = 0
        self.chat = self.completions = self  # client.chat.completions.create(...)

    def create(self, **request):
        self.served += 1
        path = self.directory / f"llm-round-{self.served}-reply.md"
        if not path.is_file():
            raise Cudal2Error(f"the replay has no reply for round {self.served} ({path.name} in {self.directory})")
        message = dataclasses.make_dataclass("Message", ["content"])(path.read_text())
        choice = dataclasses.make_dataclass("Choice", ["message", "finish_reason"])(message, "stop")
        return dataclasses.make_dataclass("Reply", ["choices", "usage"])([choice], None)


def _client(settings: LLMSettings) -> openai.OpenAI:
    key = os.environ.get(settings.api_key_env)
    if not key:
        if urlparse(settings.base_url or "").hostname not in ("localhost", "127.0.0.1", "::1"):
            raise Cudal2Error(f"set {settings.api_key_env} (or --api-key-env) for the llm proposer")
        key = "unused"  # a local server needs none
    import openai  # its client takes ~0.5 s to import: only when an LLM is asked

    return openai.OpenAI(
        base_url=settings.base_url, api_key=key, timeout=settings.timeout, max_retries=settings.max_retries
    )


# A fenced block: its language tag, its body, and its closing fence (None when the reply
# ends inside the block, as a reply cut off at max_tokens does).
_FENCE = re.compile(r"^[ \t]*```[ \t]*([^\s`]*)[^\n]*\n(.*?)(?:(^[ \t]*```)|\Z)", re.M | re.S)
_CODE = ("cuda", "cu", "cpp", "c++", "c")


def parse_reply(reply: str, problem: Problem, cc: int, n: int, label: str) -> list[Candidate | Invalid]:
    """The first `n` distinct candidates in the reply's fenced blocks, then an `Invalid` for
    every block or JSON object that could not be used (candidates `label`-1, -2, ...)."""
    candidates: list[Candidate] = []
    rejected: list[Invalid] = []
    for match in _FENCE.finditer(reply):
        tag, body, closed = match.group(1).lower(), match.group(2), match.group(3)
        if not tag:
            tag = "json" if body.lstrip()[:1] in ("{", "[") else "cuda"
        if tag not in ("json", *_CODE):
            continue  # prose in a fence (```text, ```bash): not a proposal
        if not closed:
            rejected.append(_invalid("the reply ended inside a code block (max_tokens reached?)", body))
        elif tag != "json":
            if "cudal2_gemm" in body:
                candidates.append(Candidate.from_source(body, label=f"{label}-{len(candidates) + 1}"))
            else:
                rejected.append(_invalid("the source does not define cudal2_gemm (see the kernel ABI)", body))
        else:
            try:
                doc = json.loads(body)
            except json.JSONDecodeError as exc:
                rejected.append(_invalid(f"bad JSON: {exc}", body))
                continue
            for proposal in doc if isinstance(doc, list) else [doc]:
                try:
                    candidates.append(_template_candidate(proposal, problem, cc))
                except Cudal2Error as exc:
                    rejected.append(_invalid(str(exc), json.dumps(proposal)))
    if not candidates and not rejected:
        return [_invalid("no candidate blocks in the reply", reply)]
    return list(dict.fromkeys(candidates))[:n] + rejected


def _template_candidate(proposal: Any, problem: Problem, cc: int) -> Candidate:
    shape = 'a JSON candidate is {"template": "<name>", "params": {"<parameter>": <value>, ...}}'
    if not isinstance(proposal, dict) or not isinstance(proposal.get("template"), str):
        raise Cudal2Error(shape)
    if set(proposal) - {"template", "params"} or not isinstance(proposal.get("params", {}), dict):
        raise Cudal2Error(f"unexpected keys or params: {shape}")
    name, params = proposal["template"], proposal.get("params", {})
    for key, value in params.items():
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise Cudal2Error(f"parameter {key} takes an integer or a string, got {json.dumps(value)}")
    if not get_template(name).supports(problem, cc):
        raise Cudal2Error(f"template {name} does not support {problem.dtype} {problem.layout} on compute capability {cc}")
    return template_candidate(name, params, cc)


def _invalid(reason: str, text: str) -> Invalid:
    return Invalid(reason=reason, text=text if len(text) <= 2000 else text[:2000] + "\n...")
