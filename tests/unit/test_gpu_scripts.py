"""The GPU runners (benchmarks/gpu_*.sh) parse, and their shared setup (gpu_env.sh) installs
the carried wheels, orders PYTHONPATH and records the GPU, on a machine with no GPU: a
stand-in `nvidia-smi` answers for it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "benchmarks").glob("gpu_*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_runner_parses(script: Path) -> None:
    subprocess.run(["bash", "-n", str(script)], check=True)


def _wheel(where: Path, name: str) -> None:
    """A wheel of a one-module package `name` (version 1.0) whose NAME is its name."""
    dist = f"{name}-1.0.dist-info"
    with zipfile.ZipFile(where / f"{name}-1.0-py3-none-any.whl", "w") as z:
        z.writestr(f"{name}.py", f"NAME = {name!r}\n")
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: "
                   "true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")


def _setup(tmp_path: Path, *args: str) -> dict[str, str]:
    repo, bin_dir, out = tmp_path / "repo", tmp_path / "bin", tmp_path / "out"
    (repo / "benchmarks").mkdir(parents=True)
    shutil.copy(ROOT / "benchmarks" / "gpu_env.sh", repo / "benchmarks")
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'name, memory.total'\necho 'Stand-in GPU, 1 MiB'\n")
    smi.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "OUT": str(out), "SITE": str(tmp_path / "site")}
    quoted = " ".join(f"'{a}'" for a in args)
    done = subprocess.run(
        ["bash", "-c", "set -uo pipefail; . benchmarks/gpu_env.sh; "
         f"gpu_setup {quoted} > /dev/null; echo \"rc=$?\"; echo \"PYTHONPATH=${{PYTHONPATH:-}}\"; "
         "echo \"OUT=$OUT\""],
        cwd=repo, env=env, capture_output=True, text=True, check=True)
    return dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)


def test_setup_without_wheels(tmp_path: Path) -> None:
    got = _setup(tmp_path, "/extra/one", "/extra/two")
    repo = tmp_path / "repo"
    assert got["rc"] == "0"
    assert got["PYTHONPATH"].split(":") == [
        str(tmp_path / "site"), "/extra/one", "/extra/two", str(repo), f"{repo}/clients/python"]
    assert got["OUT"] == str(tmp_path / "out")
    assert "Stand-in GPU" in (tmp_path / "out" / "gpu.txt").read_text()


def test_setup_installs_the_carried_wheels(tmp_path: Path) -> None:
    whl = tmp_path / "repo" / ".whl"
    whl.mkdir(parents=True)
    _wheel(whl, "carried_probe_pkg")
    got = _setup(tmp_path)
    assert got["rc"] == "0"
    assert (tmp_path / "site" / "carried_probe_pkg.py").read_text() == \
        "NAME = 'carried_probe_pkg'\n"


def test_setup_fails_on_a_broken_wheel(tmp_path: Path) -> None:
    whl = tmp_path / "repo" / ".whl"
    whl.mkdir(parents=True)
    (whl / "broken-1.0-py3-none-any.whl").write_bytes(b"not a zip")
    assert _setup(tmp_path)["rc"] == "1"
