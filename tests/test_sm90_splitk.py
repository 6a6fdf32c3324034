"""sm90_splitk without a GPU: the launch's clusters per tile fill one wave of the SMs as the
cost model reckons them, the template serves only the problems it can read (rows on 16
bytes) in its regime, and one configuration builds for sm_90a with nothing but the allowed
imports and the shared memory its space declares."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT, benchmark_script

from cudal2.errors import Cudal2Error
from cudal2.kernels.render import get_template, render, template_candidate
from cudal2.measure.verify import forbidden_imports
from cudal2.problem import Problem

SPACE = get_template("sm90_splitk").space


def split_of(params: dict, problem: Problem) -> tuple[int, int]:
    """(slices of a tile's K, the CTAs of them that wait for each other) on the H200."""
    inputs = SPACE.cost_inputs(SPACE.resolve(params, 90, "sm90_splitk"), 90, problem, 132)
    return inputs["split_k"], inputs["waiting_slices"]


def test_clusters_fill_one_wave_of_the_sms_and_leave_every_cta_k():
    small = {"block_m": 64, "block_n": 64, "split_k": 8, "k_clusters": 16}
    assert split_of(small, Problem(64, 64, 16384)) == (128, 8)  # one tile: 16 clusters, 128 SMs
    assert split_of(small, Problem(128, 256, 16384)) == (16, 8)  # 8 tiles: 2 clusters each
    assert split_of(small, Problem(512, 512, 8192)) == (8, 8)  # 64 tiles: one cluster fills the SMs
    assert split_of(small, Problem(64, 64, 1024)) == (16, 8)  # 16 K tiles: 2 clusters of 8 CTAs, one each
    assert split_of({**small, "k_clusters": 4}, Problem(64, 64, 16384)) == (32, 8)  # the cap
    # CTAs that take an SM's shared memory: fewer clusters of 8 run at once than 132 / 8.
    large = {"block_m": 128, "block_n": 128, "stages": 4, "split_k": 8, "k_clusters": 16}
    assert split_of(large, Problem(64, 64, 16384)) == (14 * 8, 8)
    # Pairs of such CTAs fill the GPU (66 clusters of 2 active on 132 SMs): 32 tiles, 2 clusters each.
    pairs = {"block_m": 128, "block_n": 128, "stages": 6, "split_k": 2, "k_clusters": 8}
    assert split_of(pairs, Problem(4096, 128, 16384)) == (4, 2)


def test_the_atomic_fixup_takes_up_to_128_ctas_a_tile_while_the_tiles_sums_fit_static_memory():
    direct = {"block_m": 64, "block_n": 64, "split_k": 1, "k_clusters": 128, "fixup": "atomic"}
    assert split_of(direct, Problem(64, 64, 16384)) == (128, 1)  # one tile, 128 CTAs without a cluster
    assert split_of(direct, Problem(256, 128, 16384)) == (16, 1)  # 8 tiles: 16 CTAs each
    # 256 tiles of 64x64 fill the 4 MiB of sums; beyond, one CTA a tile stores its own.
    assert split_of(direct, Problem(256, 4096, 16384)) == (1, 1)
    assert split_of({**direct, "block_n": 128}, Problem(256, 8192, 16384)) == (1, 1)
    # The workspace's last cluster loads a float4 of every cluster at once: 32 at most. The
    # spread fixup's clusters each load eight at a time: 128 clusters a tile too.
    with pytest.raises(Cudal2Error, match="k_clusters <= 32"):
        SPACE.resolve({**direct, "fixup": "workspace"}, 90, "sm90_splitk")
    assert split_of({**direct, "fixup": "spread"}, Problem(64, 64, 16384)) == (128, 1)
    for fixup in ("atomic", "spread"):  # ways for clusters to meet
        with pytest.raises(Cudal2Error, match="k_clusters > 1"):
            SPACE.resolve({**direct, "k_clusters": 1, "fixup": fixup}, 90, "sm90_splitk")


def test_it_serves_few_tiles_with_a_long_k_on_rows_tma_can_read():
    assert SPACE.admits(Problem(64, 64, 16384, "bf16", "nt"))
    assert SPACE.admits(Problem(2048, 64, 16384, "fp16", "nn"))
    assert not SPACE.admits(Problem(64, 64, 16388, "bf16", "nt"))  # K rows not on 16 bytes
    assert not SPACE.admits(Problem(64, 60, 16384, "fp16", "nn"))  # B's rows under nn
    assert SPACE.admits(Problem(64, 60, 16384, "fp16", "nt"))
    assert not SPACE.admits(Problem(4096, 4096, 4096))  # 1024 tiles of 128x128: not its regime
    assert SPACE.admits(Problem(4096, 4096, 256))  # a short K over many tiles: the persistent schedule
    assert not SPACE.admits(Problem(8192, 4096, 256))  # larger outputs: sm90_cutlass's


def test_a_short_k_on_a_small_output_takes_the_direct_epilogue_alone():
    """Below K = 1024 a CTA a tile without a split, storing from registers, ran near the library
    on small outputs (H200, grid S1 of the space's notes); the smem epilogue's pass is paid there
    and the family is priced only with the direct one."""
    from cudal2.results.leaderboard import shipped
    from cudal2.search.cost import predict_us, recorded_device

    device = recorded_device(shipped(None), "NVIDIA H200")
    template = get_template("sm90_splitk")
    problem = Problem(1024, 1024, 64)
    assert SPACE.admits(problem)
    one = {"block_m": 64, "block_n": 128, "stages": 2, "split_k": 1, "k_clusters": 1, "fixup": "workspace", "producer": "warp",
           "schedule": "tile", "n_parts": 1}
    assert predict_us(template, {**one, "epilogue": "direct"}, problem, device) < 10
    assert predict_us(template, {**one, "epilogue": "smem"}, problem, device) == float("inf")
    # Where both run (a long K without a split), the smem pass is priced: a microsecond a round
    # per 100 columns.
    long_k = Problem(4096, 128, 8192)
    smem, direct = (predict_us(template, {**one, "epilogue": e}, long_k, device) for e in ("smem", "direct"))
    assert 1.0 < smem - direct < 1.6


def test_three_warpgroups_take_no_tile_wider_than_ptxas_can_hold():
    """A 192x256 tile's CTA with the producer warp (416 threads) gets 128 registers a thread
    from ptxas, fewer than its 128 accumulators need: it never builds. The space refuses it, so
    the search spends no compile on it (the model had put 24 of them in the first 64 at
    6144x256x12288); without the warp (384 threads) it builds, and 192 columns serve three
    warpgroups either way."""
    from cudal2.kernels.render import load_templates
    from cudal2.results.leaderboard import shipped
    from cudal2.search.cost import rank, recorded_device

    wide = {"block_m": "192", "block_n": "256", "stages": "2", "split_k": "1", "k_clusters": "8", "fixup": "spread"}
    with pytest.raises(Cudal2Error, match=re.escape("fails block_m < 192 or block_n <= 192")):
        template_candidate("sm90_splitk", {**wide, "producer": "warp"}, 90)
    template_candidate("sm90_splitk", {**wide, "producer": "thread"}, 90)
    template_candidate("sm90_splitk", {**wide, "block_n": "192", "producer": "warp"}, 90)
    device = recorded_device(shipped(None), "NVIDIA H200")
    first = rank(load_templates(), Problem(6144, 256, 12288), device)[:64]
    assert not [p for _, name, p in first if name == "sm90_splitk" and p["block_m"] == 192 and p["block_n"] == 256
                and p["producer"] == "warp"]
    assert [p for _, name, p in first if name == "sm90_splitk"]  # the family still serves it


def test_the_direct_epilogue_serves_a_cta_that_sums_with_no_other():
    """epilogue=direct stores the accumulators straight to C through the quad transpose shared
    with sm90_cutlass's overlapped epilogue (templates/include/): no partial tile in shared
    memory, so its CTA holds the stages alone. A split refuses it; the default is untouched."""
    direct = {"block_m": "128", "block_n": "256", "stages": "2", "split_k": "1", "k_clusters": "1", "epilogue": "direct"}
    source = render(template_candidate("sm90_splitk", direct, 90), Problem(1, 1, 1, "fp16", "nn"))
    assert "void transpose_quad(" in source and "store_tile(words, bm, bn" in source
    assert "RED_LD" not in source and "constexpr int BARRIER_OFFSET = PIPE_BYTES;" in source
    smem = {**direct, "epilogue": "smem"}
    plain = render(template_candidate("sm90_splitk", smem, 90), Problem(1, 1, 1, "fp16", "nn"))
    assert "transpose_quad" not in plain and "RED_LD" in plain
    facts = lambda params: SPACE.facts(SPACE.resolve(params, 90, "sm90_splitk"), 90)["smem_bytes"]
    assert facts(direct) == 2 * (128 + 256) * 64 * 2 + 2 * 8 * 2  # two stages and their barriers
    assert facts(smem) == 128 * (256 + 4) * 4 + 2 * 8 * 2  # the fp32 partial tile outgrows them
    with pytest.raises(Cudal2Error, match=re.escape("fails epilogue == 'smem' or")):
        template_candidate("sm90_splitk", {**direct, "split_k": "2"}, 90)


@pytest.mark.nvcc
@pytest.mark.slow  # one CuTe TMA + GMMA build: about a minute of one core
@pytest.mark.parametrize("producer, fixup, tile", [("thread", "workspace", 128), ("warp", "workspace", 128),
                                                   ("warp", "atomic", 128), ("warp", "spread", 128), ("warp", "spread", 192)])
def test_multi_warpgroup_n_major_configuration_builds_for_sm90a(compiler, producer, fixup, tile):
    """fp16 nn reads B N-major (GMMA's transposed B) and a 128-row tile takes two warpgroups, a
    192-row one three (and, with producer=warp, a warp that issues the loads; with the atomic
    fixup, vector atomics into static memory; with the spread fixup, a barrier per tile and the
    groups' sums in shared memory): it builds without spills, imports only what a kernel may,
    and declares the dynamic shared memory its space reckons."""
    params = {"block_m": str(tile), "block_n": str(tile), "stages": "4", "split_k": "8", "k_clusters": "16",
              "producer": producer, "fixup": fixup}
    build = compiler.compile(render(template_candidate("sm90_splitk", params, 90), Problem(1, 1, 1, "fp16", "nn")))
    assert build.status == "ok", build.log[-3000:]
    assert {"cudal2_gemm", "cudal2_workspace_bytes"} <= set(build.exports)
    assert forbidden_imports(build.imports) == []
    assert build.spill_bytes == 0
    assert build.declared["dynamic_smem_bytes"] == SPACE.facts(SPACE.resolve(params, 90, "sm90_splitk"), 90)["smem_bytes"]


@pytest.mark.nvcc
@pytest.mark.slow  # one CuTe TMA + GMMA build: about a minute of one core
def test_the_direct_epilogue_builds_in_the_shared_memory_its_space_declares(compiler):
    params = {"block_m": "128", "block_n": "256", "stages": "2", "split_k": "1", "k_clusters": "1", "epilogue": "direct"}
    build = compiler.compile(render(template_candidate("sm90_splitk", params, 90), Problem(1, 1, 1, "fp16", "nn")))
    assert build.status == "ok", build.log[-3000:]
    assert build.spill_bytes == 0 and forbidden_imports(build.imports) == []
    assert build.declared["dynamic_smem_bytes"] == SPACE.facts(SPACE.resolve(params, 90, "sm90_splitk"), 90)["smem_bytes"]


def _timeline():
    return benchmark_script("splitk_timeline")


TIMELINE_CASES = [  # several clusters a tile; one cluster; no cluster, the producer one of the multiplying threads
    ({"block_m": "64", "block_n": "64", "stages": "4", "split_k": "8", "k_clusters": "16", "producer": "warp"}, "fp16", "nn"),
    ({"block_m": "128", "block_n": "128", "stages": "6", "split_k": "2", "k_clusters": "1", "producer": "warp"}, "bf16", "nt"),
    ({"block_m": "128", "block_n": "64", "stages": "4", "split_k": "1", "k_clusters": "8", "producer": "thread"}, "fp16", "nn"),
    # the atomic fixup, without a cluster and with one
    ({"block_m": "64", "block_n": "64", "stages": "4", "split_k": "1", "k_clusters": "128", "producer": "warp",
      "fixup": "atomic"}, "fp16", "nn"),
    ({"block_m": "64", "block_n": "64", "stages": "4", "split_k": "8", "k_clusters": "16", "producer": "warp",
      "fixup": "atomic"}, "bf16", "nt"),
    # the spread fixup, without a cluster and with one
    ({"block_m": "128", "block_n": "128", "stages": "6", "split_k": "1", "k_clusters": "8", "producer": "warp",
      "fixup": "spread"}, "fp16", "nn"),
    ({"block_m": "64", "block_n": "64", "stages": "4", "split_k": "8", "k_clusters": "16", "producer": "warp",
      "fixup": "spread"}, "bf16", "nt"),
    # a CTA a tile, stored straight from the accumulators: nothing parked
    ({"block_m": "64", "block_n": "128", "stages": "2", "split_k": "1", "k_clusters": "1", "producer": "warp",
      "epilogue": "direct"}, "fp16", "nn"),
]


@pytest.mark.parametrize("params, dtype, layout", TIMELINE_CASES)
def test_the_timeline_probe_finds_every_phase_in_the_rendered_source(params, dtype, layout):
    """benchmarks/splitk_timeline.py probes the rendered source at each phase of a CTA: a
    change to the template that moves a phase's anchor fails here, not on the GPU."""
    timeline = _timeline()
    source = render(template_candidate("sm90_splitk", params, 90), Problem(1, 1, 1, dtype, layout))
    probed = timeline.with_probes(source)
    several = params["k_clusters"] != "1"
    written = {i for i in range(8) if f"timeline[{i}] = " in probed}
    parked = set() if params.get("epilogue") == "direct" else {3}
    assert written == ({0, 1, 2, 3, 4, 5, 6, 7} if several else {0, 1, 2, 6, 7} | parked)
    assert probed.count("timeline[6] = ") == (2 if several else 1)  # the last cluster's store, and the single cluster's
    assert "cudal2_timeline_read" in probed and probed.startswith(source[:200])


def test_the_timeline_takes_a_configuration_as_the_docs_write_it():
    # JSON numbers, the parameters it does not name at their defaults: the script once rendered
    # only what was given, and every configuration without `schedule` failed to render.
    timeline = _timeline()
    given = {"block_m": 128, "block_n": 64, "stages": 6, "split_k": 2, "k_clusters": 32, "fixup": "spread", "producer": "warp"}
    probed = timeline.probed_source(Problem(96, 256, 12288), given)
    full = template_candidate("sm90_splitk", {key: str(value) for key, value in given.items()}, 90)
    assert probed == timeline.with_probes(render(full, Problem(1, 1, 1)))
    with pytest.raises(Cudal2Error, match="block_m"):
        timeline.probed_source(Problem(96, 256, 12288), {**given, "block_m": 96})
    persistent = {"block_m": 64, "block_n": 128, "stages": 2, "split_k": 1, "k_clusters": 1, "epilogue": "direct",
                  "schedule": "persistent"}
    with pytest.raises(ValueError, match="persistent"):  # its CTAs walk several tiles: one timeline each would mislead
        timeline.probed_source(Problem(2048, 2048, 128), persistent)


def test_the_timeline_probes_an_edited_source_and_says_which_phase_an_edit_removed(tmp_path):
    """`--source FILE` probes an edited copy of a rendered source (a variant benched beside the
    template's own); an edit that removed a phase's anchor is named, before anything compiles."""
    params, dtype, layout = TIMELINE_CASES[5]  # the spread fixup without a cluster
    source = render(template_candidate("sm90_splitk", params, 90), Problem(1, 1, 1, dtype, layout))
    edited = source.replace("store_item(first + i, sum);", "store_item(i + first, sum);")
    assert edited != source
    (tmp_path / "variant.cu").write_text(edited)

    def timeline(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "splitk_timeline.py"), "384x768x16384", *args],
                              capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})

    run = timeline("--source", str(tmp_path / "variant.cu"), "--compile-only")
    assert run.returncode == 2 and "store_item(first + i, sum);" in run.stderr
    both = timeline(json.dumps(params), "--source", str(tmp_path / "variant.cu"))
    assert both.returncode == 2 and "one of the two" in both.stderr


