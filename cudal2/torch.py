"""PyTorch ops: `torch.ops.cudal2.mm(a, b)` and `torch.ops.cudal2.linear(x, weight)`.

Each runs the dispatch library's kernel for the call's shape (cudal2/runtime.py; choose one
with `use(DIR)`) on the current stream, and falls back to torch.matmul / F.linear for
whatever the library does not cover: no library or one built for another GPU, driver or
CUDA, a device other than CUDA, another dtype, a batch dimension, non-contiguous strides, a
shape it was not tuned or verified for. The fallback is exactly what the kernel was measured
against, so a model is never slower for using the op. Registered through torch.library
with fake implementations, so the ops work eagerly, under torch.compile and in CUDA graphs.

    import cudal2.torch
    cudal2.torch.use("library/")         # cudal2 export --library library/
    cudal2.torch.patch(model)            # nn.Linear layers whose shapes were tuned
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from .runtime import DispatchTable, serving
from .verify import Kernel

DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
# The table, its loaded kernels, and each call shape's choice (a model calls few shapes many
# times: the lookup is made once per shape, so the op's host cost stays near torch.matmul's).
_state: dict = {"table": None, "kernels": {}, "chosen": {}, "no_workspace": {}}


def use(library: Path | str | None, environment: dict | None = None) -> DispatchTable | None:
    """Serves the ops from the library in `library` (None: the fallback alone). A library
    built for another GPU or driver than `environment` (default: this process's
    current CUDA device) serves nothing, with one warning."""
    _state.update(table=None, kernels={}, chosen={}, no_workspace={})
    if library is None:
        return None
    table = DispatchTable.load(Path(library))
    if environment is None and not torch.cuda.is_available():
        return table
    if serving(table, environment or _environment()):
        _state["table"] = table
    return table


def _environment() -> dict:
    from .environment import _nvidia_smi

    device = torch.cuda.current_device()
    return {"gpu": torch.cuda.get_device_name(device), "driver": _nvidia_smi(device).get("driver_version"),
            "cuda": torch.version.cuda}


def _kernel(key: tuple) -> tuple[Kernel, int] | None:
    """The kernel the table picks for (m, n, k, dtype, layout) and its workspace bytes, or None."""
    if key not in _state["chosen"]:
        entry = _state["table"].choose(*key)
        if entry is None:
            _state["chosen"][key] = None
        else:
            path = _state["table"].root / entry.library
            if path not in _state["kernels"]:  # one library may serve several shapes
                _state["kernels"][path] = Kernel(str(path))
            kernel = _state["kernels"][path]
            _state["chosen"][key] = (kernel, kernel.workspace_bytes(*key[:3]))
    return _state["chosen"][key]


def _tuned(a: torch.Tensor, b: torch.Tensor, layout: str) -> torch.Tensor | None:
    """C from the library's kernel, or None where the library does not cover the call."""
    table = _state["table"]
    if (table is None or not a.is_cuda or a.device != b.device or a.dim() != 2 or b.dim() != 2
            or a.dtype not in DTYPES or b.dtype != a.dtype or not a.is_contiguous() or not b.is_contiguous()):
        return None
    m, k = a.shape
    n = b.shape[1] if layout == "nn" else b.shape[0]
    if (b.shape[0] if layout == "nn" else b.shape[1]) != k:
        return None
    chosen = _kernel((m, n, k, DTYPES[a.dtype], layout))
    if chosen is None:
        return None
    kernel, size = chosen
    device = a.device
    out = torch.empty((m, n), dtype=a.dtype, device=device)
    # Most kernels need no workspace; they get a valid pointer all the same, as when verified.
    workspace = torch.empty(size, dtype=torch.uint8, device=device) if size else _no_workspace(device)
    code = kernel.gemm(a.data_ptr(), b.data_ptr(), out.data_ptr(), m, n, k, workspace.data_ptr(), size,
                       _stream(device))
    return out if code == 0 else None  # a kernel that declines the shape: the library call runs


def _no_workspace(device: torch.device) -> torch.Tensor:
    """One small buffer per device for the kernels that need no workspace (nothing writes it)."""
    buffers = _state["no_workspace"]
    if device not in buffers:
        buffers[device] = torch.empty(256, dtype=torch.uint8, device=device)
    return buffers[device]


