"""Baselines: the library calls a PyTorch user already has, measured exactly like a candidate.

- `cuBLAS`: cublasGemmEx with its default algorithm, fp32 compute, a 32 MiB workspace;
- `cuBLASLt`: autotuned per problem: the heuristic's top algorithms (up to 32, with a 32 MiB
  workspace) are each timed by the graph method beside cuBLAS's default call, those within 3%
  of the fastest are timed again; the finalists (those, and the heuristic's first) are then
  timed in the problem's first session of the protocol, as the other baselines are, and the
  fastest there is kept and recorded (its configuration goes in the row's `cublaslt_algo`);
- `torch.matmul`: torch.mm on the same buffers and stream (what F.linear runs for nt, the
  weight transposed), when torch is importable; only its device work is timed.

Both are called through a shim (baselines.cu) compiled once with nvcc that implements the
kernel ABI, so the bench calls them, captures them in a graph and checks their output through
the very path a candidate takes (CuPy refuses cuBLAS calls during stream capture). nvmath-python's `Matmul` plans and autotunes cuBLASLt too, but
allocates each call's result and binds its operands at construction, so it could not be
timed through that path; nor is it on the device image this project measures on.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import json
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..errors import Cudal2Error
from ..kernels.compile import Compiler, find_nvcc
from ..problem import Problem
from ..protocol import BASELINES as NAMES, OFFLINE_METHODS
from .measure import graph_medians
from .verify import Kernel, Rejected, cublas_product

LT_ALGOS = 32  # heuristic results timed by the autotuning
LT_FIELDS = ("algo", "tile", "stages", "splitk", "reduction", "swizzle", "custom", "cluster")


# ------------------------------------------------------------------ built on the host

def shim_source(problem: Problem, name: str) -> str:
    """The shim's source of baseline `name` (cuBLAS or cuBLASLt) for the problem's dtype and layout."""
    shim = (Path(__file__).parent / "baselines.cu").read_text()
    dtype = "CUDA_R_16F" if problem.dtype == "fp16" else "CUDA_R_16BF"
    return (f"#define CUDAL2_LT_TYPE {dtype}\n#define CUDAL2_LT_NT {int(problem.layout == 'nt')}\n"
            f"#define CUDAL2_CUBLAS_DEFAULT {int(name == 'cuBLAS')}\n{shim}")


def cublas_location() -> tuple[Path, Path, str, str] | None:
    """(include dir, library dir, cuBLAS and cuBLASLt library files): the CUDA toolkit
    beside nvcc, else the nvidia-cublas wheel's (nvidia/cu13 or nvidia/cublas); None if
    neither has them."""
    places = []
    try:
        toolkit = Path(find_nvcc()).resolve().parent.parent
        places += [(toolkit / "include", toolkit / d) for d in ("lib64", "lib", "targets/x86_64-linux/lib")]
    except Cudal2Error:
        pass
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        places += [(Path(root) / d / "include", Path(root) / d / "lib") for d in ("cu13", "cu12", "cublas")]
    for include, lib in places:
        if (include / "cublasLt.h").is_file() and lib.is_dir():
            blas = sorted(p.name for p in lib.glob("libcublas.so*"))
            lt = sorted(p.name for p in lib.glob("libcublasLt.so*"))
            if blas and lt:
                return include, lib, blas[0], lt[0]
    return None


def build_baselines(compiler: Compiler, problem: Problem) -> dict[str, str]:
    """The shim's libraries (cuBLAS, cuBLASLt) for this dtype and layout, compiled once, then
    cached: name -> library path. The two compile side by side (about 8 s each, one core)."""
    where = cublas_location()
    if where is None:
        raise Cudal2Error("cuBLAS headers not found (needed for the library baselines): install the CUDA "
                          "toolkit's cuBLAS or the nvidia-cublas wheel")
    include, lib, blas, lt = where
    link = (f"-I{include}", f"-L{lib}", f"-l:{blas}", f"-l:{lt}", "-Xlinker", f"-rpath,{lib}")
    libraries = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        builds = {name: pool.submit(compiler.compile, shim_source(problem, name), link=link)
                  for name in ("cuBLAS", "cuBLASLt")}
    for name, future in builds.items():
        build = future.result()
        if build.status != "ok":
            raise Cudal2Error(f"the {name} baseline does not compile: {build.log.strip().splitlines()[-1:]}")
        libraries[name] = str(build.library)
    return libraries


# ---------------------------------------------------------- called in the GPU worker

def cublas_gemm(problem: Problem, stream):
    """C = A @ B (or A @ W^T) through cublasGemmEx with fp32 compute (verify.cublas_product):
    the cuBLAS baseline. The returned function takes the shape from its arrays."""

    def run(a, b, c) -> None:
        cublas_product(problem, stream, a, b, c)

    return run


def torch_gemm(problem: Problem, stream):
    """torch.mm with its default settings on the same buffers and stream, or None."""
    try:
        import torch
    except ImportError:
        return None
    ext = torch.cuda.ExternalStream(stream.ptr)
    views: dict[tuple, Any] = {}

    def as_torch(x):
        # A view made once per buffer: DLPack's exchange orders the consumer's stream after
        # the producer's, which is not allowed while the stream is being captured.
        key = (x.data.ptr, x.shape)
        if key not in views:
            views[key] = (torch.from_dlpack(x) if problem.dtype == "fp16"
                          else torch.from_dlpack(x.view("int16")).view(torch.bfloat16))
        return views[key]

    def run(a, b, c) -> None:
        with torch.cuda.stream(ext):
            ta, tb, tc = as_torch(a), as_torch(b), as_torch(c)
            torch.mm(ta, tb if problem.layout == "nn" else tb.t(), out=tc)

    return run


class CublasLt:
    """The shim library, loaded with ctypes: the heuristic's algorithms, one selected."""

    def __init__(self, path: str):
        self.kernel = Kernel(path)
        lib = self.kernel.lib
        lib.cudal2_lt_heuristics.argtypes = [ctypes.c_int] * 4
        lib.cudal2_lt_select.argtypes = [ctypes.c_int]
        lib.cudal2_lt_describe.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        lib.cublasLtGetVersion.restype = ctypes.c_size_t
        self.lib = lib

    def algorithms(self, problem: Problem, requested: int = LT_ALGOS) -> int:
        count = self.lib.cudal2_lt_heuristics(problem.m, problem.n, problem.k, requested)
        if count <= 0:
            raise RuntimeError(f"cuBLASLt has no algorithm for {problem} (heuristic returned {count})")
        return count

    def select(self, index: int) -> None:
        if self.lib.cudal2_lt_select(index) != 0:
            raise RuntimeError(f"no cuBLASLt algorithm {index}")

    def version(self) -> int:
        """cuBLASLt's version, as the library loaded in this process gives it."""
        return int(self.lib.cublasLtGetVersion())

    def describe(self, index: int) -> dict[str, int]:
        out = (ctypes.c_int * len(LT_FIELDS))()
        self.lib.cudal2_lt_describe(index, out)
        return dict(zip(LT_FIELDS, out))