@pytest.mark.nvcc
@pytest.mark.slow  # one CuTe TMA + GMMA build
def test_the_timeline_probed_source_builds(compiler):
    timeline = _timeline()
    params, dtype, layout = TIMELINE_CASES[0]
    build = compiler.compile(timeline.with_probes(render(template_candidate("sm90_splitk", params, 90),
                                                         Problem(1, 1, 1, dtype, layout))))
    assert build.status == "ok", build.log[-3000:]
    assert {"cudal2_gemm", "cudal2_timeline_read", "cudal2_timeline_clear"} <= set(build.exports)


def test_the_persistent_schedule_serves_a_short_k_up_to_4096_squared_and_refuses_the_tile_that_spills():
    """schedule=persistent needs the direct epilogue (no split) and a producer warp, which loads
    the next tile while the warpgroups store this one; 128x256 spills there (measured slower) and
    192 rows were not measured. Priced where measured: K of 256 or less, sides of 1024 or more, up
    to 4096 x 4096 (skinny outputs stay with sm90_cutlass's one-wave tilings)."""
    from cudal2.search.cost import predict_us

    one = {"block_m": 64, "block_n": 128, "stages": 4, "split_k": 1, "k_clusters": 1, "fixup": "workspace",
           "producer": "warp", "epilogue": "direct", "schedule": "persistent", "n_parts": 1}
    assert SPACE.resolve(one, 90, "sm90_splitk") == one
    for broken in ({"epilogue": "smem"}, {"producer": "thread"}, {"block_m": 128, "block_n": 256}, {"block_m": 192}):
        with pytest.raises(Cudal2Error, match="schedule == 'tile'"):
            SPACE.resolve({**one, **broken}, 90, "sm90_splitk")
    device = {"cc": 90, "sm_count": 132, "max_sm_clock_mhz": 1980, "memory_clock_khz": 3201000, "memory_bus_bits": 6016}
    template = get_template("sm90_splitk")
    for shape in ((8192, 1024, 64), (4096, 4096, 256)):
        assert predict_us(template, one, Problem(*shape), device) < 30
    # the store overlaps the next tile's loads: priced below the same tile a CTA a tile
    small = Problem(2048, 2048, 64)
    assert predict_us(template, one, small, device) < predict_us(template, {**one, "schedule": "tile"}, small, device)
    for shape in ((4096, 4096, 512), (8192, 4096, 128), (12288, 128, 128)):
        assert predict_us(template, one, Problem(*shape), device) == float("inf")
    source = template.render(one, small)
    assert "resident_ctas" in source and "t += (int)gridDim.x" in source
    # consecutive tiles along N: the tiles stored side by side cover whole rows of C
    assert "const int tbm = (t / tiles_n) * BM, tbn = (t % tiles_n) * BN;" in source
    assert "resident_ctas" not in template.render({**one, "schedule": "tile"}, small)


