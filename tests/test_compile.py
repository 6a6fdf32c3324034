import json
import struct
from pathlib import Path

import pytest

from cudal2.measure.baselines import cublas_location
from cudal2.kernels.compile import (RESOURCES_TAG, Cancelled, Compiler, cache_key, cutlass_include, cutlass_version,
                                    declared_resources, library_symbols, nvcc_version, parse_ptxas)
from cudal2.problem import Problem
from cudal2.kernels.render import get_template, max_smem, render, template_candidate
from cudal2.measure.verify import Kernel, forbidden_imports

from conftest import ROOT, fixture_source

pytestmark = pytest.mark.nvcc


def test_template_compiles_for_sm90a_with_resource_report(compiler):
    source = render(template_candidate("sm80_mma", {}, 90), Problem(1, 1, 1, "fp16", "nn"))
    build = compiler.compile(source)
    assert build.status == "ok", build.log
    assert build.library.is_file()
    assert "cudal2_gemm" in build.exports
    assert 0 < build.registers <= 255 and build.spill_bytes == 0
    assert forbidden_imports(build.imports) == []
    # ptxas sees no shared memory (it is all dynamic); the library's record gives the launch's,
    # which for this template is its space's exact formula; every warp keeps its registers
    space = get_template("sm80_mma").space
    assert build.smem_bytes == 0 and build.declared == {
        "dynamic_smem_bytes": space.facts(space.defaults(), 90)["smem_bytes"],
        "producer_registers": None, "consumer_registers": None}

    again = compiler.compile(source)  # served from the cache: no nvcc run
    assert again.cached and again.library == build.library and again.registers == build.registers
    assert again.declared == build.declared


def test_declared_resources_are_read_from_the_file_without_loading_it(tmp_path):
    record = RESOURCES_TAG + struct.pack("<3i", 214016, 40, 232)
    (tmp_path / "record.so").write_bytes(b"\x7fELF" + bytes(1000) + record + bytes(64))
    assert declared_resources(tmp_path / "record.so") == {
        "dynamic_smem_bytes": 214016, "producer_registers": 40, "consumer_registers": 232}
    (tmp_path / "kept.so").write_bytes(RESOURCES_TAG + struct.pack("<3i", 98816, 0, 0))  # no setmaxnreg
    assert declared_resources(tmp_path / "kept.so") == {
        "dynamic_smem_bytes": 98816, "producer_registers": None, "consumer_registers": None}
    (tmp_path / "plain.so").write_bytes(b"\x7fELF" + bytes(1000))
    assert set(declared_resources(tmp_path / "plain.so").values()) == {None}


def test_bf16_nt_variant_compiles(compiler):
    source = render(template_candidate("sm80_mma", {"block_k": "64", "block_n": "64"}, 90),
                    Problem(1, 1, 1, "bf16", "nt"))
    assert compiler.compile(source).status == "ok"


def test_split_k_cluster_variant_compiles_without_new_imports(compiler):
    split = {"block_m": "16", "block_n": "64", "warps_m": "1", "warps_n": "2", "split_k": "4"}
    build = compiler.compile(render(template_candidate("sm80_mma", split, 90), Problem(1, 1, 1, "bf16", "nt")))
    assert build.status == "ok", build.log
    assert build.spill_bytes == 0 and forbidden_imports(build.imports) == []


def test_split_k_over_clusters_compiles_and_declares_its_workspace(compiler):
    """Cut into 8 x 16 slices, one tile's K is summed through 16 fp32 partial tiles in the
    workspace; the library says so on the host (no GPU needed to ask), with no new imports."""
    wide = {"block_m": "64", "block_n": "64", "warps_m": "2", "warps_n": "2", "split_k": "8", "k_clusters": "16"}
    build = compiler.compile(render(template_candidate("sm80_mma", wide, 90), Problem(1, 1, 1, "fp16", "nn")))
    assert build.status == "ok", build.log
    assert build.spill_bytes == 0 and forbidden_imports(build.imports) == []
    kernel = Kernel(str(build.library))
    assert kernel.workspace_bytes(64, 64, 16384) == 16 * 64 * 64 * 4
    assert kernel.workspace_bytes(100, 64, 16384) == 2 * 16 * 64 * 64 * 4  # two tiles, the second cut
    assert kernel.workspace_bytes(64, 64, 2048) == 4 * 64 * 64 * 4  # 32 K tiles: 4 clusters of 8 get one each
    assert kernel.workspace_bytes(64, 64, 64) == 0  # one K tile: one cluster, nothing to park
    assert kernel.workspace_bytes(8192, 4096, 4096) == 0  # more tiles than arrival counters: one cluster


