"""What the library runs at a problem: the CUDA kernels of torch.matmul (cuBLAS / cuBLASLt's
heuristic pick, as a PyTorch user gets it), read by torch.profiler (CUPTI), with their grids,
blocks, shared memory, registers and median device time over 30 calls on 3 rotating input sets.
cuBLAS's Hopper kernels (nvjet) name their design, which is printed decoded: the CTA tile and
its K step, the stages, the cluster, the split of the tile between the two consumer warpgroups,
and a split-K (whose second kernel, cublasLt::splitKreduce_kernel, follows on its own line).

  python benchmarks/library_kernels.py 3072x1024x256 384x768x14336 64x64x16384 [--dtype bf16 --layout nt]

The autotuned cuBLASLt baseline of `cudal2 bench` may pick another algorithm (its choice is in
each row's `cublaslt_algo`: the heuristic's index, tile and stages enums); `--cublaslt` also
runs each algorithm the heuristic offers there, through the bench's own cuBLASLt shim, and
lists the kernels each launched with its index and time, so that the one the autotuning picks
is named. Needs a GPU and torch; `nvjet_design` runs anywhere.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import tempfile
from pathlib import Path

# e.g. nvjet_sm90_hsh_128x192_64x5_2x1_v_bz_coopB_splitK_NNN: tile 128 x 192, K step 64, 5 stages,
# a 2 x 1 cluster, then a raster letter, options and the operands' majorness.
NVJET = re.compile(r"nvjet_(?:sm\d+_)?[a-z]+_(\d+)x(\d+)_(\d+)x(\d+)_(\d+)x(\d+)_([a-z])_(.*)_([NT]{3})$")


def nvjet_design(name: str) -> dict | None:
    """The design an nvjet kernel's name states (tile, K step, stages, cluster, whether the two
    consumer warpgroups share a tile along A's rows or B's columns, split-K), or None for any
    other kernel."""
    match = NVJET.search(name)
    if match is None:
        return None
    tile_m, tile_n, tile_k, stages, cluster_m, cluster_n, _raster, options, _majors = match.groups()
    options = options.split("_")
    cooperative = next((o[len("coop"):] for o in options if o.startswith("coop")), None)
    return {"tile": f"{tile_m}x{tile_n}", "tile_k": int(tile_k), "stages": int(stages),
            "cluster": f"{cluster_m}x{cluster_n}", "cooperative": cooperative, "split_k": "splitK" in options}


def profile_matmul(m: int, n: int, k: int, dtype: str = "fp16", layout: str = "nn", calls: int = 30) -> list[dict]:
    """torch.matmul's kernels at one problem: one row per distinct kernel launch (name, grid,
    block, shared memory, registers), with how many of `calls` ran it and its median us."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    sets = []
    for _ in range(3):
        a = torch.randn(m, k, device="cuda", dtype=torch_dtype)
        b = torch.randn(k, n, device="cuda", dtype=torch_dtype) if layout == "nn" else \
            torch.randn(n, k, device="cuda", dtype=torch_dtype).t()
        sets.append((a, b))
    for a, b in sets:  # warm: handles, workspaces, the heuristic's pick
        torch.matmul(a, b)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            a, b = sets[i % len(sets)]
            torch.matmul(a, b)
        torch.cuda.synchronize()
    return launch_rows(prof, {"shape": f"{m}x{n}x{k}", "dtype": dtype, "layout": layout})


def launch_rows(prof, fields: dict) -> list[dict]:
    """One row per distinct kernel launch a profiler saw (name, grid, block, shared memory,
    registers), `fields` first, with how many calls ran it and its median us."""
    # The launch shapes (grid, block, shared memory, registers) are in Kineto's trace only, not in
    # the profiler's FunctionEvents (which scripts/remeasure.py reads for times alone).
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "kernel"]
    launches: dict[tuple, list[float]] = {}
    for event in events:
        args = event.get("args", {})
        key = (event["name"], str(args.get("grid")), str(args.get("block")), args.get("shared memory"),
               args.get("registers per thread"))
        launches.setdefault(key, []).append(float(event["dur"]))
    return [{**fields, "name": name, "grid": grid, "block": block, "smem": smem, "registers": registers,
             "calls": len(durations), "median_us": statistics.median(durations), "design": nvjet_design(name)}
            for (name, grid, block, smem, registers), durations in launches.items()]