def test_the_tma_epilogue_stores_a_persistent_tile_through_shared_memory_once_its_slab_is_free():
    """epilogue=tma: a persistent CTA's warpgroups write their rows to shared memory (stmatrix)
    and one thread each stores them by TMA, waiting for the slab's previous store to have read
    it first and for the last one before the CTA ends. Its shared memory holds the 16-bit tile
    beside the stages; a CTA a tile would wait for its own store at its end, so only the
    persistent schedule takes it; the other epilogues render no C descriptor."""
    tma = {"block_m": 128, "block_n": 128, "stages": 4, "split_k": 1, "k_clusters": 1, "fixup": "workspace",
           "producer": "warp", "epilogue": "tma", "schedule": "persistent", "n_parts": 1}
    assert SPACE.resolve(tma, 90, "sm90_splitk") == tma
    direct = {**tma, "epilogue": "direct"}
    assert SPACE.facts(tma, 90)["smem_bytes"] == SPACE.facts(direct, 90)["smem_bytes"] + 128 * 128 * 2
    with pytest.raises(Cudal2Error, match="schedule == 'persistent'"):
        SPACE.resolve({**tma, "schedule": "tile"}, 90, "sm90_splitk")
    template = get_template("sm90_splitk")
    source = template.render(tma, Problem(4096, 4096, 128))
    loop = source[source.index("for (int t = (int)blockIdx.x; t < tiles; t += (int)gridDim.x) {\n      const int tbm"):]
    loop = loop[:loop.index("return;")]  # the persistent consumers' loop and its end
    order = [loop.index(s) for s in ("tma_store_wait<0>()", "SM90_U32x4_STSM_N::copy", "tma_store_fence()",
                                     "copy(tma_c,", "tma_store_arrive()")]
    assert order == sorted(order)
    assert loop.count("tma_store_wait<0>()") == 2  # before the slab is written again, and before the CTA ends
    assert "gemm_kernel<TmaA, TmaB, TmaC>" in source and "store_tile(words" not in loop
    assert "TmaC" not in template.render(direct, Problem(4096, 4096, 128))


