"""The README's Python blocks run as written: each is saved as a script and run in a fresh
interpreter from the repository root, as a reader would paste it into a file (a GPU block at a
module's top level, with no `__main__` guard: the GPU worker must not re-run the script).
Blocks that measure need a GPU: they run with `pytest -m gpu` and skip here with that reason.
The PyTorch section's block serves a library exported beforehand; the op's tests cover it."""

import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

GPU_CALLS = ("cudal2.bench(", "cudal2.optimize(", "cudal2.check(", 'device="cuda"')


def readme_blocks() -> list[tuple[str, str]]:
    """(section heading, code) of every ```python block of README.md."""
    text = (ROOT / "README.md").read_text()
    found, section = [], ""
    for part in re.split(r"^(## .*)$", text, flags=re.M):
        if part.startswith("## "):
            section = part[3:].strip()
            continue
        found += [(section, code) for code in re.findall(r"```python\n(.*?)```", part, flags=re.S)]
    return found


BLOCKS = [pytest.param(code, id=f"{section}-{i}", marks=[pytest.mark.gpu] if any(c in code for c in GPU_CALLS) else [])
          for i, (section, code) in enumerate(readme_blocks()) if section != "PyTorch"]


def test_the_readme_has_python_blocks_to_run():
    assert len(BLOCKS) >= 2 and any(not p.marks for p in BLOCKS)  # one runs on every machine


@pytest.mark.parametrize("code", BLOCKS)
def test_a_readme_python_block_runs_as_a_script(code, tmp_path, cache_dir):
    script = tmp_path / "readme_block.py"
    script.write_text(code)
    env = {**os.environ, "CUDAL2_RESULTS": str(tmp_path / "results"), "CUDAL2_CACHE_DIR": str(cache_dir),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr and done.stdout.strip()
