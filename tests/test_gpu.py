"""On a GPU: the template is correct over odd shapes, the verifier rejects each way to
cheat (memoised results included), the baselines and both timing methods hold, and
`cudal2 bench` measures real rows. Run with `pytest -m gpu`."""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cudal2.kernels.candidate import Candidate
from cudal2.cli import app
from cudal2.config import Settings
from cudal2.results.leaderboard import BASELINES, Leaderboard
from cudal2.tune.pipeline import Context, evaluate, measure_baselines
from cudal2.problem import Problem
from cudal2.kernels.render import get_template, render, template_candidate
from cudal2.runtime import DispatchTable
from cudal2.measure.verify import Kernel, Numerics, Operands, Rejected, checked_call, compare, trusted_error
from cudal2.measure.baselines import cublas_gemm
from cudal2.measure.worker import Worker

from conftest import ROOT, fenced, fixture_source, gpu_cc

pytestmark = pytest.mark.gpu

DIMS = (1, 17, 63, 65, 127, 1000, 4097)
SHAPES = sorted({(v, 128, 256) for v in DIMS} | {(128, v, 256) for v in DIMS}
                | {(128, 256, v) for v in DIMS} | {(65, 127, 63), (1000, 1000, 1000)})
# The default, plus a configuration exercising the other swizzle branches (64-wide K
# slices, 32-wide N tiles) and a shallower pipeline; on sm_90+ also split-K clusters: a
# 16-row tile split 4 ways, and the default split 8 ways (most slices empty when K is small).
CONFIGS = ({}, {"block_m": "64", "block_n": "32", "block_k": "64", "warps_m": "2", "warps_n": "1", "stages": "3",
                "epilogue": "direct"})
SPLIT_CONFIGS = ({"block_m": "16", "block_n": "64", "warps_m": "1", "warps_n": "2", "split_k": "4"}, {"split_k": "8"})


def call_failure(kernel: Kernel, ops: Operands, stream, rng) -> str:
    """One call of `kernel` on fresh normal inputs, checked as the verifier checks a call
    (verify.checked_call: returns 0, C within the tolerance of the fp32 reference, nothing
    written outside C, A and B intact): '' if right, else what was wrong."""
    ops.fill("normal", rng)
    try:
        checked_call(ops, kernel, stream, rng, "normal inputs", cublas_gemm(ops.problem, stream))
    except Rejected as r:
        return f"{r.status}: {r}"
    return ""


def template_failures(compiler, template: str, configs, shapes, dtype: str, layout: str, seed: int,
                      declined=()) -> list[str]:
    """Each configuration of `template` called on each of `shapes` (fresh normal inputs,
    poisoned output) against the fp32 reference within the verifier's tolerance, with no
    stray write and the inputs intact; each of `declined` refused with nothing launched.
    Returns what failed, one line each."""
    import cupy

    candidates = [template_candidate(template, params, gpu_cc()) for params in configs]
    builds = compiler.compile_all([render(c, Problem(1, 1, 1, dtype, layout)) for c in candidates])
    assert all(b.status == "ok" for b in builds), [b.log[-2000:] for b in builds]
    stream = cupy.cuda.Stream(non_blocking=True)
    num, rng = Numerics(dtype), random.Random(seed)
    failures = []
    with stream:
        for cand, build in zip(candidates, builds):
            kernel = Kernel(str(build.library))
            for m, n, k in shapes:
                problem = Problem(m, n, k, dtype, layout)
                if why := call_failure(kernel, Operands(problem, 0, num), stream, rng):
                    failures.append(f"{cand} {problem}: {why}")
            for m, n, k in declined:
                if Operands(Problem(m, n, k, dtype, layout), 0, num).call(kernel, stream) == 0:
                    failures.append(f"{cand} {m}x{n}x{k}: ran a shape it cannot")
    return failures


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("layout", ["nn", "nt"])
def test_sm80_template_is_correct_on_odd_shapes(compiler, dtype, layout):
    configs = CONFIGS + (SPLIT_CONFIGS if gpu_cc() >= 90 else ())
    failures = template_failures(compiler, "sm80_mma", configs, SHAPES, dtype, layout, seed=1)
    assert not failures, "\n".join(failures)


SM90_SHAPES = ((4096, 4096, 4096), (1, 4096, 4096), (8, 8, 8), (3000, 24, 16), (777, 1112, 8200),
               (257, 4104, 520), (1000, 1000, 1000), (129, 1000, 2048),
               # rows TMA cannot load as given (K or N not a multiple of 8): padded copies
               (128, 128, 1001), (128, 1001, 128), (65, 127, 63), (1, 1, 1), (4095, 4097, 1001))


