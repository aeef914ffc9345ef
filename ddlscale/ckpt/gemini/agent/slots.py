"""A machine's replica buffers, and the rule for which one a new version may overwrite.

For every owner rank the agent holds two separate buffers (:class:`Slot`, each a file in shared
memory) — the newest complete replica and the one being written.

**Fencing is the agent's alone.** Which buffer a new version may overwrite is decided from the job's
signed records in the store (:class:`JobView`), never from anything a client sends: the buffer holding
the committed version (the manifest) is never overwritten, nor is a complete newer version whose
commit is still undecided in the current incarnation. While the store is behind what the agent has seen
there (a committed manifest deleted, or an older one written back), no version begins at all.

A buffer is a new file per version, made by the agent alone (see :class:`Slot`), reserved whole (``posix_fallocate``) or refused naming the free space: a full /dev/shm
then fails one request instead of killing the trainer that writes through shared memory with SIGBUS.

**No trainer ever maps a buffer that holds a complete version.** The machine's own trainer writes into
a separate file, the slot's *inbox*; END copies it into the slot's buffer, which only the agent maps,
checking the MAC on the copy, then truncates and unlinks the inbox. A mapping cannot be taken back from
the process that holds it, so this is the one way a trainer that kept its mapping past END (left over
from a restart, or buggy) cannot change what the agent serves: its write faults (SIGBUS on the
truncated file) instead of corrupting the committed replica that GET sends to recovery and the drain.
The price is one copy per version on the agent, fused with the MAC check END does anyway, and one more
version-sized file per own-machine rank while a version is in flight.
"""

from __future__ import annotations

import contextlib
import errno
import math
import mmap
import os
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddlscale.ckpt.gemini.kvstore import JobStore, StoreWentBack
from ddlscale.ckpt.gemini.protocol import FAILED, NO_SPACE, NO_VERSION, mib, shm_dir, shm_usage
from ddlscale.ckpt.version.manifest import Manifest


def file_prefix(job: str, machine: int) -> str:
    return f"ddl-{re.sub(r'[^A-Za-z0-9_.-]', '_', job)}-m{machine}"


def remove_replicas(job: str) -> None:
    """Delete every shared-memory replica file of ``job`` (after its agents were killed)."""
    for path in shm_dir().glob(f"{file_prefix(job, 0)[:-3]}-m*"):
        path.unlink(missing_ok=True)


COPY_CHUNK = 1 << 20  # END copies an inbox in pieces this large, each hashed while it is in cache

