"""The replica protocol: how trainers put checkpoint bytes into a machine's agent and get them back.

One TCP connection per (sender, agent). Every request is a fixed header ``(op, version, owner, a, b)``;
``owner`` is the rank whose state the bytes are. A version is written as ``BEGIN`` (its size and the
version the agent must keep), any number of ``DATA`` chunks (no reply, so chunks stream), and
``END`` with the sender's checksum (``"crc32:..."``) — the agent checks what it holds and answers
whether they match.
Only then is the replica complete. ``GET`` returns a complete replica; ``VERIFY`` checks one again;
``STAT`` lists what an agent holds; ``CORRUPT`` flips one byte (fault injection for tests).
"""

from __future__ import annotations

import json
import mmap
import socket
import struct
from typing import Any

REQUEST = struct.Struct("<4sBqiqq")  # magic, op, version, owner, a, b
REPLY = struct.Struct("<Bq")  # status, payload length
MAGIC = b"GMNI"
OK, FAILED = 0, 1
BEGIN, DATA, END, GET, VERIFY, STAT, CORRUPT = range(1, 8)
NO_VERSION = -1


class ReplicaError(RuntimeError):
    """An agent refused a request or could not be reached; the message says which and why."""


def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock`` (straight into the caller's memory: no intermediate copy)."""
    while view:
        got = sock.recv_into(view)
        if got == 0:
            raise ConnectionError("connection closed mid-message")
        view = view[got:]


def recv_bytes(sock: socket.socket, n: int) -> bytearray:
    out = bytearray(n)
    recv_exactly(sock, memoryview(out))
    return out


def parse_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"agent address must be HOST:PORT, got {address!r}")
    return host, int(port)


class AgentClient:
    """A connection to one machine's replica agent."""

    def __init__(self, address: str, timeout_s: float = 30.0) -> None:
        self.address, self.timeout_s = address, timeout_s
        self._connect()

    def _connect(self) -> None:
        try:
            self.sock = socket.create_connection(parse_address(self.address), timeout=self.timeout_s)
        except OSError as exc:
            raise ReplicaError(f"replica agent {self.address} unreachable: {exc}") from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def reconnect(self) -> None:
        """A fresh connection. After a request failed part-way (a timeout mid-DATA, or before END's
        reply) the old one is out of step: the agent would read headers as payload, or replies late."""
        self.close()
        self._connect()

    def close(self) -> None:
        self.sock.close()

    def _request(self, op: int, version: int, owner: int, a: int = 0, b: int = 0, payload: bytes = b"") -> None:
        self.sock.sendall(REQUEST.pack(MAGIC, op, version, owner, a, b) + payload)

    def _reply(self) -> bytearray:
        status, length = REPLY.unpack(recv_bytes(self.sock, REPLY.size))
        body = recv_bytes(self.sock, length)
        if status != OK:
            raise ReplicaError(f"agent {self.address}: {body.decode(errors='replace')}")
        return body

    def begin(self, version: int, owner: int, nbytes: int, keep: int = NO_VERSION) -> str:
        """Open a version at the agent; returns the shared-memory file the agent will hold it in."""
        self._request(BEGIN, version, owner, nbytes, keep)
        return self._reply().decode()

    def data(self, version: int, owner: int, offset: int, pieces: list[memoryview]) -> None:
        """Send bytes at ``offset`` of the version; ``pieces`` are sent back to back (no reply)."""
        length = sum(len(p) for p in pieces)
        self._request(DATA, version, owner, offset, length)
        for piece in pieces:
            self.sock.sendall(piece)

    def end(self, version: int, owner: int, checksum: str) -> None:
        """Close a version; raises :class:`ReplicaError` when the agent's checksum differs."""
        text = checksum.encode()
        self._request(END, version, owner, len(text), payload=text)
        self._reply()

    def get(self, version: int, owner: int) -> bytearray:
        self._request(GET, version, owner)
        return self._reply()

    def verify(self, version: int, owner: int, checksum: str) -> None:
        text = checksum.encode()
        self._request(VERIFY, version, owner, len(text), payload=text)
        self._reply()

    def stat(self) -> dict[str, Any]:
        self._request(STAT, NO_VERSION, -1)
        return json.loads(self._reply())

    def corrupt(self, version: int, owner: int, offset: int) -> None:
        self._request(CORRUPT, version, owner, offset)
        self._reply()

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class LocalAgentClient(AgentClient):
    """The connection to this machine's own agent: data goes straight into the agent's shared-memory
    buffer (one memcpy, no TCP); BEGIN, END and the rest still go over the socket."""

    def __init__(self, address: str, timeout_s: float = 30.0) -> None:
        super().__init__(address, timeout_s)
        self._mapped: tuple[str, int] | None = None
        self._map: mmap.mmap | None = None

    def begin(self, version: int, owner: int, nbytes: int, keep: int = NO_VERSION) -> str:
        path = super().begin(version, owner, nbytes, keep)
        if self._mapped != (path, nbytes):
            self._unmap()
            with open(path, "r+b") as file:
                self._map = mmap.mmap(file.fileno(), nbytes)
            self._mapped = (path, nbytes)
        return path

    def data(self, version: int, owner: int, offset: int, pieces: list[memoryview]) -> None:
        view = memoryview(self._map)
        for piece in pieces:
            view[offset:offset + len(piece)] = piece
            offset += len(piece)
        view.release()

    def _unmap(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map, self._mapped = None, None

    def close(self) -> None:
        self._unmap()
        super().close()
