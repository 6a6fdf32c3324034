"""On a GPU: sm80_mma's split-K over several clusters per output tile (k_clusters > 1) is a
correct, honest kernel. Its clusters park fp32 partial tiles in the workspace and the last to
arrive at a tile sums them, guided by arrival counters in the library's static memory that it
resets itself: every verifier check passes (rotating inputs, memoisation probes, graph
capture, odd shapes), and the counters are zero again after back-to-back calls, graph replays
and calls of other shapes. Run with `pytest -m gpu`."""

from __future__ import annotations

import pytest

from cudal2.problem import Problem
from cudal2.kernels.render import render, template_candidate
from cudal2.measure.verify import Kernel

from conftest import gpu_cc, split_k_reset_failures, verifier_failures

pytestmark = pytest.mark.gpu

# A 64x64 tile cut into 8 x 16 = 128 slices (one tile fills the GPU at 64x64x16384), and a
# 32x64 tile in 4 clusters of no cluster at all (split_k 1: partial tiles through the
# workspace alone), whose 64-deep K tiles leave some CTAs none on the odd shapes.
WIDE = {"block_m": "64", "block_n": "64", "warps_m": "2", "warps_n": "2", "split_k": "8", "k_clusters": "16"}
NO_CLUSTER = {"block_m": "32", "block_n": "64", "warps_m": "1", "warps_n": "2", "split_k": "1", "k_clusters": "4"}
# Few tiles, long K; odd sizes (a tile cut at its edge, K not a multiple of 8: the gathering
# loads); a K of one K tile (one cluster per tile); and more tiles than the counters serve at
# 64x64 (one cluster per tile), which the 32x64 tiles still split.
SHAPES = ((64, 64, 16384), (128, 256, 4096), (1000, 72, 4100), (33, 17, 2049), (130, 1000, 2056), (512, 256, 64),
          (8192, 2048, 1024))
VARIANTS = [("fp16", "nn"), ("bf16", "nt"), ("fp16", "nt"), ("bf16", "nn")]


def build(compiler, params: dict, dtype: str, layout: str) -> Kernel:
    if gpu_cc() < 90 and params["split_k"] != "1":
        pytest.skip("clusters need compute capability 9.0")
    built = compiler.compile(render(template_candidate("sm80_mma", params, gpu_cc()), Problem(1, 1, 1, dtype, layout)))
    assert built.status == "ok", built.log[-3000:]
    return Kernel(str(built.library))


CASES = [("8x16", WIDE, *v) for v in VARIANTS] + [("1x4", NO_CLUSTER, *v) for v in VARIANTS[:2]]


@pytest.mark.parametrize("params, dtype, layout", [case[1:] for case in CASES], ids=["-".join(c[::2] + c[3:]) for c in CASES])
def test_wide_split_k_passes_the_verifier_on_few_tile_long_k_shapes(compiler, params, dtype, layout):
    kernel = build(compiler, params, dtype, layout)
    failures = verifier_failures(kernel, SHAPES, dtype, layout, seed=5)
    assert not failures, "\n".join(failures)
    # The split is real: a long K on one tile asks for the partial tiles of 16 (4) clusters.
    assert kernel.workspace_bytes(64, 64, 16384) == int(params["k_clusters"]) * 64 * 64 * 4
    assert kernel.workspace_bytes(512, 256, 64) == 0
    assert (kernel.workspace_bytes(8192, 2048, 1024) == 0) == (params is WIDE)  # 4096 tiles x 8 ranks: too many


def test_counters_reset_over_back_to_back_calls_graph_replays_and_other_shapes(compiler):
    """Calls queued without a sync between them, on new inputs each time, then a CUDA graph
    replayed three times over inputs changed in place, then calls alternating between shapes
    of different tile counts: every output is right (a counter left non-zero would make a
    cluster sum too early, or none at all), and two calls on the same inputs agree to the
    bit (the partial tiles are summed in a fixed order, whichever cluster arrives last)."""
    failures = split_k_reset_failures(build(compiler, WIDE, "bf16", "nt"), seed=6)
    assert not failures, "\n".join(failures)
