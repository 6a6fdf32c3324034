import re

import pytest

from cudal2.kernels.candidate import Candidate
from cudal2.errors import Cudal2Error
from cudal2.problem import Problem
from cudal2.kernels.render import get_template, load_templates, render, template_candidate, template_grid


def test_every_template_renders_its_default_for_every_dtype_and_layout():
    for name, tmpl in load_templates().items():
        for dtype in tmpl.space.dtypes:
            for layout in tmpl.space.layouts:
                cand = template_candidate(name, {}, max(tmpl.space.min_cc, 90))
                source = render(cand, Problem(64, 64, 64, dtype, layout))
                assert 'extern "C" int cudal2_gemm(' in source


def test_sm80_render_reflects_parameters_dtype_and_layout():
    cand = template_candidate("sm80_mma", {"block_m": "64", "stages": "3"}, 90)
    source = render(cand, Problem(1, 1, 1, "bf16", "nt"))
    assert "constexpr int BM = 64" in source and "STAGES = 3" in source
    assert "__nv_bfloat16" in source and "kTransB = true" in source
    assert "{{" not in source and "{%" not in source


def test_candidates_are_values():
    a = template_candidate("sm80_mma", {"block_m": "64"}, 90)
    b = Candidate.from_template("sm80_mma", dict(reversed(list(a.param_dict.items()))))
    assert a == b and hash(a) == hash(b) and a.id == b.id
    assert "block_m=64" in str(a)
    src = Candidate.from_source("int x;", label="x.cu")
    assert src == Candidate.from_source("int x;", label="other.cu")
    assert str(src) == "x.cu"


@pytest.mark.parametrize("params, message", [
    ({"block_q": "64"}, "unknown parameter block_q for template sm80_mma"),
    ({"block_m": "100"}, r"block_m=100 is outside template sm80_mma's space \(16, 32, 64, 128, 256\)"),
    ({"block_m": "big"}, "block_m takes an integer"),
    ({"block_m": "32", "warps_m": "4"}, r"fails block_m % \(warps_m \* 16\) == 0"),
    ({"block_m": "256", "block_n": "256", "block_k": "64", "stages": "5"}, "fails .*smem_bytes <= max_smem"),
    ({"split_k": "3"}, r"split_k=3 is outside template sm80_mma's space \(1, 2, 4, 8\)"),
])
def test_invalid_parameters_are_rejected_before_compiling(params, message):
    with pytest.raises(Cudal2Error, match=message):
        template_candidate("sm80_mma", params, 90)


def test_shared_memory_limit_follows_the_target():
    big = {"block_m": "256", "block_n": "128", "block_k": "64", "stages": "4"}  # 192 KiB
    template_candidate("sm80_mma", big, 90)
    with pytest.raises(Cudal2Error, match="smem_bytes <= max_smem"):
        template_candidate("sm80_mma", big, 86)


def test_split_k_needs_clusters_and_room_for_the_partial_tile():
    split = {"block_m": "16", "block_n": "64", "warps_m": "1", "warps_n": "2", "split_k": "4"}
    source = render(template_candidate("sm80_mma", split, 90), Problem(16, 4096, 4096, "bf16", "nt"))
    assert "__cluster_dims__(1, 1, SPLIT_K)" in source and "SPLIT_K = 4" in source
    assert "__cluster_dims__" not in render(template_candidate("sm80_mma", {}, 90), Problem(1, 1, 1, "fp16", "nn"))
    with pytest.raises(Cudal2Error, match="fails split_k == 1 or cc >= 90"):
        template_candidate("sm80_mma", split, 80)  # thread-block clusters start with sm_90
    # 256x256 fp32 partial tile (263 KiB) exceeds shared memory even where the pipeline fits.
    with pytest.raises(Cudal2Error, match="smem_bytes <= max_smem"):
        template_candidate("sm80_mma", {"block_m": "256", "block_n": "256", "block_k": "32", "stages": "2",
                                        "split_k": "2"}, 90)


