"""Where GPU and nvcc availability is decided, once: markers `gpu` and `nvcc` skip cleanly
on machines without them and run for real where they exist."""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

import jinja2
import pytest

from cudal2_cli.compile import Compiler

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "kernels"


@functools.cache
def gpu_count() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


@functools.cache
def gpu_cc() -> int:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(0)
    return props["major"] * 10 + props["minor"]


def pytest_collection_modifyitems(config, items):
    no_gpu = pytest.mark.skip(reason="no CUDA GPU on this machine (run `pytest -m gpu` on one)")
    no_nvcc = pytest.mark.skip(reason="nvcc not found")
    for item in items:
        if "gpu" in item.keywords and gpu_count() == 0:
            item.add_marker(no_gpu)
        if ("nvcc" in item.keywords or "gpu" in item.keywords) and shutil.which("nvcc") is None:
            item.add_marker(no_nvcc)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One kernel cache for the whole session, so each source compiles once;
    $CUDAL2_CACHE_DIR shares it with other runs (a GPU session's measurements)."""
    shared = os.environ.get("CUDAL2_CACHE_DIR")
    return Path(shared) if shared else tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def arch() -> str:
    from cudal2_cli.environment import default_arch

    return default_arch(gpu_cc()) if gpu_count() else "sm_90a"


@pytest.fixture(scope="session")
def compiler(cache_dir, arch) -> Compiler:
    return Compiler(arch, cache_dir)


def fixture_source(variant: str) -> str:
    """tests/kernels/simt.cu.j2 rendered as `variant` (honest, or one way to cheat)."""
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(FIXTURES), undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True)
    return env.get_template("simt.cu.j2").render(variant=variant)