VARIANTS = [("fp16", "nn"), ("bf16", "nt"), ("fp16", "nt"), ("bf16", "nn")]
# Besides the default: split-K through the stream-K scheduler, slices summed as they arrive;
# CUTLASS's own stream-K heuristic with the deterministic (ordered) reduction; and the parallel
# split-K (slices as batches, summed by a second kernel) on the non-persistent and the
# persistent cooperative kernel. K = 4096 and 2048 run there in 8 and 4 slices, K = 8200 and
# 520 (K / 8 odd) and K % 8 in one. Stream-K forced: at 4096^3 the last two of four waves of
# tiles, on the shapes of fewer tiles than SMs all of them, are cut into runs of K iterations
# (partial tiles summed through the workspace). The even grid (fewer CTAs than SMs where the
# last wave is partial: 128 for the 512 tiles of 4096^3), also over parallel split-K's slices.
SM90_CONFIGS = [({}, v) for v in VARIANTS] + [
    ({"tile_n": "128", "tile_scheduler": "streamk", "splits": "4", "reduction": "nondeterministic"}, ("fp16", "nn")),
    ({"tile_n": "128", "tile_scheduler": "streamk"}, ("bf16", "nt")),
    ({"kernel_schedule": "warpspecialized", "tile_m": "64", "tile_n": "128", "cluster_m": "1", "splits": "8",
      "reduction": "parallel"}, ("fp16", "nn")),
    ({"tile_n": "128", "splits": "4", "reduction": "parallel"}, ("bf16", "nt")),
    ({"tile_scheduler": "streamk", "decomposition": "streamk"}, ("fp16", "nn")),
    ({"tile_m": "256", "tile_n": "128", "cluster_m": "1", "cluster_n": "2", "tile_scheduler": "streamk",
      "decomposition": "streamk", "reduction": "nondeterministic"}, ("bf16", "nt")),
    ({"grid": "even", "raster_order": "along_n", "max_swizzle_size": "8"}, ("bf16", "nn")),
    ({"tile_m": "256", "tile_n": "128", "cluster_m": "1", "grid": "even", "splits": "4", "reduction": "parallel"},
     ("fp16", "nt")),
    # Operands swapped (C^T = B^T A^T into C's memory), with the extended GMMA widths.
    ({"kernel_schedule": "warpspecialized", "tile_n": "160", "cluster_m": "1", "swap_ab": "yes"}, ("fp16", "nn")),
    ({"tile_n": "144", "cluster_m": "1", "cluster_n": "2", "swap_ab": "yes", "tile_scheduler": "streamk",
      "decomposition": "streamk", "reduction": "nondeterministic"}, ("bf16", "nt")),
    ({"tile_m": "256", "tile_n": "128", "swap_ab": "yes", "grid": "even", "raster_order": "along_m",
      "max_swizzle_size": "8"}, ("fp16", "nt")),
    # Narrow GMMA widths along a small M (swapped): a 64x16 tile, a CTA a tile, and 64x32
    # ping-pong; M = 1 and 8 fill part of one tile's columns, M = 4096 runs 128-256 tiles along it.
    ({"kernel_schedule": "warpspecialized", "tile_m": "64", "tile_n": "16", "cluster_m": "1", "swap_ab": "yes"},
     ("bf16", "nt")),
    ({"kernel_schedule": "pingpong", "tile_m": "64", "tile_n": "32", "cluster_m": "1", "swap_ab": "yes"},
     ("fp16", "nn")),
    # The widths that fill one wave of a few-tile output (swapped, a CTA a tile): 48 and 112
    # with a 128-deep K stage, 80 beside a 2x1 cluster.
    ({"kernel_schedule": "warpspecialized", "tile_m": "64", "tile_n": "48", "tile_k": "128", "cluster_m": "1",
      "swap_ab": "yes"}, ("fp16", "nn")),
    ({"kernel_schedule": "warpspecialized", "tile_m": "128", "tile_n": "80", "cluster_m": "2", "swap_ab": "yes"},
     ("bf16", "nt")),
    ({"kernel_schedule": "warpspecialized", "tile_m": "64", "tile_n": "112", "tile_k": "128", "cluster_m": "1",
      "swap_ab": "yes"}, ("bf16", "nn")),
    # Each tile stored from registers during the next tile's first k-block (16-byte stores after
    # a quad transpose): 2x1 and 1x2 clusters, 128x256, 256x128 (two M repeats of the GMMA per
    # warpgroup) and 128x192 tiles, the even grid.
    ({"epilogue_schedule": "overlap", "grid": "even", "raster_order": "along_n", "max_swizzle_size": "8"},
     ("fp16", "nn")),
    ({"epilogue_schedule": "overlap", "tile_m": "256", "tile_n": "128", "cluster_m": "1", "cluster_n": "2"},
     ("bf16", "nt")),
    ({"epilogue_schedule": "overlap", "tile_n": "192", "cluster_m": "1"}, ("bf16", "nn")),
    # Clusters of 8 and 4 on the CTA-a-tile kernel (cuBLAS's few-tile, mid-K kernels): 4x2
    # 64x64, and 1x4 swapped 64x96; their grids round up to whole clusters on odd shapes.
    ({"kernel_schedule": "warpspecialized", "tile_m": "64", "tile_n": "64", "cluster_m": "4", "cluster_n": "2"},
     ("fp16", "nn")),
    ({"kernel_schedule": "warpspecialized", "tile_m": "64", "tile_n": "96", "cluster_m": "1", "cluster_n": "4",
      "swap_ab": "yes"}, ("bf16", "nt")),
]


@pytest.fixture(scope="module")
def sm90_builds(compiler):
    """sm90_cutlass configurations (SM90_CONFIGS), compiled in parallel."""
    candidates = [(template_candidate("sm90_cutlass", params, gpu_cc()), v) for params, v in SM90_CONFIGS]
    builds = compiler.compile_all([render(c, Problem(1, 1, 1, *v)) for c, v in candidates])
    return list(zip(candidates, builds))