def test_split_k_over_clusters_sums_through_the_workspace_in_one_kernel():
    wide = {"block_m": "64", "block_n": "64", "warps_m": "2", "warps_n": "2", "split_k": "8", "k_clusters": "16"}
    source = render(template_candidate("sm80_mma", wide, 90), Problem(64, 64, 16384, "fp16", "nn"))
    assert "K_CLUSTERS = 16" in source and "__device__ unsigned int tile_arrivals[" in source
    assert 'extern "C" size_t cudal2_workspace_bytes(' in source
    plain = render(template_candidate("sm80_mma", {}, 90), Problem(1, 1, 1, "fp16", "nn"))
    assert "tile_arrivals" not in plain and "K_CLUSTERS = 1" in plain
    # Without clusters (split_k 1) it runs on sm_80 too; its partial tile is always staged in
    # shared memory, so the output-staging choice is not a second configuration.
    template_candidate("sm80_mma", {**wide, "split_k": "1"}, 80)
    with pytest.raises(Cudal2Error, match="fails split_k == 1 and k_clusters == 1 or epilogue == 'smem'"):
        template_candidate("sm80_mma", {**wide, "split_k": "1", "epilogue": "direct"}, 90)
    with pytest.raises(Cudal2Error, match=r"k_clusters=3 is outside template sm80_mma's space \(1, 2, 4, 8, 16\)"):
        template_candidate("sm80_mma", {**wide, "k_clusters": "3"}, 90)
    # The fp32 partial tile must fit in shared memory as split_k's does.
    with pytest.raises(Cudal2Error, match="smem_bytes <= max_smem"):
        template_candidate("sm80_mma", {"block_m": "256", "block_n": "256", "block_k": "32", "stages": "2",
                                        "k_clusters": "2"}, 90)


def test_unknown_template():
    with pytest.raises(Cudal2Error, match="unknown template 'nope'; available: .*sm80_mma"):
        get_template("nope")


def test_grid_skips_invalid_combinations_and_keeps_valid_ones():
    grid = template_grid("sm80_mma", {"block_m": ["32", "128"], "warps_m": ["2", "4"], "warps_n": ["2"]}, 90)
    shapes = {(c.param_dict["block_m"], c.param_dict["warps_m"]) for c in grid}
    assert shapes == {(32, 2), (128, 2), (128, 4)}  # 32 rows cannot feed 4 warps of 16
    with pytest.raises(Cudal2Error, match="no valid configuration"):
        template_grid("sm80_mma", {"block_m": ["32"], "warps_m": ["4", "4"]}, 90)


def test_space_enumerates_only_valid_configurations():
    import itertools

    space = get_template("sm80_mma").space
    configs = list(space.configurations(90))
    assert configs and all(not space.violations(c, 90) for c in configs)
    assert space.defaults() in configs
    # Checking each constraint early skips subtrees but keeps every valid point, in order.
    names = list(space.params)
    every = (dict(zip(names, values)) for values in itertools.product(*(space.params[n].values for n in names)))
    assert configs == [c for c in every if not space.violations(c, 90)]


def test_stream_k_split_counts_reach_the_scheduler():
    params = {"tile_n": "128", "tile_scheduler": "streamk", "splits": "8", "reduction": "nondeterministic"}
    source = render(template_candidate("sm90_cutlass", params, 90), Problem(1, 1, 1, "fp16", "nn"))
    assert "args.scheduler.splits = 8;" in source and "ReductionMode::Nondeterministic" in source
    assert "args.scheduler.splits" not in render(template_candidate("sm90_cutlass", {}, 90), Problem(1, 1, 1, "fp16", "nn"))
    with pytest.raises(Cudal2Error, match="fails tile_scheduler == 'streamk' or"):
        template_candidate("sm90_cutlass", {"splits": "4"}, 90)  # the persistent scheduler has no splits


def test_stream_k_can_be_forced_where_cutlass_would_stay_data_parallel():
    forced = {"tile_scheduler": "streamk", "decomposition": "streamk"}
    source = render(template_candidate("sm90_cutlass", forced, 90), Problem(1, 1, 1, "fp16", "nn"))
    assert "decomposition_mode = cutlass::gemm::kernel::detail::DecompositionMode::StreamK;" in source
    heuristic = render(template_candidate("sm90_cutlass", {"tile_scheduler": "streamk"}, 90),
                       Problem(1, 1, 1, "fp16", "nn"))
    assert "decomposition_mode" not in heuristic and "decomposition=" not in heuristic
    # A stream-K scheduler argument, and split-K (splits > 1) is a decomposition of its own.
    for wrong in ({"tile_scheduler": "persistent"}, {"splits": "4", "reduction": "nondeterministic"}):
        with pytest.raises(Cudal2Error, match=re.escape("fails decomposition == 'heuristic' or")):
            template_candidate("sm90_cutlass", {**forced, **wrong}, 90)