# The current stream's handle as an integer, as code compiled by torch.compile gets it:
# torch.cuda.current_stream() builds a Stream object each call, a few microseconds of host time.
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream(device: torch.device) -> int:
    if _RAW_STREAM is not None:
        return _RAW_STREAM(device.index)  # a CUDA tensor's device always has its index
    return torch.cuda.current_stream(device).cuda_stream


# Defined through torch.library.Library, not torch.library.custom_op, whose wrapper cost 7.7
# us of host time a call on a CPU tensor (F.linear: 1.6); torch.library.register_autograd's
# kernel then cost 5.9, its redispatch included; the autograd kernel below costs 3.8.
_LIBRARY = torch.library.Library("cudal2", "DEF")
_LIBRARY.define("mm(Tensor a, Tensor b) -> Tensor")
_LIBRARY.define("linear(Tensor x, Tensor weight) -> Tensor")


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b: the tuned kernel where the library has one, else torch.matmul."""
    out = _tuned(a, b, "nn")
    return torch.matmul(a, b) if out is None else out


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight^T (weight [N, K] as nn.Linear stores it): the tuned kernel, else F.linear."""
    out = _tuned(x, weight, "nt")
    return F.linear(x, weight) if out is None else out


def _mm_backward(grad: torch.Tensor, a: torch.Tensor, b: torch.Tensor):
    return grad @ b.t(), a.t() @ grad


def _linear_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor):
    return grad @ weight, grad.t() @ x


def _autograd_kernel(name: str, run, backward):
    """The op's kernel for the Autograd key: differentiable as the library call it stands for
    (the backward runs the library); with nothing to record, on plain tensors and no mode
    active, `run` itself; otherwise (traced, fake, a mode) the kernels below autograd."""
    op = getattr(torch.ops.cudal2, name).default

    class Differentiable(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            with torch._C._AutoDispatchBelowAutograd():
                return op(a, b)

        @staticmethod
        def backward(ctx, grad):
            return backward(grad, *ctx.saved_tensors)

    def kernel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
            return Differentiable.apply(a, b)
        if (type(a) is torch.Tensor and type(b) is torch.Tensor and torch._C._len_torch_dispatch_stack() == 0
                and not torch._C._is_torch_function_mode_enabled()):
            return run(a, b)
        with torch._C._AutoDispatchBelowAutograd():
            return op(a, b)

    return kernel


for _name, _run, _backward in (("mm", mm, _mm_backward), ("linear", linear, _linear_backward)):
    _LIBRARY.impl(_name, _run, "CompositeExplicitAutograd")  # every device; the fallback where not CUDA
    _LIBRARY.impl(_name, _autograd_kernel(_name, _run, _backward), "Autograd")


@torch.library.register_fake("cudal2::mm")
def _mm_fake(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty((*a.shape[:-1], b.shape[-1]))


@torch.library.register_fake("cudal2::linear")
def _linear_fake(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _tuned_forward(layer: torch.nn.Linear):
    def forward(x: torch.Tensor) -> torch.Tensor:
        flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])  # (tokens, K): the GEMM a Linear layer runs
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            out = torch.ops.cudal2.linear(flat, layer.weight)  # traced, or differentiable: the op
        else:  # eager inference: the op's own function, without the dispatcher's and autograd's host cost
            out = linear(flat, layer.weight)
        if x.dim() != 2:
            out = out.reshape(*x.shape[:-1], layer.out_features)
        return out if layer.bias is None else out + layer.bias

    return forward


def patch(model: torch.nn.Module) -> int:
    """Swaps the forward of every nn.Linear whose (N, K) the library tuned for some M, so its
    GEMM goes through torch.ops.cudal2.linear; returns how many were swapped."""
    table = _state["table"]
    if table is None:
        return 0
    tuned = {(e.n, e.k, e.dtype) for e in table.entries if e.layout == "nt"}
    swapped = 0
    for layer in model.modules():
        if isinstance(layer, torch.nn.Linear) and layer.weight.dtype in DTYPES and \
                (layer.out_features, layer.in_features, DTYPES[layer.weight.dtype]) in tuned:
            layer.forward = _tuned_forward(layer)
            swapped += 1
    return swapped
