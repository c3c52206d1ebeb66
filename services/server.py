"""Server bootstrap shared by every service: a grpc.aio server with the error interceptor,
grpc.health.v1, server reflection, message limits, and a graceful drain.

    server = create_server(options, [(add_FooServicer_to_server, servicer, "pkg.Foo")])
    port = server.add_port(...)  # done by create_server; see ServerHandle.port

Drain: health goes NOT_SERVING first (load balancers stop sending), then the service's own
drain runs (finish or cancel what is running), then the server stops.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as reflection_pb

from services.errors import Unavailable
from services.interceptor import ErrorInterceptor

log = logging.getLogger(__name__)

MiB = 1 << 20
# grpcio-reflection ships v1alpha only; v1's messages are v1alpha's field for field (the same
# bytes on the wire), so the one servicer answers both services.
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


@dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 50051  # 0 picks a free port
    max_message_bytes: int = 16 * MiB  # both directions
    grace_s: float = 10.0  # how long running work may take to finish on SIGTERM
    # SO_REUSEPORT: several worker processes listen on the port (services/workers.py). Off,
    # a port something else listens on is a bind failure, not a silent share.
    is_port_shared: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.max_message_bytes < 4096:
            raise ValueError(f"max_message_bytes must be >= 4096, got {self.max_message_bytes}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")


@dataclass
class ServerHandle:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    service_names: tuple[str, ...]

    async def set_serving(self, is_serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if is_serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", *self.service_names):
            await self.health.set(name, status)


Registrar = Callable[[Any, grpc.aio.Server], None]


def _add_reflection(names: tuple[str, ...], server: grpc.aio.Server) -> None:
    """Server reflection as grpc.reflection.v1alpha and v1 (what newer clients ask first)."""
    servicer = reflection.aio.ReflectionServicer((*names, reflection.SERVICE_NAME,
                                                  REFLECTION_V1))
    method = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers(tuple(
        grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": method})
        for name in (reflection.SERVICE_NAME, REFLECTION_V1)))


async def create_server(options: ServerOptions,
                        services: Sequence[tuple[Registrar, Any, str]],
                        private_addresses: Sequence[str] = ()) -> ServerHandle:
    """Build and start a server hosting `services` (registrar, servicer, full service name),
    on options.host:options.port and on each of `private_addresses` (a worker's own socket,
    "unix:/path", which its sibling workers call)."""
    limits = [("grpc.max_receive_message_length", options.max_message_bytes),
              ("grpc.max_send_message_length", options.max_message_bytes),
              ("grpc.so_reuseport", int(options.is_port_shared))]
    server = grpc.aio.server(interceptors=[ErrorInterceptor()], options=limits)
    names = tuple(name for _, _, name in services)
    for register, servicer, _ in services:
        register(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    _add_reflection((*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name),
                    server)
    port = server.add_insecure_port(f"{options.host}:{options.port}")
    if port == 0:
        raise OSError(f"cannot listen on {options.host}:{options.port}")
    for address in private_addresses:
        try:
            server.add_insecure_port(address)
        except RuntimeError:
            raise Unavailable(f"cannot listen on {address} (is its directory there and "
                              "writable?)") from None
    await server.start()
    handle = ServerHandle(server, port, health_servicer, names)
    await handle.set_serving(True)
    return handle


async def serve_until_signal(handle: ServerHandle, options: ServerOptions,
                             drain: Callable[[float], Awaitable[None]],
                             ready: Callable[[], Awaitable[None]] | None = None) -> None:
    """Serve until SIGTERM or SIGINT, then drain: NOT_SERVING, `drain(grace_s)`, stop.
    `ready()` runs once the signals are handled (a signal meanwhile drains after it)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        await ready()
    await stop.wait()
    log.info("draining (grace %.1f s)", options.grace_s)
    await handle.set_serving(False)
    await drain(options.grace_s)
    await handle.server.stop(grace=1.0)
