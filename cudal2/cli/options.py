"""What the cudal2 commands share: the Typer app they register on, their common options,
the parsing of shapes and parameters, and the error boundary (cli_errors)."""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Annotated, Optional

import typer

from .. import __version__
from ..candidate import Candidate
from ..errors import Cudal2Error
from ..problem import DTYPES, Problem
from ..shapes import MODELS, shape_set

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Find the fastest HGEMM kernel for your shapes on your GPU, honestly measured.")


def _print_version(value: bool) -> None:
    if value:
        print(f"cudal2 {__version__}")
        raise typer.Exit()


@app.callback()
def _options(version: Annotated[bool, typer.Option(
        "--version", callback=_print_version, is_eager=True, help="print the version and exit")] = False) -> None:
    """Find the fastest HGEMM kernel for your shapes on your GPU, honestly measured."""

M = Annotated[str, typer.Option("--m", help="rows of A and C")]
N = Annotated[str, typer.Option("--n", help="columns of B and C")]
K = Annotated[str, typer.Option("--k", help="the reduction dimension")]
Dtype = Annotated[str, typer.Option(help=f"element type of A, B and C: {' | '.join(DTYPES)}")]
Layout = Annotated[str, typer.Option(help="nn: A[M,K] @ B[K,N]; nt: A[M,K] @ W[N,K]^T")]
Json = Annotated[bool, typer.Option("--json", help="print JSON for scripts")]
Results = Annotated[Optional[Path], typer.Option(help="results directory (leaderboard, sources)")]
Arch = Annotated[Optional[str], typer.Option(help="nvcc target, e.g. sm_90a (default: the GPU's)")]
TemplateOpt = Annotated[Optional[str], typer.Option("--template", help="a template name (see `cudal2 templates`)")]
Params = Annotated[Optional[list[str]], typer.Option(
    "--param", help="KEY=VALUE for --template, repeatable; KEY=V1,V2 tries each value (a grid)")]
Kernels = Annotated[Optional[list[Path]], typer.Option("--kernel", help="a free-form .cu file implementing the ABI, repeatable")]


def cli_errors(fn):
    """Turns the project's expected failures into one line on stderr and exit code 1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = lambda msg, *a, **k: typer.echo(f"warning: {msg}", err=True)
                return fn(*args, **kwargs)
        except Cudal2Error as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None

    return wrapper


def parse_params(items: list[str] | None) -> dict[str, list[str]]:
    """['block_m=64,128', 'stages=4'] -> {'block_m': ['64', '128'], 'stages': ['4']}."""
    params = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        values = [v.strip() for v in value.split(",") if v.strip()]
        if not sep or not key.strip() or not values:
            raise Cudal2Error(f"--param takes KEY=VALUE, got {item!r}")
        params[key.strip()] = values
    return params


def read_kernel_file(path: Path) -> Candidate:
    try:
        return Candidate.from_source(path.read_text(), label=path.name)
    except OSError as exc:
        raise Cudal2Error(f"cannot read kernel file {path}: {exc.strerror}") from None


ShapesOpt = Annotated[Optional[Path], typer.Option(
    "--shapes", help="a shape set: CSV with columns m, n, k[, dtype, layout] (instead of --m --n --k)")]
ModelOpt = Annotated[Optional[str], typer.Option(
    "--model", help=f"a model preset, its projection GEMMs (nt, bf16 unless --dtype): {' | '.join(MODELS)}")]
TokensOpt = Annotated[Optional[str], typer.Option(help="the preset's token counts, the GEMMs' M (default 1,16,128,4096)")]


def problems_of(m, n, k, dtype, layout, shapes, model, tokens, dtype_given: bool) -> list[Problem]:
    """The problems a command names: one shape (--m --n --k), a shape file or a preset."""
    named = shape_set(shapes, model, tokens, dtype if dtype_given else None)
    if named is not None:
        if any(v is not None for v in (m, n, k)):
            raise Cudal2Error("give --m --n --k, or a shape set (--shapes, --model), not both")
        return named
    if any(v is None for v in (m, n, k)):
        raise Cudal2Error("give --m, --n and --k, or a shape set (--shapes FILE or --model NAME)")
    return [Problem.parse(m, n, k, dtype, layout)]
