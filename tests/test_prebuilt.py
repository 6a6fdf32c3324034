"""The prebuilt kernel set: chosen from measurements and the cost model, built once into the
compile cache (resuming where a build stopped), and carried to another machine's cache."""

import importlib.util
import json

import pandas as pd
import pytest
from typer.testing import CliRunner

from cudal2.kernels import prebuilt
from cudal2.cli import app
from cudal2.kernels.compile import Compiler
from cudal2.search.cost import predict_us, rank, recorded_device
from cudal2.results.leaderboard import priors, shipped
from cudal2.problem import Problem
from cudal2.kernels.render import get_template, load_templates, render, template_candidate

from conftest import ROOT


def measured(rows):
    base = {"gpu": "NVIDIA H200", "cc": 90, "sm_count": 132, "max_sm_clock_mhz": 1980, "status": "ok",
            "template": "sm80_mma", "dtype": "fp16", "layout": "nn", "m": 512, "n": 512, "k": 512,
            "protocol": "cupti-graph-3"}
    return pd.DataFrame([{**base, **r} for r in rows])


def sm80(**params):
    return json.dumps({"block_m": 64, "block_n": 64, "block_k": 32, "warps_m": 2, "warps_n": 2, "stages": 3, **params})


# Ranking a whole space for one region takes seconds (five for sm90_cutlass's 300,000
# configurations on one core): these tests rank two regions' problems, not all of REGIONS,
# and each of those once (the same problems and device in both tests).
SOME_REGIONS = {name: prebuilt.REGIONS[name] for name in ("tiny", "large")}


@pytest.fixture(scope="module")
def rankings() -> dict:
    return {}


@pytest.fixture
def some_regions(monkeypatch, rankings):
    """prebuilt.kernel_set over SOME_REGIONS, each region's ranking computed once a module."""
    real = prebuilt.rank

    def rank(templates, problem, device):
        key = (tuple(templates), problem, json.dumps(device, sort_keys=True))
        if key not in rankings:
            rankings[key] = real(templates, problem, device)
        return rankings[key]

    monkeypatch.setattr(prebuilt, "REGIONS", SOME_REGIONS)
    monkeypatch.setattr(prebuilt, "rank", rank)


def test_the_set_holds_the_near_best_of_every_measured_problem_and_the_cost_model_s_picks(some_regions):
    rows = measured([
        {"params": sm80(stages=3), "speedup_offline": 1.10},   # the best of its problem
        {"params": sm80(stages=4), "speedup_offline": 1.085},  # within 2%: in
        {"params": sm80(stages=2), "speedup_offline": 1.00},   # 9% behind: out
        # another protocol's rows are compared among themselves: its best is in
        {"params": sm80(stages=2), "speedup_offline": 0.70, "protocol": "fenced", "dtype": "bf16", "layout": "nt"},
        {"params": sm80(stages=5), "speedup_offline": 2.00, "cc": 80, "gpu": "NVIDIA A100"},  # another arch: out
    ])
    entries = prebuilt.kernel_set(90, rows)
    measured_in = {(json.loads(e.candidate.params_json)["stages"], e.dtype, e.layout) for e in entries
                   if "of the best" in e.why}
    assert measured_in == {(3, "fp16", "nn"), (4, "fp16", "nn"), (2, "bf16", "nt")}
    # the cost model's best few in every region, for both of a model's usual variants
    picks = [e for e in entries if "cost model" in e.why]
    device = recorded_device(rows, "NVIDIA H200")
    for region, (m, n, k) in prebuilt.REGIONS.items():
        for dtype, layout in prebuilt.VARIANTS:
            mine = [e for e in picks if f"for {region} (" in e.why and (e.dtype, e.layout) == (dtype, layout)]
            assert mine
            # configurations the model prices alike are one pick, not three builds of a tile
            # that differ in what the model cannot tell apart
            prices = [(e.candidate.template, round(predict_us(get_template(e.candidate.template), e.candidate.param_dict,
                                                             Problem(m, n, k, dtype, layout), device), 3)) for e in mine]
            assert len(set(prices)) == len(prices), (region, dtype, prices)
    assert len({(str(e.candidate), e.dtype, e.layout) for e in entries}) == len(entries)


