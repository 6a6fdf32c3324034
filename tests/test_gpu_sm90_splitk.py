"""On a GPU: sm90_splitk, the TMA + GMMA split-K for few output tiles and a long K, is a correct,
honest kernel. Tens of CTAs share a tile: the CTAs of a cluster sum through distributed shared
memory, the clusters park their sums in the workspace and the last to arrive (arrival counters
in the library's static memory, reset by that cluster) sums them. Every verifier check passes
(rotating inputs, memoisation probes, graph capture) on few-tile long-K shapes, edges cut by
the tile and K not a multiple of the split; counters are zero again after back-to-back calls,
graph replays and calls of other shapes; with the atomic fixup (the clusters add into a tile's
fp32 sum in static memory) the same, the sums zero again after every call; with the spread
fixup (the clusters park their sums, wait for each other and each sum a share of the tile) the
same, to the bit from call to call, the barriers' counters ready for the next call; tiles of
192 rows (three warpgroups), 256 rows (four) or 192 columns alike. Run with `pytest -m gpu`."""

from __future__ import annotations

import random

import pytest

from cudal2.problem import Problem
from cudal2.kernels.render import render, template_candidate
from cudal2.measure.verify import Kernel, Numerics, Operands

from conftest import gpu_cc, split_k_reset_failures, verifier_failures

pytestmark = pytest.mark.gpu

# One warpgroup on a 64x64 tile, and two on a 128x128 one; both up to 8 x 16 = 128 CTAs a tile.
SMALL = {"block_m": "64", "block_n": "64", "stages": "4", "split_k": "8", "k_clusters": "16"}
LARGE = {"block_m": "128", "block_n": "128", "stages": "4", "split_k": "8", "k_clusters": "16"}
# Few tiles, long K (one tile over 128 CTAs; 8 tiles over 2 clusters each); edges cut by the
# tile, with K a multiple of 8 but not of 64 nor of the split (a partial last K tile, CTAs with
# none); a K of one K tile (one cluster per tile, CTAs without K); more tiles than fill a wave.
SHAPES = ((64, 64, 16384), (128, 256, 4096), (1000, 72, 4104), (33, 24, 2056), (130, 1000, 2056), (512, 256, 64),
          (2048, 2048, 1024))
VARIANTS = [("fp16", "nn"), ("bf16", "nt")]


def build(compiler, params: dict, dtype: str, layout: str) -> Kernel:
    if gpu_cc() != 90:
        pytest.skip("GMMA (sm_90a) runs on compute capability 9.0 only")
    built = compiler.compile(render(template_candidate("sm90_splitk", params, 90), Problem(1, 1, 1, dtype, layout)))
    assert built.status == "ok", built.log[-3000:]
    return Kernel(str(built.library))


