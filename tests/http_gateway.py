"""A real `python -m services.gateway` process in front of a test deployment, and plain-HTTP
helpers (urllib and http.client only, so these checks do not lean on the `openai` package)."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from deployment import _metrics, _start, terminate

ROOT = Path(__file__).resolve().parents[1]
LLM_STAGE = [sys.executable, "-m", "llm_stage_client.cli"]
# This checkout's code, whatever the installed console scripts point at.
ENV = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT / "clients" / "python"),
                                                   str(ROOT)])}
LONG = 120.0  # generous: the machine may be loaded; nothing waits this long when it works


class GatewayProc:
    """The gateway on a free loopback port (metrics on another), pointed at `target`."""

    def __init__(self, target: str, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc, endpoint, line = _start(
            ["-m", "services.gateway", "--orchestrator", target, "--port", "0",
             "--metrics-port", "0", *args], r"listening on http://127\.0\.0\.1:(\d+)", env)
        self.url = f"http://{endpoint}"
        self.metrics_url = _metrics(line)

    def stop(self) -> None:
        terminate(self.proc)


def _connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urlsplit(url)
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout), parts.path


def request(url: str, body: Any = None, *, method: str | None = None,
            headers: dict[str, str] | None = None, timeout: float = LONG
            ) -> tuple[int, dict[str, str], Any]:
    """One whole HTTP exchange: status, headers, the body decoded as JSON."""
    conn, path = _connection(url, timeout)
    try:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        conn.request(method or ("GET" if data is None else "POST"), path, body=data,
                     headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        raw = resp.read()
        return resp.status, dict(resp.getheaders()), json.loads(raw) if raw else None
    finally:
        conn.close()


def sse(url: str, body: dict[str, Any], *, timeout: float = LONG
        ) -> tuple[int, list[Any]]:
    """A streaming POST read to its end: status and every event's data (JSON decoded,
    "[DONE]" kept as the string)."""
    got = list(stream_events(url, body, timeout=timeout))
    return (got[0][0] if got else 0), [data for _, data in got]


def stream_events(url: str, body: dict[str, Any], *, timeout: float = LONG,
                  on_open: Callable[[http.client.HTTPConnection], None] | None = None
                  ) -> Iterator[tuple[int, Any]]:
    """Yields (status, data) per server-sent event; a non-200 answer yields its JSON body
    once. Closing the iterator closes the connection."""
    conn, path = _connection(url, timeout)
    try:
        conn.request("POST", path, body=json.dumps({**body, "stream": True}).encode(),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if on_open is not None:
            on_open(conn)
        if resp.status != 200:
            yield resp.status, json.loads(resp.read())
            return
        assert resp.getheader("Content-Type", "").startswith("text/event-stream")
        while line := resp.readline():
            line = line.strip()
            if line.startswith(b"data: "):
                payload = line[6:].decode()
                yield resp.status, payload if payload == "[DONE]" else json.loads(payload)
    finally:
        conn.close()


def joined(events: list[Any]) -> str:
    """The text of a stream's chunks (chat deltas or completion texts)."""
    out = []
    for ev in events:
        if isinstance(ev, dict):
            for choice in ev.get("choices", []):
                out.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    return "".join(out)


def llm_stage_generate(target: str, prompt: str, *args: str) -> str:
    """The text `llm-stage generate` prints for `prompt` (its trailing newline removed)."""
    done = subprocess.run([*LLM_STAGE, "generate", "--target", target, *args, prompt],
                          capture_output=True, text=True, timeout=LONG, env=ENV, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith("\n")
    return done.stdout[:-1]


def wait_until(predicate: Callable[[], bool], timeout: float = LONG) -> bool:
    """Polls `predicate` until it holds or `timeout` passes; whether it held."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)  # polling a condition, not synchronising
    return True
