"""Worker processes without starting any: each worker's command, the
supervisor's one line, the port reservation, the launched topology's file, and where a Cancel
is forwarded from each kind of sender."""

from __future__ import annotations

import asyncio
import socket

import pytest

from services.orchestrator.peers import (
    FORWARDED_KEY,
    FROM_REPLICA,
    FROM_WORKER,
    Peers,
    forwarded_from,
)
from services.orchestrator.topology import parse_topology, topology_doc
from services.orchestrator.workers import worker_sockets
from services.workers import (
    combined_line,
    reserve_port,
    worker_commands,
    worker_metrics_port,
)


def test_each_worker_gets_the_reserved_port_its_index_and_its_metrics_port() -> None:
    cmds = worker_commands("services.gateway", ["--port", "0", "--workers", "2"], 4321, 2, 9100)
    for i, cmd in enumerate(cmds):
        assert cmd[1:3] == ["-m", "services.gateway"]
        last = {cmd[j]: cmd[j + 1] for j in range(3, len(cmd) - 1) if cmd[j].startswith("--")}
        assert last["--port"] == "4321" and last["--worker-index"] == str(i)
        assert last["--metrics-port"] == str(9100 + i)
    assert worker_metrics_port(0, 3) == 0 and worker_metrics_port(None, 3) is None
    assert "--metrics-port" not in worker_commands("m", [], 1, 1, None)[0]


def test_the_supervisor_prints_worker_zeros_line_with_every_metrics_port() -> None:
    lines = ["llm-stage: orchestrator listening on 127.0.0.1:5000 (stages: a), metrics on "
             f"127.0.0.1:{p}\n" for p in (9100, 9101)]
    line = combined_line(lines)
    assert line.startswith(lines[0].rstrip()) and "\n" not in line
    assert line.endswith("[2 workers; metrics of each on ports 9100, 9101]")
    assert combined_line(["gateway listening on http://h:1\n"] * 3).endswith("[3 workers]")


def test_a_reserved_port_is_free_for_workers_and_refused_when_listened_on() -> None:
    with reserve_port("127.0.0.1", 0) as reserved:
        port = reserved.getsockname()[1]
        with socket.socket() as worker:  # a worker binds it too, with SO_REUSEPORT
            worker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            worker.bind(("127.0.0.1", port))
            worker.listen()
            with pytest.raises(OSError):  # another group: refused
                reserve_port("127.0.0.1", port)


def test_each_worker_knows_its_own_socket_and_its_siblings() -> None:
    own, siblings = worker_sockets("/tmp/o", 1, 3)
    assert own == "unix:/tmp/o/worker-1.sock"
    assert siblings == ("unix:/tmp/o/worker-0.sock", "unix:/tmp/o/worker-2.sock")


def test_the_launched_topology_reads_back_as_itself() -> None:
    topology = parse_topology({
        "stages": [{"id": "a", "runner": "llm.backbone", "endpoints": ["127.0.0.1:1"],
                    "emits": ["text", "hidden"]},
                   {"id": "b", "runner": "talker.codec", "discover": "dns:///b.test:2",
                    "emits": ["audio"], "inputs": ["a:hidden"], "onMissing": "skip"}],
        "sinks": ["a:text", "b:audio"], "maxRunning": 3, "maxQueued": 0})
    assert parse_topology(topology_doc(topology)) == topology


def test_a_cancel_is_forwarded_by_who_sent_it() -> None:
    asked: list[tuple[str, str]] = []

    class Recording(Peers):
        async def _replicas(self, request_id: str) -> tuple[str, ...]:
            return ("10.0.0.1:50050", "10.0.0.2:50050")

        async def _cancel_on(self, endpoint: str, request_id: str, origin: str) -> bool:
            asked.append((endpoint, origin))
            return endpoint == "unix:/w1"

    peers = Recording("dns:///orch.test:50050", ["unix:/w1", "unix:/w2"])
    assert asyncio.run(peers.cancel("r", None))  # a caller's: siblings and replicas
    assert asked == [("unix:/w1", FROM_WORKER), ("unix:/w2", FROM_WORKER),
                     ("10.0.0.1:50050", FROM_REPLICA), ("10.0.0.2:50050", FROM_REPLICA)]
    asked.clear()
    assert asyncio.run(peers.cancel("r", FROM_REPLICA))  # a replica's: this one's workers
    assert [e for e, _ in asked] == ["unix:/w1", "unix:/w2"]
    asked.clear()
    assert not asyncio.run(peers.cancel("r", FROM_WORKER)) and asked == []  # a sibling's
    assert not asyncio.run(Recording(None, ["unix:/w2"]).cancel("r"))
    assert forwarded_from(((FORWARDED_KEY, FROM_WORKER),)) == FROM_WORKER
    assert forwarded_from((("x", "y"), (FORWARDED_KEY, "1"))) == FROM_REPLICA
    assert forwarded_from(None) is None
