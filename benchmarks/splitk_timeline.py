"""Where an sm90_splitk call spends its time: one configuration rendered with %globaltimer probes
(the rendered source is changed, never the template), called on a problem, and each phase of
every CTA printed as percentiles, in microseconds from the first CTA's start:

  start        the CTA begins
  first_stage  its consumers find the first K tile landed in shared memory
  mainloop     its last GMMA is done
  parked       its partial tile sits in shared memory and its cluster has synchronised (with
               fixup=atomic and no cluster: its accumulators' atomics are issued)
  arrive0/1    (several clusters a tile) its cluster's sum is in the workspace: before and
               after the arrival's atomic (fixup=spread: after the wait for the tile's others)
  end          its tile's C is stored (one CTA per cluster rank: the last cluster's; with
               fixup=spread, every CTA's share)

With epilogue=direct nothing is parked: a CTA goes from mainloop to end. schedule=persistent
(a CTA walks several tiles) is refused.

  PYTHONPATH=. python benchmarks/splitk_timeline.py 64x64x16384 \
      '{"block_m": 64, "block_n": 64, "stages": 4, "split_k": 8, "k_clusters": 16, "producer": "warp"}'

`--source FILE` probes an edited copy of a rendered source in place of a configuration (a
variant measured beside the template's own by `cudal2 bench --kernel`); where an edit removed
a phase's anchor, it says which.

Needs a GPU of compute capability 9.0, nvcc and CuPy; `--compile-only` builds without a GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import json
from pathlib import Path

EVENTS = ("start", "first_stage", "mainloop", "parked", "arrive0", "arrive1", "end")
SLOTS = 8  # per CTA: the events above, then its SM
MAX_CTAS = 65536
PROBES = f"""
__device__ unsigned long long cudal2_timeline[{MAX_CTAS} * {SLOTS}];
__device__ __forceinline__ unsigned long long timeline_now() {{
  unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t;
}}
__device__ __forceinline__ unsigned timeline_sm() {{ unsigned s; asm volatile("mov.u32 %0, %%smid;" : "=r"(s)); return s; }}
"""
READER = f"""
extern "C" int cudal2_timeline_read(void* out, size_t bytes) {{
  return (int)cudaMemcpyFromSymbol(out, cudal2_splitk::cudal2_timeline, bytes);
}}
extern "C" int cudal2_timeline_clear() {{
  static unsigned long long zeros[{MAX_CTAS} * {SLOTS}];
  return (int)cudaMemcpyToSymbol(cudal2_splitk::cudal2_timeline, zeros, sizeof(zeros));
}}
"""


def with_probes(source: str) -> str:
    """The rendered sm90_splitk source with a probe at each of EVENTS (thread 0 of each CTA
    writes the time); raises where the source no longer reads as the probes expect."""
    def after(anchor: str, probe: str, last: bool = False) -> None:
        nonlocal source
        at = source.rfind(anchor) if last else source.find(anchor)
        if at < 0:
            raise ValueError(f"the sm90_splitk source has no {anchor.strip()!r} to probe")
        at += len(anchor)
        source = source[:at] + probe + source[at:]

    if "schedule=persistent" in source:
        raise ValueError("the timeline probes CTAs of one tile each; schedule=persistent walks several")
    after("using namespace cute;\n", PROBES)
    after("  const int tid = threadIdx.x;\n",
          "  unsigned long long* timeline = cudal2_timeline + ((size_t)(blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x"
          f" + blockIdx.x) * {SLOTS};\n"
          "  if (tid == 0) { timeline[0] = timeline_now(); timeline[7] = timeline_sm(); }\n")
    # the consumers' wait for a stage is the file's last
    after("Barrier::wait(&full[stage], (kt / STAGES) & 1);\n",
          "      if (kt == 0 && tid == 0) timeline[1] = timeline_now();\n", last=True)
    # the mainloop's end: inside the warpgroups' branch with a producer warp, else after the loop
    warp = "    warpgroup_wait<0>();\n    warpgroup_fence_operand(acc);\n  }\n"
    after(warp if warp in source else "  warpgroup_wait<0>();\n  warpgroup_fence_operand(acc);\n",
          "  if (tid == 0) timeline[2] = timeline_now();\n")
    if "epilogue=direct" not in source:  # (the direct store parks nothing: no phase between mainloop and end)
        after("  cluster.sync();\n" if "cg::this_cluster()" in source else "  __syncthreads();\n  constexpr int rank = 0;\n",
              "  if (tid == 0) timeline[3] = timeline_now();\n")
    if "unsigned int before, now;" in source:  # several clusters a tile that wait for each other (spread)
        after("      unsigned int before, now;\n", "      timeline[4] = timeline_now();\n")
        after("      } while (((now ^ before) & 0x80000000u) == 0);\n", "      timeline[5] = timeline_now();\n")
        after("        store_item(first + i, sum);\n      }\n    }\n", "    if (tid == 0) timeline[6] = timeline_now();\n")
    elif "tile_arrivals + pid" in source:  # several clusters a tile, the last to arrive stores it
        after("    if (tid == 0) {\n      unsigned int before;\n", "      timeline[4] = timeline_now();\n")
        after("      if (last) *arrivals = 0;  // every cluster has arrived: ready for the next call\n",
              "      timeline[5] = timeline_now();\n")
        # the last cluster's store: of the parked tiles' sum, or of the atomic fixup's one tile
        atomic = "red_add" in source
        after("            __stcg(reinterpret_cast<float4*>(tile_sum + r * BN + c), make_float4(0.f, 0.f, 0.f, 0.f));\n"
              "          }\n        }\n      }\n" if atomic else
              "            store(rank * ROWS + idx / QUADS, (idx % QUADS) * 4, sum);\n          }\n        }\n      }\n",
              "      if (tid == 0) timeline[6] = timeline_now();\n")
    # the single cluster's store (a build for several runs one where they would not fill the GPU)
    single = "gridDim.y == 1 && " if "tile_arrivals + pid" in source else ""
    end = source.rfind("#endif\n}")
    source = source[:end] + f"  if ({single}tid == 0) timeline[6] = timeline_now();\n" + source[end:]
    return source + READER


def probed_source(problem, params: dict) -> str:
    """The rendered source of `params` for `problem`'s dtype and layout, with the probes in:
    validated, the parameters not given at their defaults (fixup, schedule, ...), as
    `cudal2 bench --param` takes them."""
    from cudal2.kernels.render import render, template_candidate

    return with_probes(render(template_candidate("sm90_splitk", {key: str(value) for key, value in params.items()}, 90),
                              problem))


def build(problem, params: dict | None, cache_dir=None, source: str | None = None):
    """The probed library of `params` for `problem`, or of a rendered `source` given whole
    (cudal2's compiler and cache)."""
    from cudal2.config import load_settings
    from cudal2.kernels.compile import Compiler

    probed = with_probes(source) if source is not None else probed_source(problem, params)
    built = Compiler("sm_90a", cache_dir=cache_dir or load_settings().cache_dir).compile(probed)
    if built.status != "ok":
        raise SystemExit(f"the probed source does not compile:\n{built.log[-3000:]}")
    return built


def phases(problem, library: str, warm_calls: int = 10) -> tuple[list[list[int]], float]:
    """Each CTA's event times (ns, EVENTS then its SM; 0 where it had none) of one call after
    `warm_calls`, and the mean us of 50 back-to-back calls by CUDA events (host-bound for
    short calls: ctypes and the error checks are in it)."""
    import cupy

    from cudal2.measure.verify import Kernel

    kernel = Kernel(library)
    m, n, k = problem.m, problem.n, problem.k
    # fp16 bits for bf16 too: only the phases' times are wanted, not the product
    a = cupy.random.standard_normal((m, k), dtype=cupy.float32).astype(cupy.float16)
    b = cupy.random.standard_normal((k, n) if problem.layout == "nn" else (n, k), dtype=cupy.float32).astype(cupy.float16)
    c = cupy.empty((m, n), dtype=cupy.float16)
    workspace = cupy.empty(max(1, kernel.workspace_bytes(m, n, k)), cupy.uint8)
    stream = cupy.cuda.get_current_stream()

    def call() -> None:
        code = kernel.call(a.data.ptr, b.data.ptr, c.data.ptr, m, n, k, workspace.data.ptr, workspace.nbytes, stream.ptr)
        if code != 0:
            raise SystemExit(f"cudal2_gemm returned {code}")

    for _ in range(warm_calls):
        call()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record(stream)
    for _ in range(50):
        call()
    end.record(stream)
    end.synchronize()
    per_call_us = cupy.cuda.get_elapsed_time(start, end) * 1e3 / 50
    kernel.lib.cudal2_timeline_clear()
    cupy.cuda.Device().synchronize()
    call()
    cupy.cuda.Device().synchronize()
    times = (ctypes.c_ulonglong * (MAX_CTAS * SLOTS))()
    if kernel.lib.cudal2_timeline_read(times, ctypes.c_size_t(ctypes.sizeof(times))) != 0:
        raise SystemExit("could not read the timeline back")
    ctas = [list(times[i * SLOTS:(i + 1) * SLOTS]) for i in range(MAX_CTAS)]
    return [cta for cta in ctas if cta[0]], per_call_us


def summary(ctas: list[list[int]]) -> list[str]:
    """Per event: how many CTAs reached it and the 0/10/50/90/100th percentiles, us from the first start."""
    import numpy

    first = min(cta[0] for cta in ctas)
    lines = []
    for i, name in enumerate(EVENTS):
        values = numpy.array([(cta[i] - first) / 1e3 for cta in ctas if cta[i]])
        if len(values):
            lines.append(f"  {name:12s} {len(values):5d} CTAs " +
                         " ".join(f"{q:8.2f}" for q in numpy.percentile(values, [0, 10, 50, 90, 100])))
    return lines


def main() -> None:
    from cudal2.problem import Problem

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", help="MxNxK")
    parser.add_argument("params", nargs="?", help="the configuration, as JSON (or --source)")
    parser.add_argument("--source", type=Path, help="a rendered sm90_splitk source (say, an edited copy) to probe instead")
    parser.add_argument("--dtype", default="fp16")
    parser.add_argument("--layout", default="nn")
    parser.add_argument("--compile-only", action="store_true")
    args = parser.parse_args()
    if (args.params is None) == (args.source is None):
        parser.error("give the configuration as JSON or a source with --source, one of the two")
    problem = Problem(*map(int, args.shape.split("x")), dtype=args.dtype, layout=args.layout)
    try:
        built = build(problem, None if args.params is None else json.loads(args.params),
                      source=None if args.source is None else args.source.read_text())
    except ValueError as exc:
        parser.error(str(exc))
    if args.compile_only:
        print(built.library)
        return
    ctas, per_call_us = phases(problem, str(built.library))
    print(f"{problem} {args.params or args.source}: {len(ctas)} CTAs on {len({cta[7] for cta in ctas})} SMs; "
          f"{per_call_us:.2f} us a call back to back by events; percentiles 0/10/50/90/100 in us:")
    print("\n".join(summary(ctas)))


if __name__ == "__main__":
    main()
