"""Shape sets: the problems of a CSV file, or of a model preset at some token counts."""

from __future__ import annotations

import csv
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .errors import Cudal2Error
from .problem import Problem


@dataclass(frozen=True)
class Model:
    """The projection GEMMs of one transformer layer, as an inference engine runs them
    (q, k and v fused; gate and up fused): (N, K) of each weight W[N,K]."""

    source: str  # where the dimensions come from
    projections: dict[str, tuple[int, int]]


def _decoder(hidden: int, intermediate: int, heads: int, kv_heads: int, source: str) -> Model:
    head_dim = hidden // heads
    return Model(source, {
        "qkv_proj": (hidden + 2 * kv_heads * head_dim, hidden),
        "o_proj": (hidden, hidden),
        "gate_up_proj": (2 * intermediate, hidden),
        "down_proj": (hidden, intermediate),
    })


# hidden_size, intermediate_size, num_attention_heads, num_key_value_heads of each model's
# config.json as published with its weights.
MODELS = {
    "llama3-8b": _decoder(4096, 14336, 32, 8, "meta-llama/Meta-Llama-3-8B config.json"),
    "llama3-70b": _decoder(8192, 28672, 64, 8, "meta-llama/Meta-Llama-3-70B config.json"),
    "mistral-7b": _decoder(4096, 14336, 32, 8, "mistralai/Mistral-7B-v0.1 config.json"),
    "qwen2-7b": _decoder(3584, 18944, 28, 4, "Qwen/Qwen2-7B config.json"),
}


def preset(model: str, tokens: str | int | Iterable[int], dtype: str = "bf16") -> list[Problem]:
    """The projections of `model` at each token count of `tokens` ("1,16,128", 16 or
    [1, 16, 128]): M = tokens, layout nt (x @ W^T, as a Linear layer stores W)."""
    if model not in MODELS:
        raise Cudal2Error(f"unknown model {model!r}; choose one of {', '.join(MODELS)}")
    items = tokens.split(",") if isinstance(tokens, str) else [tokens] if isinstance(tokens, int) else list(tokens)
    counts = []
    for item in items:
        try:
            count = int(item.strip()) if isinstance(item, str) else item
        except ValueError:
            count = None
        if isinstance(count, bool) or not isinstance(count, int):
            raise Cudal2Error(f"tokens take comma-separated integers, got {tokens!r}")
        if count < 1:
            raise Cudal2Error(f"tokens must be >= 1 (the GEMMs' M), got {count}")
        counts.append(count)
    return list(dict.fromkeys(Problem(t, n, k, dtype, "nt") for t in counts
                              for n, k in MODELS[model].projections.values()))


def read_shapes(path: Path) -> list[Problem]:
    """The problems of a shape-set CSV: columns m, n, k, and optionally dtype (fp16) and
    layout (nn); other columns are ignored. A malformed row is named by its line."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:  # a spreadsheet's byte-order mark is not a column
            reader = csv.DictReader(f)
            rows, fields = list(reader), reader.fieldnames or []
    except (OSError, UnicodeDecodeError) as exc:
        raise Cudal2Error(f"cannot read shape set {path}: {getattr(exc, 'strerror', None) or exc}") from None
    missing = [c for c in ("m", "n", "k") if c not in fields]
    if missing:
        raise Cudal2Error(f"shape set {path} lacks column(s) {', '.join(missing)}")
    problems = []
    for line, row in enumerate(rows, start=2):
        try:
            problems.append(Problem.parse(row["m"], row["n"], row["k"], (row.get("dtype") or "fp16").strip(),
                                          (row.get("layout") or "nn").strip()))
        except Cudal2Error as exc:
            raise Cudal2Error(f"{path}, line {line}: {exc}") from None
    if not problems:
        raise Cudal2Error(f"shape set {path} has no rows")
    return problems


def shape_set(path: Path | None = None, model: str | None = None, tokens: str | None = None,
              dtype: str | None = None) -> list[Problem] | None:
    """The problems named by a file or a preset (None if neither is given)."""
    if path is not None and model is not None:
        raise Cudal2Error("give a shape file or a model preset, not both")
    if model is None and tokens is not None:
        raise Cudal2Error("--tokens needs --model")
    if path is not None:
        return read_shapes(path)
    if model is not None:
        return preset(model, tokens or "1,16,128,4096", dtype or "bf16")
    return None
