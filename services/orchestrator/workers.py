"""The orchestrator as N worker processes on one port (`--workers`, services/workers.py).

Each worker also listens on its own unix socket, DIR/worker-I.sock, which only its siblings
call: a Cancel for a request this worker does not hold is forwarded there (peers.py), so a
Cancel finds its request whichever worker the caller's connection reached. A request id is
refused (ALREADY_EXISTS) only while the same worker runs or queues it: two workers may each
run a request of the same id, and a Cancel of that id then ends the one on the worker it
reaches (or, when that one holds none, the others').
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Sequence

from services.workers import WorkerGroup, worker_commands

MODULE = "services.orchestrator"
MAX_SOCKET_PATH = 100  # a unix socket's path is at most 107 bytes


def worker_socket(directory: str, index: int) -> str:
    return f"unix:{os.path.join(os.path.abspath(directory), f'worker-{index}.sock')}"


def worker_sockets(directory: str, index: int, num_workers: int) -> tuple[str, tuple[str, ...]]:
    """Worker `index`'s own socket and its siblings'."""
    siblings = tuple(worker_socket(directory, j) for j in range(num_workers) if j != index)
    return worker_socket(directory, index), siblings


def supervise(argv: Sequence[str], reservation: socket.socket, num_workers: int,
              socket_dir: str | None, metrics_port: int | None, grace_s: float) -> int:
    """Run `num_workers` workers on the reserved port (services/workers.py: reserve_port)
    until a signal; the exit code. Raises ValueError when the socket directory's paths are
    too long."""
    directory = socket_dir or tempfile.mkdtemp(prefix="llmstage-orch-")
    try:
        if len(worker_socket(directory, num_workers)) - len("unix:") > MAX_SOCKET_PATH:
            raise ValueError(f"--worker-socket-dir {directory!r} is too long for a unix "
                             f"socket's path (at most {MAX_SOCKET_PATH} bytes with its name)")
        os.makedirs(directory, exist_ok=True)
        bound = int(reservation.getsockname()[1])
        commands = worker_commands(MODULE, argv, bound, num_workers, metrics_port,
                                   ["--worker-socket-dir", directory])
        return WorkerGroup("orchestrator", commands, grace_s).run(reservation)
    finally:
        reservation.close()
        if socket_dir is None:
            shutil.rmtree(directory, ignore_errors=True)
