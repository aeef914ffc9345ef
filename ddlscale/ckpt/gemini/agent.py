"""The replica agent: one process per machine that keeps checkpoint replicas in CPU memory.

It outlives the training processes of its machine (a trainer crash loses nothing) and dies with the
machine. For every owner rank it holds two separate buffers — the newest complete replica and the one
being written. Bytes arrive straight into the replica buffer; ``END`` checks them against the
version's MAC before the replica counts.

**Fencing is the agent's alone.** Which buffer a new version may overwrite is decided from the job's
signed records in the store, never from anything a client sends: the buffer holding the committed
version (the manifest) is never overwritten, nor is a complete newer version whose commit is still
undecided in the current incarnation; a version of an older incarnation than the job's current one
is refused as stale. A committed manifest that disappears from the store without the job clearing it
stays protected.

**Bounded.** Every request is authenticated before it is acted on (:mod:`ddlscale.ckpt.gemini.protocol`), and
every length is checked before anything is allocated: a version's size against ``--max-version-bytes``
and the shared memory's free space, each DATA chunk against the version's announced size. BEGIN
reserves the whole buffer (``posix_fallocate``) or refuses, naming the free space: a full /dev/shm
then fails one request instead of killing the trainer that writes through shared memory with SIGBUS.
Refusals are counted by reason (``STAT``) and logged.

With the store it also heartbeats (a signed count, so clocks need not agree) and takes part in root
election: the root agent watches every machine's heartbeat, records failures and replacements
(``failed/<m>``, ``events``) and the live set (``alive``) that recovering trainers read; when the root's
own heartbeat stops, another agent takes over through the store's compare-and-set.

Run one per machine (``$DDLSCALE_SECRET_FILE`` names the job's secret)::

    python -m ddlscale.ckpt.gemini.agent --machine 0 --machines 4 --bind 10.213.0.1:29500 \\
        --store 10.213.0.1:29400 --job myrun
"""

from __future__ import annotations

import argparse
import errno
import hmac
import json
import mmap
import os
import re
import secrets
import shutil
import signal
import socket
import socketserver
import sys
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddlscale import clock
from ddlscale.ckpt.gemini.auth import MAC_BYTES, SECRET_ENV, JobKeys, SecretError
from ddlscale.ckpt.gemini.protocol import (
    BEGIN,
    DATA,
    END,
    FAILED,
    GET,
    HELLO,
    MAGIC,
    MAX_TEXT,
    NO_SPACE,
    NO_VERSION,
    OK,
    PROTOCOL,
    REFUSED,
    REPLY,
    REQUEST,
    STAT,
    VERIFY,
    mib,
    parse_address,
    recv_bytes,
    recv_exactly,
    reply_mac,
    request_mac,
    shm_dir,
)
from ddlscale.ckpt.gemini.store import CLEARED, JobStore, connect
from ddlscale.ckpt.version.checksum import KEYED, algorithm_of, matches

MIN_VERSION_BYTES = 16  # a snapshot stream's header


def file_prefix(job: str, machine: int) -> str:
    return f"ddl-{re.sub(r'[^A-Za-z0-9_.-]', '_', job)}-m{machine}"


def remove_replicas(job: str) -> None:
    """Delete every shared-memory replica file of ``job`` (after its agents were killed)."""
    for path in shm_dir().glob(f"{file_prefix(job, 0)[:-3]}-m*"):
        path.unlink(missing_ok=True)


# Refusals after which the connection is closed: its framing, or its sender, cannot be trusted any more.
CLOSING = {"unauthenticated", "replayed", "stale", "bounds", "unknown_op"}


class Refused(Exception):
    """A request the agent will not carry out. ``reason`` names the counter it goes to (None: an
    ordinary failure, e.g. a version not held here, that is answered but not counted)."""

    def __init__(self, reason: str | None, message: str, status: int = FAILED) -> None:
        super().__init__(message)
        self.reason, self.status = reason, status
        self.closes = reason in CLOSING


