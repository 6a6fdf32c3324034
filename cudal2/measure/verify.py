"""Verify: the candidate is untrusted code; show that it computes C = A @ B honestly.

The static part (imported symbols) runs anywhere; the rest runs in the worker process
that owns the GPU. Each check names the cheat it closes (DESIGN.md, "Verify").
"""

from __future__ import annotations

import ctypes
import functools
import os
import time
from dataclasses import dataclass
from typing import Any

from ..problem import Problem
from .environment import dram_bandwidth, tensor_peak

# What a kernel library may import: kernel registration and launch, attributes and
# error queries of the CUDA runtime, an asynchronous memset (workspace set-up), the TMA
# descriptor encoder, and the C/C++ runtime's start-up, exception and printing plumbing.
# Anything else (cuBLAS, allocation, synchronisation, streams, events, host callbacks,
# threads, dlopen) makes it a cheat. cudaGetDriverEntryPoint* is allowed because CUTLASS
# reaches cuTensorMapEncodeTiled through it; what it could reach beyond that (a stream of
# its own, say) is caught by the graph-capture and timer checks.
ALLOWED_IMPORTS = frozenset({
    "__cudaRegisterFatBinary", "__cudaRegisterFatBinaryEnd", "__cudaUnregisterFatBinary",
    "__cudaRegisterFunction", "__cudaRegisterVar", "__cudaPushCallConfiguration",
    "__cudaPopCallConfiguration", "__cudaLaunchKernel", "__cudaGetKernel", "__cudaInitModule",
    "cudaLaunchKernel", "cudaLaunchKernelExC", "cudaLaunchCooperativeKernel",
    "cudaFuncSetAttribute", "cudaFuncGetAttributes", "cudaFuncSetCacheConfig",
    "cudaGetLastError", "cudaPeekAtLastError", "cudaGetErrorString", "cudaGetErrorName",
    "cudaGetDevice", "cudaDeviceGetAttribute", "cudaGetDeviceProperties", "cudaGetDeviceProperties_v2",
    "cudaOccupancyMaxActiveBlocksPerMultiprocessor",
    "cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags", "cudaOccupancyMaxActiveClusters",
    "cudaOccupancyMaxPotentialClusterSize", "cudaMemsetAsync",
    "cuTensorMapEncodeTiled", "cuTensorMapEncodeIm2col", "cudaGetDriverEntryPoint",
    "cudaGetDriverEntryPointByVersion",
    "__cxa_atexit", "__cxa_finalize", "__cxa_guard_acquire", "__cxa_guard_release",
    "__cxa_guard_abort", "__gxx_personality_v0", "_Unwind_Resume", "__gmon_start__",
    "_ITM_deregisterTMCloneTable", "_ITM_registerTMCloneTable", "__stack_chk_fail",
    "__cxa_begin_catch", "__cxa_end_catch", "__cxa_rethrow", "__cxa_allocate_exception",
    "__cxa_free_exception", "__cxa_throw", "__cxa_pure_virtual", "_ZSt9terminatev",
    "_Znwm", "_Znam", "_ZdlPv", "_ZdlPvm", "_ZdaPv", "_ZSt20__throw_length_errorPKc",
    "_ZSt17__throw_bad_allocv", "_ZSt28__throw_bad_array_new_lengthv",
    # exit: nvcc's host-side stub of a non-inline __device__ function calls it
    "memset", "memcpy", "memmove", "memcmp", "strlen", "strcmp", "abort", "exit", "__assert_fail",
    "printf", "fprintf", "puts", "fputs", "fwrite", "putchar", "stderr", "stdout", "__udivti3",
    # the same under _FORTIFY_SOURCE, as some distributions' compilers build them
    "__printf_chk", "__fprintf_chk", "__memcpy_chk", "__memset_chk", "__memmove_chk",
    "__snprintf_chk", "__sprintf_chk", "__vfprintf_chk",
    # <iostream>, pulled in by CuTe's printing helpers
    "_ZSt4cout", "_ZSt4cerr", "_ZSt21ios_base_library_initv", "_ZNSo3putEc", "_ZNSo5flushEv", "_ZNSo9_M_insertIPKvEERSoT_",
    "_ZNSo9_M_insertImEERSoT_", "_ZNSolsEi", "_ZNSt8ios_base4InitC1Ev", "_ZNSt8ios_base4InitD1Ev",
    "_ZNKSt5ctypeIcE13_M_widen_initEv", "_ZSt16__throw_bad_castv",
    "_ZSt16__ostream_insertIcSt11char_traitsIcEERSt13basic_ostreamIT_T0_ES6_PKS3_l",
    "_ZStlsISt11char_traitsIcEERSt13basic_ostreamIcT_ES5_c",
})