DEFAULT = -1  # the key of cuBLAS's default call, timed beside the algorithms as their reference
CLOSE = 0.03  # algorithms within this of the fastest are timed again (the fastest of 32 noisy medians flatters)
RETIMED = 4  # the most timed again
# Device seconds of the autotuning's two passes (all the heuristic's algorithms, then the close
# ones again): the baselines of a problem take at most about 2 s in all (measure_baselines).
# Long calls get fewer rounds, then fewer algorithms, in the heuristic's order.
AUTOTUNE_S = (0.3, 0.1)


def autotune(lt: CublasLt, problem: Problem, medians) -> dict[str, Any]:
    """Times the algorithms the heuristic offers and selects the fastest; returns its record.

    `medians(indices, budget_s)` gives the median device us of each index that `budget_s`
    of device time allows (the first ones), all timed together, with cuBLAS's default call
    beside them under `DEFAULT`. The algorithms within 3% of the fastest are timed again,
    alone, and the fastest of that round is kept: one noisy round's minimum is biased low.
    The record keeps cuBLAS's default from the same round, so a choice slower than it says
    that the heuristic's list lacks cuBLAS's kernel, not that the timing was off; `of` counts
    the algorithms timed, `offered` those the heuristic offered."""
    offered = lt.algorithms(problem)
    times = medians(list(range(offered)), AUTOTUNE_S[0])
    default = times.pop(DEFAULT, None)
    best = min(times.values())
    close = sorted((i for i in times if times[i] <= best * (1 + CLOSE)), key=times.get)[:RETIMED]
    final = medians(close, AUTOTUNE_S[1]) if len(close) > 1 else times
    default = final.pop(DEFAULT, default)
    fastest = min(final, key=final.get)
    lt.select(fastest)
    record = {"index": fastest, "of": len(times), "offered": offered, "cublaslt_version": lt.version(),
              "us": round(final[fastest], 3),
              "heuristic_first_us": round(times[0], 3), **lt.describe(fastest)}
    if len(close) > 1:
        record["retimed"] = close
    if default is not None:
        record["cublas_default_us"] = round(default, 3)
    return record


