"""The llm proposer's prompt: what one round shows the model (prompts/*.md.j2).

Contrastive, as in CUDA-L1: the problem and what a tuner derives from it, the GPU, the
fastest library call's time (the baseline), the templates that can run the problem with
the facts a valid parameter set needs, the fastest and slowest measured candidates with
their resource stats, and recent failures with their reasons.
"""

from __future__ import annotations

import functools
import json
import math
import re
import statistics
from typing import Any

import jinja2

from ..kernels.render import Template, bundled_dir, load_templates, max_smem, recorded_params
from ..measure.environment import dram_bandwidth, tensor_peak
from ..measure.verify import physical_floor_us
from ..problem import LAYOUT_HELP, Problem
from ..protocol import BASELINES, SCREENED
from .propose import nearest_winners

WARM_START = 8  # below this many measured candidates of its own, a problem is shown its nearest ones


def round_prompt(problem: Problem, history: list[dict[str, Any]], n: int, *, cc: int, device: dict[str, Any],
                 prior: list[dict[str, Any]], max_tokens: int) -> tuple[str, str]:
    """The (system, user) messages of one round asking for `n` candidates: `history` is the
    problem's rows on this GPU, `prior` the verified rows of other problems there (shown
    while the problem has fewer than WARM_START measured candidates of its own)."""
    facts = round_facts(problem, history, n, cc=cc, device=device, prior=prior, max_tokens=max_tokens)
    return _prompts().get_template("system.md.j2").render(), _prompts().get_template("round.md.j2").render(facts)


@functools.cache
def _prompts() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(bundled_dir("prompts")),
        undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
    )


