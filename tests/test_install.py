"""The install: nothing heavy comes for headers alone, the CUTLASS headers are fetched by
themselves where no package provides them, and what the docs say to pin is pinned."""

import tomllib

import pytest

from cudal2.kernels import compile as compile_stage

from conftest import ROOT


def test_the_install_brings_no_package_for_headers_alone():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [d.split(">")[0].split("=")[0].split("<")[0].strip() for d in project["dependencies"]]
    extras = project["optional-dependencies"]
    # nvidia-cutlass brings scipy and cuda-python; nvidia-cublas 551 MB of libraries: headers only
    assert "nvidia-cutlass" not in names and not any("cublas" in d for d in project["dependencies"] + extras["cuda13"])
    assert "cupti-python==13.0.1" in extras["cuda13"]  # docs/usage.md: newer CUPTI may refuse a 13.0 driver
    assert any(d.startswith("torch") for d in extras["torch"])  # the PyTorch path has its extra


def test_cutlass_headers_are_fetched_alone_into_the_cache(tmp_path):
    base = compile_stage.fetch_cutlass_headers(tmp_path)
    version = (base / "include" / "cutlass" / "version.h").read_text()
    assert "CUTLASS_MAJOR" in version and (base / "tools" / "util" / "include" / "cutlass").is_dir()
    assert not list(tmp_path.rglob("*.whl")) and not list(tmp_path.rglob("*.py"))  # headers, nothing else
    assert compile_stage.fetch_cutlass_headers(tmp_path) == base  # once


def test_headers_that_cannot_be_fetched_are_one_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(compile_stage, "CUTLASS_WHEEL", "nvidia-cutlass==0.0.0")  # no such release
    with pytest.warns(UserWarning, match="CUTLASS headers not found and not fetched"):
        base = compile_stage.fetch_cutlass_headers(tmp_path)
    assert not (base / "include").exists()
