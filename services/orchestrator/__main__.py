"""`python -m services.orchestrator --topology FILE [--host H] [--port P] [--workers N]`: serve
the Orchestrator API over stages that already run (see `llm-runner up` to start them too). Exit
codes: 0 after a clean stop (SIGTERM or Ctrl-C while serving), 2 an expected failure (one line
on stderr), 130 Ctrl-C before serving; with several workers, 1 when a worker dies."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from services.errors import ServiceError
from services.launched import is_launched, leave_interrupts_to_parent
from services.workers import DEFAULT_WORKERS


def main(argv: list[str] | None = None) -> int:
    leave_interrupts_to_parent()
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m services.orchestrator", description=__doc__)
    parser.add_argument("--topology", required=True, help="topology file (JSON)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (0.0.0.0 for every interface; default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=50050,
                        help="port to bind (0 = any free; default 50050)")
    parser.add_argument("--max-message-mb", type=float, default=16.0,
                        help="largest gRPC message accepted or sent, MiB (default 16)")
    parser.add_argument("--grace-s", type=float, default=10.0,
                        help="on SIGTERM, how long running requests may take to finish "
                             "(default 10 s)")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus metrics on this port (0 = any free; default off); "
                             "with several workers, worker I on this port + I")
    parser.add_argument("--peers", default=None,
                        help="DNS target of every orchestrator replica "
                             "(dns:///orchestrator-headless:50050): a Cancel for a request "
                             "this replica does not hold is forwarded to them (default off)")
    parser.add_argument("--discover-interval-s", type=float, default=5.0,
                        help="how often stages named by 'discover' are resolved again "
                             "(default 5 s; sooner after a replica fails)")
    parser.add_argument("--workers", type=int, default=DEFAULT_WORKERS,
                        help="worker processes serving the port together (SO_REUSEPORT), each "
                             "relaying its own share of the calls: one Python process relays a "
                             "few tens of thousands of messages a second. Default "
                             f"{DEFAULT_WORKERS}, whatever the cores: on 2 cores a second "
                             "worker measured no faster (the stages need the cores); raise it "
                             "where this process's CPU is saturated and cores are spare. A "
                             "Cancel reaching a worker that does not hold the request is "
                             "forwarded to the others; maxRunning and maxQueued hold per worker")
    parser.add_argument("--worker-socket-dir", default=None,
                        help="with several workers: where worker I listens for its siblings' "
                             "calls, DIR/worker-I.sock (default a fresh temporary directory)")
    parser.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # gRPC core logs nothing unless GRPC_VERBOSITY asks; it reads the variable when imported,
    # hence the imports below.
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {args.workers}")
        if args.workers > 1 and args.worker_index is None:
            return _supervise(args, argv)
        _serve(args)
    except ServiceError as exc:
        print(f"orchestrator: {exc.code}: {exc.message}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"orchestrator: INVALID_ARGUMENT: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # gRPC's bind failure
        if "bind" not in str(exc).lower():
            raise
        return _cannot_listen(args)
    except KeyboardInterrupt:  # before the server took over SIGINT (it drains and exits 0)
        if not is_launched():  # a worker, or a child of `up`: the parent says it
            print("orchestrator: interrupted", file=sys.stderr)
        return 130
    return 0


def _serve(args: argparse.Namespace) -> None:
    """One process serving (the only one, or worker `args.worker_index`)."""
    from services.orchestrator.dns import parse_target
    from services.orchestrator.service import ClusterOptions, serve
    from services.orchestrator.topology import load_topology
    from services.orchestrator.workers import worker_sockets
    from services.server import ServerOptions

    is_worker = args.worker_index is not None
    options = ServerOptions(host=args.host, port=args.port,
                            max_message_bytes=int(args.max_message_mb * (1 << 20)),
                            grace_s=args.grace_s, is_port_shared=is_worker)
    own: str | None = None
    siblings: tuple[str, ...] = ()
    if is_worker:
        own, siblings = worker_sockets(args.worker_socket_dir, args.worker_index, args.workers)
    cluster = ClusterOptions(args.peers, args.discover_interval_s, own, siblings)
    if cluster.peers is not None:
        parse_target(cluster.peers)
    asyncio.run(serve(load_topology(args.topology), options, args.metrics_port,
                      cluster=cluster))


def _supervise(args: argparse.Namespace, argv: list[str]) -> int:
    """Check what every worker would refuse (one message, not one per worker), then run them."""
    from services.orchestrator.dns import parse_target
    from services.orchestrator.topology import load_topology
    from services.orchestrator.workers import supervise
    from services.server import ServerOptions
    from services.workers import reserve_port

    ServerOptions(host=args.host, port=args.port, grace_s=args.grace_s,
                  max_message_bytes=int(args.max_message_mb * (1 << 20)))
    load_topology(args.topology)
    if args.peers is not None:
        parse_target(args.peers)
    try:
        reservation = reserve_port(args.host, args.port)
    except OSError:
        return _cannot_listen(args)
    return supervise(argv, reservation, args.workers, args.worker_socket_dir,
                     args.metrics_port, args.grace_s)


def _cannot_listen(args: argparse.Namespace) -> int:
    print(f"orchestrator: UNAVAILABLE: cannot listen on {args.host}:{args.port} (in use, or "
          f"not an address of this machine): stop what listens there, or pick another "
          f"port with --port (0 = any free port)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