@dataclass
class Slot:
    """One replica buffer: a file in shared memory, mapped. Each slot owns its file: the two never alias.

    Shared memory lets the machine's own trainers write their replica with one memcpy instead of a
    trip through the TCP stack; remote senders' bytes are received straight into the same mapping.
    """

    path: Path
    version: int = NO_VERSION
    incarnation: int = 0
    nbytes: int = 0
    complete: bool = False
    mac: str | None = None
    buf: mmap.mmap | None = None

    def view(self) -> memoryview:
        return memoryview(self.buf)[: self.nbytes]

    def reserve(self, nbytes: int, what: str) -> None:
        """Make the buffer ``nbytes`` long, every page allocated now; Refused when memory is short."""
        if self.buf is not None and len(self.buf) == nbytes:
            return
        if self.buf is not None:
            self.buf.close()
            self.buf = None
        usage = shutil.disk_usage(self.path.parent)
        held = self.path.stat().st_size if self.path.exists() else 0
        if nbytes - held > usage.free:
            raise self._no_space(nbytes, what, usage)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, min(held, nbytes))
            try:
                os.posix_fallocate(fd, 0, nbytes)  # tmpfs allocates the pages, or says ENOSPC now
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                raise self._no_space(nbytes, what, shutil.disk_usage(self.path.parent)) from None
            self.buf = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)

    def _no_space(self, nbytes: int, what: str, usage: Any) -> Refused:
        return Refused("space", f"cannot reserve {mib(nbytes)} ({nbytes} bytes) for {what} in {self.path.parent}: "
                                f"{mib(usage.free)} free of {mib(usage.total)}", NO_SPACE)

    def release(self) -> None:
        if self.buf is not None:
            self.buf.close()
            self.buf = None
        self.path.unlink(missing_ok=True)


