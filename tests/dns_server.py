"""A DNS server for tests: UDP on a loopback port, A records only, answers changed at will.

    with DnsServer() as dns:
        dns.set("runners.test", ["127.0.0.2", "127.0.0.3"])
        target = f"dns://127.0.0.1:{dns.port}/runners.test:50051"

It plays the part of a cluster's DNS for a headless Service: one A record per ready replica.
A name it does not know gets NXDOMAIN.
"""

from __future__ import annotations

import socket
import struct
import threading
from types import TracebackType


class DnsServer:
    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.settimeout(0.2)
        self.port: int = self._sock.getsockname()[1]
        self._records: dict[str, list[str]] = {}
        self._lock = threading.Lock()
        self.num_queries = 0
        self._is_closed = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def set(self, name: str, ips: list[str]) -> None:
        with self._lock:
            self._records[name.rstrip(".").lower()] = list(ips)

    def close(self) -> None:
        self._is_closed = True
        self._thread.join(5)
        self._sock.close()

    def __enter__(self) -> DnsServer:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _serve(self) -> None:
        while not self._is_closed:
            try:
                data, addr = self._sock.recvfrom(512)
            except TimeoutError:
                continue
            self._sock.sendto(self._answer(data), addr)

    def _answer(self, data: bytes) -> bytes:
        query_id, _ = struct.unpack("!HH", data[:4])
        pos, labels = 12, []
        while data[pos]:
            labels.append(data[pos + 1:pos + 1 + data[pos]].decode("ascii"))
            pos += data[pos] + 1
        question = data[12:pos + 5]
        with self._lock:
            self.num_queries += 1
            ips = self._records.get(".".join(labels).lower())
        if ips is None:  # NXDOMAIN
            return struct.pack("!HHHHHH", query_id, 0x8183, 1, 0, 0, 0) + question
        answers = b"".join(struct.pack("!HHHIH", 0xC00C, 1, 1, 5, 4) + socket.inet_aton(ip)
                           for ip in ips)
        return struct.pack("!HHHHHH", query_id, 0x8180, 1, len(ips), 0, 0) + question + answers