# The same with a producer warp of its own (empty barriers per stage; 128x128 in three stages,
# two CTAs an SM).
SMALL_WARP = {**SMALL, "producer": "warp"}
LARGE_WARP = {**LARGE, "stages": "3", "producer": "warp"}
# The atomic fixup: 128 CTAs without a cluster add their accumulators into a tile's fp32 sum in
# static memory; clusters of 8 (and of two 128x128 CTAs) add their summed rows.
DIRECT_ATOMIC = {**SMALL_WARP, "split_k": "1", "k_clusters": "128", "fixup": "atomic"}
SMALL_ATOMIC = {**SMALL_WARP, "fixup": "atomic"}
LARGE_ATOMIC = {**LARGE_WARP, "split_k": "2", "k_clusters": "8", "fixup": "atomic"}
# Tiles of 192 rows (three warpgroups) or 192 columns.
WIDE_ATOMIC = {"block_m": "128", "block_n": "192", "stages": "4", "split_k": "1", "k_clusters": "8", "fixup": "atomic"}
ATOMIC = (DIRECT_ATOMIC, SMALL_ATOMIC, LARGE_ATOMIC, WIDE_ATOMIC)
# The spread fixup: 128 CTAs without a cluster (their shares summed in 16 groups of 8), clusters
# of 8 (16 of them a tile: two groups), pairs of 128x128 CTAs (8 clusters: one group), and pairs
# of 192x128 CTAs.
DIRECT_SPREAD = {**DIRECT_ATOMIC, "fixup": "spread"}
SMALL_SPREAD = {**SMALL_ATOMIC, "fixup": "spread"}
LARGE_SPREAD = {**LARGE_ATOMIC, "fixup": "spread"}
WIDE_SPREAD = {"block_m": "192", "block_n": "128", "stages": "4", "split_k": "2", "k_clusters": "8", "fixup": "spread"}
# Four warpgroups (256 rows) and a producer warp, in pairs.
TALL_SPREAD = {**WIDE_SPREAD, "block_m": "256", "producer": "warp"}
SPREAD = (DIRECT_SPREAD, SMALL_SPREAD, LARGE_SPREAD, WIDE_SPREAD, TALL_SPREAD)
# Without a split, the tile stored straight from the accumulators (16-byte row chunks after a
# quad's transpose): two warpgroups on a 128x256 tile in two stages, and one on 64x64.
WIDE_DIRECT = {"block_m": "128", "block_n": "256", "stages": "2", "split_k": "1", "k_clusters": "1",
               "producer": "warp", "epilogue": "direct"}
SMALL_DIRECT = {**SMALL_WARP, "split_k": "1", "k_clusters": "1", "epilogue": "direct"}
DIRECT_EPILOGUE = (WIDE_DIRECT, SMALL_DIRECT)
CASES = ([("64x64", SMALL, *v) for v in VARIANTS] + [("128x128", LARGE, *v) for v in VARIANTS]
         + [("64x64-warp", SMALL_WARP, *v) for v in VARIANTS] + [("128x128-warp", LARGE_WARP, *v) for v in VARIANTS]
         + [("64x64-atomic-direct", DIRECT_ATOMIC, *v) for v in VARIANTS]
         + [("64x64-atomic", SMALL_ATOMIC, *v) for v in VARIANTS] + [("128x128-atomic", LARGE_ATOMIC, *v) for v in VARIANTS]
         + [("64x64-spread-direct", DIRECT_SPREAD, *v) for v in VARIANTS]
         + [("64x64-spread", SMALL_SPREAD, *v) for v in VARIANTS] + [("128x128-spread", LARGE_SPREAD, *v) for v in VARIANTS]
         + [("128x192-atomic", WIDE_ATOMIC, *v) for v in VARIANTS] + [("192x128-spread", WIDE_SPREAD, *v) for v in VARIANTS]
         + [("256x128-spread", TALL_SPREAD, *v) for v in VARIANTS]
         + [("128x256-direct", WIDE_DIRECT, *v) for v in VARIANTS] + [("64x64-direct", SMALL_DIRECT, *v) for v in VARIANTS])


@pytest.mark.parametrize("params, dtype, layout", [case[1:] for case in CASES], ids=["-".join(c[::2] + c[3:]) for c in CASES])
def test_gmma_split_k_passes_the_verifier_on_few_tile_long_k_shapes(compiler, params, dtype, layout):
    kernel = build(compiler, params, dtype, layout)
    failures = verifier_failures(kernel, SHAPES, dtype, layout, seed=7)
    assert not failures, "\n".join(failures)
    if params in ATOMIC or params in DIRECT_EPILOGUE:  # the sums live in static memory; nothing to sum
        assert kernel.workspace_bytes(64, 64, 16384) == 0
        return
    # The split fills the GPU: one tile of a long K takes as many clusters of 8 as run at once,
    # at most 16 (128 of the 132 SMs): all 16 where CTAs share SMs (64x64), at least 8 where
    # each takes an SM's shared memory and a cluster must find 8 free SMs in one GPC.
    # With the spread fixup, the cap (k_clusters): the SMs hold more.
    tile = int(params["block_m"]) * int(params["block_n"])
    clusters = kernel.workspace_bytes(64, 64, 16384) // (tile * 4)
    if params in SPREAD:
        assert clusters == int(params["k_clusters"]), clusters
    else:
        assert (clusters == 16) if params in (SMALL, SMALL_WARP) else (8 <= clusters <= 16), clusters
    assert kernel.workspace_bytes(512, 256, 64) == 0  # one K tile: one cluster, nothing parked