class ReplicaStore:
    """Two slots per owner rank, and the rule for which one a new version may overwrite.

    ``prefix`` names this agent's shared-memory files; whatever an earlier agent of the same machine
    left there (it was killed with its machine) is removed first: a replacement starts empty.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.slots: dict[int, tuple[Slot, Slot]] = {}
        self.lock = threading.Lock()
        for leftover in shm_dir().glob(f"{prefix}-*"):
            leftover.unlink(missing_ok=True)

    def begin(self, owner: int, version: int, nbytes: int, incarnation: int, committed: int | None,
              undecided: Any) -> Slot:
        """The slot version ``version`` goes into, reserved; Refused when none may be overwritten.

        Kept: the complete slot holding ``committed`` (the committed step, from the manifest), and a
        complete slot of this incarnation newer than it whose commit ``undecided(incarnation, version)``.
        """
        with self.lock:
            pair = self.slots.get(owner)
            if pair is None:
                pair = self.slots[owner] = tuple(Slot(shm_dir() / f"{self.prefix}-o{owner}-s{i}") for i in (0, 1))
            kept = [s for s in pair if s.complete and (
                s.version == committed or (s.incarnation == incarnation and (committed is None or s.version > committed)
                                           and undecided(s.incarnation, s.version)))]
            if version == committed and any(s.version == committed for s in kept):
                raise Refused("fenced", f"version {version} of rank {owner} is the committed one: it is never rewritten")
            free = [s for s in pair if s not in kept]
            if not free:
                raise Refused("fenced", f"both buffers of rank {owner} hold versions that must be kept "
                                        f"({', '.join(str(s.version) for s in kept)}): version {version} cannot go in")
            slot = min(free, key=lambda s: (s.version != version, s.complete, s.version))
            slot.version, slot.complete, slot.mac = NO_VERSION, False, None  # unusable until reserved again
            slot.reserve(nbytes, f"version {version} of rank {owner}")
            slot.version, slot.incarnation, slot.nbytes = version, incarnation, nbytes
            return slot

    def writing(self, owner: int, version: int, incarnation: int) -> Slot | None:
        with self.lock:
            return next((s for s in self.slots.get(owner, ()) if s.version == version and not s.complete
                         and s.incarnation == incarnation and s.buf is not None), None)

    def complete(self, owner: int, version: int) -> Slot | None:
        """The complete replica of ``version`` (NO_VERSION: the newest complete one)."""
        with self.lock:
            done = [s for s in self.slots.get(owner, ()) if s.complete]
            if version != NO_VERSION:
                done = [s for s in done if s.version == version]
            return max(done, key=lambda s: s.version, default=None)

    def describe(self) -> dict[str, Any]:
        with self.lock:
            return {str(owner): [{"version": s.version, "bytes": s.nbytes, "complete": s.complete,
                                  "incarnation": s.incarnation, "path": str(s.path)}
                                 for s in pair if s.version != NO_VERSION]
                    for owner, pair in self.slots.items()}

    def release(self) -> None:
        with self.lock:
            for pair in self.slots.values():
                for slot in pair:
                    slot.release()
            self.slots.clear()


class JobView:
    """What the agent decides from: the job's incarnation and committed manifest, read from the store."""

    def __init__(self, store: JobStore) -> None:
        self.store = store
        self.lock = threading.Lock()  # one store connection for every handler thread
        self._incarnation = 0
        self._committed: Any = None  # the last manifest seen: kept if the key disappears uncleared

    def incarnation(self, at_least: int, fresh: bool = False) -> int:
        """The job's current incarnation, read again when a client claims a newer one (or ``fresh``)."""
        with self.lock:
            if fresh or at_least > self._incarnation:
                self._incarnation = max(self._incarnation, int(self.store.get(self.store.keys.incarnation, 0)))
            return self._incarnation

    def committed(self, owner: int) -> int | None:
        with self.lock:
            manifest = self.store.manifest()
            if manifest is CLEARED:
                self._committed = None
            elif manifest is not None:
                self._committed = manifest
            current = self._committed
        return current.step if current is not None and 0 <= owner < current.world_size else None

    def undecided(self, incarnation: int, version: int) -> bool:
        with self.lock:
            return self.store.get(self.store.keys.outcome(incarnation, version)) is None


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

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
                    if op in (END, VERIFY):
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
                    self.dispatch(sock, nonce, header, op, incarnation, version, owner, a, b, text)
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

    def dispatch(self, sock: socket.socket, nonce: bytes, header: bytes, op: int, incarnation: int, version: int,
                 owner: int, a: int, b: int, text: bytes) -> None:
        agent = self.server.agent
        store = agent.replicas
        if op == BEGIN:
            if a < MIN_VERSION_BYTES or (agent.max_version_bytes is not None and a > agent.max_version_bytes):
                raise Refused("bounds", f"a version of {a} bytes (this agent takes {MIN_VERSION_BYTES} to "
                                        f"{agent.max_version_bytes or 'what its shared memory holds'})")
            try:
                committed = agent.view.committed(owner)
            except (RuntimeError, OSError) as exc:
                raise Refused(None, f"cannot read the committed manifest from the store: {exc}") from None
            slot = store.begin(owner, version, a, incarnation, committed, agent.view.undecided)
            self.reply(sock, nonce, header, OK, str(slot.path).encode())  # a sender on this machine writes there
        elif op == DATA:
            slot = store.writing(owner, version, incarnation)
            if slot is None or a < 0 or b <= 0 or a + b > slot.nbytes:
                raise Refused("bounds", f"DATA [{a}, {a + b}) of version {version} of rank {owner}: "
                                        + ("no such version in progress" if slot is None else f"it has {slot.nbytes} bytes"))
            recv_exactly(sock, memoryview(slot.buf)[a:a + b])
        elif op == END:
            expected = text.decode(errors="replace")
            slot = store.writing(owner, version, incarnation)
            if slot is None:
                raise Refused(None, f"no version {version} of rank {owner} in progress")
            if not self.holds(slot, expected):
                raise Refused("mac_mismatch", f"MAC mismatch for version {version} of rank {owner}")
            with store.lock:
                slot.complete, slot.mac = True, expected
            self.reply(sock, nonce, header, OK)
        elif op == GET:
            slot = store.complete(owner, version)
            if slot is None:
                raise Refused(None, f"no complete version {version} of rank {owner} here")
            self.reply(sock, nonce, header, OK, slot.view(), body_mac=False)
        elif op == VERIFY:
            slot = store.complete(owner, version)
            if slot is None or not self.holds(slot, text.decode(errors="replace")):
                raise Refused(None, f"version {version} of rank {owner} missing or corrupt")
            self.reply(sock, nonce, header, OK)
        elif op == STAT:
            self.reply(sock, nonce, header, OK, json.dumps(agent.stat()).encode())
        else:
            raise Refused("unknown_op", f"unknown op {op}")

    def holds(self, slot: Slot, expected: str) -> bool:
        """Whether the slot's bytes have MAC ``expected`` under the replica key (an unkeyed checksum,
        or an algorithm this agent does not know, never completes a replica)."""
        try:
            return algorithm_of(expected) in KEYED and matches(slot.view(), expected, self.server.agent.auth.replica)
        except ValueError:
            return False


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], agent: Agent) -> None:
        self.agent = agent
        super().__init__(address, _Handler)


