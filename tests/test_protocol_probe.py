"""The graph method's diagnostics (scripts/protocol_probe.py --timeline, benchmarks/launch_probe.cu):
where a call's time in the protocol's graph goes, and kernels that differ in one property each."""

import importlib.util
import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _probe():
    spec = importlib.util.spec_from_file_location("protocol_probe", ROOT / "scripts" / "protocol_probe.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _graph_records(replays, calls, neighbour_ns, launch_ns, kernels, drain_ns, pause_ns=10_000):
    """CUPTI-like kernel records (start, end in ns) of `replays` replays of `calls` x (neighbour,
    call), the call's kernels given as (offset from the call's start, length)."""
    records, t = [], 0
    for _ in range(replays):
        for _ in range(calls):
            if neighbour_ns:
                records.append((t, t + neighbour_ns))
                t += neighbour_ns + launch_ns
            records += [(t + offset, t + offset + length) for offset, length in kernels]
            t += max(offset + length for offset, length in kernels) + drain_ns
        t += pause_ns
    return records


def test_the_timeline_splits_each_call_into_launch_kernels_drain_and_neighbour():
    probe = _probe()
    # Two kernels a call, the second overlapping the first (launched with PDL): they count once.
    records = _graph_records(3, 4, 2000, 300, [(0, 800), (500, 500)], 200)
    parts = probe.call_timeline(records[::-1], calls=4, replays=3)  # in any order
    assert parts["neighbour"] == pytest.approx(2.0) and parts["launch"] == pytest.approx(0.3)
    assert parts["call"] == pytest.approx(1.0) and parts["drain"] == pytest.approx(0.2)
    assert parts["per call"] == pytest.approx((4 * 3.5 - 0.2) / 4)
    # Behind no neighbour: the gap from the call before's last kernel.
    alone = probe.call_timeline(_graph_records(2, 3, 0, 0, [(0, 1000)], 400), calls=3, replays=2, neighboured=False)
    assert alone["launch"] == pytest.approx(0.4) and alone["call"] == pytest.approx(1.0) and "neighbour" not in alone
    # The neighbours' own graph: the neighbour and the gap between two of them.
    only = probe.call_timeline(_graph_records(2, 3, 2000, 0, [(0, 1)], 499)[::2], calls=3, replays=2)
    assert only["neighbour"] == pytest.approx(2.0) and only["drain"] == pytest.approx(0.5) and "call" not in only


def test_the_timeline_refuses_records_that_do_not_make_whole_calls():
    records = _graph_records(2, 3, 2000, 300, [(0, 800)], 200)
    with pytest.raises(RuntimeError, match="11 kernel records for 2 replays of 3 calls"):
        _probe().call_timeline(records[:-1], calls=3, replays=2)


def _text_sizes(cubin: Path) -> dict[str, int]:
    """Bytes of each kernel's code (.text.<name>) in an ELF64 cubin."""
    data = cubin.read_bytes()
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = headers[shstrndx][4]  # the section-name table's offset

    def name(header):
        end = data.index(b"\0", names + header[0])
        return data[names + header[0]:end].decode()

    return {name(h)[len(".text."):]: h[5] for h in headers if name(h).startswith(".text.")}


EXPECTED = ["base", "smem", "threads", "regs", "setmaxnreg", "code", "all", "tma param", "tma global"]


@pytest.mark.nvcc
def test_each_launch_probe_kernel_differs_from_the_base_in_the_property_it_stands_for(tmp_path):
    """The synthetic contestants of --timeline --synthetic: if ptxas stopped holding 168 registers
    (the launch-time register file of CUTLASS's persistent kernels) or the straight-line code
    shrank, the probe would compare kernels alike."""
    import ctypes

    source, library, cubin = ROOT / "benchmarks" / "launch_probe.cu", tmp_path / "probe.so", tmp_path / "probe.cubin"
    nvcc = shutil.which("nvcc")
    built = subprocess.run([nvcc, "-O3", "-shared", "-Xcompiler", "-fPIC", "-arch=sm_90a", "-Xptxas", "-v",
                            "-o", str(library), str(source)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-3000:]
    lib = ctypes.CDLL(str(library))
    lib.probe_name.restype = ctypes.c_char_p
    assert [lib.probe_name(i).decode() for i in range(len(EXPECTED))] == EXPECTED and lib.probe_name(len(EXPECTED)) is None
    usage = {}
    for block in built.stderr.split("Compiling entry function")[1:]:
        kernel = re.match(r" '(\w+)'", block).group(1)
        usage[kernel] = (int(re.search(r"Used (\d+) registers", block).group(1)),
                         int(m.group(1)) if (m := re.search(r"(\d+) bytes cumulative stack", block)) else 0)
    assert set(usage) == {"probe_" + name.replace(" ", "_") for name in EXPECTED}
    for name in ("regs", "setmaxnreg", "all"):
        assert usage[f"probe_{name}"] == (168, 0), name  # the whole register file for 384 threads, nothing spilled
    for name in ("base", "smem", "threads", "code", "tma_param", "tma_global"):
        assert usage[f"probe_{name}"][0] <= 32, name
    subprocess.run([nvcc, "-O3", "-cubin", "-arch=sm_90a", "-o", str(cubin), str(source)], check=True)
    sizes = _text_sizes(cubin)
    assert sizes["probe_code"] >= 40 << 10 and sizes["probe_base"] < 2 << 10


@pytest.mark.gpu
def test_every_launch_probe_kernel_runs():
    """Each synthetic contestant launches and completes on this GPU (its TMA load included)."""
    import cupy

    from cudal2.measure.environment import default_arch

    props = cupy.cuda.runtime.getDeviceProperties(0)
    if props["major"] * 10 + props["minor"] != 90:
        pytest.skip("the launch probe is built for sm_90a")
    stream = cupy.cuda.Stream(non_blocking=True)
    run = _probe().synthetic_contestants(stream, default_arch(90))
    assert list(run) == [f"probe {name}" for name in EXPECTED]
    for call in run.values():
        call(None, None, None)
    stream.synchronize()