def test_rows_that_tma_cannot_read_are_declined_not_miscomputed(compiler):
    """Rows that do not start on 16 bytes (K, or N under nn, not a multiple of 8) are declined:
    a non-zero return (recorded as unsupported), C left as it was, nothing written elsewhere."""
    import cupy

    kernel, rng = build(compiler, SMALL, "fp16", "nn"), random.Random(9)
    num = Numerics("fp16")
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for problem in (Problem(64, 64, 4100, "fp16", "nn"), Problem(64, 100, 4096, "fp16", "nn")):
            ops = Operands(problem, kernel.workspace_bytes(problem.m, problem.n, problem.k), num)
            ops.fill("normal", rng)
            ops.poison(rng)
            assert ops.call(kernel, stream) != 0, problem
            stream.synchronize()
            assert bool((ops.c.view(cupy.uint16) == 0xFFFF).all()), f"{problem}: C changed"
            assert not ops.stray_writes(), problem


def test_counters_reset_over_back_to_back_calls_graph_replays_and_other_shapes(compiler):
    """Calls queued without a sync between them, on new inputs each time, then a CUDA graph
    replayed three times over inputs changed in place, then calls alternating between shapes
    of different tile counts: every output is right (a counter left non-zero would make a
    cluster sum too early, or none at all), and two calls on the same inputs agree to the
    bit (the partial tiles are summed in a fixed order, whichever cluster arrives last). With
    the atomic fixup, every output stays right: each tile's sum is zero again for the next call.
    With the spread fixup, outputs agree to the bit too, whichever cluster arrives last."""
    for params in (SMALL, SMALL_WARP, *ATOMIC, *SPREAD):
        failures = split_k_reset_failures(build(compiler, params, "bf16", "nt"), seed=8,
                                          deterministic=params not in ATOMIC)
        assert not failures, "\n".join(failures)


@pytest.mark.parametrize("params", DIRECT_EPILOGUE, ids=["128x256", "64x64"])
def test_the_direct_epilogue_writes_rows_of_any_length_under_nt(compiler, params):
    """Under nt, C's rows may be any length: where they are not whole 16-byte units (N % 8) the
    direct epilogue writes an element at a time, past the edges of the tile nothing."""
    kernel = build(compiler, params, "bf16", "nt")
    failures = verifier_failures(kernel, ((100, 1001, 1024), (33, 37, 2056), (257, 250, 1032)), "bf16", "nt", seed=11)
    assert not failures, "\n".join(failures)


# schedule=persistent: one wave of CTAs walking the tiles, each tile stored from registers while
# the producer warp loads the next one's K tiles.
# (128x256 is refused persistent with a producer warp: it spills; 128x128 in four stages is the
# schedule's measured best; 256x128 is four warpgroups)
# epilogue=tma: each warpgroup's rows through shared memory (stmatrix) and stored by TMA, which
# clips the edges; rows of C that are not whole 16-byte units are stored a value at a time.
# producer=warpgroup: the loads from a warpgroup of their own, whose registers go to the
# multiplying warpgroups (setmaxnreg): 128x256 (two of them at 232 registers) and 256x128 (four
# at 112).
PERSISTENT = ({**WIDE_DIRECT, "block_n": "128", "stages": "4", "schedule": "persistent"},
              {**SMALL_DIRECT, "schedule": "persistent"},
              {**WIDE_DIRECT, "block_m": "256", "block_n": "128", "stages": "4", "schedule": "persistent"},
              {**WIDE_DIRECT, "block_n": "128", "stages": "4", "schedule": "persistent", "epilogue": "tma"},
              {**SMALL_DIRECT, "block_n": "128", "stages": "2", "schedule": "persistent", "epilogue": "tma"},
              {**WIDE_DIRECT, "block_m": "256", "block_n": "128", "stages": "3", "schedule": "persistent", "epilogue": "tma"},
              {**WIDE_DIRECT, "stages": "3", "schedule": "persistent", "epilogue": "tma", "producer": "warpgroup"},
              {**WIDE_DIRECT, "block_m": "256", "block_n": "128", "stages": "4", "schedule": "persistent",
               "producer": "warpgroup"})