FINALIST = "cuBLASLt@{}"  # a finalist's contestant name in the first session (its heuristic index)


def finalists(record: dict[str, Any]) -> list[int]:
    """The algorithms the problem's first session of the protocol decides between: the
    autotuning's pick, those its retiming found close, and the heuristic's first (what a
    plain cuBLASLt call runs), at most RETIMED. The autotuning replays its graphs back to
    back, which holds a long call's GPU at its power cap; the protocol's rounds leave gaps, and
    there an algorithm that spends more energy per FLOP can be the faster (measured on an H200:
    the pick read 3.0-5.6% slower than cuBLAS's default on three large problems where the
    autotuning had found it faster)."""
    if "finalists" in record:  # those of a session under way (a wrong one left out)
        return list(record["finalists"])
    return list(dict.fromkeys([record["index"], 0, *record.get("retimed", [])]))[:RETIMED]


def choose_finalist(record: dict[str, Any], timings: dict[str, dict[str, dict]],
                    errors: dict[str, Any]) -> tuple[dict[str, Any], dict, dict]:
    """The finalist fastest in the session's own offline timings (the geometric mean of the
    kernel and graph medians) becomes `cuBLASLt`: its timings and error replace the pick's,
    and the other finalists leave. The record then names it (index and configuration, from
    `finalist_configs`), the autotuning's pick (`autotuned`, whose time `us` stays) and each
    finalist's time (`finalists_us`). Without offline timings of them all the pick stays."""
    names = {index: (FINALIST.format(index) if index != record["index"] else "cuBLASLt") for index in finalists(record)}
    methods = [m for m in OFFLINE_METHODS if m in timings]
    complete = methods and all(name in timings[m] for m in methods for name in names.values())
    scores = {index: math.prod(timings[m][name]["median_us"] for m in methods) ** (1 / len(methods))
              for index, name in names.items()} if complete else {}
    chosen = min(scores, key=scores.get) if scores else record["index"]
    kept = {names[chosen]: "cuBLASLt"}

    def without_finalists(entries: dict) -> dict:
        return {kept.get(name, name): entry for name, entry in entries.items()
                if name in kept or (name not in names.values() and not name.startswith(FINALIST.format("")))}

    configs = record.get("finalist_configs", {})
    record = {**{k: v for k, v in record.items() if k not in ("finalists", "finalist_configs")},
              **configs.get(str(chosen), {}),
              "index": chosen, "autotuned": record["index"]}
    if scores:
        record["finalists_us"] = {str(i): round(us, 3) for i, us in scores.items()}
    return record, {m: without_finalists(entries) for m, entries in timings.items()}, without_finalists(errors)


