"""cudal2 compile, prebuild and templates: kernels built without a GPU, and the templates they come from."""

from __future__ import annotations

import dataclasses
import json
import textwrap
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from .. import api
from ..config import load_settings
from ..errors import Cudal2Error
from ..kernels import prebuilt
from ..kernels import render as render_stage
from ..kernels.candidate import Candidate
from ..kernels.compile import Compiler, find_nvcc, first_error_line
from ..measure.environment import default_arch, listed_cc
from ..problem import Problem
from ..results.leaderboard import Leaderboard, with_shipped
from ..results.tables import err_console, fmt, show_table, width_limit
from .options import (Arch, Dtype, Json, Kernels, Layout, Params, Results, TemplateOpt, app, cli_errors, parse_params,
                      read_kernel_file)


def target_arch(settings, command: str) -> str:
    """--arch (or CUDAL2_ARCH), else the nvcc target of this machine's GPU, read from nvidia-smi
    without starting CUDA: a GPU machine's `prebuild` needs no flag, a CPU build host names one."""
    if settings.arch is not None:
        return settings.arch
    cc = listed_cc(settings.device)
    if cc is None:
        raise Cudal2Error(f"{command} needs --arch (e.g. sm_90a) or CUDAL2_ARCH: no GPU here to take it from")
    return default_arch(cc)


@app.command("compile")
@cli_errors
def compile_cmd(
    template: TemplateOpt = None,
    param: Params = None,
    kernel: Kernels = None,
    all_configs: Annotated[bool, typer.Option("--all", help="every valid configuration of --template")] = False,
    dtype: Dtype = "fp16",
    layout: Layout = "nn",
    arch: Arch = None,
    jobs: Annotated[Optional[int], typer.Option(help="parallel nvcc processes")] = None,
    json_out: Json = False,
) -> None:
    """Render and compile without a GPU, filling the kernel cache (e.g. on a CPU build host)."""
    settings = load_settings({"arch": arch, "jobs": jobs})
    settings = dataclasses.replace(settings, arch=target_arch(settings, "compile"))
    cc = render_stage.arch_cc(settings.arch)
    problem = Problem(1, 1, 1, dtype, layout)  # only dtype and layout shape the source
    candidates = [read_kernel_file(p) for p in kernel or []]
    if template:
        tmpl = render_stage.get_template(template)
        if all_configs:
            if param:
                raise Cudal2Error("--all compiles the whole space; drop --param")
            candidates += [Candidate.from_template(template, p) for p in tmpl.space.configurations(cc)]
        else:
            candidates += render_stage.template_grid(template, parse_params(param), cc)
    elif param or all_configs:
        raise Cudal2Error("--param and --all need --template")
    if not candidates:
        raise Cudal2Error("nothing to compile: give --template NAME or --kernel FILE")
    find_nvcc()
    compiler = Compiler(settings.arch, settings.cache_dir, settings.jobs, settings.timeout)
    builds = compiler.compile_all([render_stage.render(c, problem) for c in candidates])
    records = [
        {"kernel": str(c), "status": b.status, "cached": b.cached, "seconds": round(b.seconds, 2),
         **b.stats, **b.declared, "library": str(b.library) if b.library else None,
         "error": None if b.status == "ok" else b.log[-2000:]}
        for c, b in zip(candidates, builds)
    ]
    columns = ["kernel", "status", "cached", "seconds", "registers", "smem_bytes", "dynamic_smem_bytes", "spill_bytes"]
    if json_out:
        print(json.dumps(records, indent=1))
    else:
        show_table(columns, [[fmt(r[c]) for c in columns] for r in records])
        for r in records:
            if r["error"]:
                err_console.print(f"{r['kernel']}: {first_error_line(r['error']) if r['error'].strip() else r['status']}")
    if any(b.status != "ok" for b in builds):
        raise typer.Exit(1)


