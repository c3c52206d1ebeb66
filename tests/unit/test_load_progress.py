"""A model load is never a silent wait: where stderr is not a terminal (a log file, `up`'s
children) no bar can be drawn, so each load says one line as it starts; `--quiet` says
nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_gguf_loader import _write_tiny

from llm_runner_svc.cli_common import format_bytes, load_progress
from llm_runner_svc.models import load_model


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-qwen2.gguf"
    _write_tiny(path, "qwen2", np.random.default_rng(0))
    return path


def test_format_bytes_reads_as_a_person_would():
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(270 * (1 << 20) + (1 << 19)) == "270.5 MiB"
    assert format_bytes(3 * (1 << 30)) == "3.0 GiB"


def test_a_load_without_a_terminal_says_one_line_as_it_starts(tiny_gguf, capsys):
    with load_progress(is_quiet=False):
        load_model(str(tiny_gguf))
    err = capsys.readouterr().err
    size = format_bytes(tiny_gguf.stat().st_size)
    assert err == f"loading tiny-qwen2.gguf ({size}) ...\n"


def test_quiet_load_says_nothing(tiny_gguf, capsys):
    with load_progress(is_quiet=True):
        load_model(str(tiny_gguf))
    assert capsys.readouterr().err == ""


def test_generate_with_stderr_to_a_pipe_names_the_model_first(tiny_gguf):
    code = "import sys; from llm_runner_svc.cli import main; sys.exit(main(sys.argv[1:]))"
    res = subprocess.run(
        [sys.executable, "-c", code, "generate", "--model", str(tiny_gguf), "--max-tokens", "2",
         "--temperature", "0", "ab"],
        capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    lines = res.stderr.splitlines()
    assert lines[0] == f"loading tiny-qwen2.gguf ({format_bytes(tiny_gguf.stat().st_size)}) ..."
    assert lines[-1].startswith("[")  # the metrics line still comes last