def test_parallel_split_k_runs_slices_as_batches_and_sums_them_in_a_second_kernel():
    params = {"kernel_schedule": "warpspecialized", "tile_m": "64", "tile_n": "128", "cluster_m": "1",
              "splits": "8", "reduction": "parallel"}
    source = render(template_candidate("sm90_cutlass", params, 90), Problem(1, 1, 1, "fp16", "nn"))
    assert "using ElementD = float;" in source  # the slices' partial sums stay fp32
    assert "constexpr int kSplits = 8;" in source and "launch_sum(" in source
    assert "cudaLaunchAttributeProgrammaticStreamSerialization" in source  # the sum, behind the GEMM
    plain = render(template_candidate("sm90_cutlass", {}, 90), Problem(1, 1, 1, "fp16", "nn"))
    assert "using ElementD = Element;" in plain and "sum_slices" not in plain
    # Slices are batches of the persistent or non-persistent kernel, never stream-K's, and
    # there are at least two of them.
    for wrong, rule in (({"tile_scheduler": "streamk"}, "reduction != 'parallel' or tile_scheduler"),
                        ({"splits": "1"}, "fails tile_scheduler == 'streamk' or"),
                        ({"raster_order": "along_m"}, "raster_order == 'heuristic'")):
        with pytest.raises(Cudal2Error, match=re.escape(rule)):
            template_candidate("sm90_cutlass", {**params, **wrong}, 90)


def test_no_gemm_is_launched_with_programmatic_dependent_launch():
    """Measured on the H200 in the protocol's graph, behind a plain kernel: a GEMM launched
    with programmatic dependent launch (waiting in the kernel, griddepcontrol.wait) read
    0.2-0.45 us slower on calls under 10 us and no faster on longer ones. No template launches
    its GEMM so; within a parallel split-K call, the kernel summing the slices is launched so
    behind the GEMM, which signals it once its last tiles are under way."""
    problem = Problem(1, 1, 1, "fp16", "nn")
    sm90 = [{}, {"kernel_schedule": "pingpong", "tile_n": "128"}, {"tile_scheduler": "streamk"},
            {"kernel_schedule": "warpspecialized", "tile_m": "64", "tile_n": "128"},
            {"epilogue_schedule": "overlap"}]
    sources = [render(template_candidate("sm90_cutlass", params, 90), problem) for params in sm90]
    sources += [render(template_candidate(template, {}, 90), problem) for template in ("sm80_mma", "sm90_splitk")]
    for source in sources:
        assert "launch_with_pdl" not in source and 'asm volatile("griddepcontrol' not in source
        assert "wait_on_dependent_grids" not in source and "launch_dependent_grids" not in source
        assert "ProgrammaticStreamSerialization" not in source and "CUTLASS_ENABLE_GDC_FOR_SM90" not in source
    parallel = render(template_candidate("sm90_cutlass", {"tile_n": "128", "splits": "4", "reduction": "parallel"}, 90),
                      problem)
    assert "#define CUTLASS_ENABLE_GDC_FOR_SM90 1" in parallel and "Gemm::run(params, stream)" in parallel
    sum_kernel = parallel[parallel.index("sum_slices(float const*"):parallel.index("inline cudaError_t launch_sum")]
    assert sum_kernel.index("griddepcontrol.wait") < sum_kernel.index("__ldcs(")  # before it reads the slices
    launch_sum = parallel[parallel.index("inline cudaError_t launch_sum"):]
    assert "programmaticStreamSerializationAllowed = 1" in launch_sum[:launch_sum.index("cudaLaunchKernelEx")]


def test_the_even_grid_caps_the_persistent_grid_at_run_time():
    even = render(template_candidate("sm90_cutlass", {"grid": "even"}, 90), Problem(1, 1, 1, "fp16", "nn"))
    assert "args.hw_info.max_active_clusters = std::min(facts.max_active_clusters, ctas / cluster);" in even
    plain = render(template_candidate("sm90_cutlass", {}, 90), Problem(1, 1, 1, "fp16", "nn"))
    assert "ctas / cluster" not in plain and "grid=" not in plain
    # Stream-K balances its work its own way; the non-persistent kernel has one CTA per tile.
    for wrong in ({"tile_scheduler": "streamk"}, {"kernel_schedule": "warpspecialized", "tile_n": "128"}):
        with pytest.raises(Cudal2Error, match=re.escape("fails grid == 'all' or")):
            template_candidate("sm90_cutlass", {"grid": "even", **wrong}, 90)


