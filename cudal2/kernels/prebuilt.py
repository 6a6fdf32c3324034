"""The prebuilt kernel set of an architecture: the template configurations worth compiling
before any tuning starts, so that a run measures from its first second instead of waiting on
nvcc (a CUTLASS kernel takes about 50 s of one core).

The templates take M, N and K at run time, so one build of a configuration serves every
shape of its dtype and layout. The set is

- every configuration that measured within 2% of the best on some problem (each problem and
  protocol compared within itself), on a GPU of this architecture, in the measurements
  given (the shipped ones and the results directory's), in that problem's dtype and layout;
  of those that launch alike on that problem (Space.launched: caps above its need), the fastest;
- the cost model's PER_REGION best in each region a model's shapes fall in (tiny, decode
  at 1-8 tokens and at 16, split-K, large, unaligned, and those of the CUDA-L2 grid the library wins: short K, skinny
  outputs), configurations it prices apart, for fp16 nn and bf16 nt, where a device of this
  architecture was measured (its facts feed the model).

`build` compiles it into the compile cache (what is there already is skipped, so a stopped
build resumes) and lists what it built in the cache's manifest (MANIFEST: configuration,
dtype, layout and why, per architecture), which the search reads to know what is built
without ranking the spaces again; `pack` writes those cache entries and their manifest to a
tarball and `unpack` adds one, or another machine's cache directory, to this machine's cache.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import shutil
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from ..errors import Cudal2Error
from ..problem import Problem
from ..search.cost import RECORDED_MEMORY, rank, recorded_device
from .candidate import Candidate
from .compile import Build, Compiler
from .render import arch_cc, load_templates, recorded_params, render

NEAR_BEST = 0.98  # a configuration within 2% of a problem's best measured is in the set
MANIFEST = "prebuilt.json"  # in the cache directory: {arch: [the built set's entries]}
PER_REGION = 3
REGIONS = {  # a representative problem of each region of a model's shapes
    "tiny": (128, 64, 64),
    "decode": (16, 4096, 4096),
    # One to eight tokens: the weights streamed once (gemv), Llama-3-8B's o_proj at one token.
    "GEMV decode": (1, 4096, 4096),
    "split-K": (1024, 128, 16384),
    "large": (8192, 8192, 8192),
    "unaligned": (4095, 4097, 1001),
    # Where the H200 grid run of 2026-12-01 lost most (the h200-2026-12-01-sessions report (in git history)): K of
    # 512 or less, and outputs of 256 or fewer rows or columns with K of 1024 or more.
    "short-K": (4096, 4096, 256),
    "skinny short-K": (12288, 64, 512),
    "skinny": (1024, 64, 4096),
    "small, long-K": (256, 256, 8192),
    "skinny, long-K": (64, 512, 16384),
    "mid": (1024, 128, 2048),
    # Where the prebuilt set's best was priced furthest from the whole space's over 100 random
    # grid shapes (seed 2): 1.23x at 64x64x2048, 1.16x at 128x64x1024 (sm80_mma split over a
    # cluster: seconds to compile), 1.12x at 512x512x8192.
    "tiny, long-K": (64, 64, 2048),
    "mid, long-K": (512, 512, 8192),
    # Fewer output tiles than SMs and a long K, where the library stood furthest from the floor
    # (2.15x geomean on the H200): K split over several clusters per tile (sm80_mma k_clusters).
    "one tile, long-K": (64, 64, 16384),
    "few tiles, long-K": (128, 256, 16384),
    # Fewer 128x128 output tiles than SMs on a wide output (M and N of 512-2048, K of 4096 or
    # more): the search's best ran 0.78-0.84 of the fastest library call at 1024x512x4096,
    # 1024x1024x12288 and 1024x1024x16384 (H200, 5 and 60 s budgets), where the cost model's
    # first picks (K cut in two: one wave of 128 CTAs) were not in the set, so a time-budgeted
    # run never measured them.
    "wide few tiles, long-K": (1024, 1024, 8192),
    # Skinny outputs with a short K and a long side (one side of C 128-256, the other 8192 or
    # more, K <= 256): of the grid's 153 skinny short-K shapes, the 20 where the set's best was
    # priced furthest from the whole space's (0.85-0.96; 0.991 over all 153, 0.995 with these,
    # the worst 0.926). The model's picks tile them in about one wave of 64-row tiles, a CTA a
    # tile (swapped where C is tall); the shipped rows there hold only 128-row tiles, at
    # 0.74-0.88 of the fastest library call.
    "skinny short-K, tall": (12288, 128, 128),
    "skinny short-K, wide": (128, 12288, 128),
    # Fewer tiles than SMs with a mid K on a tall or wide output (one side 192-384, the other
    # 2048-4096, K 2048-12288), where cuBLASLt runs one wave of 64x96 or 128x80 tiles: the
    # model's picks are swapped tiles that narrow (H100, fp16 nn: 1.024 of the fastest library
    # call at 4096x192x2048, 0.958 at 3072x384x3072, where the search's picks from the set
    # without them had run 0.905 and 0.893).
    "few tiles, mid-K, tall": (3072, 384, 3072),
    "few tiles, mid-K, thin": (4096, 192, 2048),
}
VARIANTS = (("fp16", "nn"), ("bf16", "nt"))  # torch.matmul on fp16, F.linear on bf16


@dataclass(frozen=True)
class Entry:
    """One configuration of the set, in one dtype and layout, and why it is there."""

    candidate: Candidate
    dtype: str
    layout: str
    why: str

    @property
    def source(self) -> str:
        return render(self.candidate, Problem(1, 1, 1, self.dtype, self.layout))  # only dtype and layout shape it


def kernel_set(cc: int, measured: pd.DataFrame, regions: bool = True,
               on_rank: Callable[[int, int, str], None] | None = None) -> list[Entry]:
    """The set for compute capability `cc` from the measurement rows `measured` (`regions`:
    with the cost model's picks; ranking the spaces takes a few seconds per region, and
    `on_rank(i, of, what)` hears of each before it starts)."""
    templates = load_templates()
    found: dict[tuple[str, str, str], Entry] = {}

    def add(template: str, params: dict, problem: Problem, why: str) -> None:
        # On the problem that put it there: a template's `requires` may turn away others
        # (sm90_splitk serves K < 1024 with its direct epilogue alone).
        if templates[template].supports(problem, cc):
            candidate = Candidate.from_template(template, params)
            found.setdefault((str(candidate), problem.dtype, problem.layout),
                             Entry(candidate, problem.dtype, problem.layout, why))

    rows = measured[(measured["status"] == "ok") & (measured["cc"] == cc) & measured["template"].notna()
                    & measured["speedup_offline"].notna()]
    for (m, n, k, dtype, layout, protocol), group in rows.groupby(["m", "n", "k", "dtype", "layout", "protocol"]):
        best, problem = group["speedup_offline"].max(), Problem(m, n, k, dtype, layout)
        # Configurations that launch alike on this problem (caps above its need: Space.launched)
        # ran the same kernel work there: the fastest of them is built, not each.
        launched: set[tuple[str, str]] = set()
        near = group[group["speedup_offline"] >= NEAR_BEST * best].sort_values("speedup_offline", ascending=False)
        for row in near.to_dict("records"):
            if row["template"] in templates and (params := recorded_params(row, templates)) is not None:
                space = templates[row["template"]].space
                work = (row["template"], space.launch_key(params, cc, problem, int(row["sm_count"])))
                if work in launched:
                    continue
                launched.add(work)
                add(row["template"], params, problem,
                    f"{row['speedup_offline'] / best:.3f} of the best at {m}x{n}x{k} {dtype} {layout} ({protocol})")
    gpus = [g for g in rows["gpu"].dropna().unique() if g in RECORDED_MEMORY]
    if gpus and regions:
        device = recorded_device(rows, gpus[0])
        todo = [(region, shape, variant) for region, shape in REGIONS.items() for variant in VARIANTS]
        for step, (region, (m, n, k), (dtype, layout)) in enumerate(todo, 1):
            if on_rank:
                on_rank(step, len(todo), f"{region} ({m}x{n}x{k} {dtype} {layout})")
            problem = Problem(m, n, k, dtype, layout)
            ranked = distinct(rank(templates, problem, device), templates, PER_REGION)
            for i, (_, template, params) in enumerate(ranked, 1):
                add(template, params, problem, f"cost model's #{i} for {region} ({m}x{n}x{k} {dtype} {layout})")
    return sorted(found.values(), key=lambda e: (e.candidate.template, e.dtype, e.layout, str(e.candidate)))


def distinct(ranked: list[tuple[float, str, dict]], templates: dict, count: int) -> list[tuple[float, str, dict]]:
    """The `count` fastest of a ranking (cost.rank) that the cost model prices apart: of the
    configurations of one template it prices alike (they differ in what it has no term for:
    rasterisation, blocks per SM, a stage or two), the one nearest the template's defaults."""
    picks: dict[tuple[str, float], tuple[int, tuple[float, str, dict]]] = {}
    defaults = {name: template.space.defaults() for name, template in templates.items()}
    for entry in ranked:
        t, name, params = entry
        key = (name, round(math.log(t), 3))
        if key not in picks and len(picks) == count:
            break
        away = sum(value != defaults[name][p] for p, value in params.items())
        if key not in picks or away < picks[key][0]:
            picks[key] = (away, entry)
    return [entry for _, entry in picks.values()]


