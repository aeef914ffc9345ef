"""The replica protocol: how trainers put checkpoint bytes into a machine's agent and get them back.

One TCP connection per (client, agent). The agent speaks first: ``HELLO`` (magic, protocol version,
a fresh random nonce). Then every request is a fixed header ``(op, seq, incarnation, version, owner,
a, b)`` and a MAC under the job's message key (:mod:`ddlscale.ckpt.gemini.auth`) over the nonce, the header
and any short text that follows; ``owner`` is the rank whose state the bytes are:

* ``BEGIN`` (``a`` = the version's size; ``b`` = 1 from the machine's own trainer): the agent picks
  and reserves a buffer — which one is its decision alone (:mod:`ddlscale.ckpt.gemini.agent`) — and
  answers the own trainer with a shared-memory file to write, copied into the buffer at END (the
  buffer's own file is named to no writer);
* ``DATA`` (``a`` = offset, ``b`` = length, then ``b`` bytes; no reply, so chunks stream);
* ``END`` (text: the version's MAC under the replica key): the agent checks the bytes it holds;
  only then is the replica complete;
* ``GET`` returns a complete replica; ``VERIFY`` checks one again; ``STAT`` lists what an agent holds,
  what it refused and the newest commit record and incarnation it has seen;
* ``JOIN`` does nothing: every client sends it as it connects, so that its connection authenticates at
  once and takes one of the agent's slots (a connection holds none until its first request
  authenticates, :mod:`ddlscale.ckpt.gemini.agent.server`).

What the framing guarantees: a header nobody with the job's secret wrote fails its MAC; ``seq`` counts
up by one per request on a connection, so a recorded request replayed, dropped or reordered is
refused, and the nonce makes a recording useless on any other connection; ``incarnation`` older than
the job's current one marks a stale trainer (``JOIN`` and ``STAT`` change nothing and are answered
whatever their incarnation: the drain and a restart ask the agents which incarnation is current). A
refused request gets a reply saying why, then the
agent closes the connection (its framing can no longer be trusted). DATA's payload is not MACed chunk
by chunk: it lands in a version that counts only once END has proved the MAC of the whole version,
which also covers bytes a trainer wrote through shared memory, and nobody without the secret can send
DATA at all. Replies carry a MAC over the nonce, the request's ``seq``, the status and the body —
GET's body excepted: its reader checks it against the version's MAC in the signed manifest.

There is no fault-injection op: tests and drills damage a replica through its shared-memory file.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import mmap
import os
import shutil
import socket
import struct
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

from ddlscale import clock
from ddlscale.ckpt.gemini.auth import MAC_BYTES, JobKeys

MAGIC = b"GMN2"
PROTOCOL = 3
HELLO = struct.Struct("<4sB16s")  # magic, protocol, nonce
REQUEST = struct.Struct("<4sBQqqiqq")  # magic, op, seq, incarnation, version, owner, a, b
REPLY = struct.Struct("<BQq")  # status, seq of the request answered, body length
OK, FAILED, NO_SPACE, REFUSED, STORE_BEHIND = range(5)
BEGIN, DATA, END, GET, VERIFY, STAT = range(1, 7)
JOIN = 8  # (7 was a fault-injection op, long gone: the drills send it to see it refused)
CONNECT_ATTEMPTS = 3  # a connection pushed out before its JOIN was answered (a flood of strangers) is retried
NO_VERSION = -1
MAX_TEXT = 128  # a MAC's text: "hmac-sha256:" + 64 hex digits fits
MAX_SMALL_REPLY = 1 << 20  # every reply but GET's body


SHM_DIR_ENV = "DDLSCALE_SHM_DIR"  # where replica buffers live instead of /dev/shm (tests, odd hosts)
SHM_BUDGET_ENV = "DDLSCALE_SHM_BUDGET"  # bytes the job's replica files may take there at most (tests)


def shm_dir() -> Path:
    """Where replica buffers live: ``$DDLSCALE_SHM_DIR``, else RAM-backed /dev/shm where there is one."""
    if os.environ.get(SHM_DIR_ENV):
        return Path(os.environ[SHM_DIR_ENV])
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


class ShmUsage(NamedTuple):
    free: int
    total: int


def shm_usage() -> ShmUsage:
    """Free and total bytes for replica buffers: the file system's, or within ``$DDLSCALE_SHM_BUDGET``
    (less what replica files, ``ddl-*``, already take there) when that is set."""
    usage = shutil.disk_usage(shm_dir())
    budget = os.environ.get(SHM_BUDGET_ENV)
    if not budget:
        return ShmUsage(usage.free, usage.total)
    used = 0
    for path in shm_dir().glob("ddl-*"):
        with contextlib.suppress(OSError):
            used += path.lstat().st_blocks * 512
    return ShmUsage(max(0, min(usage.free, int(budget) - used)), min(usage.total, int(budget)))


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


class ReplicaError(RuntimeError):
    """An agent refused a request or could not be reached; the message says which and why."""


class ReplicaSpaceError(ReplicaError):
    """An agent could not reserve a version's buffer: its shared memory is too small."""


