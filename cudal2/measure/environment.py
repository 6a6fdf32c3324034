"""The environment every measurement is recorded with: GPU, clocks, driver and toolchain."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from typing import Any

from ..kernels import compile as compile_stage


def tensor_peak(device: dict[str, Any]) -> float:
    """Dense fp16/bf16 tensor-core FLOP/s at the boost clock (per SM and clock: 4096 on
    Hopper, 2048 before)."""
    per_sm_clock = 4096 if device["cc"] >= 90 else 2048
    return device["sm_count"] * device["max_sm_clock_mhz"] * 1e6 * per_sm_clock


def dram_bandwidth(device: dict[str, Any]) -> float:
    """Bytes per second of device memory (double data rate)."""
    return device["memory_clock_khz"] * 1e3 * device["memory_bus_bits"] / 8 * 2


def _nvidia_smi(device: int, fields: str = "clocks.sm,clocks.max.sm,driver_version") -> dict[str, str]:
    """nvidia-smi's `fields` of the device (by default the current and maximum SM clock and
    the driver version), or {} where it does not answer."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {}
    try:
        out = subprocess.run(
            [smi, f"--id={device}", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return {}
    values = [v.strip() for v in out.split(",")]
    names = fields.split(",")
    return dict(zip(names, values)) if len(values) == len(names) else {}


def driver_version(device: int = 0) -> str | None:
    """The NVIDIA driver's version as nvidia-smi reports it (what a library is recorded with),
    or None where it does not answer."""
    return _nvidia_smi(device, "driver_version").get("driver_version")


def listed_cc(device: int = 0) -> int | None:
    """The device's compute capability as nvidia-smi lists it, without starting CUDA; None
    where there is no GPU or no nvidia-smi (what parameters are checked against first)."""
    text = _nvidia_smi(device, "compute_cap").get("compute_cap", "")
    major, _, minor = text.partition(".")
    return int(major) * 10 + int(minor) if major.isdigit() and minor.isdigit() else None


def device_error(exc: BaseException) -> str:
    """Why CUDA could not start, in one line: no driver at all, else CUDA's own first line."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "no usable CUDA device: no NVIDIA driver found (libcuda.so.1 cannot be loaded)"
    return f"no usable CUDA device: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"


def gpu_temperature(device: int = 0) -> int | None:
    """The GPU's core temperature in degrees C (nvidia-smi), or None where it does not answer.
    At the power cap the SM clock a long call runs at depends on it (docs/method.md)."""
    return _int(_nvidia_smi(device, "temperature.gpu").get("temperature.gpu"))


def _int(text: str | None) -> int | None:
    try:
        return int(float(text)) if text else None
    except ValueError:
        return None


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: an id, then a 64-byte union at 8
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("count", ctypes.c_uint)]


_CLUSTER_DIMENSION = 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
_SLOT_SOURCE = 'extern "C" __global__ void cudal2_slot(int* p) { extern __shared__ int s[]; if (p) p[0] = s[0]; }'


def measure_cluster_slots(smem_bytes: int, sizes: tuple[int, ...] = (2, 4, 8)) -> dict[int, int]:
    """SMs that CTAs launched in clusters of each size occupy at once, one CTA an SM (a kernel
    taking `smem_bytes` of shared memory, as the CTA-a-tile GEMMs do): the driver's
    cuOccupancyMaxActiveClusters times the cluster's CTAs. A cluster runs on one GPC, so a GPC's
    SMs beyond a whole number of clusters stay idle; how many differs from chip to chip
    (floorsweeping; `benchmarks/cluster_slots.cu` lists a GPU's GPCs). {} where the driver does
    not answer. What `cost.cluster_slots` reads as the device's `cluster_slots`. Measured on an
    H100 SXM (132 SMs): 132 for clusters of 2, 120 for 4 and for 8, as the runtime's
    cudaOccupancyMaxActiveClusters counted them."""
    import cupy

    kernel = cupy.RawKernel(_SLOT_SOURCE, "cudal2_slot")
    kernel.max_dynamic_shared_size_bytes = smem_bytes
    occupancy = ctypes.CDLL("libcuda.so.1").cuOccupancyMaxActiveClusters
    occupancy.argtypes = (ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.POINTER(_LaunchConfig))
    slots = {}
    for size in sizes:
        attribute = _LaunchAttribute(id=_CLUSTER_DIMENSION)
        attribute.value[0:3] = (size, 1, 1)
        config = _LaunchConfig(grid=(size, 1, 1), block=(128, 1, 1), shared_bytes=smem_bytes,
                               attrs=ctypes.pointer(attribute), count=1)
        clusters = ctypes.c_int(0)
        if occupancy(ctypes.byref(clusters), ctypes.c_void_p(kernel.kernel.ptr), ctypes.byref(config)) != 0:
            return {}
        slots[size] = clusters.value * size
    return slots


def describe_device(device: int = 0) -> dict[str, Any]:
    """Facts about the GPU, read where it is owned (the worker process)."""
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(device)
    smi = _nvidia_smi(device)
    runtime = cupy.cuda.runtime.runtimeGetVersion()
    driver = cupy.cuda.runtime.driverGetVersion()
    name = props["name"]
    return {
        "gpu": name.decode() if isinstance(name, bytes) else name,
        "cc": props["major"] * 10 + props["minor"],
        "sm_count": props["multiProcessorCount"],
        "sm_clock_mhz": _int(smi.get("clocks.sm")),
        "max_sm_clock_mhz": _int(smi.get("clocks.max.sm")) or props["clockRate"] // 1000,
        "driver": smi.get("driver_version") or f"cuda {driver // 1000}.{driver % 1000 // 10}",
        "cuda": f"{runtime // 1000}.{runtime % 1000 // 10}",
        "cupy": cupy.__version__,
        "l2_bytes": props["l2CacheSize"],
        "memory_bytes": props["totalGlobalMem"],
        "smem_optin_bytes": props["sharedMemPerBlockOptin"],
        "memory_clock_khz": props["memoryClockRate"],
        "memory_bus_bits": props["memoryBusWidth"],
        "cluster_slots": _cluster_slots(props, device),
    }


def _cluster_slots(props: dict[str, Any], device: int) -> dict[int, int]:
    """measure_cluster_slots on `device` where it launches clusters (sm_90 on); else, or where
    the driver refuses: {} (the ranking then assumes every SM, rounded down to whole clusters)."""
    import cupy

    if props["major"] < 9:
        return {}
    try:
        with cupy.cuda.Device(device):
            return measure_cluster_slots(props["sharedMemPerBlockOptin"])
    except Exception:  # an old driver without the entry point, a compile failure: not fatal
        return {}


def toolchain() -> dict[str, str]:
    """Compiler-side versions, read on the host (no GPU needed)."""
    return {"nvcc": compile_stage.nvcc_version(), "cutlass": compile_stage.cutlass_version()}


def default_arch(cc: int) -> str:
    """The nvcc target for a compute capability: 'a' variants where they unlock instructions."""
    return f"sm_{cc}a" if cc in (90, 100) else f"sm_{cc}"