def available(cache_dir: Path, arch: str, measured: pd.DataFrame) -> list[Entry]:
    """The set as a machine may hold it, for the search to start from: what its cache's
    manifest lists (a `prebuild` there or an unpacked tarball: the cost model's region picks
    too), then the measured part of the set (its regions would need the spaces ranked:
    seconds a region), each configuration once. Whether each is built is the caller's to ask."""
    found: dict[tuple[str, str, str], Entry] = {}
    for entry in manifest(cache_dir, arch) + kernel_set(arch_cc(arch), measured, regions=False):
        found.setdefault((str(entry.candidate), entry.dtype, entry.layout), entry)
    return list(found.values())


def build(entries: list[Entry], compiler: Compiler,
          on_build: Callable[[int, int, Entry, Build], None] | None = None) -> list[Build]:
    """Compiles every entry into the cache (cached ones are not compiled again), in parallel;
    `on_build(done, total, entry, build)` hears of each as it finishes. Each built one is
    added to the cache's manifest as it finishes, so a stopped build's manifest lists what
    it built."""
    by_source: dict[str, list[Entry]] = {}
    for entry in entries:
        by_source.setdefault(entry.source, []).append(entry)
    done = 0

    def finished(source: str, result: Build) -> None:
        nonlocal done
        done += 1
        if result.status == "ok":
            _add_to_manifest(compiler.root.parent, compiler.arch, by_source[source])
        if on_build:
            on_build(done, len(by_source), by_source[source][-1], result)

    return compiler.compile_all(list(by_source), on_build=finished)


