"""The replica agent: one process per machine that keeps checkpoint replicas in CPU memory.

It outlives the training processes of its machine (a trainer crash loses nothing) and dies with the
machine. For every owner rank it holds two separate buffers — the newest complete replica and the one
being written — and a new version never goes into the buffer holding the version the sender says is
committed, so the last committed version survives any failure mid-transfer. Bytes arrive straight
into the replica buffer; ``END`` checks them against the sender's checksum before the replica counts.

With a store it also heartbeats (a counter in the store, so clocks need not agree) and takes part in
root election: the root agent watches every machine's heartbeat, records failures and replacements
(``failed/<m>``, ``events``) and the live set (``alive``) that recovering trainers read; when the root's
own heartbeat stops, another agent takes over through the store's compare-and-set.

Run one per machine::

    python -m ddlscale.ckpt.agent --machine 0 --machines 4 --bind 10.213.0.1:29500 \\
        --store 10.213.0.1:29400 --job myrun
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import re
import signal
import socket
import socketserver
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddlscale.ckpt import kvstore
from ddlscale.ckpt.checksum import matches
from ddlscale.ckpt.replica import (
    BEGIN,
    CORRUPT,
    DATA,
    END,
    FAILED,
    GET,
    MAGIC,
    NO_VERSION,
    OK,
    REPLY,
    REQUEST,
    STAT,
    VERIFY,
    parse_address,
    recv_bytes,
    recv_exactly,
)

MAX_CHECKSUM_TEXT = 128  # "sha256:" + 64 hex digits fits


def shm_dir() -> Path:
    """Where replica buffers live: RAM-backed /dev/shm where there is one."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


def file_prefix(job: str, machine: int) -> str:
    return f"ddl-{re.sub(r'[^A-Za-z0-9_.-]', '_', job)}-m{machine}"


def remove_replicas(job: str) -> None:
    """Delete every shared-memory replica file of ``job`` (after its agents were killed)."""
    for path in shm_dir().glob(f"{file_prefix(job, 0)[:-3]}-m*"):
        path.unlink(missing_ok=True)


@dataclass
class Slot:
    """One replica buffer: a file in shared memory, mapped. Each slot owns its file: the two never alias.

    Shared memory lets the machine's own trainers write their replica with one memcpy instead of a
    trip through the TCP stack; remote senders' bytes are received straight into the same mapping.
    """

    path: Path
    version: int = NO_VERSION
    nbytes: int = 0
    complete: bool = False
    checksum: str | None = None
    buf: mmap.mmap | None = None

    def view(self) -> memoryview:
        return memoryview(self.buf)[: self.nbytes]

    def reserve(self, nbytes: int) -> None:
        if self.buf is not None and len(self.buf) >= nbytes:
            return
        if self.buf is not None:
            self.buf.close()
        with open(self.path, "a+b") as file:
            file.truncate(nbytes)
            self.buf = mmap.mmap(file.fileno(), nbytes)

    def release(self) -> None:
        if self.buf is not None:
            self.buf.close()
            self.buf = None
        self.path.unlink(missing_ok=True)