def test_cancel_stops_a_compile_caches_nothing_and_later_compiles_run(tmp_path):
    import threading

    compiler = Compiler("sm_90a", tmp_path)
    source = render(template_candidate("sm80_mma", {"stages": "3"}, 90), Problem(1, 1, 1, "fp16", "nn"))
    threading.Timer(1.0, compiler.cancel).start()  # nvcc needs several seconds for this one
    with pytest.raises(Cancelled):
        compiler.compile_all([source])
    assert compiler.lookup(source) is None and not list((tmp_path / "kernels").glob("*/*"))
    assert compiler.compile(source).status == "ok"  # the cancel applied to the compiles it stopped

    # A batch cancelled while one of its builds is done still hands that build on (the run
    # measures it rather than ending empty), however the two finish.
    other = render(template_candidate("sm80_mma", {"stages": "4"}, 90), Problem(1, 1, 1, "fp16", "nn"))
    stale = compiler.generation
    compiler.cancel()
    for _ in range(20):
        heard = []
        with pytest.raises(Cancelled):
            compiler.compile_all([other, source], stale, lambda s, build: heard.append((s, build.status)))
        assert heard == [(source, "ok")]


def test_compile_error_keeps_the_log_and_is_cached(compiler):
    build = compiler.compile('extern "C" int cudal2_gemm() { return undefined_thing; }')
    assert build.status == "compile_error" and build.library is None
    assert "undefined_thing" in build.log
    assert compiler.compile('extern "C" int cudal2_gemm() { return undefined_thing; }').cached


def test_library_without_the_abi_entry_point_is_a_compile_error(compiler):
    build = compiler.compile('extern "C" int not_the_abi(void) { return 0; }\n')
    assert build.status == "compile_error"
    assert "does not export cudal2_gemm" in build.log


def test_forbidden_imports_are_visible_after_compile(compiler):
    build = compiler.compile(fixture_source("own_stream"))
    assert build.status == "ok", build.log
    assert forbidden_imports(build.imports) == ["cudaStreamCreateWithFlags"]
    assert forbidden_imports(compiler.compile((ROOT / "examples" / "simt_gemm_fp16_nn.cu").read_text()).imports) == []


def test_parallel_compiles_dedupe_identical_sources(tmp_path):
    compiler = Compiler("sm_90a", tmp_path, jobs=2)
    a = 'extern "C" int cudal2_gemm(const void*, const void*, void*, int, int, int, void*, unsigned long, void*) { return 1; }\n'
    b = a.replace("return 1", "return 2")
    builds = compiler.compile_all([a, b, a])
    assert [x.status for x in builds] == ["ok", "ok", "ok"]
    assert builds[0].library == builds[2].library != builds[1].library
    assert len(list((tmp_path / "kernels").glob("*/*/kernel.so"))) == 2


def test_timeout_is_a_result_not_an_exception(tmp_path):
    compiler = Compiler("sm_90a", tmp_path, timeout=0.01)
    build = compiler.compile("// any source\n")
    assert build.status == "timeout" and "exceeded" in build.log
    assert compiler.lookup("// any source\n") is None  # a timeout is not cached


@pytest.mark.parametrize("script", ["kill -9 $$",
                                    "echo \"nvcc error   : 'cicc' died due to signal 9 (Kill signal)\"; exit 255",
                                    "echo 'nvcc: Terminated'; echo \"ptxas fatal   : Input file 'k.ptx' could not be opened\"; exit 1"],
                         ids=["nvcc", "a stage", "nvcc sent SIGTERM"])
def test_a_compile_stopped_by_a_signal_is_not_cached(tmp_path, monkeypatch, script):
    # A prebuild stopped with its nvcc processes killed had cached their sources as compile
    # errors with an empty log: every later run refused those kernels without compiling them.
    nvcc = tmp_path / "nvcc"
    nvcc.write_text(f"#!/bin/sh\n{script}\n")
    nvcc.chmod(0o755)
    nvcc_version()  # the real one's, which names the cache entries (read once, before the fake stands in)
    monkeypatch.setattr("cudal2.kernels.compile.find_nvcc", lambda: str(nvcc))
    compiler = Compiler("sm_90a", tmp_path / "cache")
    build = compiler.compile("// any source\n")
    assert build.status == "compile_error" and "not cached" in build.log
    assert compiler.lookup("// any source\n") is None
    assert not list((tmp_path / "cache" / "kernels").glob("*/*"))  # nor left half-made


