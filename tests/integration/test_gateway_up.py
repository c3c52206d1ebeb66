"""`llm-stage up` starts the HTTP gateway with the deployment: it answers the text
`llm-stage generate` prints, stops with the rest on Ctrl-C (with one process each, or two
workers each), and a busy --http-port stops the command before any stage starts."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess

import pytest
from http_gateway import ENV, LLM_STAGE, LONG, ROOT, llm_stage_generate, request


@pytest.mark.parametrize("workers", [1, 2])
def test_up_serves_the_openai_api_too(workers: int) -> None:
    up = subprocess.Popen([*LLM_STAGE, "up", "--port", "0", "--workers", str(workers)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                          cwd=ROOT)
    try:
        assert up.stdout is not None
        lines = [up.stdout.readline() for _ in range(3)]
        orch = re.search(r"orchestrator listening on ([\d.]+:\d+)", lines[1])
        gw = re.search(r"gateway listening on (http://[\d.]+:\d+)", lines[2])
        assert orch and gw, lines
        if workers > 1:
            assert all(f"[{workers} workers]" in line for line in lines[1:]), lines
        expected = llm_stage_generate(orch.group(1), "The dog", "--temperature", "0",
                                      "--max-tokens", "12")
        status, _, body = request(f"{gw.group(1)}/v1/completions", {
            "model": "backbone", "prompt": "The dog", "temperature": 0, "max_tokens": 12})
        assert status == 200 and body["choices"][0]["text"] == expected
        assert request(f"{gw.group(1)}/health")[0] == 200
    finally:
        up.send_signal(signal.SIGINT)
        assert up.wait(LONG) == 0
    assert "Traceback" not in up.stderr.read()  # type: ignore[union-attr]


def test_a_busy_http_port_stops_up_before_the_stages() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run([*LLM_STAGE, "up", "--port", "0", "--http-port", str(port)],
                              capture_output=True, text=True, timeout=LONG, env=ENV, cwd=ROOT)
    assert done.returncode == 2 and "stage process" not in done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f"cannot listen on 127.0.0.1:{port}" in lines[0], done.stderr
    assert "--http-port" in lines[0]


def test_a_topology_names_the_served_model(tmp_path) -> None:
    name = "karpathy/tinyllamas-stories260K"
    topology = tmp_path / "named.json"
    topology.write_text(json.dumps({
        "stages": [{"id": "backbone", "runner": "llm.backbone", "emits": ["text", "tokens"],
                    "inputs": ["request:prompt"], "launch": {"replicas": 1},
                    "servedModelName": name}],
        "sinks": ["backbone:text"], "defaultSinks": ["backbone:text"]}))
    up = subprocess.Popen([*LLM_STAGE, "up", "--port", "0", "--topology", str(topology)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                          cwd=ROOT)
    try:
        assert up.stdout is not None
        lines = [up.stdout.readline()]
        while "gateway listening" not in lines[-1] and lines[-1] and len(lines) < 5:
            lines.append(up.stdout.readline())
        gw = re.search(r"gateway listening on (http://[\d.]+:\d+)", lines[-1])
        assert gw, lines
        status, _, models = request(f"{gw.group(1)}/v1/models")
        assert status == 200 and [m["id"] for m in models["data"]] == [name]
        status, _, body = request(f"{gw.group(1)}/v1/completions", {
            "model": name, "prompt": "The dog", "temperature": 0, "max_tokens": 4})
        assert status == 200 and body["model"] == name, body
        status, _, tokens = request(f"{gw.group(1)}/tokenize", {"model": name,
                                                                 "prompt": "The dog"})
        assert status == 200 and tokens["count"] == body["usage"]["prompt_tokens"]
    finally:
        up.send_signal(signal.SIGINT)
        assert up.wait(LONG) == 0