# cuBLASLt's choice per problem, kept for the process's life (its later jobs).
_LT_CHOICE: dict[tuple, dict[str, Any]] = {}


def names_its_algorithm(lt: CublasLt, count: int, record: dict[str, Any]) -> bool:
    """Whether the record's index (of the heuristic's `count` algorithms) still names the
    configuration it recorded, in the cuBLASLt it was made with."""
    index = record.get("index")
    return (isinstance(index, int) and 0 <= index < count and record.get("cublaslt_version") == lt.version()
            and all(record.get(field) == value for field, value in lt.describe(index).items()))


def abi_call(kernel, workspace, problem: Problem, stream, name: str):
    """run(a, b, c) for a library implementing the kernel ABI; a non-zero return is an error."""
    def run(a, b, c) -> None:
        code = kernel.call(a.data.ptr, b.data.ptr, c.data.ptr, problem.m, problem.n, problem.k,
                           workspace.data.ptr, workspace.nbytes, stream.ptr)
        if code != 0:
            raise Rejected("cheat", f"{name}: cudal2_gemm returned {code} while timed, 0 while verified", name)

    return run


def library_calls(problem: Problem, job: dict[str, Any], stream, rng) -> tuple[dict, dict]:
    """run(a, b, c) of each baseline, cuBLASLt autotuned for this problem (its record): the
    job's choice (made in the graph process, or final) or this process's earlier one, else
    autotuned here by the graph method. A job that asks for `finalists` also gets each
    finalist but the pick as a contestant of its own (FINALIST), and the record lists them
    (`finalists`) with their configurations, for choose_finalist."""
    import cupy

    libraries = job["libraries"]
    blas = Kernel(libraries["cuBLAS"])
    lt = CublasLt(libraries["cuBLASLt"])
    run = {name: abi_call(kernel, cupy.empty(kernel.workspace_bytes(problem.m, problem.n, problem.k), cupy.uint8),
                          problem, stream, name) for name, kernel in (("cuBLAS", blas), ("cuBLASLt", lt.kernel))}
    lt_call = run["cuBLASLt"]
    key = (problem.m, problem.n, problem.k, problem.dtype, problem.layout)
    count = lt.algorithms(problem)
    if job.get("cublaslt"):
        _LT_CHOICE[key] = job["cublaslt"]
    if key in _LT_CHOICE and not names_its_algorithm(lt, count, _LT_CHOICE[key]):
        del _LT_CHOICE[key]  # a choice (kept on disk, say) that the heuristic's list no longer holds
    if key in _LT_CHOICE:
        lt.select(_LT_CHOICE[key]["index"])
    else:
        def run_algorithm(name: str, a, b, c) -> None:
            if int(name) == DEFAULT:
                run["cuBLAS"](a, b, c)
            else:
                lt.select(int(name))
                run["cuBLASLt"](a, b, c)

        def medians(indices: list[int], budget_s: float) -> dict[int, float]:
            found = graph_medians(run_algorithm, [str(i) for i in [DEFAULT, *indices]], problem, stream=stream,
                                  rng=rng, budget_s=budget_s)
            return {int(name): us for name, us in found.items()}

        _LT_CHOICE[key] = autotune(lt, problem, medians)
    record = _LT_CHOICE[key]

    def algorithm(index: int):
        def call(a, b, c) -> None:  # the selection is the shim's: each call (or capture) makes its own
            lt.select(index)
            lt_call(a, b, c)
        return call

    run["cuBLASLt"] = algorithm(record["index"])
    if job.get("finalists"):
        chosen = finalists(record)
        for index in chosen[1:]:
            run[FINALIST.format(index)] = algorithm(index)
        record = {**record, "finalists": chosen, "finalist_configs": {str(i): lt.describe(i) for i in chosen}}
    if (torch_run := torch_gemm(problem, stream)) is not None:
        run["torch.matmul"] = torch_run
    return run, record


