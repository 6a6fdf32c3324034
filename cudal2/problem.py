"""The problem: one GEMM shape, its dtype and its layout."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import Cudal2Error

DTYPES = ("fp16", "bf16")
LAYOUTS = ("nn", "nt")
MAX_DIM = 2**31 - 1  # the kernel ABI passes M, N and K as C ints
LAYOUT_HELP = {
    "nn": "A[M,K] @ B[K,N], both row-major",
    "nt": "A[M,K] @ W[N,K]^T, W row-major as a Linear layer stores it",
}


@dataclass(frozen=True)
class Problem:
    """C[M,N] = A[M,K] @ B, fp32 accumulation, A, B and C all of `dtype`."""

    m: int
    n: int
    k: int
    dtype: str = "fp16"
    layout: str = "nn"

    def __post_init__(self) -> None:
        for name in ("m", "n", "k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise Cudal2Error(f"{name} must be an integer, got {value!r}")
            if value < 1:
                raise Cudal2Error(f"{name} must be >= 1, got {value}")
            if value > MAX_DIM:
                raise Cudal2Error(f"{name} must be < 2^31 (the kernel ABI passes it as an int), got {value}")
        if self.dtype not in DTYPES:
            raise Cudal2Error(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        if self.layout not in LAYOUTS:
            raise Cudal2Error(f"unknown layout {self.layout!r}; choose one of {', '.join(LAYOUTS)}")

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k

    @property
    def min_bytes(self) -> int:
        """Each input read once and the output written once, 2 bytes an element."""
        return 2 * (self.m * self.k + self.k * self.n + self.m * self.n)

    @property
    def b_shape(self) -> tuple[int, int]:
        return (self.k, self.n) if self.layout == "nn" else (self.n, self.k)

    @classmethod
    def parse(cls, m: str, n: str, k: str, dtype: str = "fp16", layout: str = "nn") -> Problem:
        """From command-line text: dimensions must be plain integers."""
        dims = []
        for name, text in (("m", m), ("n", n), ("k", k)):
            try:
                dims.append(int(str(text).strip()))
            except ValueError:
                raise Cudal2Error(f"{name} must be an integer, got {text!r}") from None
        return cls(*dims, dtype, layout)

    def __str__(self) -> str:
        return f"{self.m}x{self.n}x{self.k} {self.dtype} {self.layout}"