class ReplicaRefused(ReplicaError):
    """An agent refused a request as unauthenticated, replayed, stale or out of bounds, and closed the
    connection."""


class ReplicaStoreBehind(ReplicaError):
    """An agent refused BEGIN: the job's store holds an older commit record (or incarnation) than one the
    agent has seen, or none at all. Someone wrote an old record back or deleted it; a version begun now
    could overwrite the newest committed one, so the run must stop (:mod:`ddlscale.ckpt.gemini.kvstore`)."""


class ConnectionClosed(ConnectionError):
    """The peer closed the connection before the message was whole."""


def recv_exactly(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view`` from ``sock`` (straight into the caller's memory: no intermediate copy). ``deadline``
    (:func:`ddlscale.clock.now`): the whole message must be in by then — a socket timeout alone bounds each
    recv, so a peer sending one byte at a time would hold the connection for as long as it likes."""
    while view:
        if deadline is not None:
            left = deadline - clock.now()
            if left <= 0:
                raise TimeoutError("the message's deadline passed")
            sock.settimeout(clock.wall(left))
        got = sock.recv_into(view)
        if got == 0:
            raise ConnectionClosed("connection closed mid-message")
        view = view[got:]


def recv_bytes(sock: socket.socket, n: int, deadline: float | None = None) -> bytearray:
    """``n`` bytes; callers bound ``n`` before calling (it is allocated at once)."""
    out = bytearray(n)
    recv_exactly(sock, memoryview(out), deadline)
    return out


def parse_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"agent address must be HOST:PORT, got {address!r}")
    return host, int(port)


def request_mac(auth: JobKeys, nonce: bytes, header: bytes, text: bytes = b"") -> bytes:
    return auth.message_mac(b"req", nonce, header, text)


def reply_mac(auth: JobKeys, nonce: bytes, header: bytes, body: bytes | memoryview = b"") -> bytes:
    return auth.message_mac(b"rep", nonce, header, body)


class AgentClient:
    """An authenticated connection to one machine's replica agent, as incarnation ``incarnation``."""

    def __init__(self, address: str, auth: JobKeys, incarnation: int, timeout_s: float = 30.0) -> None:
        self.address, self.auth, self.incarnation, self.timeout_s = address, auth, incarnation, timeout_s
        self._connect()

    def _connect(self) -> None:
        """Connect and JOIN. A connection the agent closed before answering (pushed out by newer
        unauthenticated ones: a flood) is tried again, at most ``CONNECT_ATTEMPTS`` times."""
        for attempt in range(1, CONNECT_ATTEMPTS + 1):
            try:
                self.sock = socket.create_connection(parse_address(self.address), timeout=clock.wall(self.timeout_s))
                self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                magic, protocol, self.nonce = HELLO.unpack(recv_bytes(self.sock, HELLO.size))
            except OSError as exc:
                raise ReplicaError(f"replica agent {self.address} unreachable: {exc}") from None
            if magic != MAGIC or protocol != PROTOCOL:
                self.sock.close()
                raise ReplicaError(f"{self.address} is not a replica agent of protocol {PROTOCOL}")
            self.seq = 0
            try:
                self._request(JOIN, NO_VERSION, -1)
                self._reply()
                return
            except (ConnectionClosed, ConnectionResetError, BrokenPipeError) as exc:
                self.sock.close()
                if attempt == CONNECT_ATTEMPTS:
                    raise ReplicaError(f"replica agent {self.address} closed {attempt} connections before "
                                       f"answering: {exc}") from None
            except BaseException:
                self.sock.close()
                raise

    def reconnect(self) -> None:
        """A fresh connection. After a request failed part-way (a timeout mid-DATA, or before END's
        reply) the old one is out of step: the agent would read headers as payload, or replies late."""
        self.close()
        self._connect()

    def close(self) -> None:
        self.sock.close()

    def _request(self, op: int, version: int, owner: int, a: int = 0, b: int = 0, text: bytes = b"") -> None:
        self.seq += 1
        header = REQUEST.pack(MAGIC, op, self.seq, self.incarnation, version, owner, a, b)
        self.sock.sendall(header + request_mac(self.auth, self.nonce, header, text) + text)

    def _reply(self, limit: int = MAX_SMALL_REPLY, body_mac: bool = True) -> bytearray:
        header = recv_bytes(self.sock, REPLY.size)
        mac = recv_bytes(self.sock, MAC_BYTES)
        status, seq, length = REPLY.unpack(header)
        if not 0 <= length <= limit:
            raise ConnectionError(f"agent {self.address} announced a reply of {length} bytes (at most {limit})")
        body = recv_bytes(self.sock, length)
        # Every reply's MAC covers its body but a successful GET's (its reader checks the version's MAC).
        expected = reply_mac(self.auth, self.nonce, header, body if body_mac or status != OK else b"")
        if seq != self.seq or not hmac.compare_digest(bytes(mac), expected):
            raise ConnectionError(f"agent {self.address}: a reply that fails its MAC")
        if status != OK:
            message = f"agent {self.address}: {body.decode(errors='replace')}"
            raise {NO_SPACE: ReplicaSpaceError, REFUSED: ReplicaRefused,
                   STORE_BEHIND: ReplicaStoreBehind}.get(status, ReplicaError)(message)
        return body

    def begin(self, version: int, owner: int, nbytes: int, shared: bool = False) -> str:
        """Open a version at the agent. ``shared``: it will be written through shared memory; returns the
        file to write (else "")."""
        self._request(BEGIN, version, owner, nbytes, 1 if shared else 0)
        return self._reply().decode()

    def data(self, version: int, owner: int, offset: int, pieces: list[memoryview]) -> None:
        """Send bytes at ``offset`` of the version; ``pieces`` are sent back to back (no reply)."""
        length = sum(len(p) for p in pieces)
        self._request(DATA, version, owner, offset, length)
        for piece in pieces:
            self.sock.sendall(piece)

    def end(self, version: int, owner: int, mac: str) -> None:
        """Close a version; raises :class:`ReplicaError` when the agent's bytes have another MAC."""
        text = mac.encode()
        self._request(END, version, owner, len(text), text=text)
        self._reply()

    def get(self, version: int, owner: int, max_bytes: int) -> bytearray:
        """A complete replica, at most ``max_bytes`` long (the reader checks its MAC)."""
        self._request(GET, version, owner)
        return self._reply(limit=max_bytes, body_mac=False)

    def verify(self, version: int, owner: int, mac: str) -> None:
        text = mac.encode()
        self._request(VERIFY, version, owner, len(text), text=text)
        self._reply()

    def stat(self) -> dict[str, Any]:
        self._request(STAT, NO_VERSION, -1)
        return json.loads(self._reply())

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class LocalAgentClient(AgentClient):
    """The connection to this machine's own agent: data goes straight into a shared-memory file the agent
    made for it (one memcpy, no TCP); BEGIN, END and the rest still go over the socket. At END the agent
    copies that file into the replica's buffer and truncates it: nothing mapped here reaches a complete
    version."""

    def __init__(self, address: str, auth: JobKeys, incarnation: int, timeout_s: float = 30.0) -> None:
        super().__init__(address, auth, incarnation, timeout_s)
        self._mapped: tuple[str, int] | None = None
        self._map: mmap.mmap | None = None

    def begin(self, version: int, owner: int, nbytes: int) -> str:
        path = super().begin(version, owner, nbytes, shared=True)
        if Path(path).parent != shm_dir() or not Path(path).name.startswith("ddl-"):
            raise ReplicaError(f"agent {self.address} named {path!r}, not one of its shared-memory buffers")
        self._unmap()  # every version is a new file (the agent's): the last one's mapping is dropped
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            self._map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self._mapped = (path, nbytes)
        return path

    def data(self, version: int, owner: int, offset: int, pieces: list[memoryview]) -> None:
        view = memoryview(self._map)
        for piece in pieces:
            view[offset:offset + len(piece)] = piece
            offset += len(piece)
        view.release()

    def end(self, version: int, owner: int, mac: str) -> None:
        self._unmap()  # the version is written (the agent truncates the file at END: a kept mapping would fault)
        super().end(version, owner, mac)

    def _unmap(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map, self._mapped = None, None

    def close(self) -> None:
        self._unmap()
        super().close()
