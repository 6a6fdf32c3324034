"""Compile: nvcc to a shared library, cached by content, in parallel, with a timeout."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import zipfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import Cudal2Error

# Many kernel libraries share one worker process. -fno-gnu-unique and -Bsymbolic keep each
# library's inline/template statics its own: by default the dynamic linker merges such
# "unique" symbols across libraries, and one kernel's cached set-up leaks into another's.
BASE_FLAGS = (
    "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC,-fno-gnu-unique", "-Xlinker", "-Bsymbolic",
    "-cudart", "shared", "--expt-relaxed-constexpr", "-Xptxas", "-v",
)
LIBRARY = "kernel.so"
# What a library declares of itself beyond ptxas's report (declared_resources).
RESOURCES = ("dynamic_smem_bytes", "producer_registers", "consumer_registers")


@dataclass
class Build:
    """The outcome of one compile: a library, or the log saying why not."""

    key: str
    status: str  # ok | compile_error | timeout
    library: Path | None
    log: str
    seconds: float
    cached: bool = False
    registers: int | None = None
    smem_bytes: int | None = None
    spill_bytes: int | None = None
    stack_bytes: int | None = None
    exports: list[str] = field(default_factory=list)
    imports: list[str] = field(default_factory=list)
    # RESOURCES as the library declares them (declared_resources); None where not declared
    declared: dict[str, int | None] = field(default_factory=lambda: dict.fromkeys(RESOURCES))

    @property
    def stats(self) -> dict[str, int | None]:
        return {
            "registers": self.registers,
            "smem_bytes": self.smem_bytes,
            "spill_bytes": self.spill_bytes,
            "stack_bytes": self.stack_bytes,
        }


def find_nvcc() -> str:
    """$CUDAL2_NVCC, else nvcc on PATH, else under $CUDA_HOME or $CUDA_PATH."""
    places = [os.environ.get("CUDAL2_NVCC"), shutil.which("nvcc")]
    places += [str(Path(os.environ[v]) / "bin" / "nvcc") for v in ("CUDA_HOME", "CUDA_PATH") if v in os.environ]
    nvcc = next((p for p in places if p and os.access(p, os.X_OK)), None)
    if nvcc is None:
        raise Cudal2Error("nvcc not found: install the CUDA toolkit and put nvcc on PATH (or set CUDA_HOME)")
    return nvcc


@functools.cache
def nvcc_version() -> str:
    out = subprocess.run([find_nvcc(), "--version"], capture_output=True, text=True).stdout
    match = re.search(r"release ([\d.]+), V([\d.]+)", out)
    return match.group(2) if match else out.strip().splitlines()[-1]


# Where the CUTLASS/CuTe headers come from when neither CUTLASS_DIR nor the nvidia-cutlass
# package gives them: that package's wheel, its headers alone unpacked into the cache (its
# dependencies, scipy and cuda-python among them, are not needed for headers).
CUTLASS_WHEEL = "nvidia-cutlass==4.2.0.0"
_HEADERS = ("cutlass_library/source/include/", "cutlass_library/source/tools/util/include/")


@functools.cache
def cutlass_include() -> tuple[Path, ...]:
    """CUTLASS/CuTe include folders: $CUTLASS_DIR, else the nvidia-cutlass package's, else the
    headers of its wheel fetched once into the cache (fetch_cutlass_headers)."""
    if root := os.environ.get("CUTLASS_DIR"):
        base = Path(root)
    elif (spec := importlib.util.find_spec("cutlass_library")) is not None and spec.origin is not None:
        base = Path(spec.origin).parent / "source"  # located, not imported (heavy deps)
    else:
        base = fetch_cutlass_headers(Path(os.environ.get("CUDAL2_CACHE_DIR") or default_cache_dir()))
    # Absolute: nvcc runs in each build's own folder, where a relative CUTLASS_DIR or
    # CUDAL2_CACHE_DIR (say `.cache`) would name nothing and every sm90 build fail.
    dirs = (base / "include", base / "tools" / "util" / "include")
    return tuple(d.resolve() for d in dirs if d.is_dir())


def fetch_cutlass_headers(cache_dir: Path) -> Path:
    """The CUTLASS source folder (include/, tools/util/include/) under cache_dir/cutlass, made
    once from CUTLASS_WHEEL (pip download, no dependencies; about 6 MB). Where that fails
    (offline, no pip) it says how to get them, once, and the templates that need them fail
    to compile with nvcc's own message."""
    target = cache_dir / "cutlass" / CUTLASS_WHEEL.split("==")[1]
    if (target / "include" / "cutlass" / "version.h").is_file():
        return target
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
                            "-d", tmp, CUTLASS_WHEEL], check=True, capture_output=True, text=True, timeout=600)
            [wheel] = Path(tmp).glob("*.whl")
            staging = Path(tempfile.mkdtemp(prefix=".cutlass-", dir=cache_dir))
            with zipfile.ZipFile(wheel) as archive:
                for name in archive.namelist():
                    if name.startswith(_HEADERS) and not name.endswith("/"):
                        out = staging / name.removeprefix("cutlass_library/source/")
                        out.parent.mkdir(parents=True, exist_ok=True)
                        out.write_bytes(archive.read(name))
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                staging.rename(target)
            except OSError:  # another process put them in place first
                shutil.rmtree(staging, ignore_errors=True)
    except (OSError, ValueError, subprocess.SubprocessError, zipfile.BadZipFile) as exc:
        lines = (getattr(exc, "stderr", None) or str(exc)).strip().splitlines()
        warnings.warn(f"CUTLASS headers not found and not fetched ({lines[-1] if lines else type(exc).__name__}): "
                      f"`pip install {CUTLASS_WHEEL}` or set CUTLASS_DIR; the sm90 templates need them", stacklevel=2)
    return target


