"""cudal2: find the fastest half-precision GEMM kernel for a shape on your GPU, honestly measured."""

__version__ = "0.1.0"
