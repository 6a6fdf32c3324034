"""cudal2: find the fastest half-precision GEMM kernel for a shape on your GPU, honestly measured."""

__version__ = "0.1.0"

from .api import BenchResult, CheckResult, TuneResult, bench, check, export, leaderboard, optimize, report  # noqa: E402
from .problem import Problem  # noqa: E402
from .shapes import MODELS, preset, read_shapes  # noqa: E402

__all__ = ["BenchResult", "CheckResult", "MODELS", "Problem", "TuneResult", "bench", "check", "export", "leaderboard",
           "optimize", "preset", "read_shapes", "report"]
