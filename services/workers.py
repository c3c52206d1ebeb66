"""Several worker processes on one port: the front door past one Python interpreter.

One Python process relays a few tens of thousands of messages a second. Past that a service
runs as N workers, each a process of the same command (its own event loop, channels and
Step streams), all listening on the same host:port with SO_REUSEPORT: the kernel deals each
new connection to one of them. The process the user started supervises them:

  - it reserves the port first (a free one for port 0) with a bound socket that does not
    listen, so nothing else takes it before the workers bind; a port something already listens
    on (another group of workers included: the check binds without SO_REUSEPORT) is refused
    before any worker starts;
  - it starts every worker (`python -m MODULE ... --port P --worker-index I`) and prints one
    "listening on HOST:PORT" line, worker 0's, once every worker serves;
  - SIGTERM (and Ctrl-C) is forwarded to the workers as SIGTERM: each drains as a single
    process does, and the supervisor exits 0 once all have;
  - a worker that exits with an error is not restarted: the supervisor stops the others and
    exits 1, so whatever restarts the service (Kubernetes, systemd, `llm-runner up`) sees it.
    A worker that exits 0 was told to stop (a terminal's Ctrl-C reaches the whole process
    group): the others are stopped too and the supervisor exits 0.

No grpc here: the supervisor imports neither grpc nor aiohttp.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from types import FrameType

from services.launched import LAUNCHED_ENV, is_launched

_LISTENING = re.compile(r"listening on \S+:\d+")
_METRICS = re.compile(r"metrics on \S+?:(\d+)")
KILL_AFTER_S = 15.0  # past a worker's own grace: then it is killed


DEFAULT_WORKERS = 1
"""Measured on 2 cores (README "Workers"): a second orchestrator worker made tokens/s no better
at concurrency 32 and 64 (best of six runs 3,056 against 3,968 and 3,468 against 3,886; medians
within noise), the stage and the clients needing those cores. More workers pay where the
front door's one process is the bottleneck (its CPU at 100%) and cores are spare; nothing
measured here shows that from the core count alone, so the count is asked for, not guessed."""


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to host:port with SO_REUSEPORT that does not listen: it keeps the port
    (a free one for port 0) for the workers until they listen. Raises OSError when something
    listens there already."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    if port:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def worker_metrics_port(metrics_port: int | None, index: int) -> int | None:
    """Worker I serves its own metrics on metrics_port + I (0: each on any free port)."""
    if metrics_port is None or metrics_port == 0:
        return metrics_port
    return metrics_port + index


def combined_line(lines: Sequence[str]) -> str:
    """Worker 0's "listening on" line, saying how many workers serve and where each one's
    metrics are."""
    ports = [m.group(1) for line in lines if (m := _METRICS.search(line))]
    metrics = f"; metrics of each on ports {', '.join(ports)}" if ports else ""
    return f"{lines[0].rstrip()} [{len(lines)} workers{metrics}]"


class WorkerGroup:
    """N worker processes of one command, each printing "listening on HOST:PORT" once it
    serves. `run()` starts them and supervises them until they have all stopped."""

    def __init__(self, name: str, commands: Sequence[list[str]], grace_s: float) -> None:
        self.name = name
        self.commands = list(commands)
        self.stop_wait_s = grace_s + KILL_AFTER_S
        self.procs: list[subprocess.Popen[str]] = []
        self.is_stopping = False
        self._signal: int | None = None

    def run(self, reservation: socket.socket | None = None) -> int:
        """The exit code: 0 after a stop asked for by a signal, the failing worker's code
        (2: its one-line error is on stderr) when one does not start, 1 when one dies, 130
        when interrupted before every worker served. `reservation` closes once all serve."""
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        signal.signal(signal.SIGTERM, self._on_signal)
        if not is_launched():  # a launched supervisor leaves Ctrl-C to its parent
            signal.signal(signal.SIGINT, self._on_signal)
        try:
            code = self._start()
            if reservation is not None:
                reservation.close()
            return self._supervise() if code is None else code
        finally:
            self._stop()
            for proc in self.procs:
                self._wait(proc)
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _start(self) -> int | None:
        """None once every worker serves; else the exit code to return."""
        env = os.environ | {"PYTHONUNBUFFERED": "1", LAUNCHED_ENV: "1"}
        for cmd in self.commands:
            if self.is_stopping:
                break
            self.procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                                               env=env, preexec_fn=_prepare_worker))
        lines = []
        for i, proc in enumerate(self.procs):
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if self.is_stopping:
                break
            if not _LISTENING.search(line):
                self._stop()
                code = proc.wait()
                if line.strip():
                    print(f"{self.name}: worker {i}: {line.strip()}", file=sys.stderr)
                return code if code > 0 else 1
            lines.append(line)
        if self.is_stopping:
            if self._signal == signal.SIGINT:
                print(f"{self.name}: interrupted", file=sys.stderr)
            return 130
        print(combined_line(lines), flush=True)
        for proc in self.procs:
            threading.Thread(target=_copy_lines, args=(proc,), daemon=True).start()
        return None

    def _supervise(self) -> int:
        while not self.is_stopping:
            for i, proc in enumerate(self.procs):
                code = proc.poll()
                if code is None or self.is_stopping:
                    continue
                if code == 0:  # told to stop (a terminal's Ctrl-C reaches every worker)
                    self._stop()
                    break
                print(f"{self.name}: worker {i} (pid {proc.pid}) exited with code {code}; "
                      "stopping the others", file=sys.stderr)
                self._stop()
                return 1
            time.sleep(0.1)
        codes = [self._wait(proc) for proc in self.procs]
        # A worker that stopped on a signal of its own (a terminal's Ctrl-C) has put back the
        # default handlers by the time the forwarded SIGTERM comes: it ends by that signal.
        return 0 if all(c in (0, -signal.SIGTERM) for c in codes) else 1

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signal = signum
        self._stop()

    def _stop(self) -> None:
        """SIGTERM to every worker still running (each drains); idempotent."""
        self.is_stopping = True
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    def _wait(self, proc: subprocess.Popen[str]) -> int:
        try:
            return proc.wait(self.stop_wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()


def _prepare_worker() -> None:
    """In a worker, before it runs: Ctrl-C ignored until its server takes the signal (the
    supervisor stops a worker still starting; Python keeps an ignored SIGINT ignored, so a
    Ctrl-C during its imports cannot end it in a traceback), and SIGTERM when the supervisor
    dies (even by SIGKILL), so no worker outlives it and serves the port unsupervised."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.platform == "linux":
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _copy_lines(proc: subprocess.Popen[str]) -> None:
    """A worker's later output, passed on (and its pipe kept from filling)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        print(line, end="", flush=True)


def worker_commands(module: str, argv: Sequence[str], port: int, num_workers: int,
                    metrics_port: int | None, extra: Sequence[str] = ()) -> list[list[str]]:
    """Each worker's command: the user's arguments (`argv`), then the port the supervisor
    reserved, the worker's index and metrics port, and `extra` (argparse keeps the last of a
    repeated option)."""
    commands = []
    for i in range(num_workers):
        cmd = [sys.executable, "-m", module, *argv, "--port", str(port),
               "--worker-index", str(i), *extra]
        mport = worker_metrics_port(metrics_port, i)
        if mport is not None:
            cmd += ["--metrics-port", str(mport)]
        commands.append(cmd)
    return commands
