"""`llm-runner up` and the orchestrator speak as the command the user ran: `up`'s lines start
with `llm-runner:` (`llm-stage:` under the client's alias, whose usage names it too), the
orchestrator served alone starts its line with its own name; `up --metrics-port` serves the
orchestrator's metrics; every subcommand describes itself in --help."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from deployment import Deployment

from llm_runner_svc.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
RUNNER = [sys.executable, "-m", "llm_runner_svc"]
STAGE = [sys.executable, "-m", "llm_stage_client.cli"]
LONG = 120.0


def _until_listening(proc: subprocess.Popen, marker: str) -> list[str]:
    assert proc.stdout is not None
    lines: list[str] = []
    while not lines or marker not in lines[-1]:
        line = proc.stdout.readline()
        assert line, f"ended: {proc.wait(LONG)} {lines}"
        lines.append(line.rstrip("\n"))
    return lines


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(LONG)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_up_labels_its_lines_and_serves_the_orchestrators_metrics() -> None:
    proc = subprocess.Popen([*RUNNER, "up", "--port", "0", "--no-http", "--metrics-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            cwd=ROOT)
    try:
        lines = _until_listening(proc, "orchestrator listening on")
        assert all(line.startswith("llm-runner: ") for line in lines), lines
        m = re.search(r"metrics on ([\d.]+:\d+)$", lines[-1])
        assert m, lines[-1]
        text = urllib.request.urlopen(f"http://{m.group(1)}/metrics", timeout=30).read()
        assert b"llmstage_orchestrator_requests_running" in text
    finally:
        _stop(proc)
    assert proc.returncode == 0


def test_up_refuses_a_metrics_port_out_of_range() -> None:
    res = subprocess.run([*RUNNER, "up", "--port", "0", "--metrics-port", "70000"],
                         capture_output=True, text=True, timeout=LONG, cwd=ROOT)
    assert res.returncode == 2
    assert res.stderr == ("llm-runner: INVALID_ARGUMENT: --metrics-port must be in 0..65535, "
                          "got 70000\n")


def test_llm_stage_up_names_itself() -> None:
    res = subprocess.run([*STAGE, "up", "--help"], capture_output=True, text=True,
                         timeout=LONG, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("usage: llm-stage up "), res.stdout[:200]
    res = subprocess.run([*STAGE, "up", "--port", "0", "--metrics-port", "-1"],
                         capture_output=True, text=True, timeout=LONG, cwd=ROOT)
    assert res.returncode == 2 and res.stderr.startswith("llm-stage: INVALID_ARGUMENT: ")


def test_the_orchestrator_alone_starts_its_line_with_its_name(tmp_path: Path) -> None:
    dep = Deployment(tmp_path)  # `python -m services.orchestrator` over one stage process
    try:
        assert re.fullmatch(r"orchestrator listening on 127\.0\.0\.1:\d+ \(stages: backbone\)",
                            dep.line.rstrip("\n")), dep.line
    finally:
        dep.close()


@pytest.mark.parametrize("command", ["generate", "serve", "up", "build-engine"])
def test_every_subcommand_describes_itself(command: str) -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a.choices, dict))
    assert sub.choices is not None
    description = sub.choices[command].description  # type: ignore[index]
    assert description and len(description.split()) >= 8, description