@pytest.mark.parametrize("params", PERSISTENT, ids=["128x128", "64x64", "256x128", "128x128-tma", "64x128-tma", "256x128-tma",
                                                    "128x256-tma-wg", "256x128-wg"])
@pytest.mark.parametrize("dtype, layout", VARIANTS)
def test_persistent_ctas_walk_more_tiles_than_they_hold(compiler, params, dtype, layout):
    """More tiles than the wave holds (4096x4096 in 64x64 tiles: 4,096 over a few hundred CTAs),
    K of one, two and a partial last K tile, edges cut by the tile: the ring's stages and their
    phases run on across a CTA's tiles, and every output passes the verifier."""
    kernel = build(compiler, params, dtype, layout)
    shapes = ((4096, 4096, 64), (3000, 2056, 136), (8192, 1024, 128), (33, 24, 2056))
    if layout == "nt":  # rows of C not whole 16-byte units: stored a value at a time
        shapes += ((1000, 1001, 72),)
    failures = verifier_failures(kernel, shapes, dtype, layout, seed=12)
    assert not failures, "\n".join(failures)


# n_parts: a CTA a tile whose columns are multiplied a part at a time from the same stages, each
# part stored while the next multiplies (the whole K in the stages, those past K zero-filled).
PARTS = ({**WIDE_DIRECT, "stages": "4", "n_parts": "2"}, {**WIDE_DIRECT, "stages": "4", "n_parts": "4"},
         {**WIDE_DIRECT, "block_m": "192", "block_n": "192", "stages": "3", "n_parts": "3"},
         {**WIDE_DIRECT, "block_m": "64", "block_n": "128", "stages": "2", "n_parts": "2"},
         {**WIDE_DIRECT, "block_m": "256", "block_n": "128", "stages": "3", "n_parts": "2"})


@pytest.mark.parametrize("params", PARTS, ids=["128x256-2", "128x256-4", "192x192-3", "64x128-2", "256x128-2"])
@pytest.mark.parametrize("dtype, layout", VARIANTS)
def test_a_tile_in_column_parts_is_right_for_every_k_its_stages_hold(compiler, params, dtype, layout):
    """K filling the stages, K of fewer K tiles than stages (the rest zeros), a partial last K
    tile, edges cut by the tile and by its parts, more tiles than a wave: every output passes
    the verifier; under nt, rows of any length. A K beyond the stages is declined, C untouched."""
    import cupy

    kernel = build(compiler, params, dtype, layout)
    depth = int(params["stages"]) * 64
    shapes = [(3072, 1024, depth), (1000, 1000, depth - 56), (257, 248, 64), (4096, 2048, depth - 64), (33, 24, 8)]
    if layout == "nt":
        shapes.append((100, 1001, depth - 8))
    failures = verifier_failures(kernel, shapes, dtype, layout, seed=13)
    assert not failures, "\n".join(failures)
    rng, stream = random.Random(14), cupy.cuda.Stream(non_blocking=True)
    with stream:
        problem = Problem(256, 256, depth + 64, dtype, layout)
        ops = Operands(problem, kernel.workspace_bytes(problem.m, problem.n, problem.k), Numerics(dtype))
        ops.fill("normal", rng)
        ops.poison(rng)
        assert ops.call(kernel, stream) != 0
        stream.synchronize()
        assert bool((ops.c.view(cupy.uint16) == 0xFFFF).all()), "C changed"
        assert not ops.stray_writes()

