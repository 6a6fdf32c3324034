"""On a GPU: one contestant's fault never decides another's verdict. The honest kernel
reports its status through cudaGetLastError(), as ordinary CUDA code does; beside it, in the
same run, kernels that fail: a launch whose error is swallowed, an illegal address, a hang,
an abort in the host code, and a correct kernel that leaves a failed call's error pending.
Run with `pytest -m gpu`."""

from __future__ import annotations

import random
import re

import pytest

from cudal2.kernels.candidate import Candidate
from cudal2.config import Settings
from cudal2.results.leaderboard import Leaderboard
from cudal2.tune.pipeline import Context, evaluate
from cudal2.problem import Problem
from cudal2.measure.verify import Kernel, Numerics, Operands
from cudal2.measure.worker import Worker

from conftest import fixture_source

pytestmark = pytest.mark.gpu

EXPECTED = {
    "swallowed": "wrong",     # C unwritten; its launch's error named in the reason
    "honest": "ok",           # right after it, in the same run
    "leaves_error": "ok",     # correct; timed beside the honest one, an error pending after each of its calls
    "crash": "crash",         # illegal address: the context is lost, the process with it
    "abort": "crash",         # abort() in the host code
    "hang": "timeout",
}


def test_an_error_left_pending_is_cleared_before_the_next_contestants_call(compiler):
    """Through the bare ABI call, the honest kernel reads the error the swallowing kernel
    left (and says it cannot run); as a contestant it reads its own, and the error is the
    swallowing kernel's."""
    import cupy

    libraries = {v: str(b.library) for v, b in zip(("swallowed", "honest"), compiler.compile_all(
        [fixture_source(v) for v in ("swallowed", "honest")]))}
    swallowed, honest = Kernel(libraries["swallowed"]), Kernel(libraries["honest"])
    problem = Problem(256, 256, 256)
    ops = Operands(problem, 0, Numerics("fp16"))
    ops.fill("normal", random.Random(0))
    stream = cupy.cuda.Stream(non_blocking=True)
    args = (ops.a.data.ptr, ops.b.data.ptr, ops.c.data.ptr, 256, 256, 256, ops.ws.data.ptr, 0, stream.ptr)
    assert swallowed.gemm(*args) == 0 and honest.gemm(*args) == 1  # what an error left behind does
    assert swallowed.call(*args) == 0 and honest.call(*args) == 0
    assert swallowed.left_error.startswith("cudaError") and honest.left_error is None
    stream.synchronize()


@pytest.fixture(scope="module")
def worker(tmp_path_factory, compiler):
    """A worker whose first run (CuPy's kernels compiled, torch imported) is behind it, so
    that a fresh process's verification is far within the timeout a hang costs."""
    with Worker() as gpu:
        gpu.start()
        results = tmp_path_factory.mktemp("warm")
        ctx = Context(Problem(256, 256, 256), Settings(results=results, budget=0.1), gpu, compiler,
                      Leaderboard(results), "warm")
        assert [row["status"] for row in evaluate(ctx, [Candidate.from_source(fixture_source("honest"), "honest")])] == ["ok"]
        yield gpu


@pytest.mark.parametrize("shape", [(2048, 2048, 2048), (4096, 1024, 512), (1000, 1000, 1000)])
def test_the_honest_kernel_is_accepted_beside_faulting_ones_in_one_run(tmp_path, compiler, worker, shape):
    # a hang costs the timeout: at the first shape only
    variants = [v for v in EXPECTED if v != "hang" or shape == (2048, 2048, 2048)]
    settings = Settings(results=tmp_path, budget=0.2, timeout=15.0)
    ctx = Context(Problem(*shape), settings, worker, compiler, Leaderboard(tmp_path), "isolation")
    rows = {row["kernel"]: row for row in evaluate(ctx, [Candidate.from_source(fixture_source(v), v)
                                                          for v in variants])}
    report = {name: (row["status"], (row.get("error") or "")[:300]) for name, row in rows.items()}
    print(shape, report)
    assert {name: rows[name]["status"] for name in variants} == {v: EXPECTED[v] for v in variants}, report
    assert re.search(r"left cudaError\w+ pending", rows["swallowed"]["error"]), report  # (InvalidValue on CUDA 13)
    for name in ("honest", "leaves_error"):  # timed, in one session, each against its session's baselines
        assert rows[name]["speedup_offline"] > 0 and not rows[name].get("error"), report