class Agent:
    """A machine's agent: the replica server, heartbeats and the root role, on the job's store."""

    def __init__(self, machine: int, machines: int, bind: str, store: str, job: str, auth: JobKeys,
                 heartbeat_s: float = 0.5, failure_timeout_s: float = 3.0, max_version_bytes: int | None = None) -> None:
        self.machine, self.machines = machine, machines
        self.store_address, self.job, self.auth = store, job, auth
        self.view = JobView(self._job_store())
        host, port = parse_address(bind)
        self.replicas = ReplicaStore(file_prefix(job, machine) + (f"-p{os.getpid()}" if port == 0 else ""))
        # Beyond this limit (if any) a version is refused outright; below it, BEGIN checks the shared
        # memory's free space before reserving, and refuses naming it.
        self.max_version_bytes = max_version_bytes
        self.server = _Server((host, port), self)
        self.address = f"{host}:{self.server.server_address[1]}"
        self.heartbeat_s, self.failure_timeout_s = heartbeat_s, failure_timeout_s
        self.stopped = threading.Event()
        self.is_root = False
        self.refusals: Counter[str] = Counter()
        self._count_lock = threading.Lock()

    def _job_store(self) -> JobStore:
        return JobStore(connect(self.store_address), self.job, self.auth)

    def count(self, reason: str, message: str) -> None:
        with self._count_lock:
            self.refusals[reason] += 1
            n = self.refusals[reason]
        if n <= 10 or n % 100 == 0:
            print(f"gemini agent {self.machine}: refused ({reason}, #{n}) {message}", file=sys.stderr, flush=True)

    def stat(self) -> dict[str, Any]:
        usage = shutil.disk_usage(shm_dir())
        with self._count_lock:
            refused = dict(self.refusals)
        return {"machine": self.machine, "holds": self.replicas.describe(), "refused": refused,
                "shm": {"dir": str(shm_dir()), "free": usage.free, "total": usage.total}}

    def start(self) -> Agent:
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True,
                         name="replica-server").start()
        store = self._job_store()
        store.set(store.keys.agent(self.machine), self.address)
        threading.Thread(target=self._monitor, args=(store,), daemon=True, name="heartbeat").start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        self.server.shutdown()
        self.server.server_close()
        self.replicas.release()

    # -- heartbeats and the root role ------------------------------------------------------------
    def _monitor(self, store: JobStore) -> None:
        """Heartbeat; watch the root (and, as root, everyone); exit when the store is gone."""
        keys = store.keys
        beats = 0
        seen: dict[int, tuple[int, float]] = {}  # machine -> (last count, when it last changed)
        failed: set[int] = set()
        lost_store_since: float | None = None
        while not self.stopped.wait(clock.wall(self.heartbeat_s)):
            try:
                beats += 1
                store.set(keys.heartbeat(self.machine), beats)
                now = clock.now()
                for m in range(self.machines):
                    count = int(store.get(keys.heartbeat(m), 0))
                    if m not in seen or seen[m][0] != count:
                        seen[m] = (count, now)
                # A machine whose agent never heartbeated is not up yet, not failed.
                stale = {m for m, (count, t) in seen.items() if count > 0 and now - t > self.failure_timeout_s}
                was_root = self.is_root
                self._elect(store, stale)
                if self.is_root and not was_root:  # a new root starts from what the old one recorded
                    failed = {m for m in range(self.machines) if store.get(keys.failed(m)) is not None}
                if self.is_root:
                    failed = self._watch(store, stale, failed)
                lost_store_since = None
            except (RuntimeError, OSError, ConnectionError):
                lost_store_since = lost_store_since or clock.now()
                if clock.now() - lost_store_since > 10 * self.failure_timeout_s:
                    self.stop()  # the job (and its store) is over
                    return

    def _elect(self, store: JobStore, stale: set[int]) -> None:
        key = store.keys.root
        raw = store.raw.get(key) if store.raw.check([key]) else b""
        current = store.open(key, raw) if raw else None
        if current is None or current in stale:
            # compare_set: exactly one contender replaces a missing, forged or dead root.
            result = store.raw.compare_set(key, raw.decode(errors="replace"), store.signed(key, self.machine))
            current = store.open(key, result)
        self.is_root = current == self.machine

    def _watch(self, store: JobStore, stale: set[int], failed: set[int]) -> set[int]:
        """As root: record machines that stopped heartbeating and machines that came back."""
        keys = store.keys
        for m in sorted(stale - failed):
            store.set(keys.failed(m), {"detected_unix": clock.timestamp(), "by": self.machine})
            self._log(store, {"event": "failed", "machine": m, "unix": clock.timestamp(), "root": self.machine})
        for m in sorted(failed - stale):
            store.delete(keys.failed(m))
            self._log(store, {"event": "replaced", "machine": m, "unix": clock.timestamp(), "root": self.machine})
        store.set(keys.alive, [m for m in range(self.machines) if m not in stale])
        return set(stale)

    def _log(self, store: JobStore, event: dict[str, Any]) -> None:
        store.set(store.keys.events, [*store.get(store.keys.events, []), event])
        print(f"gemini root agent: {event}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="ddlscale Gemini replica agent (one per machine)")
    parser.add_argument("--machine", type=int, required=True)
    parser.add_argument("--machines", type=int, required=True)
    parser.add_argument("--bind", required=True, help="HOST:PORT to serve replicas on (port 0: any)")
    parser.add_argument("--store", required=True, help="HOST:PORT of the job's TCPStore")
    parser.add_argument("--job", default="default")
    parser.add_argument("--secret-file", default=os.environ.get(SECRET_ENV),
                        help=f"the job's secret (default: ${SECRET_ENV})")
    parser.add_argument("--failure-timeout", type=float, default=3.0)
    parser.add_argument("--max-version-bytes", type=int, default=None,
                        help="largest version accepted (default: what the shared memory's free space allows)")
    args = parser.parse_args(argv)
    if not 0 <= args.machine < args.machines:
        parser.error(f"--machine must be in 0..{args.machines - 1}")
    try:
        if not args.secret_file:
            raise SecretError(f"no job secret: pass --secret-file or set ${SECRET_ENV}")
        os.environ[SECRET_ENV] = args.secret_file
        auth = JobKeys.from_env(args.job)
    except SecretError as exc:
        parser.error(str(exc))
    agent = Agent(args.machine, args.machines, args.bind, args.store, args.job, auth,
                  failure_timeout_s=args.failure_timeout, max_version_bytes=args.max_version_bytes).start()
    signal.signal(signal.SIGTERM, lambda *_: agent.stopped.set())
    usage = shutil.disk_usage(shm_dir())
    print(f"ready {agent.address}", flush=True)
    print(f"gemini agent {args.machine}: replicas in {shm_dir()} ({mib(usage.free)} free of {mib(usage.total)})",
          file=sys.stderr, flush=True)
    try:
        while not agent.stopped.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    if agent.refusals:
        print(f"gemini agent {args.machine}: refused {dict(agent.refusals)}", file=sys.stderr, flush=True)
    agent.stop()  # the replicas' shared memory goes with the agent
    sys.exit(0)


if __name__ == "__main__":
    main()