def test_a_near_best_kernel_of_a_template_that_serves_some_problems_only_is_in_the_set():
    # sm90_splitk serves K >= 1024 alone (its `requires`); its best at 2048x64x16384 is built
    # before any run, like every other template's
    splitk = {"block_m": 128, "block_n": 64, "stages": 6, "producer": "warp", "split_k": 2, "k_clusters": 8}
    rows = measured([{"template": "sm90_splitk", "params": json.dumps(splitk), "speedup_offline": 0.9,
                      "m": 2048, "n": 64, "k": 16384}])
    [entry] = prebuilt.kernel_set(90, rows, regions=False)
    # (a row recorded before a parameter existed reads as its default)
    assert (entry.candidate.template, entry.candidate.param_dict, entry.dtype) == ("sm90_splitk", {**splitk, "fixup": "workspace", "epilogue": "smem", "schedule": "tile", "n_parts": 1}, "fp16")


def test_caps_that_launch_alike_on_the_problem_that_put_them_there_are_built_once():
    """sm90_splitk's k_clusters is a cap: at 256x1024x14336 one wave holds 8 clusters of each of
    the 16 tiles of 128x128, so caps 8, 16 and 32 ran the same kernel work there (measured within
    2% of each other, a single build's noise). The fastest of them is built, not all three; a cap
    that launches fewer clusters there is a kernel of its own."""
    spread = {"block_m": 128, "block_n": 128, "stages": 4, "producer": "warp", "split_k": 1, "fixup": "spread"}
    rows = measured([{"template": "sm90_splitk", "params": json.dumps({**spread, "k_clusters": cap}), "speedup_offline": s,
                      "m": 256, "n": 1024, "k": 14336} for cap, s in ((32, 0.86), (8, 0.858), (16, 0.852), (4, 0.855))])
    caps = sorted(e.candidate.param_dict["k_clusters"] for e in prebuilt.kernel_set(90, rows, regions=False))
    assert caps == [4, 32]


def test_the_h100s_shipped_winners_are_built_and_start_an_h100_search():
    """The shipped measurements hold the H100's rows beside the H200's: what won there is in the
    sm_90a set (one build serves both GPUs), and an H100 run's search starts from them (its
    priors), not from nothing. At 768x512x2048 fp16 nn a swapped 64x48 tile, a CTA a tile,
    measured best on the H100 (1.036 of the fastest library call), where the cost model puts
    an unswapped 64x64 first."""
    h100 = "NVIDIA H100 80GB HBM3"
    rows = shipped(None)
    narrow = {"swap_ab": "yes", "tile_m": 64, "tile_n": 48, "tile_k": 128, "kernel_schedule": "warpspecialized"}
    built = [e for e in prebuilt.kernel_set(90, rows, regions=False)
             if e.candidate.template == "sm90_cutlass" and narrow.items() <= e.candidate.param_dict.items()]
    assert [(e.dtype, e.layout) for e in built] == [("fp16", "nn")] and "768x512x2048" in built[0].why
    first = priors(rows.iloc[:0], h100)
    assert first and {r["gpu"] for r in first} == {h100}
    here = [r for r in first if (r["m"], r["n"], r["k"]) == (768, 512, 2048)]
    assert narrow.items() <= json.loads(here[0]["params"]).items()  # its best first
    h200 = priors(rows.iloc[:0], "NVIDIA H200")
    assert h200 and {r["gpu"] for r in h200} == {"NVIDIA H200"}