def forbidden_imports(imports: list[str]) -> list[str]:
    return sorted(set(imports) - ALLOWED_IMPORTS)


@dataclass
class Verdict:
    status: str  # ok | wrong | cheat | unsupported
    reason: str = ""
    max_error: float | None = None
    tolerance: float | None = None


class Rejected(Exception):
    """A verdict reached part-way through the checks (while timed: on `contestant`)."""

    def __init__(self, status: str, reason: str, contestant: str | None = None):
        super().__init__(reason)
        self.status, self.contestant = status, contestant


# Unit roundoff of the output type: a correct fp32-accumulated result is within a few
# of these (relative to the largest |C|) of the exact product.
UNIT_ROUNDOFF = {"fp16": 2.0**-11, "bf16": 2.0**-8}
GUARD = 1 << 16  # bytes of guard band before and after every buffer
ALIGN = 512  # every buffer starts on this many bytes, as an allocation of its own would

# The checks of one call, each a reduction on the device into a few 32-bit slots, read back
# together with one synchronisation (a verification makes a dozen checked calls; one read
# per check, not one per reduction, is most of its host time).
_CHECKS_SOURCE = r"""
__device__ __forceinline__ float fp16_value(unsigned short x) {
  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x)); return f;
}
__device__ __forceinline__ float bf16_value(unsigned short x) { return __uint_as_float(((unsigned int)x) << 16); }

// Over the output C (16-bit) against the fp32 reference: slot 0 the largest |C - ref| over
// the finite outputs (as float bits: non-negative floats order as integers), slot 1 the count
// of outputs that are not finite, slot 2 the largest |ref|.
template <bool kBf16>
__device__ void errors(const unsigned short* c, const float* ref, long long n, unsigned int* slots) {
  float err = 0.f, big = 0.f;
  unsigned int bad = 0;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
    float x = kBf16 ? bf16_value(c[i]) : fp16_value(c[i]), r = ref[i];
    if (isfinite(x)) err = fmaxf(err, fabsf(x - r)); else bad++;
    big = fmaxf(big, fabsf(r));
  }
  for (int o = 16; o; o >>= 1) {
    err = fmaxf(err, __shfl_xor_sync(0xffffffffu, err, o));
    big = fmaxf(big, __shfl_xor_sync(0xffffffffu, big, o));
    bad += __shfl_xor_sync(0xffffffffu, bad, o);
  }
  if ((threadIdx.x & 31) == 0) {
    atomicMax(slots, __float_as_uint(err));
    if (bad) atomicAdd(slots + 1, bad);
    atomicMax(slots + 2, __float_as_uint(big));
  }
}
extern "C" __global__ void cudal2_errors_fp16(const unsigned short* c, const float* ref, long long n, unsigned int* slots) {
  errors<false>(c, ref, n, slots);
}
extern "C" __global__ void cudal2_errors_bf16(const unsigned short* c, const float* ref, long long n, unsigned int* slots) {
  errors<true>(c, ref, n, slots);
}

// Over one allocation of guard bands and buffers, compared with its snapshot a 32-bit word at
// a time and, where a word changed, a byte at a time: slot 0 is set where a byte outside the
// inputs and the writable ranges (C, the workspace) changed, slot 1 where a byte of an input
// (A, B) changed.
__device__ __forceinline__ bool within(long long at, const long long* range) { return at >= range[0] && at < range[1]; }
extern "C" __global__ void cudal2_changes(const unsigned int* now, const unsigned int* was, long long words,
                                          const long long* ranges, unsigned int* slots) {
  // ranges: A, B (inputs) then C, the workspace (writable), each [begin, end) in bytes
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < words; i += (long long)gridDim.x * blockDim.x) {
    unsigned int changed = now[i] ^ was[i];
    for (int b = 0; changed && b < 4; ++b, changed >>= 8) {
      long long at = i * 4 + b;
      if (!(changed & 0xffu) || within(at, ranges + 4) || within(at, ranges + 6)) continue;
      slots[within(at, ranges) || within(at, ranges + 2) ? 1 : 0] = 1;
    }
  }
}
"""
_CHECK_BLOCKS, _CHECK_THREADS = 1024, 256


@functools.cache
def _checks_module(cupy):
    """The checks' kernels, compiled once a process (NVRTC)."""
    return cupy.RawModule(code=_CHECKS_SOURCE, options=("--std=c++17",))


