"""The Orchestrator servicer (translation only) and its server bootstrap."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import grpc

from services.contract.llmstage.v1 import orchestrator_pb2 as opb
from services.contract.llmstage.v1 import orchestrator_pb2_grpc
from services.contract.llmstage.v1 import stage_pb2 as pb
from services.metrics import serve_metrics
from services.orchestrator.codec import GenerateInput
from services.orchestrator.core import Orchestrator
from services.orchestrator.discovery import DEFAULT_INTERVAL_S
from services.orchestrator.peers import Peers, forwarded_from
from services.orchestrator.topology import Topology
from services.server import ServerHandle, ServerOptions, create_server, serve_until_signal
from services.telemetry import context_from, init_tracing

log = logging.getLogger(__name__)

SERVICE_NAME = opb.DESCRIPTOR.services_by_name["Orchestrator"].full_name


class OrchestratorServicer(orchestrator_pb2_grpc.OrchestratorServicer):
    """Decodes each call, calls one Orchestrator method, encodes its answer."""

    def __init__(self, orchestrator: Orchestrator, peers: Peers | None = None) -> None:
        self.orchestrator = orchestrator
        self.peers = peers

    async def Generate(self, request: opb.GenerateRequest, context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[opb.GenerateEvent]:
        parent = context_from(metadata=context.invocation_metadata() or ())
        call = GenerateInput.from_pb(request)
        async for ev in self.orchestrator.generate(call, context.time_remaining(), parent):
            yield ev.to_pb()

    async def Cancel(self, request: opb.CancelGenerateRequest,
                     context: grpc.aio.ServicerContext) -> opb.CancelGenerateResponse:
        found = self.orchestrator.cancel(request.request_id)
        if not found and self.peers is not None:
            found = await self.peers.cancel(request.request_id,
                                            forwarded_from(context.invocation_metadata()))
        return opb.CancelGenerateResponse(found=found)

    async def Topology(self, request: opb.TopologyRequest, context: grpc.aio.ServicerContext
                       ) -> opb.TopologyResponse:
        return self.orchestrator.topology_report().to_pb()

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext
                       ) -> pb.TokenizeResponse:
        replica = self.orchestrator.tokenizer_replica(request.stage_id)
        answer: pb.TokenizeResponse = await replica.forward("Tokenize", request,
                                                            context.time_remaining())
        return answer

    async def Detokenize(self, request: pb.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> pb.DetokenizeResponse:
        replica = self.orchestrator.tokenizer_replica(request.stage_id)
        answer: pb.DetokenizeResponse = await replica.forward("Detokenize", request,
                                                              context.time_remaining())
        return answer


@dataclass(frozen=True)
class ClusterOptions:
    """How an orchestrator finds what moves: peers (other orchestrator replicas, and the
    sibling workers of this one, for Cancel) and how often discovered stages are resolved
    again."""

    peers: str | None = None  # a DNS target (dns:///orchestrator-headless:50050)
    discover_interval_s: float = DEFAULT_INTERVAL_S
    private_address: str | None = None  # this worker's own socket ("unix:/path")
    workers: tuple[str, ...] = ()  # the sibling workers' own sockets

    def __post_init__(self) -> None:
        if self.discover_interval_s <= 0:
            raise ValueError(f"discover_interval_s must be > 0, got {self.discover_interval_s}")


async def create_orchestrator_server(topology: Topology, options: ServerOptions,
                                     wait_s: float = 30.0,
                                     cluster: ClusterOptions = ClusterOptions()
                                     ) -> tuple[ServerHandle, Orchestrator]:
    """Check every stage (Describe), then serve the Orchestrator API."""
    peers = None
    if cluster.peers is not None or cluster.workers:
        peers = Peers(cluster.peers, cluster.workers)
    orchestrator = Orchestrator(topology, options.max_message_bytes,
                                cluster.discover_interval_s)
    try:
        await orchestrator.start(wait_s)
        handle = await create_server(options, [(
            orchestrator_pb2_grpc.add_OrchestratorServicer_to_server,
            OrchestratorServicer(orchestrator, peers), SERVICE_NAME)],
            () if cluster.private_address is None else (cluster.private_address,))
    except BaseException:
        await orchestrator.close()
        raise
    return handle, orchestrator


async def serve(topology: Topology, options: ServerOptions, metrics_port: int | None = None,
                on_serving: Callable[[int], Awaitable[None]] | None = None,
                cluster: ClusterOptions = ClusterOptions(), prog: str = "") -> None:
    """Serve until SIGTERM or SIGINT; `on_serving(port)` runs once the API listens. The line
    saying where it listens starts with `prog`, the command serving it (`llm-runner`, for
    `up`), or with "orchestrator" alone when it is the command itself."""
    init_tracing("llmstage-orchestrator")
    handle, orchestrator = await create_orchestrator_server(topology, options, cluster=cluster)
    metrics_line = ""
    if metrics_port is not None:
        _, bound = serve_metrics(orchestrator.metrics.registry, options.host, metrics_port)
        metrics_line = f", metrics on {options.host}:{bound}"
    label = f"{prog}: " if prog else ""
    print(f"{label}orchestrator listening on {options.host}:{handle.port} "
          f"(stages: {', '.join(s.stage_id for s in topology.stages)}){metrics_line}",
          flush=True)

    async def drain(grace_s: float) -> None:
        await handle.server.stop(grace=grace_s)

    async def ready() -> None:
        if on_serving is not None:
            await on_serving(handle.port)

    try:
        await serve_until_signal(handle, options, drain, ready)
    finally:
        await orchestrator.close()