def fp16_nn_set_of(monkeypatch, *names):
    """Those regions (by name, from prebuilt.REGIONS) and the fp16 nn set of their picks."""
    regions = {name: prebuilt.REGIONS[name] for name in names}
    monkeypatch.setattr(prebuilt, "REGIONS", regions)
    monkeypatch.setattr(prebuilt, "VARIANTS", (("fp16", "nn"),))
    return regions, prebuilt.kernel_set(90, measured([{"params": sm80(), "speedup_offline": 1.0}]))


def test_a_wide_output_of_fewer_tiles_than_sms_and_a_long_k_finds_a_kernel_that_fills_one_wave_built(monkeypatch):
    # 1024x1024 is 64 tiles of 128x128 on 132 SMs: without K cut in two, half the GPU idles;
    # cut in four, the CTAs run in two waves. A time-budgeted run measures only what is built.
    # (The region's picks are sm90_splitk's split tiles; sm90_cutlass's split-K counts alike.)
    region, entries = fp16_nn_set_of(monkeypatch, "wide few tiles, long-K")
    problem = Problem(*region["wide few tiles, long-K"])
    waves = []
    for entry in entries:
        if "cost model" in entry.why:
            space = get_template(entry.candidate.template).space
            launch = space.cost_inputs(entry.candidate.param_dict, 90, problem, 132)
            waves.append(launch["tiles"] * launch["split_k"] / 132)
    assert waves and any(0.5 < w <= 1.0 for w in waves), waves


def test_a_skinny_short_k_output_with_a_long_side_finds_a_one_wave_tiling_built(monkeypatch):
    # 12288x128 (and 128x12288) with K = 128: in 128x128 tiles, 96 CTAs stream the long operand
    # on 132 SMs (the shipped rows: 0.74-0.88 of the library); the regions' picks tile it in
    # about one wave of 64-row tiles, swapped where C is tall (its M along the GMMA's N).
    regions, entries = fp16_nn_set_of(monkeypatch, "skinny short-K, tall", "skinny short-K, wide")
    space = get_template("sm90_cutlass").space
    for name, shape in regions.items():
        # the tiles as the space counts them (swapped operands tile C^T)
        waves = [space.cost_inputs(entry.candidate.param_dict, 90, Problem(*shape), 132)["tiles"] / 132
                 for entry in entries if name in entry.why and entry.candidate.template == "sm90_cutlass"]
        assert waves and all(0.75 < w <= 1.0 for w in waves), (name, waves)


def test_a_few_tile_output_with_a_mid_k_finds_narrow_swapped_tiles_that_fill_one_wave_built(monkeypatch):
    # 3072x384 and 4096x192 are 24 and 64 tiles of 128x128 on 132 SMs; cuBLASLt runs one wave
    # of 128x80 and 64x96 tiles there. The regions' picks are swapped tiles that narrow.
    regions, entries = fp16_nn_set_of(monkeypatch, "few tiles, mid-K, tall", "few tiles, mid-K, thin")
    space = get_template("sm90_cutlass").space
    for name, shape in regions.items():
        picks = [e.candidate.param_dict for e in entries if name in e.why and e.candidate.template == "sm90_cutlass"]
        narrow = [params for params in picks if params["tile_n"] in (48, 80, 96, 112)]
        assert narrow, name
        for params in narrow:
            assert params["swap_ab"] == "yes" and params["kernel_schedule"] == "warpspecialized"
            assert 0.8 < space.cost_inputs(params, 90, Problem(*shape), 132)["tiles"] / 132 <= 1.0, (name, params)


def test_one_build_serves_every_shape_of_its_dtype_and_layout():
    for name in load_templates():
        candidate = template_candidate(name, {}, 90)
        assert render(candidate, Problem(128, 64, 64)) == render(candidate, Problem(4095, 4097, 1001))


