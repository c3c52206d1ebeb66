"""`llm-stage up` (the client's alias of `llm-runner up`) starts a deployment; `llm-stage generate`
streams through it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import solo

from llm_runner_svc.models import Model

LLM_STAGE = [str(Path(sys.executable).parent / "llm-stage")]  # the installed console script


def test_up_then_generate_streams_the_runners_output(stories: Model) -> None:
    up = subprocess.Popen([*LLM_STAGE, "up", "--port", "0"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
    try:
        lines = [up.stdout.readline(), up.stdout.readline()]
        stage = re.search(r"stage process (\d+) on", lines[0])
        orch = re.search(r"orchestrator listening on ([\d.]+:\d+)", lines[1])
        assert stage and orch, lines
        done = subprocess.run([*LLM_STAGE, "generate", "--target", orch.group(1), "--seed", "5",
                               "--temperature", "0.8", "--top-k", "40", "--max-tokens", "30",
                               "Once upon a time"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        tokens, text, reason = solo(stories, dict(text="Once upon a time", seed=5,
                                                  temperature=0.8, top_k=40, max_tokens=30))
        assert done.stdout == text + "\n"
        report = json.loads(done.stderr.strip().splitlines()[-1])
        assert report["finish_reason"] == reason and report["completion_tokens"] == len(tokens)
        diag = report["diagnostics"]["backbone"]
        assert diag["tokens_out"] == len(tokens) and diag["finish_reason"] == reason
        assert diag["sampling"]["seed"] == 5 and "timings" in diag
        bad = subprocess.run([*LLM_STAGE, "generate", "--target", orch.group(1),
                              "--top-p", "nan", "Hi"], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and "INVALID_ARGUMENT" in bad.stderr
    finally:
        up.send_signal(signal.SIGINT)
        assert up.wait(30) == 0
    child = int(stage.group(1))
    deadline = time.monotonic() + 10
    while True:  # the stage process is gone too
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "stage process outlived llm-stage up"
        time.sleep(0.05)
