"""A machine's replica buffers, and the rule for which one a new version may overwrite.

For every owner rank the agent holds two separate buffers (:class:`Slot`, each a file in shared
memory) — the newest complete replica and the one being written.

**Fencing is the agent's alone.** Which buffer a new version may overwrite is decided from the job's
signed records in the store (:class:`JobView`), never from anything a client sends: the buffer holding
the committed version (the manifest) is never overwritten, nor is a complete newer version whose
commit is still undecided in the current incarnation. A committed manifest that disappears from the
store without the job clearing it stays protected.

A buffer is a new file per version, made by the agent alone (see :class:`Slot`), reserved whole (``posix_fallocate``) or refused naming the free space: a full /dev/shm
then fails one request instead of killing the trainer that writes through shared memory with SIGBUS.
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddlscale.ckpt.gemini.protocol import FAILED, NO_SPACE, NO_VERSION, mib, shm_dir, shm_usage
from ddlscale.ckpt.gemini.store import CLEARED, JobStore


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
            self.path = path
        finally:
            os.close(fd)

    def _no_space(self, nbytes: int, what: str, usage: Any) -> Refused:
        return Refused("space", f"cannot reserve {mib(nbytes)} ({nbytes} bytes) for {what} in {self.prefix.parent}: "
                                f"{mib(usage.free)} free of {mib(usage.total)}", NO_SPACE)

    def release(self) -> None:
        if self.buf is not None:
            try:
                self.buf.close()
            except BufferError:  # a DATA being received into it still holds a view: freed with that view
                pass
            self.buf = None
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None


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
        self._read_at = -math.inf  # when the incarnation was last read from the store

    def incarnation(self, at_least: int, max_age_s: float = 0.0) -> int:
        """The job's current incarnation: read again when a client claims a newer one, or when the value
        held was read more than ``max_age_s`` ago (0: always)."""
        with self.lock:
            now = time.monotonic()
            if at_least > self._incarnation or now - self._read_at >= max_age_s:
                self._incarnation = max(self._incarnation, int(self.store.get(self.store.keys.incarnation, 0)))
                self._read_at = now
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