class Kernel:
    """A compiled library implementing the kernel ABI, loaded with ctypes.

    Every library of a process calls one CUDA runtime, whose last error (per thread) they
    share: a kernel that reports its status through cudaGetLastError() would report one that
    an earlier contestant left behind. So each call clears any pending error first, and an
    error the call itself leaves pending is cleared too and kept in `left_error` (its name),
    the first one a call of this library left: a fault of this kernel, never of the next.
    """

    def __init__(self, path: str):
        self.lib = ctypes.CDLL(path)
        self.gemm = self.lib.cudal2_gemm  # the bare call (the runtime's, cudal2/torch.py)
        self.gemm.restype = ctypes.c_int
        self.gemm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 3 + [
            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        try:
            self._workspace = self.lib.cudal2_workspace_bytes
            self._workspace.restype = ctypes.c_size_t
            self._workspace.argtypes = [ctypes.c_int] * 3
        except AttributeError:
            self._workspace = None
        self._runtime = cuda_runtime_of(self.lib)
        self.left_error: str | None = None

    def call(self, a: int, b: int, c: int, m: int, n: int, k: int, workspace: int, workspace_bytes: int,
             stream: int) -> int:
        """One contestant's call of cudal2_gemm (pointers as integers), its own errors apart
        from others'; its return value."""
        self._clear_error()
        code = self.gemm(a, b, c, m, n, k, workspace, workspace_bytes, stream)
        if (left := self._clear_error()) and self.left_error is None:
            self.left_error = left
        return code

    def _clear_error(self) -> str | None:
        """Clears the runtime's pending error; its name, or None when there was none."""
        if self._runtime is None:
            return None
        code = self._runtime.cudaGetLastError()
        return self._runtime.cudaGetErrorName(code).decode() if code else None

    def workspace_bytes(self, m: int, n: int, k: int) -> int:
        return int(self._workspace(m, n, k)) if self._workspace else 0


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def cuda_runtime_of(lib: ctypes.CDLL) -> ctypes.CDLL | None:
    """The CUDA runtime library (libcudart) that a loaded library calls, found through its
    dependencies; None if it calls none, or defines the runtime's functions itself (a
    candidate's own code is not trusted to report errors)."""
    try:
        function = lib.cudaGetLastError
    except AttributeError:
        return None
    info = _DlInfo()
    if not ctypes.CDLL(None).dladdr(ctypes.cast(function, ctypes.c_void_p), ctypes.byref(info)) or not info.dli_fname:
        return None
    path = info.dli_fname.decode()
    if not os.path.basename(path).startswith("libcudart."):
        return None
    runtime = ctypes.CDLL(path)  # already loaded: the same instance, the same last error
    runtime.cudaGetLastError.restype = ctypes.c_int
    runtime.cudaGetErrorName.restype = ctypes.c_char_p
    runtime.cudaGetErrorName.argtypes = [ctypes.c_int]
    return runtime


# cuBLAS's codes: the data types of A, B and C, fp32 compute, its default algorithm.
CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF = 0, 2, 14
CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT = 68, -1


def cublas_product(problem: Problem, stream, a, b, c) -> None:
    """C = A @ B (or A @ W^T) through cublasGemmEx with fp32 compute on `stream`, the shape
    from the arrays (A is M x K, C is M x N), C in the problem's 16-bit type or in fp32 (every
    product of two 16-bit values is exact in fp32; the sums are fp32's). cuBLAS is
    column-major: a row-major C[M,N] is C^T in its eyes, so it computes C^T = B^T A^T,
    (N x K)(K x M), with W's transpose taking op T."""
    import numpy as np
    from cupy_backends.cuda.libs import cublas

    import cupy

    handle = cupy.cuda.device.get_cublas_handle()
    dtype = CUDA_R_16F if problem.dtype == "fp16" else CUDA_R_16BF
    out = CUDA_R_32F if c.dtype == cupy.float32 else dtype
    alpha, beta = np.ones(1, np.float32), np.zeros(1, np.float32)
    (m, k), n = a.shape, c.shape[1]
    op_b, ldb = (cublas.CUBLAS_OP_T, k) if problem.layout == "nt" else (cublas.CUBLAS_OP_N, n)
    cublas.setStream(handle, stream.ptr)
    cublas.gemmEx(handle, op_b, cublas.CUBLAS_OP_N, n, m, k, alpha.ctypes.data,
                  b.data.ptr, dtype, ldb, a.data.ptr, dtype, k, beta.ctypes.data,
                  c.data.ptr, out, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)


class Numerics:
    """fp16 / bf16 arrays in CuPy (bf16 held as uint16 bits) and fp32 conversions."""

    def __init__(self, dtype: str):
        import cupy

        self.cp = cupy
        self.dtype = dtype
        self.storage = cupy.float16 if dtype == "fp16" else cupy.uint16
        self._to_bf16 = cupy.ElementwiseKernel(
            "float32 x", "uint16 y",
            "unsigned int u = __float_as_uint(x);"
            "y = (u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0 : (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;",
            "cudal2_to_bf16")
        self._from_bf16 = cupy.ElementwiseKernel(
            "uint16 x", "float32 y", "y = __uint_as_float(((unsigned int)x) << 16);", "cudal2_from_bf16")

    def cast(self, x32, out) -> None:
        if self.dtype == "fp16":
            out[...] = x32.astype(self.cp.float16)
        else:
            self._to_bf16(x32, out)

    def f32(self, x):
        return x.astype(self.cp.float32) if self.dtype == "fp16" else self._from_bf16(x)

    def errors(self, c, ref, slots) -> None:
        """Queues the reduction of C (this type) against the fp32 `ref` into three zeroed
        uint32 `slots`: the largest |C - ref| over finite outputs and the largest |ref| (both
        as float bits), and the count of outputs that are not finite."""
        cp = self.cp
        c, ref = cp.ascontiguousarray(c), cp.ascontiguousarray(ref, dtype=cp.float32)
        if c.size != ref.size:
            raise ValueError(f"output of {c.size} elements against a reference of {ref.size}")
        kernel = _checks_module(cp).get_function(f"cudal2_errors_{self.dtype}")
        blocks = max(1, min(_CHECK_BLOCKS, -(-c.size // _CHECK_THREADS)))
        kernel((blocks,), (_CHECK_THREADS,), (c.view(cp.uint16), ref, cp.int64(c.size), slots))


def poison_output(c) -> None:
    """NaN in every element of C (0xFFFF is NaN in fp16 and bf16)."""
    c.view("uint8").fill(0xFF)


class Operands:
    """A, B, C and the workspace of one shape, laid out in one allocation between guard bands.

    Every byte outside C and the workspace (the guard bands, A and B) is compared with a
    snapshot after each call: a write outside C, or into A or B, changes it. The guard bands
    hold random bytes. With `kept_sets`, the allocation also holds that many kept input sets
    (keep(): a copy of A and B and their fp32 reference product), watched as the guard bands
    are (a call that writes to one writes outside C); load() puts one back in A and B, at the
    same addresses whichever set it is.
    """

    def __init__(self, problem: Problem, workspace_bytes: int, numerics: Numerics, kept_sets: int = 0):
        cp = self.cp = numerics.cp
        self.problem, self.num = problem, numerics
        p, item = problem, cp.dtype(numerics.storage).itemsize
        inputs = [p.m * p.k * item, p.b_shape[0] * p.b_shape[1] * item]
        sizes = [*inputs, p.m * p.n * item, max(workspace_bytes, 1)] + [*inputs, p.m * p.n * 4] * kept_sets
        starts, end = [], 0
        self._raw = cp.empty(sum(GUARD + -(-size // ALIGN) * ALIGN for size in sizes) + GUARD, dtype=cp.uint8)
        for size in sizes:
            self._raw[end:end + GUARD] = cp.random.randint(0, 256, GUARD, dtype=cp.uint8)
            starts.append(end + GUARD)
            end = starts[-1] + -(-size // ALIGN) * ALIGN
        self._raw[end:] = cp.random.randint(0, 256, GUARD, dtype=cp.uint8)
        self._snapshot = self._raw.copy()
        # A and B (inputs), then C and the workspace (writable): what the checks tell apart
        self._ranges = cp.asarray([bound for start, size in zip(starts[:4], sizes[:4]) for bound in (start, start + size)],
                                  dtype=cp.int64)
        view = lambda i, shape, dtype, of=self._raw: cp.ndarray(shape, dtype=dtype, memptr=of.data + starts[i])
        self.a = view(0, (p.m, p.k), numerics.storage)
        self.b = view(1, p.b_shape, numerics.storage)
        self.c = view(2, (p.m, p.n), numerics.storage)
        self.ws_bytes = workspace_bytes
        self.ws = view(3, (max(workspace_bytes, 1),), cp.uint8)
        self._watched = (view(0, (p.m, p.k), numerics.storage, self._snapshot),
                         view(1, p.b_shape, numerics.storage, self._snapshot))  # A and B as the snapshot holds them
        self._kept = [(view(4 + 3 * i, (p.m, p.k), numerics.storage), view(5 + 3 * i, p.b_shape, numerics.storage),
                       view(6 + 3 * i, (p.m, p.n), cp.float32)) for i in range(kept_sets)]
        self._calibrations: list[float] = []  # the trusted library's error on each kept set
        self.current: int | None = None  # the kept set in A and B (keep, load; fill drops it)

    @property
    def kept(self) -> bool:
        """Whether A and B hold a kept set, whose reference is kept."""
        return self.current is not None

    @property
    def calibration(self) -> float:
        """The trusted library's error on the kept set in A and B."""
        return self._calibrations[self.current]

    def keep(self, baseline) -> None:
        """Keeps the current inputs as the next kept set: a copy of A and B, their reference
        product and the trusted library's error against it, each computed once for every
        later check of the set (needs `kept_sets`)."""
        cp = self.cp
        index = len(self._calibrations)
        a, b, ref = self._kept[index]
        a[...] = self.a
        b[...] = self.b
        cublas_product(self.problem, cp.cuda.get_current_stream(), self.a, self.b, ref)
        trusted = cp.empty_like(self.c)
        baseline(self.a, self.b, trusted)
        slots = cp.zeros(3, cp.uint32)
        self.num.errors(trusted, ref, slots)
        self._calibrations.append(_judged(trusted, slots.get(), self.num)[0])
        self._snapshot[...] = self._raw
        self.current = index

    def load(self, index: int) -> None:
        """Kept set `index` into A and B (and the snapshot's A and B): new data under the
        pointers of the last call, as a user's next call may bring."""
        a, b, _ = self._kept[index]
        for live, watched, kept in zip((self.a, self.b), self._watched, (a, b)):
            live[...] = kept
            watched[...] = kept
        self.current = index

    def changes(self, slots) -> None:
        """Queues the comparison with the snapshot into two zeroed uint32 `slots`: [0] set by
        a write outside C and the workspace other than A or B, [1] by a write into A or B."""
        cp, words = self.cp, self._raw.size // 4
        kernel = _checks_module(cp).get_function("cudal2_changes")
        blocks = max(1, min(_CHECK_BLOCKS, -(-words // _CHECK_THREADS)))
        kernel((blocks,), (_CHECK_THREADS,), (self._raw.view(cp.uint32), self._snapshot.view(cp.uint32),
                                              cp.int64(words), self._ranges, slots))

    def _changed(self) -> tuple[bool, bool]:
        slots = self.cp.zeros(2, self.cp.uint32)
        self.changes(slots)
        outside, inputs = slots.get()
        return bool(outside), bool(inputs)

    def stray_writes(self) -> bool:
        return self._changed()[0]

    def intact(self) -> bool:
        """Nothing but C and the workspace changed since the snapshot."""
        return not any(self._changed())

    def inputs_intact(self) -> bool:
        return not self._changed()[1]

    def fill(self, distribution: str, rng) -> None:
        """Fresh inputs from `distribution`; a new snapshot to prove A and B untouched."""
        cp, p = self.cp, self.problem
        gen = cp.random.Generator(cp.random.XORWOW(seed=rng.getrandbits(63)))
        if distribution == "accumulation":
            # Exposes fp16/bf16 accumulation: 8192 at k=0, -8192 at k=K-1 and small terms
            # between. Accumulated in fp32 the small terms survive exactly; in fp16 each
            # one is rounded away against 8192, leaving about zero.
            a32 = cp.ones((p.m, p.k), cp.float32)
            col = gen.integers(1, 3, size=(p.k, 1)).astype(cp.float32) * 0.25
            col[0], col[-1] = (8192.0, -8192.0) if p.k > 1 else (col[0], col[-1])
            b32 = cp.broadcast_to(col, (p.k, p.n))
            if p.layout == "nt":
                b32 = b32.T
        else:
            a32 = self._draw(gen, distribution, (p.m, p.k))
            b32 = self._draw(gen, distribution, p.b_shape)
        self.num.cast(a32, self.a)
        self.num.cast(cp.ascontiguousarray(b32), self.b)
        self._snapshot[...] = self._raw
        self.current = None

    def _draw(self, gen, distribution: str, shape):
        cp = self.cp
        if distribution == "normal":
            return gen.standard_normal(shape, dtype=cp.float32)
        if distribution == "uniform":
            return gen.random(shape, dtype=cp.float32) * 2 - 1
        if distribution == "positive":  # sums grow with K: large values expose coarse accumulation
            return gen.random(shape, dtype=cp.float32)
        raise ValueError(distribution)

    def perturb(self, operand: str, rng, count: int = 8) -> None:
        """Sets `count` random entries of A or B to 8.0 in place (the rest unchanged); each
        changes a row (A) or column (B) of C far beyond the tolerance."""
        x = self.a if operand == "a" else self.b
        flat = x.reshape(-1)
        where = self.cp.asarray(rng.sample(range(flat.size), min(count, flat.size)))
        flat[where] = self.cp.float16(8.0) if self.num.dtype == "fp16" else self.cp.uint16(0x4100)  # bf16 8.0
        self._snapshot[...] = self._raw
        self.current = None

    def poison(self, rng) -> None:
        """NaN in C (poison_output); random bytes in the workspace."""
        poison_output(self.c)
        self.ws[...] = self.cp.random.randint(0, 256, self.ws.shape, dtype=self.cp.uint8)

    def call(self, kernel: Kernel, stream, shape: Problem | None = None) -> int:
        p = shape or self.problem
        return kernel.call(self.a.data.ptr, self.b.data.ptr, self.c.data.ptr, p.m, p.n, p.k,
                           self.ws.data.ptr, self.ws_bytes, stream.ptr)

    def reference(self):
        """fp32-accumulated product of the current inputs: cuBLAS on the 16-bit inputs with an
        fp32 output (cublas_product), on the current stream; the kept one where kept. (An fp32
        SGEMM on fp32 copies gives the same exact products at the fp32 units' rate: about 13x
        the time of the 16-bit call, seconds a verification on a large problem.)"""
        cp = self.cp
        if self.kept:
            return self._kept[self.current][2]
        out = cp.empty((self.problem.m, self.problem.n), dtype=cp.float32)
        cublas_product(self.problem, cp.cuda.get_current_stream(), self.a, self.b, out)
        return out


def compare(c, ref, numerics: Numerics, calibration: float = 0.0) -> tuple[float, float, str]:
    """(error, tolerance, problem) with error and tolerance relative to max |ref|.

    The tolerance is 2 unit roundoffs of the output type, or 4x the error the trusted
    library showed on the same inputs (`calibration`), whichever is larger.
    """
    slots = numerics.cp.zeros(3, numerics.cp.uint32)
    numerics.errors(c, ref, slots)
    return _judged(c, slots.get(), numerics, calibration)


def _judged(c, slots, numerics: Numerics, calibration: float = 0.0) -> tuple[float, float, str]:
    """compare()'s verdict from the three slots that Numerics.errors filled (read back)."""
    import numpy

    err, scale = (float(x) for x in numpy.asarray(slots[[0, 2]], dtype=numpy.uint32).view(numpy.float32))
    count = int(slots[1])
    tol = max(2 * UNIT_ROUNDOFF[numerics.dtype], 4 * calibration)
    if count:
        cp = numerics.cp
        row, col = divmod(int(cp.argmax(~cp.isfinite(numerics.f32(c)).ravel())), c.shape[1])
        return float("inf"), tol, f"{count} of {c.size} outputs unwritten or not finite (first at [{row}, {col}])"
    err /= scale or 1.0
    return err, tol, "" if err <= tol else f"max error {err:.3g} x max|C| exceeds tolerance {tol:.3g}"


def trusted_error(ops: Operands, ref, baseline) -> float:
    """Relative max error of the trusted library (cuBLAS) on the same inputs."""
    out = ops.cp.empty_like(ops.c)
    baseline(ops.a, ops.b, out)
    return compare(out, ref, ops.num)[0]


ODD_SHAPES = ((1, 1, 1), (17, 65, 63), (130, 72, 264))
DISTRIBUTIONS = ("normal", "uniform", "positive", "accumulation")
# A screened kernel's inputs (verify's `screen`): normal, and the one that exposes fp16 or bf16
# accumulation.
SCREEN_DISTRIBUTIONS = ("normal", "accumulation")


class ScreenInputs:
    """The screening checks' inputs, shared by the kernels that one process screens on one
    problem: one allocation of operands (Operands) keeping a set for each of
    SCREEN_DISTRIBUTIONS, each with its reference product and the trusted library's error,
    computed once. Each kernel's checks had drawn them afresh: three fills, three reference
    products and two library calls a kernel, where its own calls are three. A kernel's checks
    load each set in turn into the same A and B, so that a result cached under the pointers
    of its first call is still caught by its second. The kept sets lie in the watched
    allocation: a kernel that writes to one is a cheat by its own checks, and never leaves
    the next kernel wrong inputs or a wrong reference."""

    def __init__(self, problem: Problem, workspace_bytes: int, baseline, rng):
        self.problem, self.workspace_bytes = problem, workspace_bytes
        self.ops = Operands(problem, workspace_bytes, Numerics(problem.dtype), kept_sets=len(SCREEN_DISTRIBUTIONS))
        for dist in SCREEN_DISTRIBUTIONS:
            self.ops.fill(dist, rng)
            self.ops.keep(baseline)

    @staticmethod
    def nbytes(problem: Problem, workspace_bytes: int) -> int:
        """Device bytes they take (the allocation and its snapshot), about."""
        p, sets = problem, len(SCREEN_DISTRIBUTIONS)
        inputs = 2 * (p.m * p.k + p.b_shape[0] * p.b_shape[1])
        return 2 * ((1 + sets) * inputs + p.m * p.n * (2 + 4 * sets) + workspace_bytes + (5 + 3 * sets) * (GUARD + ALIGN))

    def serves(self, problem: Problem, workspace_bytes: int) -> bool:
        return problem == self.problem and workspace_bytes <= self.workspace_bytes

    def intact(self) -> bool:
        """As kept: each kernel's checks leave them so or convict it, but work a kernel left
        running behind its checks' backs may not."""
        return self.ops.intact()


def verify(kernel: Kernel, problem: Problem, stream, baseline, rng, screen: bool = False,
           inputs: ScreenInputs | None = None) -> Verdict:
    """Runs every check on `kernel`; the first failure decides the verdict. A CUDA error its
    calls left pending (kernel.left_error) is named in the reason of a verdict other than ok.
    `screen`: the screening pass's checks only (_verify), a sixth or less of the calls; a
    screened row is never ranked, and a kernel confirmed after it is verified in full.
    `inputs`: the screening checks' shared inputs (else drawn for this kernel alone)."""
    try:
        verdict = _verify(kernel, problem, stream, baseline, rng, screen, inputs)
    except Rejected as r:
        verdict = Verdict(r.status, str(r))
    if verdict.status != "ok" and kernel.left_error:
        verdict.reason += f" (its calls left {kernel.left_error} pending: an error it did not report)"
    return verdict


def checked_call(ops: Operands, kernel: Kernel, stream, rng, what: str, baseline,
                  keep_workspace: bool = False) -> tuple[float, float]:
    """Poison (C, and the workspace unless `keep_workspace`), call, then every check on one
    call, read back at once; returns (error, tolerance). Operands whose reference is kept
    (shared by several kernels' checks) are checked against it, and a call that declines
    them must leave them as they were."""
    if keep_workspace:
        poison_output(ops.c)
    else:
        ops.poison(rng)
    stream.synchronize()
    code = ops.call(kernel, stream)
    stream.synchronize()
    if code != 0:
        if ops.kept and not ops.intact():
            raise Rejected("cheat", f"cudal2_gemm returned {code} ({what}) but wrote outside C or into A or B")
        raise Rejected("unsupported", f"cudal2_gemm returned {code} for {ops.problem.m}x{ops.problem.n}x{ops.problem.k} ({what})")
    cp = ops.cp
    slots = cp.zeros(8, cp.uint32)  # changes (2), then the kernel's errors (3), then the trusted library's (3)
    ops.changes(slots[0:2])
    ref = ops.reference()
    ops.num.errors(ops.c, ref, slots[2:5])
    if not ops.kept:
        trusted = cp.empty_like(ops.c)
        baseline(ops.a, ops.b, trusted)
        ops.num.errors(trusted, ref, slots[5:8])
    slots = slots.get()
    if slots[0]:
        watched = "a guard band or a kept input set" if ops.kept else "a guard band"
        raise Rejected("cheat", f"wrote outside C ({watched} changed) on {what}")
    if slots[1]:
        raise Rejected("cheat", f"modified A or B on {what}")
    calibration = ops.calibration if ops.kept else _judged(trusted, slots[5:8], ops.num)[0]
    err, tol, why = _judged(ops.c, slots[2:5], ops.num, calibration)
    if why:
        raise Rejected("wrong", f"{what}: {why}")
    return err, tol


def _verify(kernel: Kernel, problem: Problem, stream, baseline, rng, screen: bool = False,
            inputs: ScreenInputs | None = None) -> Verdict:
    num = Numerics(problem.dtype)
    ws = kernel.workspace_bytes(problem.m, problem.n, problem.k)
    worst = (0.0, 0.0)
    if screen:
        # The screening pass's checks: right (fp32 accumulation included) on two calls, nothing
        # written outside C or into A and B, and all of its work on the given stream, so that
        # the screening session's graph times it whole. What only a ranked row needs (cached
        # results, the timer, odd shapes) waits for the full verification of the confirmation.
        shared = inputs is not None and inputs.serves(problem, ws)
        ops = inputs.ops if shared else Operands(problem, ws, num)
        for index, dist in enumerate(SCREEN_DISTRIBUTIONS):
            if shared:
                ops.load(index)
            else:
                ops.fill(dist, rng)
            worst = max(worst, checked_call(ops, kernel, stream, rng, f"{dist} inputs", baseline))
        if shared:
            ops.load(SCREEN_DISTRIBUTIONS.index("normal"))
        _graph_check(ops, kernel, stream, rng)
        return Verdict("ok", max_error=worst[0], tolerance=worst[1])

    first = Operands(problem, ws, num)
    second = Operands(problem, ws, num)
    # Same pointers with new data (cached results), new pointers (pointer-keyed state),
    # several distributions including one that exposes low-precision accumulation.
    for ops, dist in ((first, "normal"), (first, "uniform"), (second, "positive"), (second, "accumulation")):
        ops.fill(dist, rng)
        worst = max(worst, checked_call(ops, kernel, stream, rng, f"{dist} inputs", baseline))

    # A result memoised under a sample of the inputs (in the workspace or in the library's
    # static memory) comes back after a change of a few entries it did not sample.
    for operand in ("a", "b"):
        first.fill("normal", rng)
        checked_call(first, kernel, stream, rng, "normal inputs", baseline)
        first.perturb(operand, rng)
        try:  # the workspace as the call before left it, as a user's next call finds it
            checked_call(first, kernel, stream, rng, f"a few entries of {operand.upper()} changed", baseline,
                          keep_workspace=True)
        except Rejected as r:
            if r.status != "wrong":
                raise
            raise Rejected("cheat", f"{r} after the same call on the inputs before the change: a result "
                                    "cached from an earlier call") from None

    _graph_check(first, kernel, stream, rng)
    _timer_check(first, kernel, stream)

    # Odd shapes: a kernel may decline them (non-zero return), but what it accepts must be right.
    for m, n, k in ODD_SHAPES:
        odd = Problem(m, n, k, problem.dtype, problem.layout)
        ops = Operands(odd, kernel.workspace_bytes(m, n, k), num)
        ops.fill("normal", rng)
        ops.poison(rng)
        stream.synchronize()
        if ops.call(kernel, stream) != 0:
            continue
        stream.synchronize()
        ops.poison(rng)  # the accepted shape is now checked in full
        worst = max(worst, checked_call(ops, kernel, stream, rng, f"odd shape {m}x{n}x{k}", baseline))
    return Verdict("ok", max_error=worst[0], tolerance=worst[1])


def _graph_check(ops: Operands, kernel: Kernel, stream, rng) -> None:
    """Work outside the given stream (another stream, the legacy stream, the host) is not
    captured into a graph: replaying the graph must still produce all of C. Operands whose
    reference is kept are checked on their inputs, and for writes outside C as a call is."""
    import cupy

    if not ops.kept:
        ops.fill("normal", rng)
    ops.poison(rng)
    stream.synchronize()
    try:
        stream.begin_capture(cupy.cuda.runtime.streamCaptureModeGlobal)
        code = ops.call(kernel, stream)
        graph = stream.end_capture()
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        raise Rejected("cheat", f"cannot be captured into a CUDA graph on its stream ({exc})") from None
    if code != 0:
        raise Rejected("cheat", f"returned {code} under stream capture but 0 outside it")
    cupy.cuda.Device().synchronize()
    ops.poison(rng)
    graph.launch(stream)
    stream.synchronize()
    if ops.kept and not ops.intact():
        raise Rejected("cheat", "replayed from a CUDA graph it wrote outside C or into A or B")
    err, tol, why = compare(ops.c, ops.reference(), ops.num)
    if why:
        raise Rejected("cheat", f"replayed from a CUDA graph its output is wrong ({why}): work escapes the given stream")


def _timer_check(ops: Operands, kernel: Kernel, stream) -> None:
    """Events on the stream must account for the device time seen around a device sync.

    After the host has queued the calls, whatever the device still does is the stream's
    own work, which the events cover; more busy time than the events show means work that
    the events do not see. Three attempts must all fail before this is called a cheat.
    """
    import cupy

    count = 8
    for _ in range(3):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        cupy.cuda.Device().synchronize()
        start.record(stream)
        for _ in range(count):
            ops.call(kernel, stream)
        end.record(stream)
        queued = time.perf_counter()
        cupy.cuda.Device().synchronize()
        drain_ms = (time.perf_counter() - queued) * 1e3
        event_ms = cupy.cuda.get_elapsed_time(start, end)
        if drain_ms <= event_ms * 1.2 + 0.2:
            return
    raise Rejected("cheat", f"device stayed busy {drain_ms:.3f} ms after queueing, but its stream's events saw {event_ms:.3f} ms")


def physical_floor_us(problem: Problem, device: dict[str, Any], cold_l2: bool) -> float:
    """The fastest time the hardware allows: tensor-core FLOPs at the boost clock, plus
    (with a cold L2) reading the inputs and writing C at the memory bandwidth."""
    floor = problem.flops / tensor_peak(device)
    if cold_l2:
        floor = max(floor, problem.min_bytes / (dram_bandwidth(device) * 1.5))
    return floor * 1e6


def seed_from_os() -> int:
    return int.from_bytes(os.urandom(8), "little")
