"""What the cudal2 commands share: the Typer app they register on, their common options,
the parsing of shapes and parameters, the error boundary (cli_errors, fail) and the
`cudal2` entry point (main: usage errors one line, exit 2; JSON under --json)."""

from __future__ import annotations

import functools
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Annotated, Optional

import typer

try:  # typer carries its own copy of click since 0.20
    from typer._click import exceptions as click_errors
except ImportError:
    from click import exceptions as click_errors
NO_ARGS = getattr(click_errors, "NoArgsIsHelpError", ())  # click >= 8.2: a command given nothing

from .. import __version__
from ..errors import Cudal2Error
from ..kernels.candidate import Candidate
from ..kernels.render import arch_cc, newest_cc, template_grid
from ..measure.environment import listed_cc
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


def fail(message: str, code: int, as_json: bool) -> typer.Exit:
    """An error as the user sees it: one line on stderr (`error: ...`), or under --json one
    JSON object on stdout, where a script reads; returns the Exit to raise."""
    if as_json:
        print(json.dumps({"error": message, "exit_code": code}))
    else:
        typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def cli_errors(fn):
    """Turns the project's expected failures into one line and exit code 1: a Cudal2Error,
    and an OSError (a path that cannot be read or written: its message and the path)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        as_json = bool(kwargs.get("json_out")) or kwargs.get("format") == "json"
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = lambda msg, *a, **k: typer.echo(f"warning: {msg}", err=True)
                return fn(*args, **kwargs)
        except Cudal2Error as exc:
            raise fail(str(exc), 1, as_json) from None
        except BrokenPipeError:  # `cudal2 ... | head`: the reader has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise typer.Exit(1) from None
        except OSError as exc:
            where = f": {exc.filename}" if exc.filename else ""
            raise fail(f"{exc.strerror or exc}{where}", 1, as_json) from None

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


def check_grid(template: str | None, grid: dict[str, list[str]], arch: str | None, device: int = 0) -> None:
    """--template/--param checked against the space before a GPU is started: on the --arch
    target, else the GPU's as nvidia-smi lists it, else the newest the template runs on."""
    if grid and not template:
        raise Cudal2Error("--param needs --template")
    if template:
        template_grid(template, grid, arch_cc(arch) if arch else listed_cc(device) or newest_cc(template))


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


def main(argv: list[str] | None = None) -> None:
    """The `cudal2` command. Exit codes: 0 done, 1 an error (one line), 2 a usage error (an
    unknown option, a missing or malformed value: one line), 3 a `check` below --fail-under."""
    args = sys.argv[1:] if argv is None else [str(a) for a in argv]
    as_json = "--json" in args or "--format=json" in args or any(
        a == "--format" and b == "json" for a, b in zip(args, args[1:]))
    try:
        code = app(args=args, prog_name="cudal2", standalone_mode=False)
    except NO_ARGS as exc:  # `cudal2` or a group alone: its help
        print(exc.ctx.get_help() if exc.ctx else exc.format_message())
        code = 0
    except click_errors.UsageError as exc:
        command = exc.ctx.command_path if exc.ctx else "cudal2"
        raise SystemExit(fail(f"{exc.format_message()} (see `{command} --help`)", 2, as_json).exit_code) from None
    except click_errors.ClickException as exc:
        raise SystemExit(fail(exc.format_message(), exc.exit_code, as_json).exit_code) from None
    except typer.Abort:
        raise SystemExit(fail("interrupted", 130, as_json).exit_code) from None
    raise SystemExit(code if isinstance(code, int) else 0)
