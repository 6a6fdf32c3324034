"""The cudal2 command line: parse, call, print.

One module per group of commands, each registering on `app` (options.py, with the options
they share, the error boundary and the entry point): tune.py (bench, optimize), results.py
(leaderboard, check, report, export), kernels.py (compile, prebuild, templates)."""

from __future__ import annotations

# The commands register on `app` when their modules load, in the order `cudal2 --help` lists them.
from . import tune  # noqa: F401,I001
from . import results  # noqa: F401
from . import kernels  # noqa: F401
from .options import app, main

__all__ = ["app", "main"]
