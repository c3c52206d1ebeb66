"""`python -m services.gateway --orchestrator HOST:PORT [--host H] [--port P] [--workers N]`:
the OpenAI-compatible HTTP API in front of a running orchestrator (`llm-runner up` starts one
with its deployment). Exit codes: 0 after a clean stop (SIGTERM or Ctrl-C while serving), 2 an
expected failure (one line on stderr), 130 Ctrl-C before serving; with several workers, 1 when
a worker dies."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from services.gateway.config import GatewayConfig
from services.launched import is_launched, leave_interrupts_to_parent
from services.workers import DEFAULT_WORKERS, WorkerGroup, reserve_port, worker_commands

_DEFAULTS = GatewayConfig()


STOP_GRACE_S = 5.0  # a worker's open streams end within its runner's shutdown timeout


def main(argv: list[str] | None = None) -> int:
    leave_interrupts_to_parent()
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m services.gateway", description=__doc__)
    parser.add_argument("--orchestrator", default=_DEFAULTS.orchestrator,
                        help=f"the orchestrator's host:port (default {_DEFAULTS.orchestrator})")
    parser.add_argument("--host", default=_DEFAULTS.host,
                        help="address to bind (0.0.0.0 for every interface; default "
                             f"{_DEFAULTS.host})")
    parser.add_argument("--port", type=int, default=_DEFAULTS.port,
                        help=f"HTTP port (0 = any free; default {_DEFAULTS.port})")
    parser.add_argument("--request-timeout-s", type=float, default=_DEFAULTS.request_timeout_s,
                        help="deadline of each generation, seconds; past it the request is "
                             "cancelled and answers 504 (default "
                             f"{_DEFAULTS.request_timeout_s:g})")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve Prometheus metrics on this port (0 = any free; default off); "
                             "with several workers, worker I on this port + I")
    parser.add_argument("--workers", type=int, default=DEFAULT_WORKERS,
                        help="worker processes serving the port together (SO_REUSEPORT). "
                             f"Default {DEFAULT_WORKERS}, whatever the cores: on 2 cores a "
                             "second worker measured no faster; raise it where this process's "
                             "CPU is saturated and cores are spare")
    parser.add_argument("--orchestrator-channels", type=int, default=_DEFAULTS.num_channels,
                        help="gRPC connections to the orchestrator per worker, calls dealt "
                             "round robin: each connection reaches one orchestrator worker (or "
                             f"replica) only (default {_DEFAULTS.num_channels})")
    parser.add_argument("--served-model-name", default=None,
                        help="the name the deployment's text model is served under in "
                             "/v1/models and requests' `model` (e.g. a Hugging Face repo id "
                             "that clients load its tokenizer by); default: its stage id")
    parser.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")  # read when grpc is imported, below
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        config = GatewayConfig(orchestrator=args.orchestrator, host=args.host, port=args.port,
                               request_timeout_s=args.request_timeout_s,
                               num_channels=args.orchestrator_channels,
                               served_model_name=args.served_model_name,
                               is_port_shared=args.worker_index is not None)
        if args.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {args.workers}")
        if args.workers > 1 and args.worker_index is None:
            reservation = reserve_port(args.host, args.port)
            commands = worker_commands("services.gateway", argv,
                                       int(reservation.getsockname()[1]), args.workers,
                                       args.metrics_port)
            try:
                return WorkerGroup("gateway", commands, STOP_GRACE_S).run(reservation)
            finally:
                reservation.close()
        from services.gateway.server import serve  # not in a supervisor: aiohttp, grpc

        asyncio.run(serve(config, args.metrics_port))
    except ValueError as exc:
        print(f"gateway: INVALID_ARGUMENT: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"gateway: UNAVAILABLE: cannot listen on {args.host}:{args.port} ({exc.strerror}): "
              f"stop what listens there, or pick another port with --port (0 = any free port)",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if not is_launched():  # a child of `up`: the parent says it
            print("gateway: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
