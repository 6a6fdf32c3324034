"""How far a time is from the hardware: a problem's floor, and the regime it falls in.

The floor is the larger of two times, launch excluded: every byte of A, B and C moved once at
the copy bandwidth the GPU sustains, and 2MNK FLOPs at the tensor rate it sustains. A kernel's
fraction of the floor (floor / its time) says how much is left to win; the regime says which
kernel family should win it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..measure.environment import dram_bandwidth, tensor_peak
from ..problem import Problem
from ..protocol import TIE

REGIMES = ("unaligned", "decode", "few-tile long-K", "short-K", "large", "other")


@dataclass(frozen=True)
class Roof:
    """What a GPU sustains: bytes per second of a copy, dense fp16/bf16 FLOP/s."""

    bytes_per_s: float
    flops_per_s: float


# Measured on an H200 (DESIGN.md, "Regimes and the floor"): an elementwise kernel's 4.26 TB/s
# (a 1x28672x8192 bf16 GEMV reached 4.29) and 8192^3 bf16 at the 690 W power cap, ~720 TFLOP/s.
MEASURED = {"NVIDIA H200": Roof(4.26e12, 720e12)}
# Elsewhere, the H200's measured share of its datasheet rates: 0.885 of the DRAM bandwidth
# (4.26 of 4.81 TB/s), 0.673 of the tensor peak at the boost clock (720 of 1070 TFLOP/s).
SUSTAINED_BANDWIDTH, SUSTAINED_TENSOR = 0.885, 0.673


def roof(device: dict) -> Roof | None:
    """The GPU's measured roof where it is known, else its datasheet rates scaled by the
    shares measured on the H200 (`device` as `environment.describe_device` returns it);
    None where neither is known."""
    if device.get("gpu") in MEASURED:
        return MEASURED[device["gpu"]]
    if not all(device.get(k) for k in ("cc", "sm_count", "max_sm_clock_mhz", "memory_clock_khz", "memory_bus_bits")):
        return None
    return Roof(SUSTAINED_BANDWIDTH * dram_bandwidth(device), SUSTAINED_TENSOR * tensor_peak(device))


def floor_us(problem: Problem, at: Roof) -> float:
    """The least time `problem` can take on a GPU with roof `at`, in microseconds."""
    return max(problem.min_bytes / at.bytes_per_s, problem.flops / at.flops_per_s) * 1e6


def at_floor(library_us: float, floor: float) -> bool:
    """Whether a library call of `library_us` is within the tie band of the floor: no kernel can
    win there (a win is beyond TIE)."""
    return library_us <= floor * (1 + TIE)


def regime(problem: Problem, sm_count: int = 132) -> str:
    """Which of REGIMES the problem falls in, first match in that order. Decode: one side of
    C at most 128 wide against a wide other side; few-tile long-K: at most 512 wide, K of
    2048 or more and fewer 128x128 output tiles than SMs; short-K: K of 256 or less with
    both sides of C 1024 or more; large: every dimension 2048 or more. Unaligned: N or K not
    a multiple of 8, where the library leaves its vector paths."""
    m, n, k = problem.m, problem.n, problem.k
    if n % 8 or k % 8:  # rows of B, W or C not 16-byte aligned (M may be anything)
        return "unaligned"
    if min(m, n) <= 128 and max(m, n) >= 1024 and k >= 1024:
        return "decode"
    if min(m, n) <= 512 and k >= 2048 and math.ceil(m / 128) * math.ceil(n / 128) < sm_count:
        return "few-tile long-K"
    if k <= 256 and min(m, n) >= 1024:
        return "short-K"
    if min(m, n, k) >= 2048:
        return "large"
    return "other"