@functools.cache
def cutlass_version() -> str:
    for inc in cutlass_include():
        header = inc / "cutlass" / "version.h"
        if header.is_file():
            text = header.read_text()
            parts = [re.search(rf"#define CUTLASS_{p} (\d+)", text) for p in ("MAJOR", "MINOR", "PATCH")]
            if all(parts):
                return ".".join(m.group(1) for m in parts)
    return "none"


# What nvcc prints when it or a stage of it was stopped by a signal, not by the source.
STOPPED = re.compile(r"died due to signal|^nvcc: (Terminated|Killed|Interrupt)", re.MULTILINE)


def flags(arch: str) -> list[str]:
    """Every flag that shapes the binary; part of the cache key."""
    target = arch.removeprefix("sm_")
    includes = [f"-I{d}" for d in cutlass_include()]
    return [*BASE_FLAGS, f"-gencode=arch=compute_{target},code=sm_{target}", *includes]


def cache_key(source: str, arch: str, link: tuple[str, ...] = ()) -> str:
    payload = json.dumps(
        [source, [f for f in flags(arch) if not f.startswith("-I")], nvcc_version(),
         cutlass_version(), arch, *([list(link)] if link else [])]
    )
    return hashlib.sha256(payload.encode()).hexdigest()


def parse_ptxas(log: str) -> dict[str, int]:
    """Worst case over the library's kernels: registers, shared memory, spills, stack."""
    stats = {"registers": 0, "smem_bytes": 0, "spill_bytes": 0, "stack_bytes": 0}
    for m in re.finditer(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?", log):
        stats["registers"] = max(stats["registers"], int(m.group(1)))
        if m.group(2):
            stats["smem_bytes"] = max(stats["smem_bytes"], int(m.group(2)))
    for m in re.finditer(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log):
        stats["stack_bytes"] = max(stats["stack_bytes"], int(m.group(1)))
        stats["spill_bytes"] = max(stats["spill_bytes"], int(m.group(2)) + int(m.group(3)))
    return stats


# A template's record of what ptxas -v cannot see (templates/README.md): these 20 bytes, then
# three little-endian int32 in the order of RESOURCES.
RESOURCES_TAG = b"cudal2-resources".ljust(20, b"\0")


def declared_resources(library: Path) -> dict[str, int | None]:
    """The library's `cudal2_resources` record, read from the file, not loaded: no code runs
    and no GPU is needed, so a compile-only build host records it too. The dynamic shared
    memory of its GEMM launch, and the registers per thread of its producer and consumer
    warpgroups after setmaxnreg (None where the kernel keeps its launch count); every value
    None for a library without the record (free-form sources)."""
    data = library.read_bytes()
    at = data.find(RESOURCES_TAG)
    if at < 0:
        return dict.fromkeys(RESOURCES)
    smem, producer, consumer = struct.unpack_from("<3i", data, at + len(RESOURCES_TAG))
    return dict(zip(RESOURCES, (smem, producer or None, consumer or None)))


def library_symbols(library: Path) -> tuple[list[str], list[str]]:
    """(exported, imported) dynamic symbols of a shared library, versions stripped."""
    nm = shutil.which("nm")
    if nm is None:
        raise Cudal2Error("nm (binutils) not found: it is needed to inspect compiled kernels")
    out = subprocess.run([nm, "-D", str(library)], capture_output=True, text=True, check=True).stdout
    exports, imports = [], []
    for line in out.splitlines():
        parts = line.split()
        kind, name = parts[-2], parts[-1].split("@")[0]
        (imports if kind in ("U", "w", "v") else exports).append(name)
    return sorted(set(exports)), sorted(set(imports))


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "cudal2"


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # already gone
        pass


class Cancelled(Cudal2Error):
    """A compile stopped by Compiler.cancel(); nothing is cached for it."""


class Compiler:
    """Compiles sources to libraries under `cache_dir/kernels/<key>/`, each written once.

    A finished entry holds the source, the library (if any) and build.json; it is built in
    a temporary folder and renamed into place, so readers never see half an entry and two
    processes compiling the same source race harmlessly.
    """

    def __init__(self, arch: str, cache_dir: Path | None = None, jobs: int | None = None,
                 timeout: float = 600.0, slots: threading.Semaphore | None = None):
        self.arch = arch
        self.root = (cache_dir or default_cache_dir()) / "kernels"
        try:  # an unusable cache is one line before anything is rendered or measured
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise Cudal2Error(f"cannot use kernel cache {self.root.parent} (CUDAL2_CACHE_DIR): {exc.strerror}") from None
        self.jobs = jobs or os.cpu_count() or 1
        self.timeout = timeout
        # nvcc processes at once; compilers that share `slots` (one per GPU worker) share the cores
        self.slots = slots or threading.BoundedSemaphore(self.jobs)
        self._lock = threading.Lock()
        self._running: set[subprocess.Popen] = set()
        self._generation = 0  # compiles started before the latest cancel() belong to older ones

    @property
    def generation(self) -> int:
        """Compiles asked for with this generation are stopped by the next cancel(), even
        if they have not started yet when it comes."""
        return self._generation

    def cancel(self) -> None:
        """Stops the compiles in progress and those still queued (they raise Cancelled and
        cache nothing); compiles asked for afterwards run normally."""
        with self._lock:
            self._generation += 1
            for proc in self._running:
                _kill_group(proc)

    def _run_nvcc(self, cmd: list[str], cwd: Path, generation: int) -> tuple[int, str]:
        """nvcc's exit code and output; Cancelled if cancel() came since `generation`."""
        with self.slots:
            with self._lock:
                if generation != self._generation:
                    raise Cancelled("compile cancelled")
                # Its own process group: cancelling or a timeout kills nvcc's cicc and ptxas too.
                proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True)
                self._running.add(proc)
            try:
                out, _ = proc.communicate(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                proc.communicate()
                raise
            finally:
                with self._lock:
                    self._running.discard(proc)
        if generation != self._generation:
            raise Cancelled("compile cancelled")
        return proc.returncode, out

    def entry(self, key: str) -> Path:
        return self.root / key[:2] / key

    def lookup(self, source: str, link: tuple[str, ...] = ()) -> Build | None:
        """The cached build of `source` (linked with `link`), or None."""
        key = cache_key(source, self.arch, link)
        meta = self.entry(key) / "build.json"
        if not meta.is_file():
            return None
        build = Build(**json.loads(meta.read_text()), library=None, cached=True)
        if build.status == "compile_error" and not build.log.strip():
            # nvcc says why for every failure it decides; a failure without a word is a build
            # stopped from outside that an earlier version cached. It says nothing of the
            # source: removed, to be compiled again (a prebuild's killed builds failed six GPU tests so).
            shutil.rmtree(self.entry(key), ignore_errors=True)
            return None
        if build.status == "ok":
            build.library = self.entry(key) / LIBRARY
        return build

    def compile(self, source: str, generation: int | None = None, link: tuple[str, ...] = ()) -> Build:
        """One source to a library; a compile error or timeout is a Build, not an exception
        (cancel() raises Cancelled in the compiles it stops). `link`: extra nvcc flags for
        the trusted baselines that call a library (candidates link none)."""
        generation = self._generation if generation is None else generation
        if (hit := self.lookup(source, link)) is not None:
            return hit
        key = cache_key(source, self.arch, link)
        self.root.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{key[:12]}-", dir=self.root))
        (work / "kernel.cu").write_text(source)
        cmd = [find_nvcc(), *flags(self.arch), "kernel.cu", "-o", LIBRARY, *link]
        start = time.monotonic()
        try:
            returncode, log = self._run_nvcc(cmd, work, generation)
        except subprocess.TimeoutExpired:
            shutil.rmtree(work, ignore_errors=True)
            return Build(key, "timeout", None, f"nvcc exceeded {self.timeout:.0f} s", self.timeout)
        except Cancelled:
            shutil.rmtree(work, ignore_errors=True)
            raise
        seconds = time.monotonic() - start
        if returncode < 0 or STOPPED.search(log):
            # nvcc, or one of its stages, was stopped from outside (a killed prebuild, the machine
            # short of memory): no verdict on the source, so nothing is cached and a later run
            # compiles it again (a cached failure would refuse it for good). nvcc sent SIGTERM
            # says "nvcc: Terminated" and exits 1, its stages' files gone.
            shutil.rmtree(work, ignore_errors=True)
            how = f"signal {-returncode}" if returncode < 0 else "a signal (its log says so)"
            return Build(key, "compile_error", None, f"nvcc was stopped by {how}; not cached\n{log}", seconds)
        build = Build(key, "ok" if returncode == 0 else "compile_error", None, log, seconds,
                      **parse_ptxas(log) if returncode == 0 else {})
        if build.status == "ok":
            build.exports, build.imports = library_symbols(work / LIBRARY)
            build.declared = declared_resources(work / LIBRARY)
            if "cudal2_gemm" not in build.exports:
                build.status = "compile_error"
                build.log += "\nthe library does not export cudal2_gemm (extern \"C\" int cudal2_gemm(...))"
                (work / LIBRARY).unlink()
        record = {k: v for k, v in asdict(build).items() if k not in ("library", "cached")}
        (work / "build.json").write_text(json.dumps(record, indent=1))
        self._publish(work, key)
        published = self.lookup(source, link)
        published.cached = False  # this call ran nvcc (or raced another that did)
        return published

    def _publish(self, work: Path, key: str) -> None:
        final = self.entry(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        try:
            work.rename(final)
        except OSError:  # another process published the same key first
            shutil.rmtree(work, ignore_errors=True)

    def compile_all(self, sources: list[str], generation: int | None = None,
                    on_build: Callable[[str, Build], None] | None = None) -> list[Build]:
        """Many sources in parallel (one nvcc per job slot); identical sources compile once.
        `on_build(source, build)` hears of each build as it finishes. A compile that raises
        (Cancelled) raises here once every other has finished and been heard of: a build
        that finished is never lost to another's cancellation."""
        unique = list(dict.fromkeys(sources))
        generation = self._generation if generation is None else generation
        builds, failure = {}, None
        with ThreadPoolExecutor(max_workers=max(1, min(self.jobs, len(unique)))) as pool:
            futures = {pool.submit(self.compile, source, generation): source for source in unique}
            for future in as_completed(futures):
                try:
                    builds[futures[future]] = build = future.result()
                except Exception as exc:
                    failure = failure or exc
                    continue
                if on_build:
                    on_build(futures[future], build)
        if failure is not None:
            raise failure
        return [builds[s] for s in sources]


def first_error_line(log: str) -> str:
    """The line of a compiler's log that says what went wrong (else its last line)."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    return next((line for line in lines if "error" in line.lower()), lines[-1] if lines else "no output")
