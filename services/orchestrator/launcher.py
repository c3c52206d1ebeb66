"""`llm-runner up` (and its alias `llm-stage up`): a whole local deployment. Each launched
stage replica is an `llm-runner serve` child process (or its `launch.command`) on a free
loopback port; the orchestrator runs in this process; once it serves, the OpenAI-compatible
gateway (`python -m services.gateway`) starts as one more child in front of it, unless
`http_port` is None. With several workers (`workers` > 1) the orchestrator is a child too,
`python -m services.orchestrator --workers N` over the launched topology written to a file,
and the gateway runs as many workers. Ctrl-C (or SIGTERM) stops the orchestrator, then the
children (each drains on SIGTERM). A child that cannot start raises FailedPrecondition (its
command is missing) or Unavailable (it exited before listening)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from services.errors import FailedPrecondition, Unavailable
from services.launched import LAUNCHED_ENV
from services.orchestrator.service import serve
from services.orchestrator.topology import (
    Topology,
    load_topology,
    single_stage,
    topology_doc,
    with_endpoints,
)
from services.server import ServerOptions

log = logging.getLogger(__name__)

_LISTENING = re.compile(r"listening on (?:http://)?[\w.\-]+:(\d+)")
_LABEL = re.compile(r"^[\w.\-]+: ")  # a line's leading "llm-stage: "
# A terminal's Ctrl-C reaches the children too; LAUNCHED_ENV tells a child to leave it to this
# process (services/launched.py), which stops them and says "interrupted" once.
CHILD_ENV = {"PYTHONUNBUFFERED": "1", LAUNCHED_ENV: "1"}


class ChildProcess:
    """A child server that prints "... listening on HOST:PORT" once it serves."""

    def __init__(self, cmd: list[str], what: str, host: str) -> None:
        self.what = what
        try:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                                         env=os.environ | CHILD_ENV)
        except OSError as exc:  # no such file, or not executable
            raise FailedPrecondition(_not_runnable(cmd[0], exc)) from exc
        assert self.proc.stdout is not None
        try:
            self.line = self.proc.stdout.readline()
        except BaseException:  # Ctrl-C while it starts: it leaves SIGINT to us
            self.stop()
            raise
        m = _LISTENING.search(self.line)
        if m is None:
            self.stop()
            said = f": {self.line.strip()}" if self.line.strip() else " (its error is above)"
            raise Unavailable(f"{what} process {os.path.normpath(cmd[0])} did not start "
                              f"(exit {self.proc.poll()}){said}")
        self.endpoint = f"{host}:{m.group(1)}"

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class StageProcess(ChildProcess):
    """One `llm-runner serve` child."""

    def __init__(self, config: str | None, stage: str | None, host: str,
                 command: tuple[str, ...] = ()) -> None:
        if command:
            cmd = [*command, "--host", host, "--port", "0"]
        else:
            cmd = [sys.executable, "-m", "llm_runner_svc", "serve", "--host", host, "--port", "0"]
        if config:
            cmd += ["--config", config]
        if stage:
            cmd += ["--stage", stage]
        super().__init__(cmd, "stage", host)


class GatewayProcess(ChildProcess):
    """The `python -m services.gateway` child in front of the orchestrator at `target`."""

    def __init__(self, target: str, host: str, port: int, workers: int = 1) -> None:
        super().__init__([sys.executable, "-m", "services.gateway", "--orchestrator", target,
                          "--host", host, "--port", str(port), "--workers", str(workers)],
                         "gateway", host)


class OrchestratorProcess(ChildProcess):
    """`python -m services.orchestrator --workers N` over the topology file `topology`."""

    def __init__(self, topology: Path, options: ServerOptions, workers: int,
                 metrics_port: int | None = None) -> None:
        metrics = [] if metrics_port is None else ["--metrics-port", str(metrics_port)]
        super().__init__([sys.executable, "-m", "services.orchestrator", "--topology",
                          str(topology), "--host", options.host, "--port", str(options.port),
                          "--grace-s", str(options.grace_s), "--max-message-mb",
                          str(options.max_message_bytes / (1 << 20)), "--workers",
                          str(workers), *metrics], "orchestrator", options.host)


def _not_runnable(command: str, exc: OSError) -> str:
    path = os.path.normpath(command)
    fix = "build or install it, or fix `launch.command` in the topology"
    if os.path.basename(path) == "talker_stage":  # the C++ reference talker (clients/cpp)
        fix = ("build it first: cmake -S clients/cpp -B clients/cpp/build && "
               "cmake --build clients/cpp/build -j2 (see clients/cpp/README.md)")
    why = "does not exist" if isinstance(exc, FileNotFoundError) else f"cannot run ({exc})"
    return f"stage command {path} {why}; {fix}"


def launch_stages(topology: Topology, host: str) -> tuple[Topology, list[StageProcess]]:
    """Start every `launch` stage's replicas; return the topology with their endpoints."""
    procs: list[StageProcess] = []
    endpoints: dict[str, list[str]] = {}
    try:
        for spec in topology.stages:
            for _ in range(spec.launch_replicas):
                procs.append(StageProcess(spec.launch_config, spec.launch_stage, host,
                                          spec.launch_command))
                endpoints.setdefault(spec.stage_id, []).append(procs[-1].endpoint)
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return with_endpoints(topology, endpoints), procs


