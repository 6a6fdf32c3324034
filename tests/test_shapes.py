"""Shape sets: CSV files and model presets, and their bad input."""

import pytest

from cudal2.errors import Cudal2Error
from cudal2.problem import Problem
from cudal2.shapes import MODELS, preset, read_shapes, shape_set


def test_llama3_8b_preset_is_the_dev_sets_projections():
    # tests/shapes/dev.csv's llama3-8b rows at 16 tokens: qkv, o, gate+up, down.
    assert preset("llama3-8b", "16") == [Problem(16, 6144, 4096, "bf16", "nt"), Problem(16, 4096, 4096, "bf16", "nt"),
                                         Problem(16, 28672, 4096, "bf16", "nt"), Problem(16, 4096, 14336, "bf16", "nt")]
    assert len(preset("llama3-70b", "1,16,128,4096")) == 16
    assert preset("qwen2-7b", "8")[0] == Problem(8, 3584 + 2 * 4 * 128, 3584, "bf16", "nt")
    assert all(model.source.endswith("config.json") for model in MODELS.values())
    # token counts as Python gives them: an int, a list
    assert preset("llama3-8b", 16) == preset("llama3-8b", "16") and preset("llama3-8b", [1, 16]) == preset(
        "llama3-8b", "1,16")


def test_a_shape_file_saved_with_a_byte_order_mark_reads(tmp_path):
    path = tmp_path / "excel.csv"
    path.write_bytes("m,n,k\r\n128,64,64\r\n".encode("utf-8-sig"))
    assert read_shapes(path) == [Problem(128, 64, 64)]


def test_the_examples_shape_file_reads():
    from conftest import ROOT

    problems = read_shapes(ROOT / "examples" / "shapes.csv")
    assert Problem(128, 64, 64) in problems and len(problems) == len(set(problems))


def test_a_shape_file_names_its_defaults_and_its_bad_rows(tmp_path):
    good = tmp_path / "set.csv"
    good.write_text("m,n,k,dtype,layout,group\n4096,4096,4096,,,big\n16,4096,4096,bf16,nt,decode\n")
    assert read_shapes(good) == [Problem(4096, 4096, 4096), Problem(16, 4096, 4096, "bf16", "nt")]
    short = tmp_path / "short.csv"
    short.write_text("m,n,k\n64,64,64\n128,128\n")
    with pytest.raises(Cudal2Error, match=r"short.csv, line 3: k must be an integer"):
        read_shapes(short)
    typo = tmp_path / "typo.csv"
    typo.write_text("m,n,k,dtype\n64,64,64,fp61\n")
    with pytest.raises(Cudal2Error, match=r"line 2: unknown dtype 'fp61'"):
        read_shapes(typo)
    with pytest.raises(Cudal2Error, match="lacks column"):
        (tmp_path / "cols.csv").write_text("rows,cols\n1,2\n")
        read_shapes(tmp_path / "cols.csv")
    with pytest.raises(Cudal2Error, match="cannot read shape set"):
        read_shapes(tmp_path / "missing.csv")


def test_presets_and_files_refuse_bad_combinations():
    with pytest.raises(Cudal2Error, match="unknown model 'llama9'"):
        preset("llama9", "1")
    with pytest.raises(Cudal2Error, match="comma-separated integers"):
        preset("llama3-8b", "1,many")
    with pytest.raises(Cudal2Error, match="--tokens needs --model"):
        shape_set(tokens="16")
    assert shape_set() is None and len(shape_set(model="mistral-7b")) == 16
