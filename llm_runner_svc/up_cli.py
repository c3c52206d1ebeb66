"""`llm-runner up`: a whole local deployment from this install.

Every stage of the topology that carries `launch` starts as an `llm-runner serve` child process
on a free loopback port, and the orchestrator runs in this process (services/orchestrator/
launcher.py); Ctrl-C or SIGTERM stops the orchestrator, then the children. Without a topology,
one backbone stage serves the embedded model. The client's `llm-stage up` runs this command when
the server package is installed.
"""

from __future__ import annotations

import argparse

from llm_runner_svc.errors import InvalidArgument, Unavailable


def add_up(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start a local deployment: stage processes + orchestrator")
    p.add_argument("--topology", default=None,
                   help="topology file whose stages carry `launch` (default: one backbone stage "
                        "serving the embedded model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50050, help="orchestrator port (0 = any free)")


def run_up(args: argparse.Namespace) -> int:
    """Serve until interrupted; 0 after a clean stop. Raises ServiceError when the deployment
    cannot start."""
    # Imported here: the other llm-runner commands do not need the orchestrator.
    from services.orchestrator.launcher import up
    from services.server import ServerOptions

    try:
        options = ServerOptions(host=args.host, port=args.port)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from exc
    try:
        up(args.topology, options)
    except (RuntimeError, OSError) as exc:  # a stage child could not start or did not listen
        raise Unavailable(f"a stage process did not start: {exc}") from exc
    return 0
