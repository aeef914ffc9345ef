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

import hmac
import json
import secrets
import socket
import socketserver
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from ddlscale.ckpt.gemini.agent.slots import Refused, Slot
from ddlscale.ckpt.gemini.auth import MAC_BYTES
from ddlscale.ckpt.gemini.protocol import (
    BEGIN,
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
from ddlscale.ckpt.version.checksum import KEYED, algorithm_of, matches

if TYPE_CHECKING:
    from ddlscale.ckpt.gemini.agent import Agent

MIN_VERSION_BYTES = 16  # a snapshot stream's header
TEXT_OPS = (END, VERIFY)  # requests followed by a short text (a MAC), covered by the request's MAC


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
        sock.settimeout(None)
        nonce = secrets.token_bytes(16)
        agent = self.server.agent
        try:
            sock.sendall(HELLO.pack(MAGIC, PROTOCOL, nonce))
            seq = 0
            while True:
                try:
                    magic = bytes(recv_bytes(sock, len(MAGIC)))
                    if magic != MAGIC:  # answered at once: a stranger's protocol need not fill our header
                        agent.count("unauthenticated", f"{self.client_address[0]}: not the replica protocol")
                        self.reply(sock, nonce, REQUEST.pack(MAGIC, 0, 0, 0, 0, 0, 0, 0), REFUSED,
                                   b"not the replica protocol")
                        return
                    raw = magic + recv_bytes(sock, REQUEST.size - len(MAGIC) + MAC_BYTES)
                except ConnectionError:
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
                        # BEGIN reads it afresh: a trainer left from an earlier incarnation must not start
                        # writing after a restart this agent has not heard of yet.
                        current = agent.view.incarnation(at_least=incarnation, fresh=op == BEGIN)
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
        """Reserve the buffer this version goes into (the slots' fencing decides which); answer its file."""
        agent = self.server.agent
        if r.a < MIN_VERSION_BYTES or (agent.max_version_bytes is not None and r.a > agent.max_version_bytes):
            raise Refused("bounds", f"a version of {r.a} bytes (this agent takes {MIN_VERSION_BYTES} to "
                                    f"{agent.max_version_bytes or 'what its shared memory holds'})")
        try:
            committed = agent.view.committed(r.owner)
        except (RuntimeError, OSError) as exc:
            raise Refused(None, f"cannot read the committed manifest from the store: {exc}") from None
        slot = agent.replicas.begin(r.owner, r.version, r.a, r.incarnation, committed, agent.view.undecided)
        self.reply(r.sock, r.nonce, r.header, OK, str(slot.path).encode())  # a sender on this machine writes there

    def data(self, r: Request) -> None:
        """Receive ``b`` bytes at offset ``a`` straight into the buffer (no reply: chunks stream)."""
        slot = self.server.agent.replicas.writing(r.owner, r.version, r.incarnation)
        if slot is None or r.a < 0 or r.b <= 0 or r.a + r.b > slot.nbytes:
            raise Refused("bounds", f"DATA [{r.a}, {r.a + r.b}) of version {r.version} of rank {r.owner}: "
                                    + ("no such version in progress" if slot is None else f"it has {slot.nbytes} bytes"))
        recv_exactly(r.sock, memoryview(slot.buf)[r.a:r.a + r.b])

    def end(self, r: Request) -> None:
        """The replica counts once the bytes held have the version's MAC."""
        replicas = self.server.agent.replicas
        expected = r.text.decode(errors="replace")
        slot = replicas.writing(r.owner, r.version, r.incarnation)
        if slot is None:
            raise Refused(None, f"no version {r.version} of rank {r.owner} in progress")
        if not self.holds(slot, expected):
            raise Refused("mac_mismatch", f"MAC mismatch for version {r.version} of rank {r.owner}")
        with replicas.lock:
            slot.complete, slot.mac = True, expected
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

    def holds(self, slot: Slot, expected: str) -> bool:
        """Whether the slot's bytes have MAC ``expected`` under the replica key (an unkeyed checksum,
        or an algorithm this agent does not know, never completes a replica)."""
        try:
            return algorithm_of(expected) in KEYED and matches(slot.view(), expected, self.server.agent.auth.replica)
        except ValueError:
            return False


class ReplicaServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], agent: Agent) -> None:
        self.agent = agent
        super().__init__(address, ReplicaHandler)
