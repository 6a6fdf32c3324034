"""PyTorch ops: `torch.ops.cudal2.linear(x, weight, bias=None)` and `torch.ops.cudal2.mm(a, b)`
(and `torch.ops.cudal2.layer(weight, bias, x)`, linear for a patched layer's forward, which
calls it as `LAYER`: C++ bound by pybind11, without torch.ops' argument parsing, where Python's
headers let the library build as a Python module).

The ops live in C++ (`csrc/torch_op.cpp`, a TORCH_LIBRARY built with torch.utils.cpp_extension
on first import and cached): a call is looked up in the dispatch library's table (choose one
with `use(DIR)`) and runs its kernel on the current stream, or falls back to at::linear /
at::mm for whatever the library does not cover: no library or one built for another GPU or
driver, a device other than CUDA, another dtype, non-contiguous strides, a shape it was not
tuned or verified for, a misaligned pointer. The fallback is what the kernel was measured
against, so a model is never slower for using the op. Below torch.ops' own binding no Python
runs on the call path. They have a meta kernel
(torch.compile, fake tensors) and autograd (the library calls' gradients), and run in CUDA
graphs.

    import cudal2.torch
    cudal2.torch.use("library/")         # cudal2 export --library library/
    cudal2.torch.patch(model)            # nn.Linear layers whose shapes were tuned
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from .errors import Cudal2Error
from .kernels.compile import default_cache_dir
from .measure.environment import driver_version
from .runtime import DispatchTable, serving

SOURCE = Path(__file__).parent / "csrc" / "torch_op.cpp"
DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
# How the table's dtype and layout reach the C++ op (its dtype_code and Layout).
DTYPE_CODES = {"fp16": 0, "bf16": 1}
LAYOUT_CODES = {"nn": 0, "nt": 1}


def build() -> ModuleType | None:
    """Compiles the ops' library for this torch (with its CUDA path where torch has CUDA and
    the toolkit is installed), once per source and torch build, under the cache directory's
    `torch-op/`, and loads it (the ops register). Where Python's headers are installed it is a
    Python module too, returned: its `layer` is the patched layers' call; else None."""
    from torch.utils import cpp_extension

    cuda = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    python = Path(sysconfig.get_paths()["include"], "Python.h").is_file()
    stamp = f"{torch.__version__} {torch.version.cuda} {cuda} {python} {sys.version_info[:2]}".encode()
    key = hashlib.sha256(SOURCE.read_bytes() + stamp).hexdigest()[:16]
    name = f"cudal2_torch_op_{key}"
    directory = default_cache_dir() / "torch-op" / key
    library = directory / f"{name}.so"
    if library.is_file():
        if not python:
            torch.ops.load_library(str(library))
            return None
        spec = importlib.util.spec_from_file_location(name, library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    directory.mkdir(parents=True, exist_ok=True)
    flags = ["-O3", *(["-DCUDAL2_CUDA"] if cuda else []), *(["-DCUDAL2_PYTHON"] if python else [])]
    try:
        module = cpp_extension.load(name=name, sources=[str(SOURCE)], with_cuda=cuda, build_directory=str(directory),
                                    extra_cflags=flags, is_python_module=python)
    except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:  # no compiler, no ninja, a build error
        raise Cudal2Error(f"cannot build the cudal2 PyTorch op from {SOURCE} in {directory}: "
                          f"{str(exc).strip().splitlines()[-1]}") from None
    return module if python else None


OP = build()
# A patched layer's forward: cudal2::layer called from C++ (bound by pybind11), else through torch.ops.
LAYER = OP.layer if OP is not None else torch.ops.cudal2.layer.default
if OP is not None:
    @torch.compiler.substitute_in_graph(OP.layer, skip_signature_check=True)
    def _layer(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
        """What torch.compile traces for a patched layer's call (OP.layer, a C++ function): the op."""
        return torch.ops.cudal2.layer.default(weight, bias, x)
_served: dict = {"table": None}  # the table the C++ op serves, for patch()


def use(library: Path | str | None, environment: dict | None = None) -> DispatchTable | None:
    """Serves the ops from the library in `library` (None: the fallback alone). A library
    built for another GPU or driver than `environment` (default: this process's current CUDA
    device) serves nothing, with one warning. The table is handed to the C++ op once: its
    kernels are loaded and each call shape's choice is then made in C++."""
    _serve(None)
    if library is None:
        return None
    table = DispatchTable.load(Path(library))
    if environment is None and not torch.cuda.is_available():
        return table
    if serving(table, environment or _environment()):
        _serve(table)
    return table


def _environment() -> dict:
    device = torch.cuda.current_device()
    return {"gpu": torch.cuda.get_device_name(device), "driver": driver_version(device), "cuda": torch.version.cuda}


def _serve(table: DispatchTable | None) -> None:
    entries = table.entries if table is not None else []
    paths = sorted({e.library for e in entries})
    index = {path: i for i, path in enumerate(paths)}
    flat = [v for e in entries for v in (e.m, e.n, e.k, DTYPE_CODES[e.dtype], LAYOUT_CODES[e.layout],
                                         index[e.library], min(e.verified_m), max(e.verified_m))]
    library_call = [v for m, n, k, dtype, layout in (table.library_call if table is not None else ())
                    for v in (m, n, k, DTYPE_CODES[dtype], LAYOUT_CODES[layout])]
    _served["table"] = None
    try:
        torch.ops.cudal2._serve([str(table.root / path) for path in paths], flat, library_call)
    except RuntimeError as exc:  # a kernel that will not load: the C++ op keeps serving nothing
        raise Cudal2Error(str(exc).splitlines()[0]) from None
    _served["table"] = table


def served(m: int, n: int, k: int, dtype: str = "fp16", layout: str = "nt") -> Path | None:
    """The kernel library a call of this problem runs (layout "nt": linear, "nn": mm), or
    None where it runs the library call: the C++ op's own choice."""
    path = torch.ops.cudal2._kernel(m, n, k, DTYPE_CODES[dtype], LAYOUT_CODES[layout])
    return Path(path) if path else None


def patch(model: torch.nn.Module) -> int:
    """Routes every nn.Linear whose (N, K) the served library tuned for some M straight to
    the op: its forward becomes cudal2::layer (linear, the layer's tensors first) called from
    C++ (LAYER, i.e. OP.layer: no Python of ours, nor torch.ops' argument parsing, between the
    module call and the dispatcher) with the layer's weight and bias bound. torch.compile
    traces it as torch.ops.cudal2.layer. Returns how many."""
    table = _served["table"]
    if table is None:
        return 0
    tuned = {(e.n, e.k, e.dtype) for e in table.entries if e.layout == "nt"}
    swapped = 0
    for layer in model.modules():
        if isinstance(layer, torch.nn.Linear) and layer.weight.dtype in DTYPES and \
                (layer.out_features, layer.in_features, DTYPES[layer.weight.dtype]) in tuned:
            layer.forward = functools.partial(LAYER, layer.weight, layer.bias)
            swapped += 1
    return swapped


def host_us(calls: dict[str, Callable[[], object]], *, cuda: bool, rounds: int, repeat: int) -> dict[str, float]:
    """Host time of one call of each function, in microseconds: the fastest of `rounds`
    rounds of `repeat` calls, the functions' rounds interleaved. Another process's load slows
    a round, never speeds it up. With `cuda`, each round's calls are queued behind a sleep
    kernel longer than they take to queue, so that none waits for the GPU and the wall time
    is the host's work alone."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            if cuda:
                fn()
                torch.cuda.synchronize()
                torch.cuda._sleep(100_000_000)  # ~50 ms at an H200's clock
            start = time.perf_counter()
            for _ in range(repeat):
                fn()
            times[name].append((time.perf_counter() - start) / repeat * 1e6)
            if cuda:
                torch.cuda.synchronize()
    return {name: min(t) for name, t in times.items()}