def test_a_cached_failure_without_a_word_from_nvcc_is_compiled_again(tmp_path):
    # Caches written before builds stopped by a signal were left out hold such failures.
    compiler = Compiler("sm_90a", tmp_path)
    source = 'extern "C" int cudal2_gemm(const void*, const void*, void*, int, int, int, void*, unsigned long, void*) { return 0; }\n'
    assert compiler.compile(source).status == "ok"
    meta = next((tmp_path / "kernels").glob("*/*/build.json"))
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "status": "compile_error", "log": ""}))
    assert compiler.lookup(source) is None
    build = compiler.compile(source)
    assert build.status == "ok" and not build.cached
    # a failure nvcc explained stays cached
    broken = "this is not C++\n"
    assert compiler.compile(broken).status == "compile_error"
    assert compiler.lookup(broken).status == "compile_error"


def test_headers_named_relative_to_the_working_folder_are_found_by_nvcc(tmp_path, monkeypatch):
    # nvcc runs in each build's own folder. CUTLASS's include folders named relative to the
    # user's (CUDAL2_CACHE_DIR=.cache with the headers fetched there, or CUTLASS_DIR=cutlass)
    # named nothing there: every sm90 build failed with "cute/tensor.hpp: No such file", cached.
    headers = tmp_path / "cutlass" / "include" / "cutlass"
    headers.mkdir(parents=True)
    (headers / "version.h").write_text("#define CUTLASS_MAJOR 4\n#define CUTLASS_MINOR 2\n#define CUTLASS_PATCH 0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CUTLASS_DIR", "cutlass")
    cutlass_include.cache_clear(), cutlass_version.cache_clear()
    try:
        assert cutlass_include() == (headers.parent,)
        source = ('#include <cutlass/version.h>\nstatic_assert(CUTLASS_MAJOR == 4, "the header named");\n'
                  'extern "C" int cudal2_gemm(const void*, const void*, void*, int, int, int, void*, unsigned long, void*)'
                  ' { return 0; }\n')
        build = Compiler("sm_90a", Path("cache")).compile(source)
        assert build.status == "ok", build.log
    finally:
        cutlass_include.cache_clear(), cutlass_version.cache_clear()  # the session's own, read again


def test_cache_key_names_the_target():
    assert cache_key("x", "sm_90a") != cache_key("x", "sm_80")
    assert cache_key("x", "sm_90a") != cache_key("y", "sm_90a")


def test_ptxas_report_is_parsed():
    log = """ptxas info    : Used 168 registers, used 1 barriers, 98304 bytes smem, 400 bytes cmem[0]
    0 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 200 registers, used 1 barriers
    16 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"""
    assert parse_ptxas(log) == {"registers": 200, "smem_bytes": 98304, "spill_bytes": 12, "stack_bytes": 16}


def test_the_cutlass_template_s_default_compiles_with_allowed_imports(compiler):
    """The CUTLASS 3.x family's one compile in the default suite (about a minute of one core):
    its default configuration, checked as test_cutlass_variants_compile checks its variants."""
    [build] = compiler.compile_all([render(template_candidate("sm90_cutlass", {}, 90), Problem(1, 1, 1, "fp16", "nn"))])
    check_cutlass_build({}, build)


@pytest.mark.slow  # four CUTLASS builds: minutes of 2 cores (`pytest -m slow`; the GPU tests build them too)
def test_cutlass_variants_compile_with_allowed_imports(compiler):
    """Four more CUTLASS 3.x kernels (about 60-170 s of one core each, side by side): the
    parallel split-K, which adds a batched fp32 GEMM and a second kernel launched with
    programmatic dependent launch behind it (cudaLaunchKernelEx); operands swapped with a 160-column
    GMMA of CuTe's extended shapes (column-major C^T through the TMA epilogue); the
    cooperative kernel that stores each tile during the next one's GMMAs (bf16 packing); and
    64x64 tiles, a CTA each, in clusters of 8 (4x2) that multicast both operands."""
    parallel = {"kernel_schedule": "warpspecialized", "tile_m": "64", "tile_n": "128", "cluster_m": "1",
                "splits": "8", "reduction": "parallel"}
    swapped = {"kernel_schedule": "warpspecialized", "tile_n": "160", "cluster_m": "1", "swap_ab": "yes"}
    overlap = {"epilogue_schedule": "overlap", "grid": "even", "raster_order": "along_n", "max_swizzle_size": "8"}
    eight = {"kernel_schedule": "warpspecialized", "tile_m": "64", "tile_n": "64", "cluster_m": "4", "cluster_n": "2"}
    variants = ((parallel, "bf16", "nt"), (swapped, "fp16", "nn"), (overlap, "bf16", "nt"), (eight, "fp16", "nn"))
    sources = [render(template_candidate("sm90_cutlass", params, 90), Problem(1, 1, 1, dtype, layout))
               for params, dtype, layout in variants]
    for (params, _, _), build in zip(variants, compiler.compile_all(sources)):
        check_cutlass_build(params, build)


