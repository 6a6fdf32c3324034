"""A cheap cost model: predicted time of a configuration on a problem, for ranking.

Waves and tile quantisation decide how much of the GPU a configuration keeps busy; the
bytes each tile pulls through L2 decide whether it is fed. A template's `[cost]` table
supplies its tile, its blocks per SM and the fraction of the tensor peak a full wave
reaches (measured); everything else comes from the problem and the device.
"""

from __future__ import annotations

import json
import math
import operator
from typing import Any

import pandas as pd

from ..kernels.render import Template, load_templates, recorded_params
from ..measure.environment import dram_bandwidth, tensor_peak
from ..problem import Problem
from ..protocol import PROTOCOL, SCREENED

LAUNCH_US = 2.0  # a launch and its tail, measured: cuBLAS 64^3 takes ~2-3 us back to back
OVERLAP_LOSS = 0.25  # share of the shorter of compute and memory time not hidden behind the other
# Share of the DRAM bandwidth the copy between unaligned and padded rows reaches: measured
# on the H200, the copies of A, W and C at 4095x4097x1001 bf16 nt (100 MB moved) took
# 38.4 us, 2.6 TB/s (the h200-2026-11-30 report (in git history), fourth round).
COPY_EFFICIENCY = 0.54
# What the L2 delivers to the SMs, bytes per SM clock. The H100 and the H200 share one chip and
# its L2 (only the HBM differs), so it is a per-clock figure, not a multiple of the DRAM
# bandwidth: 6080 is the 2.5x of the H200's 4.81 TB/s the model was fitted with (12.0 TB/s at
# 1980 MHz), where 2.5x the H100's 3.35 TB/s had priced its L2 at 8.4 TB/s. Measured on the
# H100: swapped 128x80 tiles at 3072x384x12288 pull 598 MB through L2 in 46 us (13 TB/s; CTAs
# reading the same panels at once are partly served by merged requests). With it, on the H100's
# screened rows (`scripts/cost_check.py RESULTS "NVIDIA H100 80GB HBM3" --screened`) the best
# measured among the model's top 1 / top 3 rose from 0.834 / 0.890 to 0.870 / 0.912 over 30
# few-tile long-K problems, 0.846 / 0.889 to 0.874 / 0.919 over 30 others, 0.961 / 0.974 to
# 0.969 / 0.982 and 0.957 / 0.975 to 0.972 / 0.980 over two sets of 30 short-K, 0.930 / 0.966 to
# 0.942 / 0.977 over 50 grid shapes; on the shipped H200 rows it is unchanged (0.966 / 0.987).
L2_BYTES_PER_CLOCK = 6080
# Warps per SM below which an SM cannot keep enough loads in flight to reach the memory
# bandwidth (Little's law).
OCCUPANCY_WARPS = 4
# Split-K is not free: the CTAs of a cluster must be co-resident, wait for each other and
# reduce through distributed shared memory. Per extra CTA sharing a tile, the compute time
# stretches by this share (split_k 2 and 4 lost 1-5 us on the small problems of the
# 162-configuration grids in the h200-2026-11-30 report (in git history), third round, where the model without
# it expected gains).
SPLIT_LOSS = 0.35
# A split-K reduction in a fixed order (`ordered_reduction` in a template's [cost]) makes each
# slice of a tile wait for the one before it: a serial chain of fp32 partial-tile reads and
# writes. Measured on the H200 at 1024x128x16384 (128x64 and 128x128 tiles, 8 and 16 slices,
# the h200-2026-11-30 report (in git history), fourth round): ~0.9 us per extra slice per 32 KiB partial tile
# over the same kernels reducing in arrival order.
ORDERED_REDUCTION_BYTES_PER_US = 36e3
# Stream-K (`stream_k_tiles` in a template's [cost]): those tiles' K iterations are spread
# evenly over the SMs, but the runs that share a tile wait for each other's fp32 partial sums.
# Measured on the H200 (the h200-2026-11-30 report (in git history), eighth round), the stream-K part took its
# even share plus about a third of a tile's time: 0.31 at 4096^3 (128x256 tiles, 248 of them
# stream-K), 0.33 at 8192^3 (200), 0.38 at 3072x768x3072 (128x192, all 96).
STREAM_K_WAIT_WAVES = 1 / 3
# Besides that wave term, stream-K costs each call a fixed time: the memset of its tile
# counters before the launch, and the partial tiles' fp32 traffic, which a third of a tile's
# time covers where a tile's K loop is long but not where it is short. Measured on the H200
# (ninth round), over the model's time scaled to the best measured kernel of the problem:
# 768x3072x768 (12 K iterations per tile) 128x128, 256x64 and 256x192 forced ran 6.4-9.7 us
# over, 3072x768x3072 (48) 2.8-4.4 us over. With 5 us, 5120^3 (140 tiles, 80 iterations) and
# 8192^3 still rank stream-K forced ahead of data-parallel, as measured.
STREAM_K_FIXED_US = 5.0
# OCCUPANCY_WARPS and SPLIT_LOSS are fitted to the recorded H200 measurements with
# scripts/cost_check.py (29 problems, in-sample): geometric mean of the best measured among
# the model's top 1 / top 3 over the best measured 0.963 / 0.986, and on every problem with
# 10 or more measured configurations the top 10 hold one within 1% of the best. Without
# the split-K term and at 8 warps: 0.862 / 0.922, and 0.56 on the worst problem. With a
# 30th problem measured afterwards (768x1536x1024, 162 configurations): 0.960 / 0.984.
# With the stores a tile's SM waits for (`exposed_epilogue_bytes`, priced at the SM's share
# of the DRAM bandwidth) and the parallel split-K, over 31 problems: 0.962 / 0.988 and a mean
# rank correlation of +0.72 (without the stores term: 0.945 / 0.977, +0.64).
# A K step waits for its stage's loads: with s stages, every s - 1 steps wait at least a load's
# latency (Little's law). Without it, 2-stage kernels ran 2-3x their predicted time where the K
# loop is long and the tiles few (2048x64x2048: 16-18 us against 5-7 predicted, and the ranking
# missed its best by 17%). Fitted, with SPLIT_LOSS (0.25 before), the sm80 warp-tile exponent
# (0.2 before) and the parallel split-K's summing kernel counted as a launch, over the shipped
# measurements (54 problems of 6 or more configurations) and the 96 other problems of the H200
# run of 2026-12-01 (most of them grid shapes, 16 configurations each, measured after the model
# had picked them), by scripts/cost_check.py: top 1 / top 3 / rank correlation 0.970 / 0.986 /
# +0.70 and 0.914 / 0.969 / +0.53 before, 0.971 / 0.987 / +0.70 and 0.962 / 0.984 / +0.61 after.
LOAD_LATENCY_US = 0.4
# Loads in flight an SM needs to keep its share of the DRAM bandwidth (Little's law: about
# 4.3 TB/s times 2 us of loaded latency, over 132 SMs). Measured on the H200 with gemv at
# 1x4096x4096 bf16 nt: 64 KiB in flight per SM ran 11.4-11.7 us in the graph, 32 KiB 14.4-17.9.
IN_FLIGHT_BYTES = 64 * 1024
# What one SM's loads bring in at most (operands from L2 to shared memory), bytes per SM clock:
# where a few CTAs each read a long K, that, not the DRAM, bounds their loads. The fastest of
# 6,600 measured rows of one wave or less (a CTA reading 256 KiB or more): 188 GB/s (H200) and
# 185 GB/s (H100), both at 1980 MHz, by sm90_cutlass's 64x64 tiles without a split at
# 64x64x16384 and 128x64x14336 (that template's median: 72 and 84 GB/s).
SM_STREAM_BYTES_PER_CLOCK = 96


