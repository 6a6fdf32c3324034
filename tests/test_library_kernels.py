"""benchmarks/library_kernels.py: what the library runs at a problem, its nvjet kernels' designs
decoded from their names (the names below are what torch.matmul ran on an H100, fp16 nn)."""

import pytest
from conftest import benchmark_script


def _tool():
    return benchmark_script("library_kernels")


def test_an_nvjet_name_gives_its_tile_stages_cluster_and_split():
    design = _tool().nvjet_design
    assert design("nvjet_sm90_hsh_128x192_64x5_2x1_v_bz_coopB_NNN") == {
        "tile": "128x192", "tile_k": 64, "stages": 5, "cluster": "2x1", "cooperative": "B", "split_k": False}
    assert design("nvjet_sm90_hsh_96x64_64x8_1x2_h_bz_splitK_NNN") == {
        "tile": "96x64", "tile_k": 64, "stages": 8, "cluster": "1x2", "cooperative": None, "split_k": True}
    assert design("nvjet_sm90_hsh_192x96_64x5_1x2_h_bz_NNT")["tile"] == "192x96"
    # the split-K's second kernel, and anything else, is not an nvjet design
    assert design("void cublasLt::splitKreduce_kernel<32, 16, int, float, __half, float, __half, false, float") is None
    assert design("sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1") is None


@pytest.mark.gpu
def test_torch_matmuls_kernels_at_a_split_k_problem_are_listed_with_their_times():
    """On a GPU (`pytest -m gpu`): every kernel torch.matmul launched, each call's, with its
    launch shape and a time; on a Hopper GPU cuBLAS's are nvjet kernels, their designs decoded."""
    torch = pytest.importorskip("torch")
    rows = _tool().profile_matmul(64, 64, 16384, calls=30)
    assert rows and all(row["calls"] == 30 and row["median_us"] > 0 and row["grid"] and row["block"] for row in rows)
    if torch.cuda.get_device_capability() == (9, 0):
        assert any(row["design"] for row in rows), [row["name"] for row in rows]


@pytest.mark.gpu
def test_every_algorithm_cublaslt_offers_is_run_and_its_kernels_named():
    """On a GPU: `--cublaslt` runs each algorithm of the heuristic's list through the bench's
    shim, so the autotuned baseline's pick (its index in that list) is named by its kernels."""
    pytest.importorskip("torch")
    rows = _tool().profile_cublaslt(256, 256, 4096, "bf16", "nt", calls=30)
    offered = rows[0]["offered"]
    assert offered >= 1 and {row["algorithm"] for row in rows} == set(range(offered))
    assert all(row["calls"] == 30 and row["median_us"] > 0 and row["name"] for row in rows)
    assert all(isinstance(row["tile"], int) and isinstance(row["stages"], int) for row in rows)
