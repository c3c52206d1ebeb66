"""Replica discovery without stage processes: DNS targets, the resolver against a loopback DNS
server whose answer changes, and a pool's joins and drains driven by those answers."""

from __future__ import annotations

import asyncio

import pytest
from dns_server import DnsServer

from services.errors import InvalidArgument, Unavailable
from services.orchestrator.discovery import Discovery
from services.orchestrator.dns import DnsTarget, parse_target, resolve
from services.orchestrator.peers import FORWARDED_KEY, is_forwarded
from services.orchestrator.replicas import Replica, StagePool
from services.orchestrator.topology import parse_topology


def test_targets_parse_and_name_their_faults() -> None:
    assert parse_target("dns:///runner-headless.llm.svc:50051") == DnsTarget(
        "runner-headless.llm.svc", 50051)
    assert parse_target("dns://127.0.0.1:5353/runners.test:7000") == DnsTarget(
        "runners.test", 7000, ("127.0.0.1", 5353))
    assert str(parse_target("dns://10.0.0.10/a.b:1")) == "dns://10.0.0.10:53/a.b:1"
    for bad, why in (("runners:50051", "starts with 'dns://'"), ("dns://x", "no '/'"),
                     ("dns:///runners", "needs its port"), ("dns:///r:99999", "1..65535")):
        with pytest.raises(InvalidArgument, match=why):
            parse_target(bad)


def test_topology_takes_discover_instead_of_endpoints() -> None:
    stage = {"id": "backbone", "runner": "llm.backbone", "emits": ["text"],
             "discover": "dns:///runner-headless:50051"}
    topo = parse_topology({"stages": [stage]})
    assert topo.stages[0].discover == "dns:///runner-headless:50051"
    assert topo.stages[0].endpoints == ()
    with pytest.raises(InvalidArgument, match=r"stages\[0\]\.discover: replaces"):
        parse_topology({"stages": [dict(stage, endpoints=["127.0.0.1:1"])]})
    with pytest.raises(InvalidArgument, match=r"stages\[0\]\.discover: .*starts with"):
        parse_topology({"stages": [dict(stage, discover="runner-headless:50051")]})


def test_resolver_reads_the_servers_changing_answer() -> None:
    async def main(dns: DnsServer) -> None:
        target = parse_target(f"dns://127.0.0.1:{dns.port}/Runners.Test:7000")
        dns.set("runners.test", ["127.0.0.3", "127.0.0.2", "127.0.0.10"])
        assert await resolve(target) == ("127.0.0.2:7000", "127.0.0.3:7000", "127.0.0.10:7000")
        dns.set("runners.test", [])
        assert await resolve(target) == ()  # no ready replica: a valid, empty answer
        with pytest.raises(Unavailable, match="DNS error code 3"):
            await resolve(parse_target(f"dns://127.0.0.1:{dns.port}/nobody.test:7000"))
        assert await resolve(parse_target("dns:///localhost:7000")) == ("127.0.0.1:7000",)

    with DnsServer() as dns:
        asyncio.run(main(dns))


def test_pool_follows_the_answer_joins_after_admit_and_drains_when_idle() -> None:
    async def main(dns: DnsServer) -> None:
        pool = StagePool("backbone", (), 1 << 20, discover="dns:///runners.test:7000")
        with pytest.raises(Unavailable, match="none found at dns:///runners.test:7000"):
            pool.pick()
        refused = {"127.0.0.4:7000"}

        async def admit(replica: Replica) -> bool:
            return replica.endpoint not in refused

        found = Discovery(pool, f"dns://127.0.0.1:{dns.port}/runners.test:7000", admit)
        dns.set("runners.test", ["127.0.0.2", "127.0.0.3", "127.0.0.4"])
        await found.refresh()
        assert pool.endpoints() == {"127.0.0.2:7000", "127.0.0.3:7000"}  # .4 failed its check
        busy = pool.pick()
        busy.in_flight = 1  # a request runs there
        other = pool.pick()
        assert other is not busy  # least loaded first
        dns.set("runners.test", ["127.0.0.3", "127.0.0.4"] if busy.endpoint.startswith(
            "127.0.0.2") else ["127.0.0.2", "127.0.0.4"])
        refused.clear()
        await found.refresh()
        assert busy.is_draining and busy in pool.replicas  # still serving its request
        assert all(pool.pick() is not busy for _ in range(4))
        assert len(pool.endpoints()) == 3
        busy.in_flight = 0
        await found.refresh()
        assert busy not in pool.replicas and len(pool.replicas) == 2
        dns.set("runners.test", ["127.0.0.2", "127.0.0.3", "127.0.0.4"])
        await found.refresh()
        assert len(pool.replicas) == 3
        dns.set("nothing", [])
        dns.set("runners.test", [])
        for r in pool.replicas:
            r.in_flight = 1
        await found.refresh()
        with pytest.raises(Unavailable, match="no healthy replica"):
            pool.pick()
        for r in list(pool.replicas):
            r.in_flight = 0
        await found.refresh()
        assert pool.replicas == []

    with DnsServer() as dns:
        asyncio.run(main(dns))


def test_a_forwarded_cancel_is_recognised() -> None:
    assert is_forwarded(((FORWARDED_KEY, "1"), ("x", "y")))
    assert not is_forwarded((("x", "y"),)) and not is_forwarded(None)