def cluster_slots(device: dict[str, Any], ctas: int) -> int:
    """SMs that run CTAs launched in clusters of `ctas` at once: the device's own count where it
    was measured (`cluster_slots`: cudaOccupancyMaxActiveClusters times the cluster's CTAs),
    else every SM, rounded down to whole clusters."""
    if ctas <= 1:
        return device["sm_count"]
    measured = device.get("cluster_slots") or {}  # int keys, or string ones after JSON
    return int(measured.get(ctas) or measured.get(str(ctas)) or device["sm_count"] // ctas * ctas)


def predict_us(template: Template, params: dict[str, Any], problem: Problem, device: dict[str, Any]) -> float:
    """Predicted microseconds of `template` with `params` on `problem` (for ranking only);
    infinite where the template says it cannot run the shape."""
    c = template.space.cost_inputs(params, device["cc"], problem, device["sm_count"])
    if not c["requires"]:
        return math.inf
    tm, tn, split = int(c["tile_m"]), int(c["tile_n"]), max(1, int(c["split_k"]))
    tiles = int(c["tiles"])
    walked = int(c["walked_tiles"]) or tiles  # padding tiles a scheduler runs cost a tile's time
    ctas, sms = walked * split, device["sm_count"]
    # CTAs sharing an SM at once: as many as fit, or fewer when the grid is small.
    resident = min(max(1, int(c["ctas_per_sm"])), math.ceil(ctas / sms))
    stream_k = int(c["stream_k_tiles"])
    # A cluster's CTAs run on one GPC: clusters of 4 or 8 leave the SMs of a GPC beyond a whole
    # number of clusters idle.
    slots = cluster_slots(device, int(c["cluster_ctas"]))
    waves = math.ceil((walked - stream_k) * split / (slots * resident))
    if stream_k:
        waves += stream_k / (sms * resident) + STREAM_K_WAIT_WAVES
    sm_flops = tensor_peak(device) / sms * float(c["efficiency"])
    # Each wave costs as much as a full wave of whole tiles: padding and idle SMs are paid.
    tile_flops = 2.0 * tm * tn * math.ceil(problem.k / split)
    # The slices that wait for each other: all of a tile's (or none, `slices_wait`), or only
    # those of one cluster where several clusters share a tile and the last to arrive sums.
    waiting = int(c["waiting_slices"]) or (split if c["slices_wait"] else 1)
    stretch = 1 + SPLIT_LOSS * (waiting - 1)
    compute_s = waves * resident * tile_flops / sm_flops * stretch
    # A tile's stores that its SM waits for (no other tile's mainloop runs meanwhile), at the
    # SM's share of the DRAM bandwidth.
    compute_s += waves * resident * float(c["exposed_epilogue_bytes"]) / (dram_bandwidth(device) / sms)
    # A tile's K loop cannot run faster than its pipeline refills: with s stages, s - 1 loads
    # are in flight while one stage is computed, so every s - 1 K steps wait at least a load's
    # latency (templates that give `pipeline_stages` and `tile_k`).
    latency_s = 0.0
    if int(c["pipeline_stages"]):
        steps = math.ceil(math.ceil(problem.k / split) / int(c["tile_k"]))
        # A template may price its own round trip (`load_latency_us`): gemv's loads go to DRAM
        # with hundreds of kilobytes in flight per SM, where a round trip takes about 1 us.
        latency_us = float(c.get("load_latency_us", LOAD_LATENCY_US))
        latency_s = waves * math.ceil(steps / max(1, int(c["pipeline_stages"]) - 1)) * latency_us * 1e-6
    l2_bytes = tiles * (tm + tn) * problem.k * 2 + (tiles * tm * tn * 4 * 2 if split > 1 else 0)
    l2_bandwidth = L2_BYTES_PER_CLOCK * device["max_sm_clock_mhz"] * 1e6
    memory_s = max(problem.min_bytes / dram_bandwidth(device), l2_bytes / l2_bandwidth)
    # Too few warps on an SM cannot keep enough loads in flight: the memory time stretches
    # by the missing share of OCCUPANCY_WARPS (templates that give `warps` per block).
    if c.get("warps"):
        occupancy = min(1.0, resident * int(c["warps"]) / OCCUPANCY_WARPS)
        memory_s = memory_s / occupancy
    # Likewise too few bytes of loads in flight (templates that give `in_flight_bytes` a CTA).
    if int(c["in_flight_bytes"]):
        memory_s = memory_s / min(1.0, resident * int(c["in_flight_bytes"]) / IN_FLIGHT_BYTES)
    # Nor faster than one SM streams its CTAs' operand tiles.
    sm_bytes = waves * resident * (tm + tn) * math.ceil(problem.k / split) * 2
    memory_s = max(memory_s, sm_bytes / (SM_STREAM_BYTES_PER_CLOCK * device["max_sm_clock_mhz"] * 1e6))
    # Compute and memory overlap, but not perfectly: a quarter of the smaller is paid too
    # (this also ranks, among memory-bound configurations, the more efficient one first).
    gemm_us = (max(compute_s, memory_s, latency_s) + OVERLAP_LOSS * min(compute_s, memory_s)) * 1e6 + LAUNCH_US
    # Passes before or after the GEMM (padded copies of unaligned operands, the sum of
    # parallel split-K slices) run on their own.
    passes_us = float(c["extra_bytes"]) / (COPY_EFFICIENCY * dram_bandwidth(device)) * 1e6
    passes_us += int(c["extra_launches"]) * LAUNCH_US
    # Split-K slices summed in a fixed order: each waits for the one before it.
    ordered_us = (split - 1) * tm * tn * 4 / ORDERED_REDUCTION_BYTES_PER_US if c["ordered_reduction"] else 0.0
    stream_k_us = STREAM_K_FIXED_US if stream_k else 0.0
    return gemm_us + passes_us + ordered_us + stream_k_us + float(c["extra_us"])


def rank(templates: dict[str, Template], problem: Problem, device: dict[str, Any]) -> list[tuple[float, str, dict]]:
    """Every valid configuration of every template that supports the problem, fastest
    predicted first: (predicted us, template name, params)."""
    names = {name: tuple(template.space.params) for name, template in templates.items()}
    return [(t, name, dict(zip(names[name], values))) for t, name, values in rank_values(templates, problem, device)]


def rank_values(templates: dict[str, Template], problem: Problem,
                device: dict[str, Any]) -> list[tuple[float, str, tuple[Any, ...]]]:
    """rank() with each configuration as its tuple of values in its space's parameter order
    (Space.value_sets; no dictionary per configuration). Configurations alike in the
    parameters the cost model reads are priced once (sm90_cutlass: 120,436 prices for its
    308,276 configurations; sm80_mma: 15,036 for 120,288)."""
    ranked = []
    for name, template in templates.items():
        if template.supports(problem, device["cc"]):
            space = template.space
            params = tuple(space.params)
            keys, prices = operator.itemgetter(*(params.index(p) for p in space.cost_params())), {}
            for values in space.value_sets(device["cc"]):
                key = keys(values)
                price = prices.get(key)
                if price is None:
                    price = prices[key] = predict_us(template, dict(zip(params, values)), problem, device)
                if price < math.inf:
                    ranked.append((price, name, values))
    ranked.sort(key=operator.itemgetter(0))
    return ranked


# Memory facts the leaderboard does not record per row (clock kHz, bus bits), by GPU name.
# (nvidia-smi's clocks.max.memory and the HBM's bus: H100 SXM's 3.35 TB/s, H200's 4.8 TB/s)
RECORDED_MEMORY = {"NVIDIA H200": (3201000, 6016), "NVIDIA H100 80GB HBM3": (2619000, 5120)}
# The GPU's cluster slots (environment.measure_cluster_slots), where one was measured: the
# H100 SXM's by the driver's and the runtime's occupancy calls alike (benchmarks/cluster_slots.cu).
# A chip's GPCs differ with floorsweeping, so another H100 may hold a few more or fewer.
RECORDED_CLUSTER_SLOTS = {"NVIDIA H100 80GB HBM3": {2: 132, 4: 120, 8: 120}}


def recorded_device(df: pd.DataFrame, gpu: str) -> dict[str, Any]:
    """The device facts predict_us needs, for a GPU the leaderboard has rows of."""
    rows = df[df["gpu"] == gpu]
    if rows.empty or gpu not in RECORDED_MEMORY:
        raise ValueError(f"no recorded rows or memory facts for {gpu!r}")
    device = {k: int(rows[k].iloc[0]) for k in ("cc", "sm_count", "max_sm_clock_mhz")}
    device["memory_clock_khz"], device["memory_bus_bits"] = RECORDED_MEMORY[gpu]
    device["cluster_slots"] = RECORDED_CLUSTER_SLOTS.get(gpu, {})
    return {"gpu": gpu, **device}


def measured_configurations(df: pd.DataFrame, gpu: str, screened: bool = False) -> dict[Problem, dict[tuple[str, str], float]]:
    """What the leaderboard says about the template configurations on one GPU: per problem,
    (template, params JSON of today's space) -> best offline speedup measured. Speedups of
    one problem are compared within one bench protocol (the `protocol` column): the one with
    the most configurations measured, this version's on a tie. (Configurations are only
    compared with each other: the ratio between two kernels of one protocol.) `screened`:
    the screening pass's rows and their graph ratio instead (a time-budgeted run screens 64
    configurations a shape and confirms one: its screened rows are what ranks them)."""
    templates = load_templates()
    status, column = (SCREENED, "speedup_graph") if screened else ("ok", "speedup_offline")
    ok = df[(df["status"] == status) & df["template"].isin(list(templates)) & (df["gpu"] == gpu)
            & df[column].notna()]
    by_protocol: dict[Problem, dict[str, dict[tuple[str, str], float]]] = {}
    for row in ok.to_dict("records"):
        if (params := recorded_params(row, templates)) is not None:
            problem = Problem(int(row["m"]), int(row["n"]), int(row["k"]), row["dtype"], row["layout"])
            key = (row["template"], json.dumps(params, sort_keys=True))
            speedups = by_protocol.setdefault(problem, {}).setdefault(row["protocol"], {})
            speedups[key] = max(speedups.get(key, 0.0), float(row[column]))
    return {problem: max(protocols.items(), key=lambda e: (len(e[1]), e[0] == PROTOCOL))[1]
            for problem, protocols in by_protocol.items()}