@pytest.mark.nvcc  # one CuTe TMA + GMMA build: about a minute of one core
def test_the_tma_epilogue_builds_without_spills_in_the_shared_memory_its_space_declares(compiler):
    params = {"block_m": "128", "block_n": "128", "stages": "4", "split_k": "1", "k_clusters": "1",
              "producer": "warp", "epilogue": "tma", "schedule": "persistent"}
    build = compiler.compile(render(template_candidate("sm90_splitk", params, 90), Problem(1, 1, 1, "bf16", "nt")))
    assert build.status == "ok", build.log[-3000:]
    assert build.spill_bytes == 0 and forbidden_imports(build.imports) == []
    assert not re.findall(r"\(C75(?:1[5-9]|20)\)", build.log), build.log[-3000:]
    assert build.declared["dynamic_smem_bytes"] == SPACE.facts(SPACE.resolve(params, 90, "sm90_splitk"), 90)["smem_bytes"]


def test_a_producer_warpgroup_hands_its_registers_to_the_multiplying_warpgroups():
    """producer=warpgroup: the loads' warp in a warpgroup of its own, which gives up its registers
    (setmaxnreg) before it loads and the multiplying warpgroups take them before they multiply;
    only for the persistent tiles that outgrow a thread's share beside a producer warp (128x256,
    256x128), one CTA an SM. The CTA's register pool is what its launch count gives every thread:
    what the warpgroups take must fit it."""
    wg = {"block_m": 128, "block_n": 256, "stages": 3, "split_k": 1, "k_clusters": 1, "fixup": "workspace",
          "producer": "warpgroup", "epilogue": "tma", "schedule": "persistent", "n_parts": 1}
    assert SPACE.resolve(wg, 90, "sm90_splitk") == wg
    with pytest.raises(Cudal2Error, match="producer != 'warpgroup'"):
        SPACE.resolve({**wg, "block_n": 128}, 90, "sm90_splitk")  # 128x128 fits beside a warp
    with pytest.raises(Cudal2Error, match="producer != 'warpgroup'"):
        SPACE.resolve({**wg, "schedule": "tile", "epilogue": "direct"}, 90, "sm90_splitk")
    with pytest.raises(Cudal2Error, match="schedule == 'tile'"):
        SPACE.resolve({**wg, "producer": "warp"}, 90, "sm90_splitk")  # 128x256 persistent spills beside a warp
    problem = Problem(4096, 4096, 128)
    assert SPACE.cost_inputs(wg, 90, problem, 132)["ctas_per_sm"] == 1
    source = get_template("sm90_splitk").render(wg, problem)
    loop = source[source.index("if (tid >= CONSUMERS) {\n      cutlass::arch::warpgroup_reg_dealloc"):]
    order = [loop.index(s) for s in ("warpgroup_reg_dealloc<PRODUCER_REGS>()", "if (tid == CONSUMERS)", "return;",
                                     "warpgroup_reg_alloc<CONSUMER_REGS>()", "warpgroup_arrive()")]
    assert order == sorted(order)
    assert "constexpr int THREADS = CONSUMERS + 128;" in source
    assert "WARPGROUPS > 2 ? 24 : 40" in source
    for block_m, threads, producer, consumer in ((128, 384, 40, 232), (256, 640, 24, 112)):
        launch = 65536 // threads // 8 * 8
        assert producer == (24 if block_m > 128 else 40)
        assert consumer == (launch * threads - 128 * producer) // (block_m * 2) // 8 * 8  # the template's rule
        assert 128 * producer + block_m * 2 * consumer <= launch * threads  # within the CTA's pool
    warp = {**wg, "block_m": 256, "block_n": 128, "producer": "warp"}
    assert "reg_reconfig" not in get_template("sm90_splitk").render(warp, problem)


