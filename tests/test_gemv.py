"""The gemv template on the CPU: its configurations compile in seconds behind the kernel ABI
with nothing but allowed imports, and its constraints turn invalid parameters away before
anything is compiled. (On the GPU: tests/test_gpu_gemv.py.)"""

import pytest

from cudal2.errors import Cudal2Error
from cudal2.kernels.render import get_template, render, template_candidate
from cudal2.measure.verify import forbidden_imports
from cudal2.problem import Problem


@pytest.mark.nvcc
def test_representative_configurations_compile_without_spills_or_new_imports(compiler):
    # The default (bf16 nt: 16-byte rows into the MMA fragments) and the widest tile with K
    # sliced over a cluster of two (fp16 nn: 8-byte N-rows through movmatrix; the transposed
    # path too).
    # path too); and bulk loads (bf16 nt: a producer warp's copies into a shared-memory ring).
    configs = [({}, Problem(1, 1, 1, "bf16", "nt")),
               ({"tile_rows": "64", "warps": "4", "unroll": "1", "split_k": "2"}, Problem(1, 1, 1, "fp16", "nn")),
               ({"loads": "bulk", "warps": "4", "unroll": "2", "stages": "4"}, Problem(1, 1, 1, "bf16", "nt"))]
    builds = compiler.compile_all([render(template_candidate("gemv", params, 90), p) for params, p in configs])
    for build in builds:
        assert build.status == "ok", build.log[-3000:]
        assert "cudal2_gemm" in build.exports and forbidden_imports(build.imports) == []
        assert 0 < build.registers <= 255 and build.spill_bytes == 0, build.log[-3000:]
    # the register path's partial sums are static shared memory; the bulk path's stages are
    # dynamic: 4 x (16 rows + 8 tokens) x (512 K x 2 bytes + 64), and the barriers
    assert [b.declared["dynamic_smem_bytes"] for b in builds] == [0, 0, 4 * 24 * 1088 + 64]


def test_invalid_configurations_are_refused_with_the_rule_they_break():
    with pytest.raises(Cudal2Error, match=r"fails loads_registers <= 64"):
        template_candidate("gemv", {"tile_rows": "64", "unroll": "2"}, 90)  # 128 registers of loads
    with pytest.raises(Cudal2Error, match=r"fails loads_registers <= 32 or warps <= 8"):
        template_candidate("gemv", {"warps": "16", "unroll": "4"}, 90)  # 512 threads: 128 registers each at most
    with pytest.raises(Cudal2Error, match=r"tile_rows=48 is outside template gemv's space \(16, 32, 64\)"):
        template_candidate("gemv", {"tile_rows": "48"}, 90)
    with pytest.raises(Cudal2Error, match=r"unknown parameter cache for template gemv"):
        template_candidate("gemv", {"cache": "default"}, 90)  # measured 1.1-2.5x slower: not in the space
    with pytest.raises(Cudal2Error, match=r"fails split_k == 1 or cc >= 90"):
        template_candidate("gemv", {"split_k": "2"}, 80)  # slices summed in a cluster: sm_90+
    with pytest.raises(Cudal2Error, match=r"fails loads == 'registers' or \(cc >= 90 and split_k == 1\)"):
        template_candidate("gemv", {"loads": "bulk"}, 80)  # bulk copies and transaction barriers: sm_90+
    with pytest.raises(Cudal2Error, match=r"fails loads == 'bulk' or stages == 4"):
        template_candidate("gemv", {"stages": "8"}, 90)  # stages are the bulk path's
    with pytest.raises(Cudal2Error, match=r"fails smem_bytes <= max_smem"):
        template_candidate("gemv", {"loads": "bulk", "tile_rows": "32", "unroll": "2", "stages": "8"}, 90)


def test_the_space_is_small_and_every_configuration_is_valid():
    space = get_template("gemv").space
    configs = list(space.configurations(90))
    assert 15 <= len(configs) <= 300
    assert all(not space.violations(c, 90) for c in configs) and space.defaults() in configs