@pytest.mark.parametrize("index", range(len(SM90_CONFIGS)))
def test_sm90_cutlass_is_correct_on_odd_and_unaligned_shapes(sm90_builds, index):
    import cupy

    (cand, (dtype, layout)), build = sm90_builds[index]
    assert build.status == "ok", build.log[-3000:]
    kernel, num, rng = Kernel(str(build.library)), Numerics(dtype), random.Random(2)
    stream = cupy.cuda.Stream(non_blocking=True)
    failures = []
    with stream:
        for m, n, k in SM90_SHAPES:
            problem = Problem(m, n, k, dtype, layout)
            if dict(cand.params)["reduction"] == "parallel" and k % 8 == 0 and n % 8 == 0:
                # The kernel cuts K into as many slices as the cost model prices: its workspace
                # (no padded copies here) is exactly their fp32 partial sums.
                device = {"cc": gpu_cc(), "sm_count": 132}
                slices = get_template("sm90_cutlass").space.cost_inputs(dict(cand.params), device["cc"], problem,
                                                                        device["sm_count"])["split_k"]
                expected = -(-slices * m * n * 4 // 256) * 256
                if kernel.workspace_bytes(m, n, k) != expected:
                    failures.append(f"{cand} {problem}: workspace {kernel.workspace_bytes(m, n, k)}, "
                                    f"not {slices} slices ({expected})")
            if why := call_failure(kernel, Operands(problem, kernel.workspace_bytes(m, n, k), num), stream, rng):
                failures.append(f"{cand} {problem}: {why}")
    assert not failures, "\n".join(failures)


def test_cluster_slots_are_whole_clusters_of_the_gpus_sms(tmp_path):
    """The GPU's cluster capacity (the driver's cuOccupancyMaxActiveClusters through ctypes),
    which the ranking divides the CTA-a-tile kernel's waves by: whole clusters, no more SMs than
    the GPU has, clusters of 2 on every SM (a TPC's two SMs share a GPC), bigger ones on no
    more, what the runtime's count says (benchmarks/cluster_slots.cu, built with nvcc), and
    what every worker's environment carries to the ranking."""
    import re
    import shutil
    import subprocess

    from cudal2.measure.environment import describe_device, measure_cluster_slots

    device = describe_device(0)
    if device["cc"] < 90:
        pytest.skip("thread-block clusters need sm_90")
    slots, sms = measure_cluster_slots(device["smem_optin_bytes"]), device["sm_count"]
    assert sorted(slots) == [2, 4, 8], slots
    assert device["cluster_slots"] == slots
    assert all(slots[size] % size == 0 and sms // 2 < slots[size] <= sms for size in slots), slots
    assert slots[2] == sms and slots[8] <= slots[4] <= slots[2], slots
    probe = tmp_path / "cluster_slots"
    built = subprocess.run([shutil.which("nvcc"), "-O2", "-arch=sm_90a", "-o", str(probe),
                            str(ROOT / "benchmarks" / "cluster_slots.cu")], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-3000:]
    printed = subprocess.run([str(probe), str(device["smem_optin_bytes"])], capture_output=True, text=True).stdout
    runtime = {int(c): int(n) for c, n in re.findall(r"^cluster (\d+): \d+ clusters, (\d+) CTAs$", printed, re.M)}
    assert {size: runtime.get(size) for size in slots} == slots, printed


# Calls chained on one stream: the sm90 default, parallel split-K (whose kernel summing the
# slices is launched with programmatic dependent launch behind its GEMM) and the overlapped
# epilogue (SM90_CONFIGS), and sm80_mma.
PARALLEL_SPLIT_K = next(params for params, _ in SM90_CONFIGS if params.get("reduction") == "parallel"
                        and params.get("kernel_schedule") != "warpspecialized")
OVERLAP = next(params for params, v in SM90_CONFIGS if params.get("epilogue_schedule") == "overlap"
               and v == ("fp16", "nn"))
CHAINED = [("sm90_cutlass", {}), ("sm90_cutlass", PARALLEL_SPLIT_K), ("sm90_cutlass", OVERLAP), ("sm80_mma", {})]


@pytest.mark.parametrize("template, params", CHAINED, ids=["sm90", "sm90-parallel", "sm90-overlap", "sm80"])
def test_a_call_reads_all_of_its_predecessors_output(compiler, template, params):
    """Two calls back to back on one stream, the second multiplying the first's output: the
    second must read all of C1 (within a parallel split-K call, the sum is launched while its
    GEMM may still run, and must wait for all of the slices)."""
    import cupy

    if template == "sm90_cutlass" and gpu_cc() != 90:
        pytest.skip("sm90_cutlass runs on compute capability 9.0")
    failures = []
    for size in (2048, 1001):  # aligned rows (TMA reads C1 directly), unaligned (padded copies)
        problem = Problem(size, size, size, "fp16", "nn")
        build = compiler.compile(render(template_candidate(template, params, gpu_cc()), problem))
        assert build.status == "ok", build.log[-3000:]
        kernel, num, rng = Kernel(str(build.library)), Numerics("fp16"), random.Random(3)
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            ws = kernel.workspace_bytes(size, size, size)
            first, second = Operands(problem, ws, num), Operands(problem, ws, num)
            first.fill("normal", rng)
            second.fill("normal", rng)
            for _ in range(3):
                first.poison(rng)
                second.poison(rng)
                stream.synchronize()
                codes = [first.call(kernel, stream),
                         kernel.gemm(first.c.data.ptr, second.b.data.ptr, second.c.data.ptr, size, size, size,
                                     second.ws.data.ptr, second.ws_bytes, stream.ptr)]
                stream.synchronize()
                second.a[...] = first.c  # what the second call should have read
                ref = second.reference()
                _, _, why = compare(second.c, ref, num, trusted_error(second, ref, cublas_gemm(problem, stream)))
                if codes != [0, 0] or why:
                    failures.append(f"{template} {params} {problem}: codes {codes} {why}")
    assert not failures, "\n".join(failures)


def test_a_call_of_two_overlapping_kernels_reads_alike_by_both_methods(context):
    """Parallel split-K's sum kernel is launched with programmatic dependent launch behind its
    GEMM, resident and waiting while the GEMM runs. Its CUPTI records overlap; the kernel
    method counts their union, as the device ran them (summed, such a call read 0.91 of the
    library by CUPTI and 1.08 in the graph at 128x1024x12288 on an H200)."""
    if gpu_cc() != 90:
        pytest.skip("sm90_cutlass runs on compute capability 9.0")
    params = {"kernel_schedule": "warpspecialized", "tile_m": "64", "tile_n": "128", "cluster_m": "1",
              "splits": "8", "reduction": "parallel"}
    ctx = context(Problem(128, 1024, 12288))
    ctx.settings = Settings(results=ctx.settings.results, budget=0.5, timeout=120.0)
    try:
        row = next(iter(evaluate(ctx, [template_candidate("sm90_cutlass", params, 90)])))
    finally:
        ctx.worker.close()
    assert row["status"] == "ok", row.get("error")
    print(f"parallel split-K 128x1024x12288: kernel {row['kernel_us']:.2f} us, graph {row['graph_us']:.2f} us; "
          f"cuBLASLt kernel {row['cublaslt_kernel_us']:.2f}, graph {row['cublaslt_graph_us']:.2f}")
    ours, library = row["kernel_us"] / row["graph_us"], row["cublaslt_kernel_us"] / row["cublaslt_graph_us"]
    assert ours == pytest.approx(library, rel=0.08), (ours, library)


@pytest.fixture
def context(tmp_path, compiler):
    def make(problem: Problem, timeout: float = 120.0) -> Context:
        settings = Settings(results=tmp_path, budget=0.2, timeout=timeout)
        worker = Worker()
        worker.start()
        return Context(problem, settings, worker, compiler, Leaderboard(tmp_path), "test")

    return make


VERDICTS = {
    "honest": {"ok"},
    "half": {"wrong"},
    "nothing": {"wrong"},
    "fp16_accumulate": {"wrong"},
    "past_end": {"cheat"},
    "own_stream": {"cheat"},
    "legacy_stream": {"cheat", "wrong"},
    "cached": {"wrong", "cheat"},
}


def test_verifier_rejects_every_broken_kernel(context):
    ctx = context(Problem(512, 512, 512))
    honest = Candidate.from_source((ROOT / "examples" / "simt_gemm_fp16_nn.cu").read_text(), "honest")
    cands = [honest] + [Candidate.from_source(fixture_source(v), v) for v in VERDICTS if v != "honest"]
    try:
        rows = {row["kernel"]: row for row in evaluate(ctx, cands)}
    finally:
        ctx.worker.close()
    report = {name: (row["status"], row.get("error")) for name, row in rows.items()}
    for name, allowed in VERDICTS.items():
        assert rows[name]["status"] in allowed, report
    assert rows["honest"]["speedup_offline"] > 0
    assert "max error" in rows["fp16_accumulate"]["error"], report  # inaccurate, not unwritten
    assert "guard band" in rows["past_end"]["error"], report
    assert "cudaStreamCreateWithFlags" in rows["own_stream"]["error"], report
    assert "uniform" in rows["cached"]["error"], report  # the second call on the same pointers


class CountingKernel(Kernel):
    """A kernel library whose calls (and the device time they queue) are counted."""

    def __init__(self, path: str):
        super().__init__(path)
        self.calls = 0

    def call(self, *args) -> int:
        self.calls += 1
        return super().call(*args)


def test_the_screening_checks_reject_every_broken_kernel_at_a_fraction_of_the_calls(compiler):
    """verify's `screen` (a screening session's kernels, never ranked): every broken fixture
    gets a verdict other than ok as the full verification gives (the cached one as wrong: its
    second call on the same pointers leaves C unwritten), the honest one and a template kernel
    are accepted, and a screened kernel costs at most a third of the full verification's calls."""
    import time

    import cupy

    from cudal2.measure.verify import forbidden_imports, verify

    problem, rng = Problem(512, 512, 512), random.Random(5)
    stream = cupy.cuda.Stream(non_blocking=True)
    report = {}
    with stream:
        for variant, allowed in VERDICTS.items():
            build = compiler.compile(fixture_source(variant))
            assert build.status == "ok", build.log[-2000:]
            if bad := forbidden_imports(build.imports):  # judged before any check runs (pipeline)
                report[variant] = ("cheat", f"imports {bad}")
                continue
            verdict = verify(Kernel(str(build.library)), problem, stream, cublas_gemm(problem, stream), rng,
                             screen=True)
            report[variant] = (verdict.status, verdict.reason)
            assert verdict.status in allowed, report
        template = compiler.compile(render(template_candidate("sm80_mma", {}, gpu_cc()), problem))
        assert template.status == "ok", template.log[-2000:]
        big = Problem(4096, 4096, 4096)
        calls, seconds = {}, {}
        for screen in (True, False):
            kernel = CountingKernel(str(template.library))
            start = time.perf_counter()
            verdict = verify(kernel, big, stream, cublas_gemm(big, stream), rng, screen=screen)
            seconds[screen] = time.perf_counter() - start
            assert verdict.status == "ok", verdict.reason
            calls[screen] = kernel.calls
    print(f"verify at 4096^3 (sm80_mma default): screening {calls[True]} calls in {seconds[True]:.3f} s, "
          f"full {calls[False]} calls in {seconds[False]:.3f} s")
    assert "unwritten" in report["cached"][1] and "max error" in report["fp16_accumulate"][1], report
    assert calls[True] * 3 <= calls[False], calls


def test_a_screening_pass_shares_its_checks_inputs_and_no_kernel_leaves_the_next_a_wrong_one(compiler):
    """verify's `screen` on one ScreenInputs for every kernel, as a worker's screening pass
    runs them (cudal2/measure/jobs.py: the sets rebuilt where not intact): every broken fixture gets a
    verdict it gets on inputs of its own (the cached one still caught by its second call on the
    same pointers), and the honest kernel is accepted right after each of them; a byte changed
    in a kept reference leaves the sets not intact; and a template kernel's screening makes its
    own three calls alone, faster than on inputs of its own."""
    import time

    import cupy

    from cudal2.measure.verify import ScreenInputs, forbidden_imports, verify

    problem, rng = Problem(512, 512, 512), random.Random(7)
    stream = cupy.cuda.Stream(non_blocking=True)
    builds = dict(zip(VERDICTS, compiler.compile_all([fixture_source(v) for v in VERDICTS])))
    report = {}
    with stream:
        baseline = cublas_gemm(problem, stream)
        inputs = ScreenInputs(problem, 0, baseline, rng)
        honest = Kernel(str(builds["honest"].library))
        for variant, allowed in VERDICTS.items():
            assert builds[variant].status == "ok", builds[variant].log[-2000:]
            if forbidden_imports(builds[variant].imports):  # judged before any check runs (pipeline)
                continue
            verdict = verify(Kernel(str(builds[variant].library)), problem, stream, baseline, rng, screen=True,
                             inputs=inputs)
            report[variant] = (verdict.status, verdict.reason)
            assert verdict.status in allowed, report
            if not inputs.intact():
                inputs = ScreenInputs(problem, 0, baseline, rng)
            after = verify(honest, problem, stream, baseline, rng, screen=True, inputs=inputs)
            assert after.status == "ok", (variant, after.reason)
        assert "unwritten" in report["cached"][1], report

        inputs.ops.load(1)
        byte = cupy.ndarray((1,), cupy.uint8, memptr=inputs.ops.reference().data + 4097)
        byte[...] = ~byte
        assert not inputs.intact()

        template = compiler.compile(render(template_candidate("sm80_mma", {}, gpu_cc()), problem))
        assert template.status == "ok", template.log[-2000:]
        big = Problem(4096, 4096, 4096)
        began = time.perf_counter()
        shared = ScreenInputs(big, 0, cublas_gemm(big, stream), rng)
        build_s = time.perf_counter() - began
        calls, seconds = {}, {"own": [], "shared": []}
        for _ in range(3):
            for name, given in (("own", None), ("shared", shared)):
                kernel = CountingKernel(str(template.library))
                began = time.perf_counter()
                verdict = verify(kernel, big, stream, cublas_gemm(big, stream), rng, screen=True, inputs=given)
                seconds[name].append(time.perf_counter() - began)
                assert verdict.status == "ok", verdict.reason
                calls[name] = kernel.calls
    print(f"screening checks at 4096^3 (sm80_mma default), three times each: {seconds} s, {calls} calls; the "
          f"shared inputs built in {build_s:.3f} s")
    assert calls == {"own": 3, "shared": 3}
    assert min(seconds["shared"]) < min(seconds["own"])


def test_operands_tell_a_write_outside_c_from_a_change_of_the_inputs_to_the_byte():
    """The checks of a call read every byte but C's and the workspace's: poisoning those two
    changes nothing watched; one byte just before or after C (whose size is no multiple of 4),
    or after a 3-byte workspace, is a write outside C; one byte of B is a change of the inputs;
    and compare() names the first unwritten output."""
    import cupy

    num, rng = Numerics("fp16"), random.Random(3)
    problem = Problem(33, 17, 5, "fp16", "nn")  # C: 1,122 bytes

    def operands():
        ops = Operands(problem, 3, num)
        ops.fill("normal", rng)
        ops.poison(rng)
        return ops

    def flip(pointer) -> None:
        byte = cupy.ndarray((1,), cupy.uint8, memptr=pointer)
        byte[...] = ~byte

    ops = operands()
    assert not ops.stray_writes() and ops.inputs_intact()
    for where in (lambda o: o.c.data - 1, lambda o: o.c.data + o.c.nbytes, lambda o: o.ws.data + 3):
        ops = operands()
        flip(where(ops))
        assert ops.stray_writes() and ops.inputs_intact()
    ops = operands()
    flip(ops.b.data + 7)
    assert not ops.stray_writes() and not ops.inputs_intact()

    ref = ops.reference()
    ops.c[...] = ref.astype(cupy.float16)
    assert compare(ops.c, ref, num)[2] == ""
    ops.c[5, 3] = cupy.nan
    err, _, why = compare(ops.c, ref, num)
    assert err == float("inf") and "1 of 561 outputs" in why and "[5, 3]" in why, why


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("layout", ["nn", "nt"])
def test_the_reference_is_the_fp32_product_of_the_inputs(dtype, layout):
    """The verifier's reference (cuBLAS on the 16-bit inputs, fp32 out) agrees with an fp32
    SGEMM on fp32 copies of the inputs to within fp32's own rounding of the sums, on every
    input distribution (the accumulation pattern exactly) and odd shapes."""
    import cupy

    num, rng = Numerics(dtype), random.Random(11)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for m, n, k in ((1, 1, 1), (17, 65, 63), (1000, 1000, 1000), (64, 4096, 8192)):
            ops = Operands(Problem(m, n, k, dtype, layout), 0, num)
            for distribution in ("normal", "uniform", "positive", "accumulation"):
                ops.fill(distribution, rng)
                a, b = num.f32(ops.a), num.f32(ops.b)
                exact = a @ (b if layout == "nn" else b.T)
                ours = ops.reference()
                scale = float(cupy.abs(exact).max()) or 1.0
                error = float(cupy.abs(ours - exact).max()) / scale
                # Two fp32 sums of k products in different orders: each off by about sqrt(k)
                # roundings (2^-24) of the scale (measured: 1.8e-5 at K 8192, positive inputs);
                # a 16-bit output's rounding alone would be 2^-12 (bf16 2^-9) or more.
                assert error <= 8 * math.sqrt(k) * 2.0**-24, (m, n, k, distribution, error)
                if distribution == "accumulation":
                    assert bool(cupy.array_equal(ours, exact)), (m, n, k)


def test_kernels_timed_together_read_as_each_does_alone(context):
    """A batch's verified kernels share one session with the baselines (one set-up, one soak,
    the same rounds): against its own session's cuBLAS, each kernel reads within 5% of what
    it reads in a session of its own (the mean of one before and one after), by both methods;
    and the baselines' session decided cuBLASLt between its finalists."""
    from cudal2.tune.pipeline import build_all, measure_rows

    ctx = context(Problem(2048, 2048, 2048))
    configs = CONFIGS + (SPLIT_CONFIGS[:1] if gpu_cc() >= 90 else ())
    built = build_all(ctx, [template_candidate("sm80_mma", params, gpu_cc()) for params in configs])
    try:
        algo = json.loads(next(r for r in measure_baselines(ctx) if r["kernel"] == "cuBLASLt")["cublaslt_algo"])
        before = [measure_rows(ctx, [item])[0] for item in built]
        together = measure_rows(ctx, built)
        after = [measure_rows(ctx, [item])[0] for item in built]
    finally:
        ctx.worker.close()
    rows = before + together + after
    assert all(row["status"] == "ok" for row in rows), [(r["kernel"], r.get("error")) for r in rows]
    assert "autotuned" in algo and all(row["cublaslt_algo"] == json.dumps(algo, sort_keys=True) for row in rows)
    ratio = lambda row, method: row[f"{method}_us"] / row[f"cublas_{method}_us"]
    apart = [(row["kernel"], method, ratio(row, method), ratio(one, method), ratio(two, method))
             for row, one, two in zip(together, before, after) for method in ("kernel", "graph")
             if abs(ratio(row, method) / ((ratio(one, method) + ratio(two, method)) / 2) - 1) > 0.05]
    assert not apart, apart


def test_crash_and_hang_cost_one_kernel_not_the_run(context):
    ctx = context(Problem(256, 256, 256), timeout=30.0)
    honest = Candidate.from_source((ROOT / "examples" / "simt_gemm_fp16_nn.cu").read_text(), "honest")
    cands = [Candidate.from_source(fixture_source("crash"), "crash"),
             Candidate.from_source(fixture_source("hang"), "hang"), honest]
    try:
        rows = {row["kernel"]: row for row in evaluate(ctx, cands)}
    finally:
        ctx.worker.close()
    assert rows["crash"]["status"] == "crash", rows["crash"]
    assert rows["hang"]["status"] == "timeout", rows["hang"]
    assert rows["honest"]["status"] == "ok", rows["honest"]


def test_baselines_are_correct_and_timed_on_the_device(context):
    ctx = context(Problem(64, 64, 64))
    try:
        rows = {row["kernel"]: row for row in measure_baselines(ctx)}
    finally:
        ctx.worker.close()
    assert set(rows) == set(BASELINES) and all(r["status"] == "ok" for r in rows.values()), rows
    algo = json.loads(rows["cuBLASLt"]["cublaslt_algo"])
    assert algo["of"] >= 1 and 0 <= algo["index"] < algo["of"], algo
    # Device time of the call alone (~2 us at 64^3), not the host's wrapper time.
    for name, row in rows.items():
        assert row["kernel_us"] < 10.0 and row["graph_us"] < 10.0, row
    assert rows["torch.matmul"]["kernel_us"] < 2 * rows["cuBLAS"]["kernel_us"], rows


def test_a_worker_keeps_only_the_memory_of_the_problem_it_times(tmp_path, compiler):
    """One worker through a shape set: after 8192^3 (three input sets of 3 x 128 MiB), a
    64^3 problem's session leaves its pools holding megabytes, not the earlier problem's
    gigabytes (they kept every size seen, 80 GiB after 24 shapes, until allocation failed)."""
    worker = Worker()
    try:
        for problem in (Problem(8192, 8192, 8192), Problem(64, 64, 64)):
            measure_baselines(Context(problem, Settings(results=tmp_path, budget=0.05), worker, compiler,
                                      Leaderboard(tmp_path), "test"))
            held = worker.pool_bytes()
            if problem.m == 8192:
                assert max(held.values()) > 1 << 30, held  # the big problem's sets were there
        assert set(held) == {"graph", "cupti"} and max(held.values()) < 256 << 20, held
    finally:
        worker.close()


DEV_SET = Path(os.environ.get("DEVSET", Path(__file__).resolve().parent / "shapes" / "dev.csv"))


@pytest.fixture(scope="module")
def dev_baselines(tmp_path_factory, compiler) -> dict[str, dict[str, dict]]:
    """The baselines' rows over tests/shapes/dev.csv, measured once: problem -> kernel -> row."""
    import pandas as pd

    if not DEV_SET.is_file():
        pytest.skip(f"the dev shape set ({DEV_SET}; DEVSET=path) is not there")
    results = tmp_path_factory.mktemp("dev-baselines")
    worker = Worker()
    worker.start()
    ctx = Context(Problem(64, 64, 64), Settings(results=results, budget=0.2, timeout=120.0), worker, compiler,
                  Leaderboard(results), "test")
    measured = {}
    try:
        for r in pd.read_csv(DEV_SET).itertuples():
            ctx.problem, ctx.libraries = Problem(r.m, r.n, r.k, r.dtype, r.layout), None
            measured[str(ctx.problem)] = {row["kernel"]: row for row in measure_baselines(ctx)}
    finally:
        worker.close()
    return measured


def test_cublaslt_autotuned_is_never_slower_than_cublas_over_the_dev_set(dev_baselines):
    """cuBLASLt autotuned is never slower than cuBLAS's default beyond noise (3%, and 0.15 us
    for calls under 5 us) unless its own autotuning, timing both side by side, found cuBLAS's
    default faster than every algorithm the heuristic offers (the list lacks that kernel: the
    best baseline is then cuBLAS)."""
    slower = []
    for problem, rows in dev_baselines.items():
        lt, default = rows["cuBLASLt"], rows["cuBLAS"]
        algo = json.loads(lt["cublaslt_algo"])
        lacking = algo["us"] > algo["cublas_default_us"]
        if lt["kernel_us"] > max(1.03 * default["kernel_us"], default["kernel_us"] + 0.15) and not lacking:
            slower.append((problem, lt["kernel_us"], default["kernel_us"], algo))
    assert not slower, slower


def test_the_two_methods_rank_the_baselines_alike_over_the_dev_set(dev_baselines):
    """The two methods time the same work: for calls of 20 us to 1 ms, each baseline's ratio
    to cuBLAS agrees within 5% between them, and no time is 1.5x the other method's (a method
    that missed or double-counted a kernel of a call breaks both). Over the H200 runs of this
    protocol the ratios of calls of 20 us to 1 ms agreed within 3.6% on 98% of 280, one beyond
    5%; beyond it otherwise only on power-capped calls of 5-13 ms (docs/method.md)."""
    disagree = []
    for problem, rows in dev_baselines.items():
        default = rows["cuBLAS"]
        for row in rows.values():
            if row["kernel_us"] < 20.0:
                continue
            times = (problem, row["kernel"], row["kernel_us"], row["graph_us"])
            if max(row["graph_us"] / row["kernel_us"], row["kernel_us"] / row["graph_us"]) > 1.5:
                disagree.append(times)
            if row is not default and default["kernel_us"] <= 1000.0:
                by_cupti, by_graph = row["kernel_us"] / default["kernel_us"], row["graph_us"] / default["graph_us"]
                if abs(by_graph / by_cupti - 1) > 0.05:
                    disagree.append((*times, "to cuBLAS", round(by_cupti, 3), round(by_graph, 3)))
    assert not disagree, disagree


@pytest.mark.xfail(reason="known to fail on the H200: 54 of 464 baseline rows differ by more than 5% between "
                          "the methods (docs/method.md)", strict=False)
def test_the_two_methods_agree_within_5_percent_for_calls_of_20_us_or_more(dev_baselines):
    """The measurement issue's rule: CUPTI and in-graph times of each baseline agree within 5%
    for calls of 20 us or more. Not yet met on the H200 (docs/method.md: 54 of 464 baseline
    rows of the current protocol beyond it; the graph reads 5-13% slower on 20-100 us calls
    that write a large C over a short K, 4096x16384x64 among them, and 5-16% faster on
    power-capped calls of milliseconds, 16384x4096x16384 among them)."""
    disagree = [(problem, row["kernel"], row["kernel_us"], row["graph_us"])
                for problem, rows in dev_baselines.items() for row in rows.values()
                if row["kernel_us"] >= 20.0 and abs(row["graph_us"] / row["kernel_us"] - 1) > 0.05]
    assert not disagree, disagree


MEMO_SHAPES = [Problem(1, 8192, 8192), Problem(64, 4096, 4096), Problem(2048, 2048, 2048)]


@pytest.mark.parametrize("problem", MEMO_SHAPES, ids=str)
def test_memoised_results_are_rejected_and_an_honest_slow_kernel_accepted(context, problem):
    """A kernel that keeps C under a sample of A and B (in its workspace, or in the library's
    static memory) and copies it back when the sample matches passed every check of the
    fenced protocol and read up to 5x; an honest kernel as slow as it is still measured."""
    ctx = context(problem, timeout=300.0)
    honest = Candidate.from_source((ROOT / "examples" / "simt_gemm_fp16_nn.cu").read_text(), "honest")
    cands = [honest] + [Candidate.from_source(fixture_source(v), v) for v in ("memo_workspace", "memo_static")]
    try:
        rows = {row["kernel"]: row for row in evaluate(ctx, cands)}
    finally:
        ctx.worker.close()
    report = {name: (row["status"], row.get("error")) for name, row in rows.items()}
    assert rows["honest"]["status"] == "ok" and rows["honest"]["speedup_offline"] > 0, report
    for memo in ("memo_workspace", "memo_static"):
        assert rows[memo]["status"] in ("cheat", "wrong"), report
        assert "cached from an earlier call" in rows[memo]["error"], report


def test_bench_cli_end_to_end(tmp_path, cache_dir):
    runner = CliRunner(env={"CUDAL2_CACHE_DIR": str(cache_dir)})
    # K = 500 leaves rows that TMA cannot load (not 16-byte aligned): sm90_cutlass loads A
    # from a copy with padded rows.
    args = ["bench", "--m", "1000", "--n", "3000", "--k", "500", "--budget", "0.3",
            "--results", str(tmp_path), "--mode", "both", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = {r["kernel"]: r for r in json.loads(result.output)["rows"]}
    default = next(name for name in rows if name.startswith("sm80_mma("))
    assert set(BASELINES) <= set(rows)
    assert any(name.startswith("sm90_cutlass(") for name in rows)
    for name, row in rows.items():
        assert row["status"] == "ok", row
        assert row["kernel_us"] > 0 and row["graph_us"] > 0 and row["server_us"] > 0 and row["gpu"]
    assert rows[default]["speedup_offline"] == pytest.approx(rows[default]["baseline_offline_us"] / rows[default]["offline_us"])
    assert rows[default]["speedup_offline"] == pytest.approx(min(rows[default]["speedup_kernel"], rows[default]["speedup_graph"]))
    # Without arguments, the next bench measures what the leaderboard holds for the problem.
    again = runner.invoke(app, args[:-3] + ["--json"])
    assert default in {r["kernel"] for r in json.loads(again.output)["rows"]}
    # The leaderboard shows the fastest verified kernel (a template's, not a baseline), each
    # kernel by its latest measurement: the second run's, not the better of the two.
    listed = runner.invoke(app, ["leaderboard", "--results", str(tmp_path), "--format", "json"])
    shown = json.loads(listed.output)[0]
    measured = Leaderboard(tmp_path).read()
    kernels = measured[(measured["status"] == "ok") & ~measured["kernel"].isin(BASELINES)]
    latest = kernels.sort_values("time").drop_duplicates("source_hash", keep="last")
    assert shown["kernel"].startswith(("sm80_mma(", "sm90_cutlass("))
    assert shown["speedup_offline"] == pytest.approx(latest["speedup_offline"].max())


def test_optimize_search_ends_with_a_verified_exported_kernel(tmp_path, cache_dir):
    runner = CliRunner(env={"CUDAL2_CACHE_DIR": str(cache_dir)})
    result = runner.invoke(app, ["optimize", "--m", "4096", "--n", "4096", "--k", "4096", "--iterations", "1",
                                 "--batch", "2", "--budget", "0.3", "--results", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["best"]["status"] == "ok" and summary["best"]["speedup_offline"] > 0, summary
    exported = Path(summary["exported"])
    assert exported.is_file() and "cudal2_gemm" in exported.read_text()
    print(f"optimize 4096^3 (2 candidates): best {summary['best']['kernel']} "
          f"{summary['best']['speedup_offline']:.3f}x; wall {summary['wall_s']} s, GPU {summary['gpu_s']} s")


def test_optimize_llm_free_form_kernels_are_verified_on_the_gpu(tmp_path, cache_dir, endpoint, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-not-written")
    honest = (ROOT / "examples" / "simt_gemm_fp16_nn.cu").read_text()
    endpoint.reply(fenced("cuda", honest) + "\n" + fenced("cuda", fixture_source("past_end")))
    runner = CliRunner(env={"CUDAL2_CACHE_DIR": str(cache_dir)})
    result = runner.invoke(app, ["optimize", "--m", "512", "--n", "512", "--k", "512", "--proposer", "llm",
                                 "--base-url", endpoint.url, "--iterations", "1", "--batch", "2", "--budget", "0.2",
                                 "--results", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    rows = Leaderboard(tmp_path).read()
    kernels = rows[(rows["proposer"] == "llm") & ~rows["kernel"].isin(BASELINES)].set_index("kernel")
    assert sorted(kernels["status"]) == ["cheat", "ok"], kernels[["status", "error"]]
    assert "guard band" in kernels[kernels["status"] == "cheat"]["error"].iloc[0]


def test_optimize_replays_one_llm_round_of_a_template_and_a_free_form_kernel(tmp_path, cache_dir):
    """`cudal2 optimize --proposer llm --replay DIR`: one saved reply, holding a template
    parameter set and a free-form kernel, stands in for the endpoint for one round. Both
    candidates are compiled, verified and timed on this GPU, the template's row carries what
    its kernel declared beyond ptxas's report, and the run's summary credits the llm proposer
    with both (a replay spends no tokens)."""
    template = "sm90_cutlass" if gpu_cc() == 90 else "sm80_mma"
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "llm-round-1-reply.md").write_text(
        "The template's default, and a plain kernel to compare.\n"
        + fenced("json", json.dumps({"template": template, "params": {}})) + "\n" + fenced("cuda", fixture_source("honest")))
    results = tmp_path / "results"
    runner = CliRunner(env={"CUDAL2_CACHE_DIR": str(cache_dir)})
    result = runner.invoke(app, ["optimize", "--m", "512", "--n", "512", "--k", "512", "--proposer", "llm",
                                 "--replay", str(saved), "--iterations", "1", "--batch", "2", "--budget", "0.2",
                                 "--results", str(results), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    rows = Leaderboard(results).read()
    kernels = rows[~rows["kernel"].isin(BASELINES)].set_index("kernel")
    ours = str(template_candidate(template, {}, gpu_cc()))
    assert sorted(kernels.index) == sorted([ours, "llm-r1-2"]) and set(kernels["proposer"]) == {"llm"}, kernels
    for name, row in kernels.iterrows():
        assert row["status"] == "ok", (name, row["error"])
        assert row["compile_s"] > 0 and row["registers"] > 0, name  # built by nvcc, ptxas's report kept
        assert row["kernel_us"] > 0 and row["graph_us"] > 0 and row["speedup_offline"] > 0, name
    declared = kernels.loc[ours, ["dynamic_smem_bytes", "producer_registers", "consumer_registers"]]
    assert declared["dynamic_smem_bytes"] > 0
    if template == "sm90_cutlass":  # the cooperative default: setmaxnreg moves its warpgroups' registers
        assert (declared["producer_registers"], declared["consumer_registers"]) == (40, 232)
    assert kernels.loc["llm-r1-2", ["dynamic_smem_bytes", "producer_registers", "consumer_registers"]].isna().all()
    assert summary["contributions"] == {"llm": {"candidates": 2, "ok": 2,
                                                "best_speedup": pytest.approx(kernels["speedup_offline"].max())}}
    assert summary["llm_tokens_run"] == 0
    assert (results / "runs" / summary["run_id"] / "gpu0" / "llm-round-1-prompt.md").is_file()


def test_check_of_a_library_exits_3_on_a_deliberately_slow_kernel(tmp_path, cache_dir):
    """A plain SIMT kernel (far slower than cuBLAS) benched, exported whatever its speed,
    then `check --library` on this GPU: the binary the library ships is verified and timed
    again, and the check fails the bar with exit 3 (and passes a bar of 0)."""
    kernel = tmp_path / "simt.cu"
    kernel.write_text(fixture_source("honest"))
    results, library = tmp_path / "results", tmp_path / "lib"
    runner = CliRunner(env={"CUDAL2_CACHE_DIR": str(cache_dir)})
    bench = runner.invoke(app, ["bench", "--m", "512", "--n", "512", "--k", "512", "--kernel", str(kernel),
                                "--budget", "0.1", "--results", str(results), "--json"])
    assert bench.exit_code == 0, bench.output
    exported = runner.invoke(app, ["export", "--library", str(library), "--results", str(results),
                                   "--min-speedup", "0"])
    assert exported.exit_code == 0, exported.output
    [entry] = DispatchTable.load(library).entries
    assert entry.speedup < 1.0
    slow = runner.invoke(app, ["check", "--library", str(library), "--fail-under", "1.0", "--results", str(results),
                               "--json"])
    assert slow.exit_code == 3, slow.output
    [row] = json.loads(slow.output)["rows"]
    assert row["status"] == "ok" and 0 < row["measured"] < 1.0 and not row["passed"]
    assert runner.invoke(app, ["check", "--library", str(library), "--fail-under", "0",
                               "--results", str(results)]).exit_code == 0


def test_a_screening_session_of_long_calls_times_the_library_as_the_protocol_does(context):
    """Back to back, calls of 100 us and more run at the GPU's power cap, a lower clock than
    the protocol's sessions time them at (on the H200, cuBLAS at 16384x2048x4096 screened at
    412 us among 64 kernels where its baselines' session timed 361). A screening session
    rests the GPU after each replay (worker.SCREEN_REST), so its own library call reads as
    the protocol's does (357 against 361 there), and its kernels rank as they confirm."""
    from cudal2.tune.pipeline import build_all, measure_rows
    from cudal2.kernels.render import template_grid
    from cudal2.measure.worker import SOAK_US

    problem = Problem(16384, 2048, 4096)
    ctx = context(problem)
    # 24 distinct binaries: enough replays back to back (about 0.3 s) to reach the cap unrested
    kernels = template_grid("sm80_mma", {"group_m": ["1", "4", "8", "16"], "stages": ["3", "4", "5"],
                                         "block_n": ["64", "128"]}, gpu_cc())
    assert len(kernels) >= 16
    try:
        baselines = {row["kernel"]: row for row in measure_baselines(ctx)}
        built = [b for b in build_all(ctx, kernels) if b.build.status == "ok"]
        screened = measure_rows(ctx, built, screen=True)
    finally:
        ctx.worker.close()
    protocol_us = baselines["cuBLAS"]["graph_us"]
    assert protocol_us >= SOAK_US
    rows = [row for row in screened if row["status"] == "screened"]
    assert len(rows) >= 16, [(row["kernel"], row["status"], row.get("error")) for row in screened]
    screen_us = sorted(row["cublas_graph_us"] for row in rows)[len(rows) // 2]
    print(f"cuBLAS {problem}: screened {screen_us:.1f} us, the baselines' session {protocol_us:.1f} us")
    assert screen_us == pytest.approx(protocol_us, rel=0.06)


def test_screening_checks_every_kernel_and_ranks_as_the_protocol_does(context):
    """The optimize loop's screening pass on the GPU (Worker._screen): the screening checks
    first (verify's `screen`: the wrong and the stray-writing kernels are caught as in the
    protocol, each costing a fresh process), then the graph method alone for a few rounds; its
    rows are SCREENED, with no claimed speedup. The protocol then measures the template
    kernels in full: the screened graph times agree with its graph times; and a cheat the
    screening checks may let through (a result memoised in static memory, which three
    rotating input sets never let pay) is convicted by the full verification of a
    confirmation. Prints where the seconds go: verification, a screening session, a full one."""
    import time

    from cudal2.tune.pipeline import build_all, measure_rows
    from cudal2.protocol import PROTOCOL, SCREEN_PROTOCOL, SCREENED

    problem = Problem(2048, 2048, 2048)
    ctx = context(problem)
    ctx.settings = Settings(results=ctx.settings.results, budget=1.0, timeout=120.0)  # the default budget
    kernels = [template_candidate("sm80_mma", params, gpu_cc()) for params in
               ({}, {"stages": "3"}, {"block_n": "64"}, {"block_m": "64"})]
    broken = [Candidate.from_source(fixture_source(v), v) for v in ("half", "past_end", "memo_static")]
    honest = Candidate.from_source(fixture_source("honest"), "honest")
    try:
        measure_baselines(ctx)  # the cuBLASLt choice the sessions reuse, the shims built
        built = build_all(ctx, kernels + [honest] + broken)
        good = built[:len(kernels) + 1]
        began = time.monotonic()
        verdicts = [ctx.worker._graph.request({**ctx.job("kernels"), "op": "kernel", "library": str(b.build.library)},
                                              120.0)["status"] for b in good]
        verify_s = (time.monotonic() - began) / len(good)
        began = time.monotonic()
        screened = {row["kernel"]: row for row in measure_rows(ctx, good, screen=True)}
        screen_s = time.monotonic() - began
        began = time.monotonic()
        full = {row["kernel"]: row for row in measure_rows(ctx, built[:len(kernels)])}
        full_s = time.monotonic() - began
        began = time.monotonic()
        screened |= {row["kernel"]: row for row in measure_rows(ctx, built[len(good):], screen=True)}
        broken_s = time.monotonic() - began
        confirmed_memo = measure_rows(ctx, built[-1:])[0]
    finally:
        ctx.worker.close()
    report = {name: (row["status"], (row.get("error") or "")[:200]) for name, row in screened.items()}
    print(f"screening 2048^3: {len(good)} kernels in {screen_s:.2f} s ({verify_s:.3f} s to verify one alone); "
          f"the protocol's session of {len(kernels)}: {full_s:.2f} s; {len(broken)} broken ones: {broken_s:.2f} s")
    print(report)
    assert verdicts == ["ok"] * len(good)
    assert screened["half"]["status"] == "wrong" and screened["past_end"]["status"] == "cheat", report
    assert screened["memo_static"]["status"] in (SCREENED, "cheat", "wrong"), report
    assert confirmed_memo["status"] == "cheat" and "cached" in confirmed_memo["error"], confirmed_memo.get("error")
    passed = [str(c) for c in kernels] + ["honest"]
    assert all(screened[k]["status"] == SCREENED and screened[k]["protocol"] == SCREEN_PROTOCOL for k in passed), report
    assert all(screened[k].get("speedup_offline") is None and screened[k]["graph_us"] > 0 for k in passed)
    for name in map(str, kernels):
        assert full[name]["status"] == "ok" and full[name]["protocol"] == PROTOCOL, full[name].get("error")
        print(f"{name}: screened graph {screened[name]['graph_us']:.1f} us, protocol graph {full[name]['graph_us']:.1f} "
              f"us, kernel {full[name]['kernel_us']:.1f} us")
        assert screened[name]["graph_us"] == pytest.approx(full[name]["graph_us"], rel=0.15)
    assert screen_s < full_s