def round_facts(problem: Problem, history: list[dict[str, Any]], n: int, *, cc: int, device: dict[str, Any],
                prior: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    """What round.md.j2 shows (see round_prompt)."""
    baselines = [us for row in history if (us := _number(row.get("baseline_offline_us")))]
    baseline_us = statistics.median(baselines) if baselines else None
    latest: dict[str, dict[str, Any]] = {}  # a kernel measured again counts by its latest row, as ranked
    for row in history:  # in the order measured
        if (row.get("status") == "ok" and row.get("kernel") not in BASELINES
                and _number(row.get("speedup_offline")) is not None):
            latest[_kernel(row)] = row
    measured = sorted(latest.values(), key=lambda row: -row["speedup_offline"])
    ranked_rows = [_measured(row) for row in measured]
    nearest = [] if len(ranked_rows) >= WARM_START else [
        {**_measured(row), "problem": f"{row['m']}x{row['n']}x{row['k']} {row['dtype']} {row['layout']}"}
        for row in nearest_winners(problem, prior)[:WARM_START]]
    # "pending": proposed and compiling, not measured yet (the optimize loop's batch ahead);
    # SCREENED: passed the screening pass, a rank among its batch, no measurement to show
    failures = [
        row for row in history
        if row.get("status") not in ("ok", "pending", SCREENED, None) and row.get("kernel") not in BASELINES
    ][-6:]
    return {
        "problem": problem, "layout_help": LAYOUT_HELP[problem.layout], "cc": cc, "n": n,
        "max_tokens": max_tokens,
        "gpu": _gpu_facts(device, problem),
        "baseline_us": baseline_us,
        "baseline_tflops": problem.flops / baseline_us / 1e6 if baseline_us else None,
        "templates": [template_facts(t, cc) for t in load_templates().values() if t.supports(problem, cc)],
        "derived": _problem_facts(device, problem),
        "best": ranked_rows[:8],
        "near_misses": ranked_rows[8:12],
        "nearest": nearest,
        "failures": [
            {"kernel": _kernel(row), "status": row["status"], "reason": _reason(row)} for row in failures
        ],
    }


def template_facts(template: Template, cc: int) -> dict[str, Any]:
    """A template as the prompt shows it: each parameter's values, default and meaning; the
    constraints that some parameter set breaks on this target (one that always holds there
    cannot reject a proposal, so it is left out), and the derived values those read."""
    space = template.space
    rules = space.binding(cc)
    read = {name for rule in rules for name in space.reads(rule)[1]}
    return {
        "name": template.name,
        "description": space.description,
        "params": [
            {"name": p.name, "choices": ", ".join(json.dumps(v) for v in p.values),
             "default": json.dumps(p.default), "help": p.help}
            for p in space.params.values()
        ],
        "derived": [(name, expr) for name, expr in space.derived.items() if name in read],
        "constraints": rules,
        "max_smem": max_smem(cc),
    }


def _number(value: Any) -> float | None:
    """A measured value, or None for a missing one (None, or NaN from pandas)."""
    if value is None or isinstance(value, str) or (isinstance(value, float) and math.isnan(value)):
        return None
    return value


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _kernel(row: dict[str, Any]) -> str:
    """A candidate as the model should name it back: template and JSON parameters, as
    today's template completes the recorded ones (parameters added since at their defaults)."""
    template, params, kernel = _text(row.get("template")), _text(row.get("params")), _text(row.get("kernel"))
    if template and params:
        if (today := recorded_params(row)) is not None:
            return f"{template} {json.dumps(today, sort_keys=True)}"
        return f"{template} {params} (an earlier version of the template: not a valid parameter set today)"
    if template:
        return kernel or template
    return f"free-form source {kernel or '?'}"


def _measured(row: dict[str, Any]) -> dict[str, str]:
    def shown(column: str, form: str) -> str:
        value = _number(row.get(column))
        return "-" if value is None else form.format(value)

    low, high = _number(row.get("offline_p20_us")), _number(row.get("offline_p80_us"))
    producer, consumer = _number(row.get("producer_registers")), _number(row.get("consumer_registers"))
    registers = shown("registers", "{:.0f}")
    if producer is not None and consumer is not None:  # moved by setmaxnreg after launch
        registers += f" ({producer:.0f} / {consumer:.0f})"
    return {
        "kernel": _kernel(row), "speedup": shown("speedup_offline", "{:.3f}x"), "time": shown("offline_us", "{:.2f}"),
        "spread": f"{low:.2f}-{high:.2f}" if low is not None and high is not None else "-",
        "methods": f"{shown('kernel_us', '{:.2f}')} / {shown('graph_us', '{:.2f}')}",
        "tflops": shown("tflops", "{:.1f}"), "registers": registers,
        "smem": shown("smem_bytes", "{:.0f}"), "dynamic_smem": shown("dynamic_smem_bytes", "{:.0f}"),
        "spills": shown("spill_bytes", "{:.0f}"),
    }


def _problem_facts(device: dict[str, Any], problem: Problem) -> list[tuple[str, str]]:
    """What a tuner derives before choosing a tile: bytes, intensity, the DRAM floor, and
    how many output tiles (and waves over the SMs) common tile shapes make."""
    facts = [("operands (A, B, C once)", f"{problem.min_bytes / 1e6:.3g} MB"),
             ("arithmetic intensity", f"{problem.flops / problem.min_bytes:.0f} FLOP/byte")]
    if device.get("memory_clock_khz") and device.get("memory_bus_bits"):
        bandwidth = dram_bandwidth(device)
        facts.append(("DRAM time floor (operands once at peak bandwidth)", f"{problem.min_bytes / bandwidth * 1e6:.2f} us"))
        if all(device.get(key) is not None for key in ("cc", "sm_count", "max_sm_clock_mhz")):
            ridge = tensor_peak(device) / bandwidth
            facts.append(("the GPU's ridge point (tensor peak / DRAM bandwidth)", f"{ridge:.0f} FLOP/byte"))
    if sms := device.get("sm_count"):
        for tm, tn in ((64, 64), (128, 128), (128, 256)):
            tiles = math.ceil(problem.m / tm) * math.ceil(problem.n / tn)
            facts.append((f"{tm}x{tn} output tiles", f"{tiles} ({tiles / sms:.2f} waves on {sms} SMs)"))
    return facts


def _reason(row: dict[str, Any]) -> str:
    """A failure's reason on one line; of a compiler log, its first few error lines."""
    text = _text(row.get("error")) or "(no reason recorded)"
    if row.get("status") == "compile_error":
        lines = [line.strip() for line in text.splitlines() if re.search(r"error\s*:", line, re.I)]
        lines = lines or text.strip().splitlines()[-3:]
        # nvcc names the temporary build folder; the file name and line are what matter
        text = " / ".join(re.sub(r"^\S*/(?=[^/\s]+\(\d+\))", "", line) for line in lines[:3])
    text = " ".join(text.split())
    return text if len(text) <= 400 else text[:400] + " ..."


_GPU_FACTS = (
    ("gpu", "name", "{}"),
    ("sm_count", "streaming multiprocessors", "{}"),
    ("max_sm_clock_mhz", "max SM clock", "{} MHz"),
    ("l2_bytes", "L2 cache", "{} bytes"),
    ("smem_optin_bytes", "shared memory per block (opt-in)", "{} bytes"),
    ("memory_clock_khz", "memory clock", "{} kHz"),
    ("memory_bus_bits", "memory bus width", "{} bits"),
)


def _gpu_facts(device: dict[str, Any], problem: Problem) -> list[tuple[str, str]]:
    """The device facts that are known, as (label, text)."""
    facts = [(label, form.format(device[key])) for key, label, form in _GPU_FACTS if device.get(key) is not None]
    if device.get("cc") is not None:
        facts.insert(1, ("compute capability", f"{device['cc'] // 10}.{device['cc'] % 10}"))
    if all(device.get(key) is not None for key in ("cc", "sm_count", "max_sm_clock_mhz")):
        floor = physical_floor_us(problem, device, cold_l2=False)
        facts.append(("tensor-core time floor for this problem (peak FLOP/s at max clock)", f"{floor:.2f} us"))
    return facts