@app.command()
@cli_errors
def prebuild(
    arch: Arch = None,
    jobs: Annotated[Optional[int], typer.Option(help="parallel nvcc processes (default: every core)")] = None,
    pack: Annotated[Optional[Path], typer.Option(help="also write the built set to this tarball (.tar.gz)")] = None,
    unpack: Annotated[Optional[Path], typer.Option(
        help="instead: add another machine's build (a --pack tarball or a cache directory) to this cache")] = None,
    list_only: Annotated[bool, typer.Option("--list", help="only list the set (no compiling)")] = False,
    results: Results = None,
    json_out: Json = False,
) -> None:
    """Compile the prebuilt kernel set of an architecture into the kernel cache (no GPU
    needed): every configuration within 2% of the best on a measured problem, plus the cost
    model's best per region. What is cached already is skipped, so a stopped build resumes."""
    settings = load_settings({"arch": arch, "jobs": jobs, "results": results})
    if unpack is not None:
        added = prebuilt.unpack(unpack, settings.cache_dir)
        print(f"{added} kernel build(s) added to {settings.cache_dir}")
        return
    settings = dataclasses.replace(settings, arch=target_arch(settings, "prebuild"))
    measured = with_shipped(Leaderboard(settings.results).read(protocol=None))
    began = time.perf_counter()

    def ranking(step: int, of: int, what: str) -> None:  # the cost model ranks whole spaces: say so as it goes
        err_console.print(f"choosing the set: cost model ranking {step}/{of}, {what} "
                          f"({time.perf_counter() - began:.0f} s)")

    entries = prebuilt.kernel_set(render_stage.arch_cc(settings.arch), measured, on_rank=ranking)
    if not entries:
        raise Cudal2Error(f"no measurements of a {settings.arch} GPU to choose a kernel set from")
    if list_only:
        records = prebuilt.describe(entries)
        if json_out:
            print(json.dumps(records, indent=1))
        else:
            show_table(["kernel", "dtype", "layout", "why"], [[r["kernel"], r["dtype"], r["layout"], r["why"]]
                                                              for r in records])
        return
    find_nvcc()
    compiler = Compiler(settings.arch, settings.cache_dir, settings.jobs, settings.timeout)
    todo = sum(compiler.lookup(e.source) is None for e in entries)
    err_console.print(f"{len(entries)} configurations for {settings.arch}, {todo} to compile "
                      f"with {compiler.jobs} jobs into {settings.cache_dir}")

    def progress(done: int, total: int, entry, build) -> None:
        state = "cached" if build.cached else f"{build.status} in {build.seconds:.0f} s"
        err_console.print(f"[{done}/{total}] {state}: {entry.candidate} {entry.dtype} {entry.layout}")

    start = time.perf_counter()
    builds = prebuilt.build(entries, compiler, progress)
    failed = [b for b in builds if b.status != "ok"]
    size = sum(b.library.stat().st_size for b in builds if b.status == "ok" and b.library)
    summary = {"configurations": len(entries), "compiled": todo, "failed": len(failed), "megabytes": size / 1e6,
               "seconds": time.perf_counter() - start, "jobs": compiler.jobs, "cache": str(settings.cache_dir)}
    if pack is not None:
        summary["packed"] = prebuilt.pack(entries, compiler, pack)
        summary["tarball"] = str(pack)
    if json_out:
        print(json.dumps(summary, indent=1))
    else:
        print(f"{summary['configurations']} configurations ({summary['megabytes']:.1f} MB of libraries), "
              f"{todo} compiled in {summary['seconds']:.0f} s on {compiler.jobs} jobs, {len(failed)} failed"
              + (f"; packed into {pack}" if pack is not None else ""))
    if failed:
        raise typer.Exit(1)


# -------------------------------------------------------------------------- templates

@app.command()
@cli_errors
def templates(json_out: Json = False) -> None:
    """List the kernel templates and their parameter spaces."""
    found = render_stage.load_templates()
    if json_out:
        print(json.dumps({
            name: {"description": t.space.description, "min_cc": t.space.min_cc, "max_cc": t.space.max_cc,
                   "dtypes": t.space.dtypes, "layouts": t.space.layouts, "constraints": t.space.constraints,
                   "params": {p.name: {"values": p.values, "default": p.default, "help": p.help}
                              for p in t.space.params.values()}}
            for name, t in found.items()}, indent=1))
        return
    width = width_limit() or 10**6  # a log or a pipe: whole lines
    for name, t in found.items():
        print(textwrap.fill(f"{name}: {t.space.description}", width=width))
        show_table(["parameter", "values", "default", "meaning"],
                   [[p.name, ", ".join(map(str, p.values)), str(p.default), p.help] for p in t.space.params.values()])
        print(textwrap.fill("constraints: " + "; ".join(t.space.constraints), width=width, break_on_hyphens=False))

