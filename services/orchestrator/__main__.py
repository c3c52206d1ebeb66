"""`python -m services.orchestrator --topology FILE [--host H] [--port P]`: serve the
Orchestrator API over stages that already run (see `llm-runner up` to start them too). Exit
codes: 0 after a clean stop (SIGTERM or Ctrl-C while serving), 2 an expected failure (one line
on stderr), 130 Ctrl-C before serving."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from services.errors import ServiceError


def main(argv: list[str] | None = None) -> int:
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
                        help="serve Prometheus metrics on this port (0 = any free; default off)")
    parser.add_argument("--peers", default=None,
                        help="DNS target of every orchestrator replica "
                             "(dns:///orchestrator-headless:50050): a Cancel for a request "
                             "this replica does not hold is forwarded to them (default off)")
    parser.add_argument("--discover-interval-s", type=float, default=5.0,
                        help="how often stages named by 'discover' are resolved again "
                             "(default 5 s; sooner after a replica fails)")
    args = parser.parse_args(argv)
    # gRPC core logs nothing unless GRPC_VERBOSITY asks; it reads the variable when imported,
    # hence the imports below.
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    from services.orchestrator.dns import parse_target
    from services.orchestrator.service import ClusterOptions, serve
    from services.orchestrator.topology import load_topology
    from services.server import ServerOptions

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        options = ServerOptions(host=args.host, port=args.port,
                                max_message_bytes=int(args.max_message_mb * (1 << 20)),
                                grace_s=args.grace_s)
        cluster = ClusterOptions(args.peers, args.discover_interval_s)
        if cluster.peers is not None:
            parse_target(cluster.peers)
        asyncio.run(serve(load_topology(args.topology), options, args.metrics_port,
                          cluster=cluster))
    except ServiceError as exc:
        print(f"orchestrator: {exc.code}: {exc.message}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"orchestrator: INVALID_ARGUMENT: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # gRPC's bind failure
        if "bind" not in str(exc).lower():
            raise
        print(f"orchestrator: UNAVAILABLE: cannot listen on {args.host}:{args.port} (in use, or "
              f"not an address of this machine): stop what listens there, or pick another "
              f"port with --port (0 = any free port)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before the server took over SIGINT (it drains and exits 0)
        print("orchestrator: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
