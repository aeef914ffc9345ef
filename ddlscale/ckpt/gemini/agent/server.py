"""The agent's replica server: one thread per connection, every request authenticated before it is acted on.

Per connection the server speaks first (``HELLO`` with a fresh nonce); each request's MAC, sequence
number and incarnation are checked (:mod:`ddlscale.ckpt.gemini.protocol`), then the handler its op
code names in :attr:`ReplicaHandler.HANDLERS` carries it out. Every length is checked before anything
is allocated: a version's size against ``--max-version-bytes`` (the shared memory's free space is the
slots' check), each DATA chunk against the version's announced size, a MAC text against
``MAX_TEXT``. A refusal is counted by reason and answered; those in
:data:`~ddlscale.ckpt.gemini.agent.slots.CLOSING` close the connection.

Limits (:class:`Admission`), so that strangers, however many and however slow, cannot keep the job's own
clients out — the drain at a stop, a restart's recovery:

* a connection takes one of the agent's ``MAX_CONNECTIONS`` slots only once its first request
  authenticates; until then it is *pending*, and a newer pending connection pushes out the oldest one
  of its own address when that address holds ``PENDING_PER_PEER``, else the oldest of all at
  ``MAX_PENDING``. A client JOINs as it connects, so its connection is pending for one round trip;
* deadlines on whole messages, not on each recv: the first request within ``FIRST_REQUEST_S`` of the
  connection, every later one within ``MESSAGE_S`` of its first byte (its DATA payload included);
* at the slots' cap, a connection of an older incarnation than the newcomer's (a trainer left from before
  a restart) gives its slot up; else the newcomer is told so and closed (``connections``).
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
from typing import TYPE_CHECKING, ClassVar

from ddlscale import clock
from ddlscale.ckpt.gemini.agent.slots import Refused, Slot
from ddlscale.ckpt.gemini.auth import MAC_BYTES
from ddlscale.ckpt.gemini.kvstore import StoreWentBack
from ddlscale.ckpt.gemini.protocol import (
    BEGIN,
    DATA,
    END,
    GET,
    HELLO,
    JOIN,
    MAGIC,
    MAX_TEXT,
    OK,
    PROTOCOL,
    REFUSED,
    REPLY,
    REQUEST,
    STAT,
    STORE_BEHIND,
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
TEXT_OPS = (END, VERIFY)  # requests followed by a short text (a MAC), covered by the request's MAC
UNFENCED = (JOIN, STAT)  # change nothing: answered whatever the incarnation (the drain asks STAT which is current)
MAX_CONNECTIONS = 256  # authenticated, per agent: trainers hold one per holder they send to, drills and readers a few
MAX_PENDING = 64  # not yet authenticated, per agent: a newer one pushes out the oldest
PENDING_PER_PEER = 16  # ... of them from one address: one peer pushes out its own, not everyone else's
FIRST_REQUEST_S = 10.0  # from a connection's HELLO to its first request, whole (emulated seconds)
MESSAGE_S = 30.0  # any later message, whole (header, MAC, text, DATA payload), from its first byte
IDLE_S = 24 * 3600.0  # an authenticated connection between requests (a trainer between versions)


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
    deadline: float  # the whole message, DATA's payload included, by then (clock.now())


class ReplicaHandler(socketserver.BaseRequestHandler):
    server: ReplicaServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nonce = secrets.token_bytes(16)
        agent, admission, peer = self.server.agent, self.server.admission, self.client_address[0]
        pushed_out = admission.arrive(sock, peer)
        if pushed_out is not None:
            agent.count("evicted", f"{pushed_out}: an unauthenticated connection pushed out by a newer one")
        try:
            sock.sendall(HELLO.pack(MAGIC, PROTOCOL, nonce))
            opened = clock.now()
            seq = 0
            while True:
                try:
                    # The first request must be whole by FIRST_REQUEST_S after HELLO, however it trickles in.
                    # After that a trainer may idle between versions, but a message once begun must be whole
                    # within MESSAGE_S.
                    deadline = opened + FIRST_REQUEST_S if seq == 0 else None
                    sock.settimeout(clock.wall(IDLE_S))
                    magic = bytes(recv_bytes(sock, 1, deadline))
                    if deadline is None:
                        deadline = clock.now() + MESSAGE_S
                    magic += recv_bytes(sock, len(MAGIC) - 1, deadline)
                    if magic != MAGIC:  # answered at once: a stranger's protocol need not fill our header
                        agent.count("unauthenticated", f"{peer}: not the replica protocol")
                        self.reply(sock, nonce, REQUEST.pack(MAGIC, 0, 0, 0, 0, 0, 0, 0), REFUSED,
                                   b"not the replica protocol")
                        return
                    raw = magic + recv_bytes(sock, REQUEST.size - len(MAGIC) + MAC_BYTES, deadline)
                except ConnectionError:
                    return
                header, mac = bytes(raw[:REQUEST.size]), bytes(raw[REQUEST.size:])
                _, op, rseq, incarnation, version, owner, a, b = REQUEST.unpack(header)
                try:
                    text = b""
                    if op in TEXT_OPS:
                        if not 0 < a <= MAX_TEXT:
                            raise Refused("bounds", f"a MAC text of {a} bytes (at most {MAX_TEXT})")
                        text = bytes(recv_bytes(sock, a, deadline))
                    if not hmac.compare_digest(mac, request_mac(agent.auth, nonce, header, text)):
                        raise Refused("unauthenticated", "request not signed with this job's secret")
                    if rseq != seq + 1:
                        raise Refused("replayed", f"request {rseq} where {seq + 1} was due (replayed or reordered)")
                    if seq == 0 and not admission.authenticated(sock, self.standing(incarnation)):
                        raise Refused("connections", f"at its connection cap ({admission.slots} authenticated "
                                                     "connections, none of an older incarnation)")
                    seq = rseq
                    if op not in UNFENCED:
                        self.fence(op, incarnation)
                    handler = self.HANDLERS.get(op)
                    if handler is None:
                        raise Refused("unknown_op", f"unknown op {op}")
                    sock.settimeout(clock.wall(MESSAGE_S))  # the reply, likewise
                    handler(self, Request(sock, nonce, header, incarnation, version, owner, a, b, text, deadline))
                except Refused as refusal:
                    if refusal.reason is not None:
                        agent.count(refusal.reason, f"{peer}: {refusal}")
                    self.reply(sock, nonce, header, REFUSED if refusal.closes else refusal.status,
                               str(refusal).encode())
                    if refusal.closes:
                        return
        except TimeoutError:  # a deadline passed: whatever it was sending, it was too slow (or silent)
            agent.count("slow", f"{peer}: a message not whole by its deadline")
        except OSError:
            return  # the sender died: a partial version simply never completes
        finally:
            admission.leave(sock)

    def standing(self, claimed: int) -> int:
        """The incarnation a new connection's slot counts as: what it claims, at most the job's (a claim
        above it must not push out the job's own trainers; JOIN itself is not fenced)."""
        try:
            return min(claimed, self.server.agent.view.incarnation(at_least=claimed, max_age_s=DATA_FENCE_S))
        except (RuntimeError, OSError):  # the store is unreachable: the lowest standing
            return 0

    def fence(self, op: int, incarnation: int) -> None:
        """Refuse a request of any but the job's current incarnation. Every request but a DATA chunk reads
        it afresh, and a chunk within DATA_FENCE_S of the last read: a trainer left from an earlier
        incarnation is refused as soon as the restart raised it, whatever it sends."""
        try:
            current = self.server.agent.view.incarnation(at_least=incarnation,
                                                         max_age_s=DATA_FENCE_S if op == DATA else 0.0)
        except (RuntimeError, OSError) as exc:  # the store is unreachable: nothing can be decided
            raise Refused(None, f"cannot read the job's incarnation from the store: {exc}") from None
        if incarnation != current:
            raise Refused("stale", f"incarnation {incarnation} is not the job's current one ({current})")

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
        except StoreWentBack as exc:  # its buffers may hold the only copies of the newest committed version
            raise Refused("store_behind", f"{exc}: no version begins here until the job puts it forward "
                                          "(a restart does)", STORE_BEHIND) from None
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
        recv_exactly(r.sock, memoryview(slot.buf)[r.a:r.a + r.b], r.deadline)

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

    def join(self, r: Request) -> None:
        """Nothing but the connection authenticated (its slot taken): the client's first request."""
        self.reply(r.sock, r.nonce, r.header, OK)

    HANDLERS: ClassVar[dict[int, Callable[[ReplicaHandler, Request], None]]] = {
        BEGIN: begin, DATA: data, END: end, GET: get, VERIFY: verify, STAT: stat, JOIN: join,
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


class Admission:
    """Who holds the agent's connections (see the module's docstring): ``pending`` ones, not authenticated
    yet, oldest first, and ``held`` ones, each with the incarnation of its first request."""

    def __init__(self, slots: int, pending: int, per_peer: int) -> None:
        self.slots, self.max_pending, self.per_peer = slots, pending, per_peer
        self.lock = threading.Lock()
        self.pending: dict[socket.socket, str] = {}  # connection -> its peer's address (dicts keep order)
        self.held: dict[socket.socket, int] = {}  # connection -> its incarnation

    def arrive(self, sock: socket.socket, peer: str) -> str | None:
        """A new connection, pending; returns the peer of the one it pushed out, if any."""
        with self.lock:
            own = [s for s, p in self.pending.items() if p == peer]
            victim = own[0] if len(own) >= self.per_peer else (
                next(iter(self.pending)) if len(self.pending) >= self.max_pending else None)
            pushed = self.pending.pop(victim) if victim is not None else None
            if victim is not None:
                _close_under(victim)
            self.pending[sock] = peer
            return pushed

    def authenticated(self, sock: socket.socket, incarnation: int) -> bool:
        """Its first request authenticated: a slot, taken from a connection of an older incarnation at the
        cap, or False (no slot)."""
        with self.lock:
            self.pending.pop(sock, None)
            if len(self.held) >= self.slots:
                older = min(self.held, key=self.held.get)
                if self.held[older] >= incarnation:
                    return False
                del self.held[older]
                _close_under(older)
            self.held[sock] = incarnation
            return True

    def leave(self, sock: socket.socket) -> None:
        with self.lock:
            self.pending.pop(sock, None)
            self.held.pop(sock, None)


def _close_under(sock: socket.socket) -> None:
    """End another thread's connection: its blocked recv returns at once and its handler ends (under the
    admission's lock, so that the socket is still that thread's own: it leaves before it closes)."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


class ReplicaServer(socketserver.ThreadingTCPServer):
    """A thread per connection; how many there are is :class:`Admission`'s to bound."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # the listen backlog: a burst of strangers must not fill it before we accept

    def __init__(self, address: tuple[str, int], agent: Agent, max_connections: int = MAX_CONNECTIONS) -> None:
        self.agent = agent
        self.admission = Admission(max_connections, MAX_PENDING, PENDING_PER_PEER)
        super().__init__(address, ReplicaHandler)