@pytest.mark.nvcc  # one CuTe TMA + GMMA build: about a minute of one core
def test_a_producer_warpgroup_tile_builds_at_its_launch_count_without_spills(compiler):
    """128x256 with the TMA store and a producer warpgroup: ptxas gives every thread the launch
    count its pool assumes (65536 / 384 in eights: 168) and spills nothing where a producer warp
    spilled; the library declares the registers the warpgroups hold after setmaxnreg."""
    params = {"block_m": "128", "block_n": "256", "stages": "3", "split_k": "1", "k_clusters": "1",
              "producer": "warpgroup", "epilogue": "tma", "schedule": "persistent"}
    build = compiler.compile(render(template_candidate("sm90_splitk", params, 90), Problem(1, 1, 1, "fp16", "nn")))
    assert build.status == "ok", build.log[-3000:]
    assert build.registers == 168 and build.spill_bytes == 0
    assert (build.declared["producer_registers"], build.declared["consumer_registers"]) == (40, 232)
    assert build.declared["dynamic_smem_bytes"] == SPACE.facts(SPACE.resolve(params, 90, "sm90_splitk"), 90)["smem_bytes"]


def test_every_configuration_the_gpu_suite_builds_is_one_the_space_admits():
    """The GPU tests run on the device only; a configuration the space has since refused fails
    there at its check, not at the kernel. Caught here (the persistent 128x256 case was one)."""
    import test_gpu_sm90_splitk as gpu

    configurations = [params for _, params, *_ in gpu.CASES]
    configurations += [gpu.SMALL, gpu.SMALL_WARP, *gpu.ATOMIC, *gpu.SPREAD, *gpu.DIRECT_EPILOGUE, *gpu.PERSISTENT, *gpu.PARTS]
    for params in configurations:
        template_candidate("sm90_splitk", params, 90)