# Refusals after which the connection is closed: its framing, or its sender, cannot be trusted any more.
CLOSING = {"unauthenticated", "replayed", "stale", "bounds", "unknown_op", "connections"}


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

    Every version gets a new file, created by the agent alone (``O_CREAT | O_EXCL | O_NOFOLLOW``, mode
    0600, a name with 64 random bits in ``prefix``'s family): nobody can plant it (a symlink or a file
    of their own) before the agent makes it, and a trainer's mapping of an older version's file never
    reaches a later version's buffer. The previous file is unlinked as the new one is made.
    """

    prefix: Path
    version: int = NO_VERSION
    incarnation: int = 0
    nbytes: int = 0
    complete: bool = False
    mac: str | None = None
    buf: mmap.mmap | None = None
    path: Path | None = None
    fd: int | None = None  # kept open: truncating the file by its descriptor reaches nothing else
    inbox: Slot | None = None  # the file this version's own-machine trainer writes; copied in at END

    def view(self) -> memoryview:
        return memoryview(self.buf)[: self.nbytes]

    def reserve(self, nbytes: int, what: str) -> None:
        """A new file of ``nbytes``, every page allocated now; Refused when memory is short."""
        self.release()  # its pages go back before the new ones are counted
        usage = shm_usage()
        if nbytes > usage.free:
            raise self._no_space(nbytes, what, usage)
        path = self.prefix.with_name(f"{self.prefix.name}-{secrets.token_hex(8)}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:  # someone made it first (a planted link or file): never written through
            raise Refused("planted", f"{path} exists already and is not this agent's: {what} not stored") from None
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            try:
                os.posix_fallocate(fd, 0, nbytes)  # tmpfs allocates the pages, or says ENOSPC now
            except OSError as exc:
                os.unlink(path)
                if exc.errno != errno.ENOSPC:
                    raise
                raise self._no_space(nbytes, what, shm_usage()) from None
            self.buf = mmap.mmap(fd, nbytes)
        except BaseException:
            os.close(fd)
            raise
        self.path, self.fd = path, fd

    def _no_space(self, nbytes: int, what: str, usage: Any) -> Refused:
        return Refused("space", f"cannot reserve {mib(nbytes)} ({nbytes} bytes) for {what} in {self.prefix.parent}: "
                                f"{mib(usage.free)} free of {mib(usage.total)}", NO_SPACE)

    def release(self, revoke: bool = False) -> None:
        """Unmap and unlink; ``revoke``: truncate the file first, so that its pages go now and a mapping
        some other process kept faults on its next access (only for an inbox: nothing of the agent's reads
        it once END copied it)."""
        if self.inbox is not None:
            self.inbox.release(revoke=True)
            self.inbox = None
        unmapped = True
        if self.buf is not None:
            try:
                self.buf.close()
            except BufferError:  # a DATA being received into it still holds a view: freed with that view
                unmapped = False  # and never truncated under it (the agent itself would fault)
            self.buf = None
        if self.fd is not None:
            if revoke and unmapped:
                os.ftruncate(self.fd, 0)
            os.close(self.fd)
            self.fd = None
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None

    def open_inbox(self, what: str) -> Path:
        """A file of this slot's size for the machine's own trainer to write (BEGIN names it); the slot's
        own file is never named to anyone who writes."""
        self.inbox = Slot(self.prefix.with_name(f"{self.prefix.name}-in"))
        self.inbox.reserve(self.nbytes, f"{what} (the file its trainer writes)")
        return self.inbox.path

    def copy_in(self, inbox: Slot, digest: Callable[[memoryview], None]) -> None:
        """Copy ``inbox`` (detached from this slot: :meth:`ReplicaStore.detach_inbox`) into this slot's
        buffer, passing the copied bytes (never the inbox's, which a trainer may still change) to
        ``digest``; then revoke the inbox."""
        try:
            if self.buf is None:  # a BEGIN took the slot for another version meanwhile
                raise Refused(None, f"the buffer of version {self.version} was reused meanwhile")
            with memoryview(inbox.buf) as source, memoryview(self.buf) as target:
                for start in range(0, self.nbytes, COPY_CHUNK):
                    end = min(self.nbytes, start + COPY_CHUNK)
                    target[start:end] = source[start:end]
                    with target[start:end] as copied:  # hashed while it is still in cache
                        digest(copied)
        finally:
            inbox.release(revoke=True)


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
              undecided: Any, shared: bool = False) -> Slot:
        """The slot version ``version`` goes into, reserved; Refused when none may be overwritten.
        ``shared``: the sender is the machine's own trainer, writing through shared memory; the slot then
        gets an inbox (:meth:`Slot.open_inbox`) as well.

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
            for s in pair:  # a trainer writes one version at a time: one it left unfinished is abandoned
                if s.inbox is not None:
                    s.inbox.release(revoke=True)
                    s.inbox = None
            free = [s for s in pair if s not in kept]
            if not free:
                raise Refused("fenced", f"both buffers of rank {owner} hold versions that must be kept "
                                        f"({', '.join(str(s.version) for s in kept)}): version {version} cannot go in")
            slot = min(free, key=lambda s: (s.version != version, s.complete, s.version))
            slot.version, slot.complete, slot.mac = NO_VERSION, False, None  # unusable until reserved again
            what = f"version {version} of rank {owner}"
            slot.reserve(nbytes, what)
            slot.incarnation, slot.nbytes = incarnation, nbytes
            if shared:
                try:
                    slot.open_inbox(what)
                except BaseException:
                    slot.release()  # no half-reserved version: a refusal frees what was taken
                    raise
            slot.version = version
            return slot

    def detach_inbox(self, slot: Slot) -> Slot | None:
        """The slot's inbox, no longer the slot's: a BEGIN reusing the slot meanwhile cannot truncate it
        under END's copy."""
        with self.lock:
            inbox, slot.inbox = slot.inbox, None
            return inbox

    def mark_complete(self, slot: Slot, version: int, incarnation: int, mac: str) -> bool:
        """Complete ``slot`` as ``version``, unless a BEGIN took the slot for another version meanwhile."""
        with self.lock:
            if slot.version != version or slot.incarnation != incarnation or slot.buf is None:
                return False
            slot.complete, slot.mac = True, mac
            return True

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
    """What the agent decides from: the job's incarnation and committed manifest, read from the store, and
    the newest of each it has seen there. The store can be made to go back (an old signed record written
    back, a key deleted: :mod:`ddlscale.ckpt.gemini.kvstore`); what the agent has seen cannot. So it refuses
    BEGIN while the store is behind what it has seen (:meth:`committed` raises
    :class:`~ddlscale.ckpt.gemini.kvstore.StoreWentBack`), and tells anyone who asks (STAT: :meth:`seen`)."""

    def __init__(self, store: JobStore) -> None:
        self.store = store
        self.lock = threading.Lock()  # one store connection for every handler thread
        self._incarnation = 0  # the highest the store has held
        self._read_at = -math.inf  # when the incarnation was last read from the store

    def incarnation(self, at_least: int, max_age_s: float = 0.0) -> int:
        """The job's current incarnation: read again when a client claims a newer one, or when the value
        held was read more than ``max_age_s`` ago (0: always)."""
        with self.lock:
            now = time.monotonic()
            if at_least > self._incarnation or now - self._read_at >= max_age_s:
                self._incarnation = max(self._incarnation, self._read_incarnation())
                self._read_at = now
            return self._incarnation

    def _read_incarnation(self) -> int:
        return int(self.store.get(self.store.keys.incarnation, 0))

    def committed(self, owner: int) -> int | None:
        """The committed step, for BEGIN to keep its buffer; raises ``StoreWentBack`` when the store's
        incarnation or commit record is behind the newest seen here: a version begun now could go over the
        newest committed one, which only the agents still know of."""
        with self.lock:
            there = self._read_incarnation()
            if there < self._incarnation:
                raise StoreWentBack(f"store key {self.store.keys.incarnation} went back to {there} (this agent "
                                    f"has seen {self._incarnation})")
            manifest = self.store.manifest(strict=True)
        return manifest.step if isinstance(manifest, Manifest) and 0 <= owner < manifest.world_size else None

    def observe(self) -> None:
        """Read the commit record (the heartbeat does, every beat), so that the newest seen here includes a
        version committed after the last BEGIN: the last one of a run, say."""
        with self.lock, contextlib.suppress(StoreWentBack):  # behind: BEGIN says so, and refuses
            self.store.manifest(strict=True)

    def seen(self) -> dict[str, Any]:
        """The highest incarnation and the newest commit record (signed, as the store held it) seen here."""
        with self.lock:
            return {"incarnation": self._incarnation, "record": self.store.newest_record}

    def undecided(self, incarnation: int, version: int) -> bool:
        with self.lock:
            return self.store.get(self.store.keys.outcome(incarnation, version)) is None