@pytest.mark.nvcc
def test_a_build_resumes_and_travels_to_another_machine_as_a_tarball(tmp_path):
    rows = measured([{"params": sm80(stages=3), "speedup_offline": 1.1},
                     {"params": sm80(stages=4), "speedup_offline": 1.09}])
    entries = prebuilt.kernel_set(90, rows, regions=False)
    assert len(entries) == 2
    here = Compiler("sm_90a", tmp_path / "here", jobs=2)
    heard = []
    builds = prebuilt.build(entries[:1], here, lambda done, total, e, b: heard.append((done, total, b.cached)))
    assert builds[0].status == "ok" and heard == [(1, 1, False)]
    heard.clear()
    prebuilt.build(entries, here, lambda done, total, e, b: heard.append(b.cached))  # resumes: one new
    assert sorted(heard) == [False, True]
    tarball = tmp_path / "set.tar.gz"
    assert prebuilt.pack(entries, here, tarball) == 2
    there = Compiler("sm_90a", tmp_path / "there")
    assert prebuilt.unpack(tarball, tmp_path / "there") == 2
    assert all(there.lookup(e.source).status == "ok" for e in entries)
    assert prebuilt.unpack(tarball, tmp_path / "there") == 0  # kept, not written again
    # A download cut short, even by its last bytes only, is refused in one line and adds nothing.
    for cut in (8, tarball.stat().st_size // 2):
        truncated = tmp_path / f"cut-{cut}.tar.gz"
        truncated.write_bytes(tarball.read_bytes()[:-cut])
        refused = CliRunner(env={"CUDAL2_CACHE_DIR": str(tmp_path / "cut")}).invoke(
            app, ["prebuild", "--unpack", str(truncated)])
        assert refused.exit_code == 1 and refused.output.count("\n") == 1, refused.output
        assert refused.output.startswith(f"error: cannot unpack {truncated}: the tarball is truncated")
        assert not [p for p in (tmp_path / "cut").rglob("*") if p.is_file()]  # nothing half-unpacked
    # or straight from another cache directory
    assert prebuilt.unpack(tmp_path / "here", tmp_path / "third") == 2
    # Each cache's manifest lists what of the set it holds (what the search starts from
    # without ranking the spaces again), once, whatever the way the builds came.
    listed = lambda cache: sorted((str(e.candidate), e.dtype, e.layout, e.why) for e in prebuilt.manifest(cache, "sm_90a"))
    expected = sorted((str(e.candidate), e.dtype, e.layout, e.why) for e in entries)
    assert listed(tmp_path / "here") == listed(tmp_path / "there") == listed(tmp_path / "third") == expected
    assert prebuilt.manifest(tmp_path / "here", "sm_80") == []
    # What the search starts from: the manifest's entries (a region pick no measurement names
    # among them) before the measured part of the set, each once.
    pick = prebuilt.Entry(template_candidate("sm80_mma", {"stages": "5"}, 90), "fp16", "nn", "cost model's #1 for a test")
    prebuilt.build([pick], there)
    starts = prebuilt.available(tmp_path / "there", "sm_90a", rows)
    assert [str(e.candidate) for e in starts] == [str(e.candidate) for e in entries + [pick]]
    assert prebuilt.available(tmp_path / "elsewhere", "sm_90a", rows[:0]) == []
    # A build stopped after its first finished compile (Ctrl-C, say) has that one listed.
    stopped = tmp_path / "stopped"

    def stop(done, total, entry, build):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prebuilt.build(entries, Compiler("sm_90a", stopped, jobs=1), stop)
    assert len(prebuilt.manifest(stopped, "sm_90a")) == 1


def test_a_tarball_that_is_not_a_cache_is_refused(tmp_path):
    import tarfile

    bad = tmp_path / "bad.tar.gz"
    (tmp_path / "evil").write_text("x")
    with tarfile.open(bad, "w:gz") as tar:
        tar.add(tmp_path / "evil", arcname="../evil")
    with pytest.raises(Exception, match="not a kernel build"):
        prebuilt.unpack(bad, tmp_path / "cache")
    # A tar cut at a member's boundary reads as a shorter archive: without the manifest that
    # `pack` writes last, it is refused, and none of its builds is added.
    build = tmp_path / "kernels" / "ab" / "abcdef"
    build.mkdir(parents=True)
    (build / "build.json").write_text("{}")
    headless = tmp_path / "headless.tar.gz"
    with tarfile.open(headless, "w:gz") as tar:
        tar.add(tmp_path / "kernels", arcname="kernels")
    with pytest.raises(Exception, match="ends before its manifest"):
        prebuilt.unpack(headless, tmp_path / "cache")
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]