def test_the_overlapped_epilogue_is_its_own_cooperative_kernel():
    overlap = render(template_candidate("sm90_cutlass", {"epilogue_schedule": "overlap"}, 90),
                     Problem(1, 1, 1, "bf16", "nn"))
    assert "struct OverlapCooperative : Base" in overlap
    assert "using GemmKernel = OverlapCooperative<cutlass::gemm::kernel::GemmUniversal<" in overlap
    assert "cvt.rn.bf16x2.f32" in overlap and "st.global.v4.b32" in overlap
    assert "cutlass::epilogue::NoSmemWarpSpecialized" in overlap  # D's pointer and stride only
    plain = render(template_candidate("sm90_cutlass", {}, 90), Problem(1, 1, 1, "fp16", "nn"))
    assert "OverlapCooperative" not in plain
    # Its own kernel: cooperative, static persistent, C (not C^T), whole 32-column groups.
    for wrong in ({"kernel_schedule": "pingpong", "tile_m": "64", "tile_n": "128"},
                  {"tile_scheduler": "streamk"}, {"swap_ab": "yes"}, {"tile_n": "144", "cluster_m": "1"},
                  {"splits": "4", "reduction": "parallel"},
                  {"tile_m": "256", "tile_n": "192", "cluster_m": "1"}):  # registers: it would spill
        with pytest.raises(Cudal2Error, match=re.escape("epilogue_schedule != 'overlap' or")):
            template_candidate("sm90_cutlass", {"epilogue_schedule": "overlap", **wrong}, 90)


def test_device_code_two_templates_share_is_rendered_into_each_source_whole():
    """templates/include/ holds device code more than one template renders (the 16-byte store
    of GMMA accumulators): it is no template itself, and each source that includes it carries
    it whole, so that a source still compiles alone and its hash covers all of it."""
    from cudal2.kernels.render import INCLUDE, load_templates

    assert INCLUDE not in load_templates()
    overlap = render(template_candidate("sm90_cutlass", {"epilogue_schedule": "overlap"}, 90), Problem(1, 1, 1, "fp16", "nn"))
    direct = render(template_candidate("sm90_splitk", {"split_k": "1", "k_clusters": "1", "epilogue": "direct"}, 90),
                    Problem(1, 1, 1, "fp16", "nn"))
    for source in (overlap, direct):
        assert "{%" not in source and source.count("__device__ __forceinline__ void transpose_quad(") == 1


def test_swapped_operands_compute_c_transposed_into_cs_memory():
    swapped = {"kernel_schedule": "warpspecialized", "tile_n": "160", "cluster_m": "1", "swap_ab": "yes"}
    source = render(template_candidate("sm90_cutlass", swapped, 90), Problem(1, 1, 1, "fp16", "nn"))
    assert "args.problem_shape = ProblemShape{N, M, K, 1};" in source
    assert "using LayoutD = cutlass::layout::ColumnMajor;" in source
    assert "args.mainloop.ptr_A = static_cast<ElementA const*>(b);" in source
    # A 160-column GMMA needs CuTe's extended shapes; 128 and 192 columns do not.
    assert "#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED" in source
    plain = render(template_candidate("sm90_cutlass", {}, 90), Problem(1, 1, 1, "fp16", "nn"))
    assert "ProblemShape{M, N, K, 1}" in plain and "LayoutD = cutlass::layout::RowMajor" in plain
    assert "EXTENDED_MMA_SHAPES" not in plain and "swap_ab" not in plain
    with pytest.raises(Cudal2Error, match=re.escape("fails swap_ab == 'no' or")):
        template_candidate("sm90_cutlass", {**swapped, "splits": "4", "reduction": "parallel"}, 90)


def test_narrow_tiles_run_along_a_small_m_only_with_operands_swapped():
    """16- and 32-column tiles are GMMA's own shapes (no extended set), along M when swapped;
    unswapped they would cut a wide N into many narrow tiles, and the space refuses them."""
    narrow = {"kernel_schedule": "warpspecialized", "tile_m": "64", "tile_n": "16", "cluster_m": "1", "swap_ab": "yes"}
    source = render(template_candidate("sm90_cutlass", narrow, 90), Problem(1, 1, 1, "bf16", "nt"))
    assert "using TileShape    = Shape<Int<64>, Int<16>, Int<64>>;" in source
    assert "ProblemShape{N, M, K, 1}" in source and "EXTENDED_MMA_SHAPES" not in source
    with pytest.raises(Cudal2Error, match=re.escape("fails tile_n >= 64 or swap_ab == 'yes'")):
        template_candidate("sm90_cutlass", {**narrow, "swap_ab": "no"}, 90)


