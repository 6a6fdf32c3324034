"""The floor and the regimes a report and the search speak of."""

import pytest

from cudal2.problem import Problem
from cudal2.results.roofline import MEASURED, floor_us, regime, roof

H200 = {"gpu": "NVIDIA H200", "cc": 90, "sm_count": 132, "max_sm_clock_mhz": 1980,
        "memory_clock_khz": 3201000, "memory_bus_bits": 6016}


@pytest.mark.parametrize("shape, dtype, layout, floor", [
    ((64, 64, 16384), "fp16", "nn", 1.0),      # bytes-bound: the library's 6.5 us is launch latency
    ((2048, 2048, 128), "fp16", "nn", 2.2),    # the store of C dominates
    ((1, 4096, 4096), "bf16", "nt", 7.9),      # decode: the weight read once
    ((8192, 8192, 8192), "bf16", "nn", 1527),  # FLOP-bound at the power-capped rate
])
def test_the_floor_is_the_larger_of_bytes_and_flops_on_the_h200(shape, dtype, layout, floor):
    assert floor_us(Problem(*shape, dtype, layout), roof(H200)) == pytest.approx(floor, rel=0.02)


def test_another_gpu_gets_the_h200s_sustained_share_of_its_datasheet():
    h100 = {**H200, "gpu": "NVIDIA H100 80GB HBM3", "memory_clock_khz": 2619000, "memory_bus_bits": 5120}
    derived = roof(h100)
    assert derived.flops_per_s == pytest.approx(MEASURED["NVIDIA H200"].flops_per_s, rel=0.01)  # same SMs, clock
    assert derived.bytes_per_s < MEASURED["NVIDIA H200"].bytes_per_s * 0.75  # 3.35 against 4.8 TB/s


def test_a_gpu_whose_rates_are_unknown_has_no_floor():
    assert roof({"gpu": "a GPU of another vendor", "sm_count": 80}) is None


@pytest.mark.parametrize("shape, expected", [
    ((4097, 4095, 4093), "unaligned"),
    ((100, 200, 300), "unaligned"),
    ((7, 4096, 4096), "decode"),  # an odd M leaves every row aligned
    ((1, 4096, 4096), "decode"),
    ((16, 28672, 4096), "decode"),
    ((4096, 8, 4096), "decode"),  # through the transpose
    ((64, 64, 16384), "few-tile long-K"),
    ((512, 512, 8192), "few-tile long-K"),
    ((1024, 1024, 8192), "other"),  # 64 tiles, but both sides wider than 512
    ((4096, 4096, 128), "short-K"),
    ((2048, 2048, 128), "short-K"),
    ((4096, 4096, 4096), "large"),
    ((1024, 1024, 1024), "other"),
])
def test_regimes(shape, expected):
    assert regime(Problem(*shape)) == expected


def test_a_measured_row_carries_its_floor_and_the_fraction_it_reaches():
    from cudal2.tune.pipeline import timing_columns

    timing = {"median_us": 10.0, "p20_us": 9.9, "p80_us": 10.1, "samples": 30}
    library = {**timing, "median_us": 12.0}
    timings = {"kernel": {"kernel": timing, "cuBLAS": library}, "graph": {"kernel": timing, "cuBLAS": library}}
    floor = floor_us(Problem(64, 64, 16384), roof(H200))
    row = timing_columns(timings, "kernel", flops=2 * 64 * 64 * 16384, floor=floor)
    assert row["floor_us"] == pytest.approx(1.0, rel=0.02) and row["floor_fraction"] == pytest.approx(floor / 10.0)


def test_a_library_call_within_the_tie_band_of_the_floor_leaves_no_win():
    from cudal2.protocol import TIE
    from cudal2.results.roofline import at_floor

    assert at_floor(10.0, 10.0) and at_floor(10.0 * (1 + TIE), 10.0)
    assert not at_floor(10.0 * (1 + TIE) + 0.01, 10.0)
