from pathlib import Path

import pytest

from cudal2.config import load_settings
from cudal2.errors import Cudal2Error


def test_precedence_cli_over_env_over_file_over_defaults(tmp_path, monkeypatch):
    cfg = tmp_path / "cudal2.toml"
    cfg.write_text('[cudal2]\nbudget = 3.0\nqps = 50\nresults = "from-file"\n')
    monkeypatch.setenv("CUDAL2_CONFIG", str(cfg))
    monkeypatch.setenv("CUDAL2_QPS", "75")
    s = load_settings({"results": None, "budget": 0.5})
    assert s.budget == 0.5 and s.qps == 75.0 and s.results == Path("from-file")
    assert s.timeout == 600.0  # default


def test_cache_dir_honours_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("CUDAL2_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert load_settings().cache_dir == tmp_path / "cudal2"


@pytest.mark.parametrize("text, message", [
    ("[cudal2]\nbugdet = 1\n", "unknown setting 'bugdet'"),
    ("[cudal2]\nbudget = 'lots'\n", "bad value 'lots' for setting budget"),
    ("[cudal2\n", "bad config"),
    ("[cudal2]\nbudget = -1\n", "budget must be > 0"),
])
def test_bad_config_is_named(tmp_path, text, message):
    cfg = tmp_path / "c.toml"
    cfg.write_text(text)
    with pytest.raises(Cudal2Error, match=message):
        load_settings(config=cfg)


def test_missing_config_file_named_explicitly(tmp_path):
    with pytest.raises(Cudal2Error, match="cannot read config"):
        load_settings(config=tmp_path / "absent.toml")