def test_clusters_of_four_and_eight_are_the_non_persistent_kernels_only():
    """cuBLAS's few-tile kernels share each operand tile among 4 or 8 CTAs of a cluster; the
    space has them on the CTA-a-tile kernel (at most 8, the portable cluster size), and prices
    the GPC slots its clusters take."""
    four_by_two = {"kernel_schedule": "warpspecialized", "tile_m": "64", "tile_n": "64", "cluster_m": "4",
                   "cluster_n": "2"}
    source = render(template_candidate("sm90_cutlass", four_by_two, 90), Problem(1, 1, 1, "fp16", "nn"))
    assert "using ClusterShape = Shape<Int<4>, Int<2>, _1>;" in source
    assert "constexpr int kClusterM = 4;" in source and "constexpr int kClusterN = 2;" in source
    rule = "fails max(cluster_m, cluster_n) < 4 or"
    for wrong in ({"kernel_schedule": "pingpong"}, {"cluster_n": "4"}):
        with pytest.raises(Cudal2Error, match=re.escape(rule)):
            template_candidate("sm90_cutlass", {**four_by_two, **wrong}, 90)
    space, problem = get_template("sm90_cutlass").space, Problem(1024, 384, 3072, "fp16", "nn")
    inputs = space.cost_inputs(template_candidate("sm90_cutlass", four_by_two, 90).param_dict, 90, problem, 132)
    assert inputs["requires"] and inputs["cluster_ctas"] == 8


def test_binding_constraints_are_those_some_parameter_set_breaks_on_the_target(tmp_path):
    """A constraint reads parameters, derived values and the target; one that every value of
    the parameters it reads meets on a target cannot reject anything there."""
    from cudal2.kernels.render import Space

    path = tmp_path / "space.toml"
    path.write_text("""
constraints = ["split == 1 or cc >= 90", "tile * depth <= 256", "bytes <= max_smem", "tile >= 1"]
[derived]
bytes = "tile * depth * 2048"
[params.tile]
values = [1, 8, 32]
default = 8
[params.depth]
values = [1, 8]
default = 1
[params.split]
values = [1, 2]
default = 1
""")
    space = Space.load(path)
    # tile 32 x depth 8 = 256 fits; 512 KiB of shared memory never does
    assert space.binding(90) == ("bytes <= max_smem",)
    assert space.binding(80) == ("split == 1 or cc >= 90", "bytes <= max_smem")
    assert space.reads("bytes <= max_smem") == ({"tile", "depth"}, {"bytes"})


def test_a_launch_table_maps_caps_to_what_the_problem_runs_and_names_parameters_only(tmp_path):
    """[launch] gives, per parameter, the value that runs the same work on a problem (a cap
    above the problem's need); a key that is no parameter is a mistake in the file."""
    from cudal2.kernels.render import Space

    path = tmp_path / "space.toml"
    text = """
[params.cap]
values = [1, 2, 4, 8]
default = 1
[params.tile]
values = [64, 128]
default = 64
[launch]
cap = "min(cap, max(1, sm_count // ((m + tile - 1) // tile)))"
"""
    path.write_text(text)
    space = Space.load(path)
    # 1024 rows in 64-row tiles: 16 of them, 132 // 16 = 8 fit; in 128-row tiles 8, 16 fit
    assert space.launched({"cap": 8, "tile": 64}, 90, Problem(1024, 64, 64), 132) == {"cap": 8, "tile": 64}
    assert space.launched({"cap": 8, "tile": 64}, 90, Problem(4096, 64, 64), 132) == {"cap": 2, "tile": 64}
    assert space.launched({"cap": 1, "tile": 128}, 90, Problem(4096, 64, 64), 132) == {"cap": 1, "tile": 128}
    path.write_text(text + 'tiles = "1"\n')
    with pytest.raises(Cudal2Error, match=r"\[launch\] names tiles, which are not parameters"):
        Space.load(path)