def up(topology_path: str | None, options: ServerOptions, http_port: int | None = None,
       workers: int = 1, metrics_port: int | None = None, prog: str = "llm-runner") -> None:
    """Serve the deployment until SIGTERM or SIGINT; `http_port` (0: any free) is the
    gateway's, None for no gateway; `workers`: the orchestrator's and the gateway's worker
    processes (1: the orchestrator in this process); `metrics_port`: the orchestrator's
    Prometheus port (0: any free; None: off). Every line it prints starts with `prog`, the
    command the user ran."""
    procs: list[ChildProcess]
    if topology_path is None:
        procs = [StageProcess(None, None, options.host)]
        topology = single_stage([procs[0].endpoint])
    else:
        topology, stages = launch_stages(load_topology(Path(topology_path)), options.host)
        procs = list(stages)
    for p in procs:
        print(f"{prog}: stage process {p.proc.pid} on {p.endpoint}", flush=True)
    if workers > 1:
        try:
            _up_workers(topology, procs, options, http_port, workers, metrics_port, prog)
        finally:
            for p in reversed(procs):
                p.stop()
        return

    async def start_gateway(port: int) -> None:
        if http_port is None:
            return
        # An orchestrator on every interface is reached on loopback.
        host = "127.0.0.1" if options.host in ("0.0.0.0", "::", "") else options.host
        procs.append(await asyncio.to_thread(GatewayProcess, f"{host}:{port}", options.host,
                                             http_port))
        print(relabel(procs[-1].line, prog), end="", flush=True)

    try:
        asyncio.run(serve(topology, options, metrics_port, on_serving=start_gateway, prog=prog))
    finally:
        for p in reversed(procs):
            p.stop()


def relabel(line: str, prog: str) -> str:
    """A child's "... listening on" line as `prog` shows it: its own leading "name: " label,
    if any, replaced by `prog`'s."""
    return f"{prog}: {_LABEL.sub('', line, count=1)}"


def _up_workers(topology: Topology, procs: list[ChildProcess], options: ServerOptions,
                http_port: int | None, workers: int, metrics_port: int | None,
                prog: str) -> None:
    """The orchestrator and the gateway as child processes of `workers` workers each; returns
    on SIGTERM or SIGINT, raises Unavailable when a child exits with an error."""
    with tempfile.TemporaryDirectory(prefix="llmstage-up-") as tmp:
        path = Path(tmp) / "topology.json"
        path.write_text(json.dumps(topology_doc(topology)))
        procs.append(OrchestratorProcess(path, options, workers, metrics_port))
        print(relabel(procs[-1].line, prog), end="", flush=True)
        if http_port is not None:
            host = "127.0.0.1" if options.host in ("0.0.0.0", "::", "") else options.host
            port = procs[-1].endpoint.rsplit(":", 1)[1]
            procs.append(GatewayProcess(f"{host}:{port}", options.host, http_port, workers))
            print(relabel(procs[-1].line, prog), end="", flush=True)
        _wait_for_stop(procs)


def _wait_for_stop(procs: list[ChildProcess]) -> None:
    """Until SIGTERM or SIGINT, or a child exits: one that exits 0 was told to stop (a
    terminal's Ctrl-C reaches every process of the group); else Unavailable."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set())
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not stop.wait(0.2):
            for p in procs:
                code = p.proc.poll()
                if code == 0:
                    return
                if code is not None:
                    raise Unavailable(f"{p.what} process {p.proc.pid} exited with code {code}")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
