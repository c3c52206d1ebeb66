"""The README's Test section is what CI runs: its install line and its test command are lines of
.ci/run, and the extras it names exist. Without the optional packages, collecting the suite
skips the modules that need them instead of stopping at an import error."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Import names of the packages our extras bring (torch, onnx, tensorrt, and dev's ML libraries).
OPTIONAL_MODULES = ("torch", "transformers", "peft", "triton", "onnx", "onnxruntime",
                    "tensorrt", "tensorrt_rtx", "cuda")


def _readme_test_block() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Test\n", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "README's Test section has no bash block"
    return [line.strip() for line in block.group(1).splitlines() if line.strip()]


def _ci_lines() -> list[str]:
    return [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()]


def _readme_command(prefix: str) -> str:
    lines = [line for line in _readme_test_block() if line.startswith(prefix)]
    assert len(lines) == 1, f"README's Test block should have one `{prefix}` line: {lines}"
    return lines[0]


def test_ci_runs_the_readmes_install_line():
    install = _readme_command("pip install -e ")
    assert install in _ci_lines(), f".ci/run does not run the README's `{install}`"


def test_ci_runs_the_readmes_test_command():
    command = _readme_command("python -m pytest")
    runs = [line for line in _ci_lines()
            if line == command or line.startswith(command + " ||")]
    assert runs, f".ci/run does not run the README's `{command}`"


def test_readme_names_extras_that_exist():
    install = _readme_command("pip install -e ")
    named = re.search(r"\.\[([^\]]*)\]", install)
    assert named, f"the install line names no extras: {install}"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert set(named.group(1).split(",")) <= set(extras)


BLOCKER = f"""
import sys
BLOCKED = {set(OPTIONAL_MODULES)!r}
class _Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, _Blocker())
"""


def test_collection_skips_modules_whose_optional_packages_are_missing(tmp_path):
    (tmp_path / "block_optional.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "block_optional", "--collect-only", "-q",
         "-p", "no:cacheprovider", str(ROOT / "tests")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    report = res.stdout + res.stderr
    assert res.returncode == 0, report[-4000:]
    assert "ERROR" not in report, report[-4000:]
    assert "could not import 'torch'" in report  # the blocker was in force
