"""DNS targets for replica discovery: `dns:///NAME:PORT` (the system resolver) or
`dns://SERVER:PORT/NAME:PORT` (ask that DNS server over UDP directly).

A Kubernetes headless Service answers its name with one A record per ready pod, so resolving
the name lists the replicas. Only A records (IPv4) are read; the answer is sorted so two
resolutions of the same set compare equal.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import struct
from dataclasses import dataclass

from services.errors import InvalidArgument, Unavailable

_TYPE_A, _CLASS_IN = 1, 1


@dataclass(frozen=True)
class DnsTarget:
    name: str  # the host name to resolve
    port: int  # the port every replica listens on
    server: tuple[str, int] | None = None  # a DNS server to ask; None = the system resolver

    def __str__(self) -> str:
        where = "" if self.server is None else f"{self.server[0]}:{self.server[1]}"
        return f"dns://{where}/{self.name}:{self.port}"


def parse_target(text: str) -> DnsTarget:
    """`dns:///name:port` or `dns://server:port/name:port`; InvalidArgument names the fault."""
    if not text.startswith("dns://"):
        raise InvalidArgument(f"{text!r}: a discovery target starts with 'dns://' "
                              "(dns:///name:port or dns://server:port/name:port)")
    authority, slash, rest = text[len("dns://"):].partition("/")
    if not slash:
        raise InvalidArgument(f"{text!r}: no '/' before the name (dns:///name:port)")
    server = None
    if authority:
        host, colon, sport = authority.partition(":")
        server = (host, _port(text, sport if colon else "53"))
    name, _, port = rest.rpartition(":")
    if not name or not port:
        raise InvalidArgument(f"{text!r}: the name needs its port (name:port)")
    return DnsTarget(name, _port(text, port), server)


async def resolve(target: DnsTarget, timeout_s: float = 2.0) -> tuple[str, ...]:
    """The target's replicas as sorted "ip:port" strings. Raises Unavailable when the name
    does not resolve (an empty answer is a valid result: no replica is ready)."""
    if target.server is None:
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(loop.getaddrinfo(
                target.name, target.port, family=socket.AF_INET, type=socket.SOCK_STREAM),
                timeout_s)
        except (TimeoutError, OSError) as exc:
            raise Unavailable(f"cannot resolve {target}: {exc}") from None
        ips = {str(info[4][0]) for info in infos}
    else:
        ips = set(await _query_a(target, timeout_s))
    return tuple(f"{ip}:{target.port}" for ip in sorted(ips, key=socket.inet_aton))


async def _query_a(target: DnsTarget, timeout_s: float) -> list[str]:
    assert target.server is not None
    query_id = secrets.randbits(16)
    loop = asyncio.get_running_loop()
    answer: asyncio.Future[bytes] = loop.create_future()

    class _Proto(asyncio.DatagramProtocol):
        def datagram_received(self, data: bytes, addr: object) -> None:
            if len(data) >= 2 and struct.unpack("!H", data[:2])[0] == query_id \
                    and not answer.done():
                answer.set_result(data)

    transport, _ = await loop.create_datagram_endpoint(_Proto, remote_addr=target.server)
    try:
        transport.sendto(encode_query(query_id, target.name))
        data = await asyncio.wait_for(answer, timeout_s)
    except (TimeoutError, OSError) as exc:
        raise Unavailable(f"cannot resolve {target}: no answer ({exc!r})") from None
    finally:
        transport.close()
    return decode_a_records(data, str(target))


def encode_query(query_id: int, name: str) -> bytes:
    """One question, type A, class IN, recursion desired."""
    header = struct.pack("!HHHHHH", query_id, 0x0100, 1, 0, 0, 0)
    return header + encode_name(name) + struct.pack("!HH", _TYPE_A, _CLASS_IN)


def encode_name(name: str) -> bytes:
    labels = [p.encode("ascii") for p in name.rstrip(".").split(".") if p]
    return b"".join(bytes([len(p)]) + p for p in labels) + b"\0"


def decode_a_records(data: bytes, what: str) -> list[str]:
    """The A records of a DNS answer; Unavailable for an error code (NXDOMAIN included)."""
    try:
        _, flags, num_questions, num_answers = struct.unpack("!HHHH", data[:8])
        if flags & 0xF:
            raise Unavailable(f"cannot resolve {what}: DNS error code {flags & 0xF}")
        pos = 12
        for _ in range(num_questions):
            pos = _skip_name(data, pos) + 4
        ips = []
        for _ in range(num_answers):
            pos = _skip_name(data, pos)
            rtype, rclass, _, length = struct.unpack("!HHIH", data[pos:pos + 10])
            pos += 10
            if rtype == _TYPE_A and rclass == _CLASS_IN and length == 4:
                ips.append(socket.inet_ntoa(data[pos:pos + 4]))
            pos += length
        return ips
    except (struct.error, IndexError):
        raise Unavailable(f"cannot resolve {what}: a malformed DNS answer") from None


def _skip_name(data: bytes, pos: int) -> int:
    while True:
        n = data[pos]
        if n == 0:
            return pos + 1
        if n & 0xC0 == 0xC0:  # a compression pointer ends the name
            return pos + 2
        pos += n + 1


def _port(text: str, port: str) -> int:
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"{text!r}: port {port!r} is not in 1..65535")
    return int(port)
