"""The agent's replica server: one thread per connection, every request authenticated before it is acted on.

Per connection the server speaks first (``HELLO`` with a fresh nonce); each request's MAC, sequence
number and incarnation are checked (:mod:`ddlscale.ckpt.gemini.protocol`), then the handler its op
code names in :attr:`ReplicaHandler.HANDLERS` carries it out. Every length is checked before anything
is allocated: a version's size against ``--max-version-bytes`` (the shared memory's free space is the
slots' check), each DATA chunk against the version's announced size, a MAC text against
``MAX_TEXT``. A refusal is counted by reason and answered; those in
:data:`~ddlscale.ckpt.gemini.agent.slots.CLOSING` close the connection.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import secrets
import socket
import socketserver
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from ddlscale.ckpt.gemini.agent.slots import Refused, Slot
from ddlscale.ckpt.gemini.auth import MAC_BYTES
from ddlscale.ckpt.gemini.protocol import (
    BEGIN,
    BUSY,
    DATA,
    END,
    GET,
    HELLO,
    MAGIC,
    MAX_TEXT,
    OK,
    PROTOCOL,
    REFUSED,
    REPLY,
    REQUEST,
    STAT,
    VERIFY,
    recv_bytes,
    recv_exactly,
    reply_mac,
    request_mac,
)
from ddlscale.ckpt.version.checksum import KEYED, Checksum, algorithm_of

if TYPE_CHECKING:
    from ddlscale.ckpt.gemini.agent import Agent

MIN_VERSION_BYTES = 16  # a snapshot stream's header
DATA_FENCE_S = 0.05  # how stale the incarnation a DATA chunk is checked against may be (one store read per
# chunk would halve a fast link's chunk rate)
TEXT_OPS = (END, VERIFY)
MAX_CONNECTIONS = 256  # per agent: trainers hold one each per holder they send to, drills and readers a few
FIRST_REQUEST_S = 10.0  # a new connection's first request must arrive within this
MESSAGE_S = 30.0  # the rest of a message (header, MAC, text, DATA payload) once its first bytes came
IDLE_S = 24 * 3600.0  # an authenticated connection between requests (a trainer between versions)  # requests followed by a short text (a MAC), covered by the request's MAC


@dataclass(frozen=True)
class Request:
    """One authenticated request of the current incarnation, as its handler sees it."""

    sock: socket.socket
    nonce: bytes
    header: bytes
    incarnation: int
    version: int
    owner: int
    a: int
    b: int
    text: bytes


class ReplicaHandler(socketserver.BaseRequestHandler):
    server: ReplicaServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nonce = secrets.token_bytes(16)
        agent = self.server.agent
        if not self.server.admitted:  # at the cap: said plainly, then closed (the client names the cap)
            agent.count("connections", f"{self.client_address[0]}: over {self.server.max_connections} connections")
            with contextlib.suppress(OSError):
                sock.settimeout(1.0)
                sock.sendall(HELLO.pack(BUSY, PROTOCOL, bytes(16)))
            return
        try:
            sock.sendall(HELLO.pack(MAGIC, PROTOCOL, nonce))
            seq = 0
            while True:
                try:
                    # Until a request authenticates, a connection gets FIRST_REQUEST_S to send it; after
                    # that a trainer may idle between versions, but a message once begun must keep coming.
                    sock.settimeout(FIRST_REQUEST_S if seq == 0 else IDLE_S)
                    magic = bytes(recv_bytes(sock, len(MAGIC)))
                    sock.settimeout(MESSAGE_S)
                    if magic != MAGIC:  # answered at once: a stranger's protocol need not fill our header
                        agent.count("unauthenticated", f"{self.client_address[0]}: not the replica protocol")
                        self.reply(sock, nonce, REQUEST.pack(MAGIC, 0, 0, 0, 0, 0, 0, 0), REFUSED,
                                   b"not the replica protocol")
                        return
                    raw = magic + recv_bytes(sock, REQUEST.size - len(MAGIC) + MAC_BYTES)
                except (ConnectionError, TimeoutError):
                    return
                header, mac = bytes(raw[:REQUEST.size]), bytes(raw[REQUEST.size:])
                _, op, rseq, incarnation, version, owner, a, b = REQUEST.unpack(header)
                try:
                    text = b""
                    if op in TEXT_OPS:
                        if not 0 < a <= MAX_TEXT:
                            raise Refused("bounds", f"a MAC text of {a} bytes (at most {MAX_TEXT})")
                        text = bytes(recv_bytes(sock, a))
                    if not hmac.compare_digest(mac, request_mac(agent.auth, nonce, header, text)):
                        raise Refused("unauthenticated", "request not signed with this job's secret")
                    if rseq != seq + 1:
                        raise Refused("replayed", f"request {rseq} where {seq + 1} was due (replayed or reordered)")
                    seq = rseq
                    try:
                        # Every request but a DATA chunk reads it afresh, and a chunk within DATA_FENCE_S
                        # of the last read: a trainer left from an earlier incarnation is refused as soon
                        # as the restart raised it, whatever it sends.
                        current = agent.view.incarnation(at_least=incarnation,
                                                         max_age_s=DATA_FENCE_S if op == DATA else 0.0)
                    except (RuntimeError, OSError) as exc:  # the store is unreachable: nothing can be decided
                        raise Refused(None, f"cannot read the job's incarnation from the store: {exc}") from None
                    if incarnation != current:
                        raise Refused("stale", f"incarnation {incarnation} is not the job's current one ({current})")
                    handler = self.HANDLERS.get(op)
                    if handler is None:
                        raise Refused("unknown_op", f"unknown op {op}")
                    handler(self, Request(sock, nonce, header, incarnation, version, owner, a, b, text))
                except Refused as refusal:
                    if refusal.reason is not None:
                        agent.count(refusal.reason, f"{self.client_address[0]}: {refusal}")
                    self.reply(sock, nonce, header, REFUSED if refusal.closes else refusal.status,
                               str(refusal).encode())
                    if refusal.closes:
                        return
        except OSError:
            return  # the sender died: a partial version simply never completes

    def reply(self, sock: socket.socket, nonce: bytes, request: bytes, status: int, body: bytes | memoryview = b"",
              body_mac: bool = True) -> None:
        header = REPLY.pack(status, REQUEST.unpack(request)[2], len(body))
        sock.sendall(header + reply_mac(self.server.agent.auth, nonce, header, body if body_mac else b""))
        if len(body):
            sock.sendall(body)

    # -- one handler per op code ---------------------------------------------------------------------
    def begin(self, r: Request) -> None:
        """Reserve the buffer this version goes into (the slots' fencing decides which). ``b`` = 1: the
        sender is the machine's own trainer, answered with the file it writes (the slot's inbox, copied
        in at END); to anyone else nothing: the buffer's own file is never named to a writer."""
        agent = self.server.agent
        if agent.stopping.is_set():  # the job is stopping: what is held stays as the drain reads it
            raise Refused(None, "the agent is stopping (a stop signal): it takes no new version")
        if r.a < MIN_VERSION_BYTES or (agent.max_version_bytes is not None and r.a > agent.max_version_bytes):
            raise Refused("bounds", f"a version of {r.a} bytes (this agent takes {MIN_VERSION_BYTES} to "
                                    f"{agent.max_version_bytes or 'what its shared memory holds'})")
        try:
            committed = agent.view.committed(r.owner)
        except (RuntimeError, OSError) as exc:
            raise Refused(None, f"cannot read the committed manifest from the store: {exc}") from None
        shared = r.b == 1
        slot = agent.replicas.begin(r.owner, r.version, r.a, r.incarnation, committed, agent.view.undecided, shared)
        self.reply(r.sock, r.nonce, r.header, OK, str(slot.inbox.path).encode() if shared else b"")

    def data(self, r: Request) -> None:
        """Receive ``b`` bytes at offset ``a`` straight into the buffer (no reply: chunks stream)."""
        slot = self.server.agent.replicas.writing(r.owner, r.version, r.incarnation)
        if slot is None or slot.inbox is not None or r.a < 0 or r.b <= 0 or r.a + r.b > slot.nbytes:
            raise Refused("bounds", f"DATA [{r.a}, {r.a + r.b}) of version {r.version} of rank {r.owner}: " + (
                "no such version in progress" if slot is None else "it is written through shared memory"
                if slot.inbox is not None else f"it has {slot.nbytes} bytes"))
        recv_exactly(r.sock, memoryview(slot.buf)[r.a:r.a + r.b])

    def end(self, r: Request) -> None:
        """The replica counts once the bytes held have the version's MAC."""
        replicas = self.server.agent.replicas
        expected = r.text.decode(errors="replace")
        slot = replicas.writing(r.owner, r.version, r.incarnation)
        if slot is None:
            raise Refused(None, f"no version {r.version} of rank {r.owner} in progress")
        if not self.holds(slot, expected, inbox=replicas.detach_inbox(slot)):
            raise Refused("mac_mismatch", f"MAC mismatch for version {r.version} of rank {r.owner}")
        if not replicas.mark_complete(slot, r.version, r.incarnation, expected):
            raise Refused(None, f"the buffer of version {r.version} of rank {r.owner} was reused meanwhile")
        self.reply(r.sock, r.nonce, r.header, OK)

    def get(self, r: Request) -> None:
        slot = self.server.agent.replicas.complete(r.owner, r.version)
        if slot is None:
            raise Refused(None, f"no complete version {r.version} of rank {r.owner} here")
        self.reply(r.sock, r.nonce, r.header, OK, slot.view(), body_mac=False)

    def verify(self, r: Request) -> None:
        slot = self.server.agent.replicas.complete(r.owner, r.version)
        if slot is None or not self.holds(slot, r.text.decode(errors="replace")):
            raise Refused(None, f"version {r.version} of rank {r.owner} missing or corrupt")
        self.reply(r.sock, r.nonce, r.header, OK)

    def stat(self, r: Request) -> None:
        self.reply(r.sock, r.nonce, r.header, OK, json.dumps(self.server.agent.stat()).encode())

    HANDLERS: ClassVar[dict[int, Callable[[ReplicaHandler, Request], None]]] = {
        BEGIN: begin, DATA: data, END: end, GET: get, VERIFY: verify, STAT: stat,
    }

    def holds(self, slot: Slot, expected: str, inbox: Slot | None = None) -> bool:
        """Whether the slot's bytes have MAC ``expected`` under the replica key (an unkeyed checksum,
        or an algorithm this agent does not know, never completes a replica). ``inbox``: the file a
        trainer wrote through shared memory, copied in first; the copy is what is checked."""
        try:
            keyed = algorithm_of(expected) in KEYED
        except ValueError:
            keyed = False
        if not keyed:
            if inbox is not None:
                inbox.release(revoke=True)
            return False
        digest = Checksum(algorithm_of(expected), self.server.agent.auth.replica)
        if inbox is not None:
            slot.copy_in(inbox, digest.update)
        else:
            with slot.view() as held:
                digest.update(held)
        return hmac.compare_digest(digest.text(), expected)


class ReplicaServer(socketserver.ThreadingTCPServer):
    """A thread per connection, at most ``max_connections`` of them: one more is told so and closed,
    so the agent's threads and open files stay bounded whoever connects."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], agent: Agent, max_connections: int = MAX_CONNECTIONS) -> None:
        self.agent = agent
        self.max_connections = max_connections
        self._open = 0
        self._open_lock = threading.Lock()
        self._local = threading.local()
        super().__init__(address, ReplicaHandler)

    @property
    def admitted(self) -> bool:
        return self._local.admitted

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            self._local.admitted = self._open < self.max_connections
            if self._local.admitted:
                self._open += 1
        try:
            super().process_request_thread(request, client_address)
        finally:
            if self._local.admitted:
                with self._open_lock:
                    self._open -= 1