def test_a_tile_in_column_parts_takes_a_short_k_that_fills_its_stages():
    """n_parts > 1: a CTA a tile (no split, the direct store, a producer warp), parts of whole
    64-column chunks of B, offered where K fills the stages (its multiplies run them all)."""
    parts = {"block_m": 128, "block_n": 256, "stages": 4, "split_k": 1, "k_clusters": 1, "fixup": "workspace",
             "producer": "warp", "epilogue": "direct", "schedule": "tile", "n_parts": 2}
    assert SPACE.resolve(parts, 90, "sm90_splitk") == parts
    assert SPACE.resolve({**parts, "n_parts": 4}, 90, "sm90_splitk")["n_parts"] == 4
    for broken in ({"n_parts": 3}, {"block_n": 192, "n_parts": 2}, {"epilogue": "smem"}, {"schedule": "persistent"},
                   {"producer": "thread"}, {"split_k": 2, "epilogue": "smem"}):
        with pytest.raises(Cudal2Error):
            SPACE.resolve({**parts, **broken}, 90, "sm90_splitk")
    two = {**parts, "stages": 2}
    inputs = lambda params, k: SPACE.cost_inputs(params, 90, Problem(2048, 2048, k), 132)["requires"]
    assert inputs(two, 128) and inputs(two, 72)
    assert not inputs(two, 64) and not inputs(two, 136)  # a stage left empty; K beyond them
    assert inputs({**two, "n_parts": 1}, 64)
    source = get_template("sm90_splitk").render(parts, Problem(3072, 1024, 256))
    assert "n_parts=2" in source and "if (K > STAGES * BK) return 6;" in source
    assert source.count("store_tile(words, bm, bn + ") == 2


@pytest.mark.nvcc
@pytest.mark.slow  # two CuTe TMA + GMMA builds
@pytest.mark.parametrize("params", [
    {"block_m": "192", "block_n": "128", "stages": "4", "split_k": "1", "k_clusters": "1", "producer": "warp",
     "epilogue": "direct", "n_parts": "2"},
    {"block_m": "64", "block_n": "64", "stages": "4", "split_k": "1", "k_clusters": "128", "producer": "warp",
     "fixup": "spread"},
], ids=["parts", "spread"])
def test_ptxas_keeps_the_mainloops_gmmas_asynchronous(compiler, params):
    """ptxas serializes GMMAs it cannot prove safe to run ahead and says so (C7515-C7520: a wait
    after divergent branches rejoin, plain register writes to accumulators in flight, a loop of
    run-time length around them); every producer-warp kernel of the family once built so."""
    build = compiler.compile(render(template_candidate("sm90_splitk", params, 90), Problem(1, 1, 1, "fp16", "nn")))
    assert build.status == "ok", build.log[-3000:]
    assert build.spill_bytes == 0
    assert not re.findall(r"\(C75(?:1[5-9]|20)\)", build.log), build.log[-3000:]

