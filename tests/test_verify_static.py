from cudal2.measure.bench import summarize
from cudal2.measure.verify import forbidden_imports, physical_floor_us
from cudal2.problem import Problem

H200 = {"cc": 90, "sm_count": 132, "max_sm_clock_mhz": 1980, "memory_clock_khz": 3201000, "memory_bus_bits": 6144}


def test_launch_plumbing_is_allowed_and_everything_else_is_not():
    plumbing = ["__cudaRegisterFatBinary", "__cudaPushCallConfiguration", "cudaLaunchKernel",
                "cudaFuncSetAttribute", "cudaGetLastError", "__cxa_atexit", "memcpy"]
    assert forbidden_imports(plumbing) == []
    cheats = ["cublasGemmEx", "cudaStreamCreate", "cudaMalloc", "cudaDeviceSynchronize", "dlopen",
              "pthread_create", "cudaLaunchHostFunc", "cudaStreamSynchronize", "cudaEventRecord"]
    assert forbidden_imports(plumbing + cheats) == sorted(cheats)


def test_physical_floor_uses_tensor_peak_and_bandwidth_when_cold():
    big = Problem(8192, 8192, 8192)
    floor = physical_floor_us(big, H200, cold_l2=False)
    assert 900 < floor < 1100  # 1.1 PFLOP/s at 1980 MHz: a real kernel takes ~1400 us
    skinny = Problem(16, 28672, 4096)
    assert physical_floor_us(skinny, H200, cold_l2=True) > 5 * physical_floor_us(skinny, H200, cold_l2=False)


def test_summary_is_median_and_quantiles():
    t = summarize([float(x) for x in range(1, 101)])
    assert t.median_us == 50.5 and t.samples == 100
    assert 20 <= t.p20_us <= 21 and 80 <= t.p80_us <= 81
    one = summarize([7.0])
    assert (one.median_us, one.p20_us, one.p80_us) == (7.0, 7.0, 7.0)