def test_the_cli_lists_the_h200_set_from_the_shipped_measurements(tmp_path, some_regions):
    out = CliRunner().invoke(app, ["prebuild", "--arch", "sm_90a", "--list", "--json", "--results", str(tmp_path)])
    assert out.exit_code == 0, out.output
    listed = json.loads(out.stdout)
    assert "choosing the set: cost model ranking 1/" in out.stderr  # minutes of ranking are not silent
    families = {r["kernel"].split("(")[0] for r in listed}
    # the measured winners' families (gemv where a decode shape was measured), nothing else
    assert len(listed) > 50 and {"sm80_mma", "sm90_cutlass"} <= families <= {"sm80_mma", "sm90_cutlass", "gemv", "sm90_splitk"}
    none = CliRunner().invoke(app, ["prebuild", "--arch", "sm_100a", "--list", "--results", str(tmp_path)])
    assert none.exit_code != 0 and "no measurements" in none.output


def test_prebuild_and_compile_take_this_gpus_target_where_no_arch_is_named(tmp_path, some_regions, monkeypatch):
    # `--arch` says "default: the GPU's"; a GPU machine's prebuild had stopped at "needs --arch".
    import cudal2.cli.kernels as kernels

    monkeypatch.delenv("CUDAL2_ARCH", raising=False)
    monkeypatch.setattr(kernels, "listed_cc", lambda device=0: None)  # a CPU build host
    for args in (["prebuild", "--list", "--results", str(tmp_path)], ["compile", "--template", "sm80_mma", "--jobs", "1"]):
        out = CliRunner().invoke(app, args)
        assert out.exit_code == 1 and f"{args[0]} needs --arch (e.g. sm_90a) or CUDAL2_ARCH: no GPU here" in out.output
    named = CliRunner().invoke(app, ["prebuild", "--arch", "sm_90a", "--list", "--json", "--results", str(tmp_path)])
    monkeypatch.setattr(kernels, "listed_cc", lambda device=0: 90)  # an H100 or H200, as nvidia-smi lists it
    taken = CliRunner().invoke(app, ["prebuild", "--list", "--json", "--results", str(tmp_path)])
    assert taken.exit_code == 0 and json.loads(taken.stdout) == json.loads(named.stdout)


def test_the_coverage_script_prices_the_sets_best_against_the_whole_spaces():
    """scripts/prebuilt_coverage.py: where the set holds the model's pick the ratio is 1; where
    it holds nothing of a shape's dtype and layout, the shape is priced as uncovered."""
    path = ROOT / "scripts" / "prebuilt_coverage.py"
    spec = importlib.util.spec_from_file_location("prebuilt_coverage", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    templates, device = load_templates(), recorded_device(shipped(None), "NVIDIA H200")
    fp16, bf16 = Problem(128, 64, 64), Problem(128, 64, 64, "bf16", "nt")
    price, name, params = rank(templates, fp16, device)[0]
    entries = [{"template": name, "params": params, "dtype": "fp16", "layout": "nn"},
               {"template": None, "params": None, "dtype": "bf16", "layout": "nt"}]  # a free-form kernel
    (_, in_set, best), (_, none, _) = script.coverage([fp16, bf16], entries, templates, device)
    assert in_set[0] == best[0] == price and in_set[1] == name
    assert none == (float("inf"), None, None)