def check_cutlass_build(params: dict, build) -> None:
    """A CUTLASS kernel built as the ABI wants it: no spills, and ptxas keeps every wgmma
    pipeline (no C7510/C7515 serialization warning), nothing imported beyond what is allowed,
    and the resources it declares."""
    assert build.status == "ok", build.log[-3000:]
    assert "cudal2_gemm" in build.exports and "cudal2_workspace_bytes" in build.exports
    assert build.spill_bytes == 0
    assert "wgmma" not in build.log.lower(), build.log[-3000:]
    assert forbidden_imports(build.imports) == []
    # The GEMM's shared memory, which ptxas does not count (it is all dynamic): at least its
    # stages' A and B tiles (as many as the space reckons CUTLASS's carveout makes), at
    # most the opt-in shared memory (the kernel refuses to run beyond it). The cooperative
    # kernels move registers with setmaxnreg: 40 to the producer, 232 to the consumers
    # (CUTLASS's counts below 208 accumulator registers, which acc_regs <= 192 keeps); the
    # non-persistent one keeps its launch count.
    facts = get_template("sm90_cutlass").space.facts(template_candidate("sm90_cutlass", params, 90).param_dict, 90)
    declared = build.declared
    assert build.smem_bytes == 0
    assert facts["mainloop_stages"] * (facts["stage_bytes"] - 16) <= declared["dynamic_smem_bytes"] <= max_smem(90)
    registers = (40, 232) if facts["coop"] else (None, None)
    assert (declared["producer_registers"], declared["consumer_registers"]) == registers, params


def sample_of_space(template: str, count: int, seed: int) -> list:
    import random

    from cudal2.kernels.candidate import Candidate
    from cudal2.kernels.render import get_template

    configs = list(get_template(template).space.configurations(90))
    return [Candidate.from_template(template, c) for c in random.Random(seed).sample(configs, count)]


def test_a_random_sample_of_the_sm80_space_compiles(compiler):
    """Two random configurations, in the two variants no other test of the suite compiles
    (fp16 nn and bf16 nt kernels are built by many)."""
    problems = [Problem(1, 1, 1, d, l) for d, l in (("fp16", "nt"), ("bf16", "nn"))]
    sources = [render(c, p) for c, p in zip(sample_of_space("sm80_mma", 2, seed=11), problems)]
    builds = compiler.compile_all(sources)
    assert [b.status for b in builds] == ["ok"] * 2, [b.log[-1500:] for b in builds if b.status != "ok"]


@pytest.mark.slow
def test_a_random_sample_of_the_sm90_space_compiles(compiler):
    """About two minutes of one core per configuration: `pytest -m slow` runs it."""
    problems = [Problem(1, 1, 1, d, l) for d, l in (("fp16", "nn"), ("bf16", "nt"), ("fp16", "nt"))]
    sources = [render(c, p) for c, p in zip(sample_of_space("sm90_cutlass", 3, seed=5), problems)]
    builds = compiler.compile_all(sources)
    assert [b.status for b in builds] == ["ok"] * 3, [b.log[-1500:] for b in builds if b.status != "ok"]


@pytest.mark.nvcc
@pytest.mark.skipif(cublas_location() is None, reason="cuBLAS headers not installed (pip install nvidia-cublas)")
def test_the_library_baselines_compile_behind_the_kernel_abi(compiler):
    from cudal2.measure.baselines import build_baselines

    for problem in (Problem(64, 64, 64), Problem(16, 4096, 4096, "bf16", "nt")):
        libraries = build_baselines(compiler, problem)
        for name, path in libraries.items():
            exports, imports = library_symbols(Path(path))
            assert {"cudal2_gemm", "cudal2_workspace_bytes"} <= set(exports), name
        assert "cudal2_lt_heuristics" in library_symbols(Path(libraries["cuBLASLt"]))[0]
        assert "cublasGemmEx" in library_symbols(Path(libraries["cuBLAS"]))[1]
        assert "cublasLtMatmul" in library_symbols(Path(libraries["cuBLASLt"]))[1]
