"""`llm-runner up`: a whole local deployment from this install.

Every stage of the topology that carries `launch` starts as an `llm-runner serve` child process
(or its `launch.command`) on a free loopback port, and the orchestrator runs in this process
(services/orchestrator/launcher.py), with the OpenAI-compatible HTTP gateway in front of it
(`--http-port`, 8000 by default; `--no-http` leaves it out), each as `--workers` processes
on its port (past one, the orchestrator is a child process too); Ctrl-C or SIGTERM stops the
orchestrator, then the children, and the command exits 0. Without a topology, one backbone
stage serves the embedded model. The client's `llm-stage up` runs this command when the
server package is installed.
"""

from __future__ import annotations

import argparse
import socket

from llm_runner_svc.cli_common import HelpFormatter, bind_failure, is_bind_failure
from llm_runner_svc.errors import InvalidArgument
from services.workers import DEFAULT_WORKERS

DEFAULT_HTTP_PORT = 8000


def add_up(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start a local deployment: stage processes + orchestrator",
                       formatter_class=HelpFormatter,
                       description="Starts every stage of the topology that carries `launch` "
                                   "as a stage process on a free port of --host, then the "
                                   "orchestrator over them and the OpenAI-compatible HTTP "
                                   "gateway in front; serves until SIGTERM or Ctrl-C, then "
                                   "stops them all. Without --topology, one backbone stage "
                                   "serves the embedded stories260K model.")
    p.add_argument("--topology", default=None,
                   help="topology file whose stages carry `launch` (default: one backbone stage "
                        "serving the embedded model)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address the orchestrator binds (0.0.0.0 for every interface); stages "
                        "bind it too, on free ports")
    p.add_argument("--port", type=int, default=50050, help="orchestrator port (0 = any free)")
    p.add_argument("--http-port", type=int, default=None,
                   help="port of the OpenAI-compatible HTTP API (0 = any free; default 8000, "
                        "or any free port when --port is 0)")
    p.add_argument("--no-http", action="store_true",
                   help="start no HTTP gateway: the gRPC Orchestrator API only")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve the orchestrator's Prometheus metrics on this port (0 = any "
                        "free; default off); with several workers, worker I on this port + I")
    p.add_argument("--workers", type=int, default=DEFAULT_WORKERS,
                   help="worker processes of the orchestrator and of the gateway, each set "
                        "serving its port together: one Python process relays a few tens of "
                        "thousands of messages a second. On 2 cores a second worker measured "
                        "no faster (the stages need the cores); raise it where the "
                        "orchestrator's CPU is saturated and cores are spare")


def run_up(args: argparse.Namespace) -> int:
    """Serve until interrupted; 0 after a clean stop. Raises ServiceError when the deployment
    cannot start (a stage command missing or failing, the port taken)."""
    # Imported here: the other llm-runner commands do not need the orchestrator.
    from services.orchestrator.launcher import up
    from services.server import ServerOptions

    try:
        options = ServerOptions(host=args.host, port=args.port)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from exc
    if args.workers < 1:
        raise InvalidArgument(f"--workers must be >= 1, got {args.workers}")
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise InvalidArgument(f"--metrics-port must be in 0..65535, got {args.metrics_port}")
    http_port = None if args.no_http else http_port_of(args)
    _check_free(args.host, args.port)
    if http_port is not None:
        _check_free(args.host, http_port, "--http-port")
    try:
        up(args.topology, options, http_port, args.workers, args.metrics_port, args.prog)
    except (RuntimeError, OSError) as exc:
        if is_bind_failure(exc):
            raise bind_failure(args.host, args.port) from exc
        raise
    return 0


def http_port_of(args: argparse.Namespace) -> int:
    """--http-port; without it 8000, or any free port when the orchestrator's is any free."""
    if args.http_port is None:
        return 0 if args.port == 0 else DEFAULT_HTTP_PORT
    if not 0 <= args.http_port <= 65535:
        raise InvalidArgument(f"--http-port must be in 0..65535, got {args.http_port}")
    return int(args.http_port)


def _check_free(host: str, port: int, flag: str = "--port") -> None:
    """Fails before any stage process loads its model when a port of ours is taken; the
    server's own bind still decides (something may take the port in between)."""
    if port == 0:
        return
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.create_server((host, port), family=family):
            pass
    except OSError as exc:
        raise bind_failure(host, port, flag) from exc