# ------------------------------------------------ the autotuning's choice, kept on this machine

PICKS = "cublaslt-picks.json"  # in the cache directory: {"entries": [{"key": ..., "record": ...}]}
# The baselines' own session (their rows; the choice between cuBLASLt's finalists): rounds for
# at most this timing budget, after this soak (long calls), so that with the autotuning the
# baselines of a problem take about 2 s at most. Each kernel's session times them again beside it.
SESSION_BUDGET_S, SESSION_SOAK_S = 0.2, 0.3
# ... and at least this many rounds a process (a session of kernels: worker.MIN_ROUNDS, 5). On the
# H200 the baselines of 8192^3 (1.5 ms calls) took 1.74 s, 0.66 s of it in 9 rounds a process
# (fitting 0.2 s); a round of calls eight times as long (the grid's 16384^3) with cuBLASLt's
# finalists beside the baselines is estimated at 0.2 s from that, so that 5 rounds a process
# would take 2 s alone (a grid sample's baselines reached 2.83 s). With 3 (H200): 8192^3 1.72 s
# first, 1.12 s with the kept choice; 16384^3 2.46 and 2.01 s, still over; over 99 fresh grid
# shapes at --time-budget 5 (seed 20261304) a median of 0.89 s and at most 2.01 s.
SESSION_MIN_ROUNDS = 3


def cublaslt_version() -> str | None:
    """The cuBLASLt library the shim links, as its file's name and size (a wheel's carries
    only the major version in its name)."""
    where = cublas_location()
    if where is None:
        return None
    library = (where[1] / where[3]).resolve()
    return f"{library.name}:{library.stat().st_size}"


def pick_key(problem: Problem, environment: dict[str, Any], version: str | None) -> dict[str, Any]:
    """What cuBLASLt's choice for a problem depends on: the problem, the GPU and its driver,
    the cuBLASLt library (`version`), and the shim's request (its source and LT_ALGOS)."""
    shim = hashlib.sha256(f"{LT_ALGOS}\n{(Path(__file__).parent / 'baselines.cu').read_text()}".encode()).hexdigest()
    return {"m": problem.m, "n": problem.n, "k": problem.k, "dtype": problem.dtype, "layout": problem.layout,
            "gpu": environment.get("gpu"), "cc": environment.get("cc"), "driver": environment.get("driver"),
            "cublaslt": version, "shim": shim[:16]}


def _entries(path: Path) -> list[dict[str, Any]]:
    """The file's well-formed entries; none when it is missing or unreadable."""
    try:
        entries = json.loads(path.read_text()).get("entries", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [e for e in entries if isinstance(e, dict) and isinstance(e.get("key"), dict) and _well_formed(e.get("record"))]


def _well_formed(record: Any) -> bool:
    return (isinstance(record, dict) and isinstance(record.get("index"), int) and record["index"] >= 0
            and all(isinstance(record.get(field), int) for field in LT_FIELDS))


def read_pick(path: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    """The choice kept under exactly this key, or None (the worker checks it against the
    heuristic's list before using it: names_its_algorithm)."""
    return next((e["record"] for e in _entries(path) if e["key"] == key), None)


def write_pick(path: Path, key: dict[str, Any], record: dict[str, Any]) -> None:
    """Keeps the choice under the key (replacing the key's earlier one), the file replaced
    whole; a record not shaped like a choice is not kept, and a cache that cannot be
    written is left as it is."""
    if not _well_formed(record):
        return
    entries = [e for e in _entries(path) if e["key"] != key] + [{"key": key, "record": record}]
    temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_text(json.dumps({"entries": entries}, sort_keys=True))
        os.replace(temporary, path)
    except OSError:
        temporary.unlink(missing_ok=True)


def algo_json(record: dict[str, Any] | None) -> str | None:
    return json.dumps(record, sort_keys=True) if record else None
