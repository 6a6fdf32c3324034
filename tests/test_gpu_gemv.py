"""On a GPU: the gemv template (decode: M <= 8, or N <= 8 through C^T = B^T A^T) is correct
over decode and odd shapes in both dtypes and layouts, declines the shapes it cannot run, and
passes the verifier. Run with `pytest -m gpu`."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from cudal2.measure.baselines import build_baselines
from cudal2.tune.pipeline import evaluate
from cudal2.problem import Problem
from cudal2.kernels.render import template_candidate

from conftest import gpu_cc
from test_gpu import context, template_failures  # noqa: F401  (context: the fixture, a worker and a leaderboard per problem)

pytestmark = pytest.mark.gpu

# The default; wider tiles with one step in flight; 64-row tiles of two warps; a 16-warp
# block. Together they take every load path: 16-byte rows (nt, and nn's transpose), 8-byte
# N-rows through movmatrix (nn), element loads (unaligned rows, nn's B^T as tokens).
CONFIGS = ({}, {"tile_rows": "32", "warps": "4", "unroll": "1"},
           {"tile_rows": "64", "warps": "2", "unroll": "1"}, {"tile_rows": "16", "warps": "16", "unroll": "2"})
# sm_90+: K sliced over a cluster of 2 (one slice empty where K is one step), 64-row tiles and
# 8 warps.
SPLIT_CONFIGS = ({"tile_rows": "64", "warps": "4", "unroll": "1", "split_k": "2"},
                 {"warps": "8", "unroll": "2", "split_k": "2"})
# sm_90: bulk loads into a shared-memory ring (nt, and N <= 8 transposed; other problems take
# the register path in the same build): the default (1,024 K a stage), 32-row tiles with one step
# a warp in three stages, and a deep ring of two-warp stages that wraps around many times.
BULK_CONFIGS = ({"loads": "bulk"}, {"loads": "bulk", "tile_rows": "32", "warps": "4", "unroll": "1", "stages": "3"},
                {"loads": "bulk", "warps": "2", "unroll": "2", "stages": "8"})
# Decode shapes (M <= 8), odd ones (K or N not a multiple of 8, partial tiles and steps), and
# N <= 8 run transposed (M large).
SHAPES = [(1, 4096, 4096), (2, 6144, 4096), (4, 1024, 14336), (8, 4096, 1024), (1, 1, 1), (3, 1000, 1001),
          (7, 127, 65), (8, 17, 4097), (5, 4104, 520), (6, 24, 72), (1, 200, 8),
          (4096, 1, 4096), (1000, 3, 1001), (127, 5, 4096), (9, 8, 16), (4097, 8, 63), (33, 2, 520)]
UNSUPPORTED = [(9, 9, 64), (16, 4096, 4096)]


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("layout", ["nn", "nt"])
def test_gemv_is_correct_on_decode_and_odd_shapes(compiler, dtype, layout):
    # neither side a few vectors (UNSUPPORTED): declined, nothing launched
    configs = CONFIGS + (SPLIT_CONFIGS + BULK_CONFIGS if gpu_cc() >= 90 else ())
    failures = template_failures(compiler, "gemv", configs, SHAPES, dtype, layout, seed=4, declined=UNSUPPORTED)
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
    # The library baselines of both variants first, side by side (each variant's two shims take
    # about 8 s of nvcc; one after another, with the kernels, they took most of the test's time).
    variants = {(p.dtype, p.layout): p for p in VERIFIED}.values()
    with ThreadPoolExecutor() as pool:
        list(pool.map(lambda p: build_baselines(ctx.compiler, p), variants))
    try:
        for problem in VERIFIED:
            ctx.problem, ctx.libraries = problem, None
            rows += list(evaluate(ctx, [template_candidate("gemv", {}, gpu_cc())]))
    finally:
        ctx.worker.close()
    report = [(row["m"], row["n"], row["k"], row["status"], row.get("error")) for row in rows]
    assert [row["status"] for row in rows] == ["ok"] * len(VERIFIED), report
    assert all(row["kernel_us"] > 0 and row["graph_us"] > 0 and row["speedup_offline"] > 0 for row in rows), report


def test_gemv_with_bulk_loads_passes_the_verifier(context):  # noqa: F811
    """The bulk path (sm_90) through the verifier on the problems it serves (nt: one token and
    eight, N <= 8 transposed, a K that ends in a partial stage, rows that end in a partial
    tile), each a verified, measured row."""
    if gpu_cc() < 90:
        pytest.skip("bulk copies and transaction barriers: sm_90+")
    problems = [Problem(1, 4096, 4096, "bf16", "nt"), Problem(8, 4104, 1160, "bf16", "nt"),
                Problem(4096, 4, 4096, "fp16", "nt"), Problem(3, 1000, 14336, "fp16", "nt")]
    ctx = context(problems[0])
    rows = []
    try:
        for problem in problems:
            ctx.problem, ctx.libraries = problem, None
            rows += list(evaluate(ctx, [template_candidate("gemv", {"loads": "bulk"}, gpu_cc())]))
    finally:
        ctx.worker.close()
    report = [(row["m"], row["n"], row["k"], row["status"], row.get("error")) for row in rows]
    assert [row["status"] for row in rows] == ["ok"] * len(problems), report
