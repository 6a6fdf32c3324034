"""Settings, with one precedence: command line > environment (CUDAL2_*) > cudal2.toml > defaults."""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import Cudal2Error
from .kernels.compile import default_cache_dir
from .kernels.render import arch_cc


@dataclass(frozen=True)
class Settings:
    results: Path = Path("results")  # leaderboard and kernel sources
    cache_dir: Path = field(default_factory=default_cache_dir)  # compiled kernels
    arch: str | None = None  # nvcc target; None = the GPU's own
    device: int = 0
    budget: float = 1.0  # seconds of timing per mode and measurement
    qps: float = 200.0  # server mode: mean calls per second
    timeout: float = 600.0  # seconds for one kernel's verify + bench, and for one compile
    jobs: int = field(default_factory=lambda: os.cpu_count() or 1)  # parallel compiles


def _coerce(name: str, raw: Any, kind: type, origin: str) -> Any:
    try:
        if kind is Path:
            return Path(os.path.expanduser(str(raw)))
        if kind in (int, float) and isinstance(raw, str):
            return kind(raw)
        if kind in (int, float) and isinstance(raw, (int, float)) and not isinstance(raw, bool):
            return kind(raw)
        if kind is str and isinstance(raw, str):
            return raw
    except ValueError:
        pass
    raise Cudal2Error(f"bad value {raw!r} for setting {name} (from {origin})")


def config_table(table: str, kinds: dict[str, type], config: Path | None = None) -> dict[str, Any]:
    """The settings in cudal2.toml's `[table]`, coerced to `kinds`: from `config`, else
    $CUDAL2_CONFIG, else ./cudal2.toml when it exists (no file: no settings)."""
    path = config or (Path(os.environ["CUDAL2_CONFIG"]) if "CUDAL2_CONFIG" in os.environ else Path("cudal2.toml"))
    if config is None and not path.is_file():
        return {}
    try:
        doc = tomllib.loads(path.read_text())
    except OSError as exc:
        raise Cudal2Error(f"cannot read config {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise Cudal2Error(f"bad config {path}: {exc}") from None
    values = {}
    for name, raw in doc.get(table, {}).items():
        if name not in kinds:
            raise Cudal2Error(f"unknown setting {name!r} in {path} [{table}]; known: {', '.join(kinds)}")
        values[name] = _coerce(name, raw, kinds[name], str(path))
    return values


def load_settings(cli: dict[str, Any] | None = None, config: Path | None = None) -> Settings:
    """Settings from the command line (None = not given), CUDAL2_* variables, and
    cudal2.toml (CUDAL2_CONFIG or ./cudal2.toml when it exists)."""
    kinds = {
        "results": Path, "cache_dir": Path, "arch": str, "device": int, "budget": float,
        "qps": float, "timeout": float, "jobs": int,
    }
    values = config_table("cudal2", kinds, config)
    for name, kind in kinds.items():
        env = f"CUDAL2_{name.upper()}"
        if env in os.environ:
            values[name] = _coerce(name, os.environ[env], kind, env)
    for name, raw in (cli or {}).items():
        if raw is not None:
            values[name] = _coerce(name, raw, kinds[name], "command line")
    for name in ("budget", "qps", "timeout", "jobs"):
        if name in values and values[name] <= 0:
            raise Cudal2Error(f"setting {name} must be > 0, got {values[name]}")
    if values.get("device", 0) < 0:
        raise Cudal2Error(f"setting device must be >= 0, got {values['device']}")
    if values.get("arch") is not None:
        arch_cc(values["arch"])
    for name, what in (("results", "results directory"), ("cache_dir", "kernel cache")):
        if name in values:  # the path, or the nearest part of it that exists, must be a directory
            there = next(p for p in (values[name], *values[name].parents) if p.exists() or p == p.parent)
            if there.exists() and not there.is_dir():
                raise Cudal2Error(f"{what} {values[name]}: {there} is a file, not a directory")
    return dataclasses.replace(Settings(), **values)