def _entry_record(entry: Entry) -> dict:
    return {"template": entry.candidate.template, "params": entry.candidate.param_dict, "dtype": entry.dtype,
            "layout": entry.layout, "why": entry.why}


def _record_key(record: dict) -> tuple[str, str, str, str]:
    return record["template"], json.dumps(record["params"], sort_keys=True), record["dtype"], record["layout"]


def _read_manifest_file(path: Path) -> dict[str, list[dict]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _add_to_manifest(cache_dir: Path, arch: str, entries: list[Entry] | list[dict]) -> None:
    """Adds entries (Entry or their records) to the cache's manifest for `arch`, each once;
    written whole into place, so a reader never sees half of it."""
    path = Path(cache_dir) / MANIFEST
    manifest = _read_manifest_file(path)
    records = manifest.setdefault(arch, [])
    known = {_record_key(r) for r in records}
    for entry in entries:
        record = _entry_record(entry) if isinstance(entry, Entry) else entry
        if (key := _record_key(record)) not in known:
            known.add(key)
            records.append(record)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    partial.replace(path)


def manifest(cache_dir: Path, arch: str) -> list[Entry]:
    """The entries the cache's manifest lists as built for `arch` (a build here, or an
    unpacked tarball or cache directory, wrote them); configurations today's templates no
    longer know are left out."""
    templates = load_templates()
    found = []
    for record in _read_manifest_file(Path(cache_dir) / MANIFEST).get(arch, []):
        template = templates.get(record.get("template"))
        params = template.space.complete(record.get("params") or {}) if template else None
        if params is not None and not template.space.violations(params, arch_cc(arch)):
            found.append(Entry(Candidate.from_template(template.name, params), record["dtype"], record["layout"],
                               record.get("why", "")))
    return found


def pack(entries: list[Entry], compiler: Compiler, out: Path) -> int:
    """Writes the cache entries of the built `entries` to the tarball `out` (paths relative
    to the cache directory, as `unpack` takes them); returns how many."""
    entries_dirs, packed = [], []
    for entry in entries:
        built = compiler.lookup(entry.source)
        if built is not None and built.status == "ok":
            entries_dirs.append(built.library.parent)
            packed.append(entry)
    cache = compiler.root.parent
    with tarfile.open(out, "w:gz") as tar:
        for directory in dict.fromkeys(entries_dirs):
            tar.add(directory, arcname=str(directory.relative_to(cache)))
        listing = json.dumps({compiler.arch: [_entry_record(e) for e in packed]}, indent=1, sort_keys=True).encode()
        info = tarfile.TarInfo(MANIFEST)
        info.size = len(listing)
        tar.addfile(info, io.BytesIO(listing))
    return len(set(entries_dirs))


def unpack(source: Path, cache_dir: Path) -> int:
    """Adds the kernel builds of a tarball from `pack`, or of another cache directory, to
    `cache_dir`; entries already there are kept. Returns how many were added. A tarball is
    read whole before anything is added: a truncated or corrupt one adds nothing."""
    source = Path(source)
    if not source.exists():
        raise Cudal2Error(f"cannot unpack {source}: no such file or directory")
    if not source.is_dir() and not tarfile.is_tarfile(source):
        raise Cudal2Error(f"cannot unpack {source}: not a tarball (`cudal2 prebuild --pack FILE` writes one) "
                          "nor a cache directory")
    target = Path(cache_dir) / "kernels"
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise Cudal2Error(f"cannot use kernel cache {cache_dir} (CUDAL2_CACHE_DIR): {exc.strerror}") from None
    if source.is_dir():
        added = 0
        for meta in (source / "kernels").glob("*/*/build.json"):
            entry = meta.parent
            destination = target / entry.parent.name / entry.name
            if not destination.exists():
                destination.parent.mkdir(parents=True, exist_ok=True)
                shutil.copytree(entry, destination)
                added += 1
        listed = _read_manifest_file(source / MANIFEST)
    else:
        added, listed = _unpack_tarball(source, target)
    fields = {"template", "params", "dtype", "layout"}
    for arch, records in (listed.items() if isinstance(listed, dict) else []):
        _add_to_manifest(cache_dir, arch, [r for r in records if isinstance(r, dict) and fields <= r.keys()])
    return added


def _unpack_tarball(source: Path, target: Path) -> tuple[int, dict]:
    """unpack() of a tarball into the cache's `target` (its kernels/): the whole stream is
    checked (a gzip stream cut short, even by its last bytes, or a tar without the manifest
    `pack` writes last, is refused), then the builds are extracted into a staging directory
    beside `target` and each moved into place whole. Returns (builds added, the manifest)."""
    staging = Path(tempfile.mkdtemp(prefix=".unpack-", dir=target.parent))
    try:
        with gzip.open(source) as stream:  # reading to the end checks the length and the CRC
            while stream.read(1 << 20):
                pass
        with tarfile.open(source, "r:gz") as tar:
            members, listed = tar.getmembers(), None
            for member in members:
                parts = Path(member.name).parts
                if member.name == MANIFEST and member.isfile():
                    listed = json.loads(tar.extractfile(member).read() or b"{}")
                elif parts[:1] != ("kernels",) or ".." in parts or not (member.isfile() or member.isdir()):
                    raise Cudal2Error(f"cannot unpack {source}: {member.name!r} is not a kernel build of a cudal2 cache")
            if listed is None:
                raise Cudal2Error(f"cannot unpack {source}: it ends before its manifest ({MANIFEST}), which "
                                  "`cudal2 prebuild --pack` writes last: the tarball is truncated")
            builds = [m for m in members if m.name != MANIFEST]
            keys = {Path(m.name).parts[1:3] for m in builds if len(Path(m.name).parts) >= 3}
            fresh = {key for key in keys if not (target / key[0] / key[1]).exists()}
            tar.extractall(staging, members=[m for m in builds if tuple(Path(m.name).parts[1:3]) in fresh],
                           filter="data")
        for first, second in sorted(fresh):
            (target / first).mkdir(exist_ok=True)
            (staging / "kernels" / first / second).replace(target / first / second)
        return len(fresh), listed
    except EOFError as exc:
        raise Cudal2Error(f"cannot unpack {source}: the tarball is truncated ({exc})") from None
    except (tarfile.TarError, OSError, ValueError) as exc:  # corrupt, unreadable, no space left
        raise Cudal2Error(f"cannot unpack {source}: {exc}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def describe(entries: list[Entry]) -> list[dict]:
    return [{"kernel": str(e.candidate), "template": e.candidate.template, "dtype": e.dtype, "layout": e.layout,
             "why": e.why, "params": json.loads(e.candidate.params_json) if e.candidate.template else None}
            for e in entries]