def profile_cublaslt(m: int, n: int, k: int, dtype: str = "fp16", layout: str = "nn", calls: int = 30) -> list[dict]:
    """Every algorithm cuBLASLt's heuristic offers at one problem, each called `calls` times on the
    bench's rotating input sets (measure.InputSets), through its shim (cudal2/measure/baselines.cu, built here): one row per
    kernel launch, with the algorithm's index in the heuristic's list and its configuration
    (`CublasLt.describe`: the tile and stages enums of a row's `cublaslt_algo`)."""
    import cupy
    import torch
    from torch.profiler import ProfilerActivity, profile

    from cudal2.config import load_settings
    from cudal2.kernels.compile import Compiler
    from cudal2.measure.baselines import CublasLt, abi_call, build_baselines
    from cudal2.measure.environment import default_arch
    from cudal2.measure.measure import InputSets
    from cudal2.measure.verify import Numerics
    from cudal2.problem import Problem

    problem = Problem(m, n, k, dtype, layout)
    major, minor = torch.cuda.get_device_capability()
    lt = CublasLt(build_baselines(Compiler(default_arch(major * 10 + minor), load_settings().cache_dir), problem)["cuBLASLt"])
    offered = lt.algorithms(problem)
    stream = cupy.cuda.Stream(non_blocking=True)
    run = abi_call(lt.kernel, cupy.empty(max(1, lt.kernel.workspace_bytes(m, n, k)), cupy.uint8), problem, stream, "cuBLASLt")

    sets = InputSets(problem, Numerics(dtype), ["cuBLASLt"], random.Random(0))  # the bench's rotating inputs
    operands = [(sets.a[s], sets.b[s], sets.c["cuBLASLt"][s]) for s in range(len(sets.a))]
    cupy.cuda.Device().synchronize()  # the operands, made on the default stream, before the shim's stream reads them
    rows = []
    for index in range(offered):
        lt.select(index)
        with stream:
            for a, b, c in operands:  # warm: the algorithm's module and plan
                run(a, b, c)
            stream.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for i in range(calls):
                    run(*operands[i % len(operands)])
                stream.synchronize()
        rows += launch_rows(prof, {"shape": f"{m}x{n}x{k}", "dtype": dtype, "layout": layout, "algorithm": index,
                                   "offered": offered, **lt.describe(index)})
    return rows


def decoded(design: dict | None) -> str:
    """An nvjet design in words ("" for any other kernel)."""
    if not design:
        return ""
    return (f"tile {design['tile']}x{design['tile_k']}, {design['stages']} stages, cluster {design['cluster']}"
            + (f", coop{design['cooperative']}" if design["cooperative"] else "")
            + (", split-K" if design["split_k"] else ""))


def launch_text(row: dict) -> str:
    """One launch row's time, launch shape, kernel name and decoded nvjet design, for printing."""
    return (f"{row['median_us']:8.2f} us  grid {row['grid']:>12}  block {row['block']:>12}  "
            f"smem {row['smem']}  {row['name'][:64]}  {decoded(row['design'])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shapes", nargs="+", help="MxNxK")
    parser.add_argument("--dtype", default="fp16", choices=("fp16", "bf16"))
    parser.add_argument("--layout", default="nn", choices=("nn", "nt"))
    parser.add_argument("--cublaslt", action="store_true",
                        help="also every algorithm cuBLASLt's heuristic offers (the autotuned baseline's choices)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    rows = []
    for shape in args.shapes:
        m, n, k = map(int, shape.split("x"))
        for row in profile_matmul(m, n, k, args.dtype, args.layout):
            rows.append(row)
            print(f"{row['shape']:>16} {launch_text(row)}", flush=True)
        if args.cublaslt:
            for row in profile_cublaslt(m, n, k, args.dtype, args.layout):
                rows.append(row)
                print(f"{row['shape']:>16} cuBLASLt algorithm {row['algorithm']} of {row['offered']} (algo {row['algo']}, "
                      f"tile enum {row['tile']}, stages enum {row['stages']}, split-K {row['splitk']}): "
                      f"{launch_text(row)}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
