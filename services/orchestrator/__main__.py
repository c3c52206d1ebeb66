"""`python -m services.orchestrator --topology FILE [--host H] [--port P]`: serve the
Orchestrator API over stages that already run (see `llm-stage up` to start them too)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from services.errors import ServiceError
from services.orchestrator.service import serve
from services.orchestrator.topology import load_topology
from services.server import ServerOptions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.orchestrator", description=__doc__)
    parser.add_argument("--topology", required=True, help="topology file (JSON)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50050)
    parser.add_argument("--max-message-mb", type=float, default=16.0)
    parser.add_argument("--grace-s", type=float, default=10.0,
                        help="on SIGTERM, how long running requests may take to finish")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus metrics on this port (0 = any free)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        options = ServerOptions(host=args.host, port=args.port,
                                max_message_bytes=int(args.max_message_mb * (1 << 20)),
                                grace_s=args.grace_s)
        asyncio.run(serve(load_topology(args.topology), options, args.metrics_port))
    except ServiceError as exc:
        print(f"orchestrator: {exc.code}: {exc.message}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"orchestrator: INVALID_ARGUMENT: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