class ReplicaStore:
    """Two slots per owner rank, and the rules for which one a new version may overwrite.

    ``prefix`` names this agent's shared-memory files; whatever an earlier agent of the same machine
    left there (it was killed with its machine) is removed first: a replacement starts empty.
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.slots: dict[int, tuple[Slot, Slot]] = {}
        self.lock = threading.Lock()
        for leftover in shm_dir().glob(f"{prefix}-*"):
            leftover.unlink(missing_ok=True)

    def begin(self, owner: int, version: int, nbytes: int, keep: int) -> Slot:
        """The slot ``version`` goes into; ValueError when it is ``keep``: the committed version is never
        rewritten (a sender replaying steps behind a stale manifest would otherwise reset it)."""
        if keep != NO_VERSION and version == keep:
            raise ValueError(f"version {version} of rank {owner} is the committed one: it is never rewritten")
        with self.lock:
            pair = self.slots.get(owner)
            if pair is None:
                pair = self.slots[owner] = tuple(Slot(shm_dir() / f"{self.prefix}-o{owner}-s{i}") for i in (0, 1))
            same = [s for s in pair if s.version == version]
            if same:
                slot = same[0]
            else:
                # Never the kept (committed) version; otherwise an unfinished slot, else the older one.
                free = [s for s in pair if keep == NO_VERSION or s.version != keep]
                slot = min(free, key=lambda s: (s.complete, s.version))
            slot.reserve(nbytes)
            slot.version, slot.nbytes, slot.complete, slot.checksum = version, nbytes, False, None
            return slot

    def writing(self, owner: int, version: int) -> Slot | None:
        with self.lock:
            return next((s for s in self.slots.get(owner, ()) if s.version == version and not s.complete), None)

    def complete(self, owner: int, version: int) -> Slot | None:
        """The complete replica of ``version`` (NO_VERSION: the newest complete one)."""
        with self.lock:
            done = [s for s in self.slots.get(owner, ()) if s.complete]
            if version != NO_VERSION:
                done = [s for s in done if s.version == version]
            return max(done, key=lambda s: s.version, default=None)

    def describe(self) -> dict[str, Any]:
        with self.lock:
            return {str(owner): [{"version": s.version, "bytes": s.nbytes, "complete": s.complete}
                                 for s in pair if s.version != NO_VERSION]
                    for owner, pair in self.slots.items()}

    def release(self) -> None:
        with self.lock:
            for pair in self.slots.values():
                for slot in pair:
                    slot.release()
            self.slots.clear()


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)
        try:
            while True:
                try:
                    header = recv_bytes(sock, REQUEST.size)
                except ConnectionError:
                    return
                magic, op, version, owner, a, b = REQUEST.unpack(header)
                if magic != MAGIC:
                    return  # not our protocol: drop the connection
                self.dispatch(sock, op, version, owner, a, b)
        except OSError:
            return  # the sender died: a partial version simply never completes

    def reply(self, sock: socket.socket, status: int, body: bytes | memoryview = b"") -> None:
        sock.sendall(REPLY.pack(status, len(body)))
        if len(body):
            sock.sendall(body)

    @staticmethod
    def checksum_text(sock: socket.socket, length: int) -> str:
        if not 0 < length <= MAX_CHECKSUM_TEXT:
            raise ConnectionError(f"checksum of {length} bytes")  # out of step with the protocol: drop
        return recv_bytes(sock, length).decode(errors="replace")

    @staticmethod
    def holds(slot: Slot, expected: str) -> bool:
        try:
            return matches(slot.view(), expected)
        except ValueError:  # an algorithm this agent does not know
            return False

    def dispatch(self, sock: socket.socket, op: int, version: int, owner: int, a: int, b: int) -> None:
        store = self.server.replicas
        if op == BEGIN:
            try:
                slot = store.begin(owner, version, nbytes=a, keep=b)
            except ValueError as exc:
                self.reply(sock, FAILED, str(exc).encode())
                return
            self.reply(sock, OK, str(slot.path).encode())  # a sender on this machine writes there itself
        elif op == DATA:
            slot = store.writing(owner, version)
            if slot is None or a < 0 or a + b > slot.nbytes:
                recv_bytes(sock, b)  # keep the stream in step; END will fail for this version
                return
            recv_exactly(sock, memoryview(slot.buf)[a:a + b])
        elif op == END:
            expected = self.checksum_text(sock, a)
            slot = store.writing(owner, version)
            if slot is None:
                self.reply(sock, FAILED, f"no version {version} of rank {owner} in progress".encode())
                return
            if not self.holds(slot, expected):
                self.reply(sock, FAILED, f"checksum mismatch for version {version} of rank {owner}".encode())
                return
            with store.lock:
                slot.complete, slot.checksum = True, expected
            self.reply(sock, OK)
        elif op == GET:
            slot = store.complete(owner, version)
            if slot is None:
                self.reply(sock, FAILED, f"no complete version {version} of rank {owner} here".encode())
            else:
                self.reply(sock, OK, slot.view())
        elif op == VERIFY:
            expected = self.checksum_text(sock, a)
            slot = store.complete(owner, version)
            if slot is None or not self.holds(slot, expected):
                self.reply(sock, FAILED, f"version {version} of rank {owner} missing or corrupt".encode())
            else:
                self.reply(sock, OK)
        elif op == STAT:
            self.reply(sock, OK, json.dumps(store.describe()).encode())
        elif op == CORRUPT:
            slot = store.complete(owner, version)
            if slot is None or not 0 <= a < slot.nbytes:
                self.reply(sock, FAILED, b"nothing to corrupt there")
            else:
                slot.buf[a] ^= 0xFF
                self.reply(sock, OK)
        else:
            self.reply(sock, FAILED, f"unknown op {op}".encode())


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], prefix: str) -> None:
        super().__init__(address, _Handler)
        self.replicas = ReplicaStore(prefix)


class Agent:
    """A machine's agent: the replica server, and (with a store) heartbeats and the root role."""

    def __init__(self, machine: int, machines: int, bind: str, store: str | None = None, job: str = "default",
                 heartbeat_s: float = 0.5, failure_timeout_s: float = 3.0) -> None:
        self.machine, self.machines = machine, machines
        host, port = parse_address(bind)
        self.server = _Server((host, port), file_prefix(job, machine) + (f"-p{os.getpid()}" if port == 0 else ""))
        self.address = f"{parse_address(bind)[0]}:{self.server.server_address[1]}"
        self.store_address, self.keys = store, kvstore.Keys(job)
        self.heartbeat_s, self.failure_timeout_s = heartbeat_s, failure_timeout_s
        self.stopped = threading.Event()
        self.is_root = False

    @property
    def replicas(self) -> ReplicaStore:
        return self.server.replicas

    def start(self) -> Agent:
        threading.Thread(target=self.server.serve_forever, daemon=True, name="replica-server").start()
        if self.store_address is not None:
            store = kvstore.connect(self.store_address)
            store.set(self.keys.agent(self.machine), self.address)
            store.add(self.keys.heartbeat(self.machine), 1)
            threading.Thread(target=self._monitor, daemon=True, name="heartbeat").start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        self.server.shutdown()
        self.server.server_close()
        self.replicas.release()

    # -- heartbeats and the root role ------------------------------------------------------------
    def _monitor(self) -> None:
        """Heartbeat; watch the root (and, as root, everyone); exit when the store is gone."""
        store = kvstore.connect(self.store_address)
        seen: dict[int, tuple[int, float]] = {}  # machine -> (last counter, when it last changed)
        failed: set[int] = set()
        lost_store_since: float | None = None
        while not self.stopped.wait(self.heartbeat_s):
            try:
                store.add(self.keys.heartbeat(self.machine), 1)
                now = time.monotonic()
                for m in range(self.machines):
                    key = self.keys.heartbeat(m)
                    count = int(store.get(key)) if store.check([key]) else 0
                    if m not in seen or seen[m][0] != count:
                        seen[m] = (count, now)
                # A machine whose agent never heartbeated is not up yet, not failed.
                stale = {m for m, (count, t) in seen.items() if count > 0 and now - t > self.failure_timeout_s}
                was_root = self.is_root
                self._elect(store, stale)
                if self.is_root and not was_root:  # a new root starts from what the old one recorded
                    failed = {m for m in range(self.machines) if store.check([self.keys.failed(m)])}
                if self.is_root:
                    failed = self._watch(store, stale, failed)
                lost_store_since = None
            except (RuntimeError, OSError, ConnectionError):
                lost_store_since = lost_store_since or time.monotonic()
                if time.monotonic() - lost_store_since > 10 * self.failure_timeout_s:
                    self.stop()  # the job (and its store) is over
                    return

    def _elect(self, store: Any, stale: set[int]) -> None:
        current = store.get(self.keys.root).decode() if store.check([self.keys.root]) else ""
        if current == "" or int(current) in stale:
            # compare_set: exactly one contender replaces a missing or dead root.
            current = store.compare_set(self.keys.root, current, str(self.machine)).decode()
        self.is_root = current == str(self.machine)

    def _watch(self, store: Any, stale: set[int], failed: set[int]) -> set[int]:
        """As root: record machines that stopped heartbeating and machines that came back."""
        for m in sorted(stale - failed):
            store.set(self.keys.failed(m), json.dumps({"detected_unix": time.time(), "by": self.machine}))
            self._log(store, {"event": "failed", "machine": m, "unix": time.time(), "root": self.machine})
        for m in sorted(failed - stale):
            store.delete_key(self.keys.failed(m))
            self._log(store, {"event": "replaced", "machine": m, "unix": time.time(), "root": self.machine})
        kvstore.set_json(store, self.keys.alive, [m for m in range(self.machines) if m not in stale])
        return set(stale)

    def _log(self, store: Any, event: dict[str, Any]) -> None:
        events = kvstore.get_json(store, self.keys.events, [])
        kvstore.set_json(store, self.keys.events, [*events, event])
        print(f"gemini root agent: {event}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="ddlscale Gemini replica agent (one per machine)")
    parser.add_argument("--machine", type=int, required=True)
    parser.add_argument("--machines", type=int, required=True)
    parser.add_argument("--bind", required=True, help="HOST:PORT to serve replicas on (port 0: any)")
    parser.add_argument("--store", default=None, help="HOST:PORT of the job's TCPStore")
    parser.add_argument("--job", default="default")
    parser.add_argument("--failure-timeout", type=float, default=3.0)
    args = parser.parse_args(argv)
    if not 0 <= args.machine < args.machines:
        parser.error(f"--machine must be in 0..{args.machines - 1}")
    agent = Agent(args.machine, args.machines, args.bind, args.store, args.job,
                  failure_timeout_s=args.failure_timeout).start()
    signal.signal(signal.SIGTERM, lambda *_: agent.stopped.set())
    print(f"ready {agent.address}", flush=True)
    try:
        while not agent.stopped.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    agent.stop()  # the replicas' shared memory goes with the agent
    sys.exit(0)


if __name__ == "__main__":
    main()
