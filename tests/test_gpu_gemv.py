"""On a GPU: the gemv template (decode: M <= 8, or N <= 8 through C^T = B^T A^T) is correct
over decode and odd shapes in both dtypes and layouts, declines the shapes it cannot run, and
passes the verifier. Run with `pytest -m gpu`."""

from __future__ import annotations

import random

import pytest

from cudal2.baselines import cublas_gemm
from cudal2.pipeline import evaluate
from cudal2.problem import Problem
from cudal2.render import render, template_candidate
from cudal2.verify import Kernel, Numerics, Operands, compare, trusted_error

from conftest import gpu_cc
from test_gpu import context  # noqa: F401  (the fixture: a worker and a leaderboard per problem)

pytestmark = pytest.mark.gpu

# The default; wider tiles with one step in flight; 64-row tiles of two warps; a 16-warp
# block. Together they take every load path: 16-byte rows (nt, and nn's transpose), 8-byte
# N-rows through movmatrix (nn), element loads (unaligned rows, nn's B^T as tokens).
CONFIGS = ({}, {"tile_rows": "32", "warps": "4", "unroll": "1"},
           {"tile_rows": "64", "warps": "2", "unroll": "1"}, {"tile_rows": "16", "warps": "16", "unroll": "2"})
# Decode shapes (M <= 8), odd ones (K or N not a multiple of 8, partial tiles and steps), and
# N <= 8 run transposed (M large).
SHAPES = [(1, 4096, 4096), (2, 6144, 4096), (4, 1024, 14336), (8, 4096, 1024), (1, 1, 1), (3, 1000, 1001),
          (7, 127, 65), (8, 17, 4097), (5, 4104, 520), (6, 24, 72), (1, 200, 8),
          (4096, 1, 4096), (1000, 3, 1001), (127, 5, 4096), (9, 8, 16), (4097, 8, 63), (33, 2, 520)]
UNSUPPORTED = [(9, 9, 64), (16, 4096, 4096)]


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("layout", ["nn", "nt"])
def test_gemv_is_correct_on_decode_and_odd_shapes(compiler, dtype, layout):
    import cupy

    candidates = [template_candidate("gemv", params, gpu_cc()) for params in CONFIGS]
    builds = compiler.compile_all([render(c, Problem(1, 1, 1, dtype, layout)) for c in candidates])
    assert all(b.status == "ok" for b in builds), [b.log[-2000:] for b in builds]
    stream = cupy.cuda.Stream(non_blocking=True)
    num, rng = Numerics(dtype), random.Random(4)
    failures = []
    with stream:
        for cand, build in zip(candidates, builds):
            kernel = Kernel(str(build.library))
            for m, n, k in SHAPES:
                problem = Problem(m, n, k, dtype, layout)
                ops = Operands(problem, 0, num)
                ops.fill("normal", rng)
                ops.poison(rng)
                code = ops.call(kernel, stream)
                stream.synchronize()
                ref = ops.reference()
                err, tol, why = compare(ops.c, ref, num, trusted_error(ops, ref, cublas_gemm(problem, stream)))
                if code != 0 or why or ops.stray_writes() or not ops.inputs_intact():
                    failures.append(f"{cand} {problem}: code {code} {why}")
            for m, n, k in UNSUPPORTED:  # neither side a few vectors: declined, nothing launched
                ops = Operands(Problem(m, n, k, dtype, layout), 0, num)
                if ops.call(kernel, stream) == 0:
                    failures.append(f"{cand} {m}x{n}x{k}: ran a shape it cannot")
    assert not failures, "\n".join(failures)


# Both layouts and dtypes, one token and eight, N <= 8 transposed (nn: B^T read along its
# columns), K and N not multiples of 8.
VERIFIED = [Problem(1, 4096, 4096, "bf16", "nt"), Problem(8, 6144, 4096, "fp16", "nn"),
            Problem(4096, 4, 4096, "fp16", "nn"), Problem(3, 1000, 1001, "bf16", "nt")]


def test_gemv_passes_the_verifier(context):  # noqa: F811
    """cudal2's own verify path (fresh inputs per call, poisoned outputs, rotating input
    sets, memo checks, both timing methods) gives a verified, measured row on each problem
    (one worker through them, as a shape set runs)."""
    ctx = context(VERIFIED[0])
    rows = []
    try:
        for problem in VERIFIED:
            ctx.problem, ctx.libraries = problem, None
            rows += list(evaluate(ctx, [template_candidate("gemv", {}, gpu_cc())]))
    finally:
        ctx.worker.close()
    report = [(row["m"], row["n"], row["k"], row["status"], row.get("error")) for row in rows]
    assert [row["status"] for row in rows] == ["ok"] * len(VERIFIED), report
    assert all(row["kernel_us"] > 0 and row["graph_us"] > 0 and row["speedup_offline"] > 0 for row in rows), report
