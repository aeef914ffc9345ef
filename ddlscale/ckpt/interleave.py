"""Traffic interleaving: send a checkpoint in the gaps of training communication.

Over the first iterations the checkpointer records, per iteration, when training collectives were in
flight (the sync backend's timestamps) up to the deadline — the optimizer step, which mutates the
state being sent. :func:`idle_spans` turns that into the spans that were idle in nearly every
profiled iteration; :func:`schedule` fits whole chunks into them (a chunk takes ``chunk_s``, measured,
and a span is used at a fraction ``mu`` < 1 to leave slack). :class:`ReplicaSender` then ships version
v during iteration v+1 along that plan, and whatever did not fit goes when the deadline arrives.

Chunks leave through a small staging buffer of ``p`` sub-buffers: a copier fills sub-buffer i+1 from
the live tensors (a device-to-host copy on a GPU) while the sender puts sub-buffer i on the wire.
With ``p = 1`` copy and send alternate — the "unpipelined" mode of the comparison.
"""

from __future__ import annotations

import hashlib
import math
import queue
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ddlscale.ckpt.replica import AgentClient, ReplicaError
from ddlscale.ckpt.snapshot import Snapshot

MODES = ("gemini", "unpipelined", "blocking")


def idle_spans(busy: Sequence[Sequence[tuple[float, float]]], horizons: Sequence[float], resolution_s: float = 1e-3,
               quorum: float = 0.9) -> list[tuple[float, float]]:
    """Spans of ``[0, median horizon)`` with no collective in flight in at least ``quorum`` of iterations.

    ``busy[i]``: (start, end) of iteration i's collectives, seconds from its start; ``horizons[i]``: its
    deadline. A bin of ``resolution_s`` is idle in an iteration when no interval touches it.
    """
    if not busy or len(busy) != len(horizons):
        raise ValueError("idle_spans needs one busy list and one horizon per profiled iteration")
    horizon = statistics.median(horizons)
    bins = max(1, int(horizon / resolution_s))
    idle_count = [0] * bins
    for intervals, own_horizon in zip(busy, horizons, strict=True):
        taken = [False] * bins
        for start, end in intervals:
            for b in range(max(0, int(start / resolution_s)), min(bins, int(math.ceil(end / resolution_s)))):
                taken[b] = True
        for b in range(min(bins, int(own_horizon / resolution_s))):
            idle_count[b] += not taken[b]
    need = quorum * len(busy)
    spans: list[tuple[float, float]] = []
    start: int | None = None
    for b in range(bins + 1):
        idle = b < bins and idle_count[b] >= need
        if idle and start is None:
            start = b
        elif not idle and start is not None:
            spans.append((start * resolution_s, b * resolution_s))
            start = None
    return spans


def is_stable(horizons: Sequence[float], tolerance: float = 0.1) -> bool:
    """Whether every profiled iteration is within ``tolerance`` of the median (the paper's < 10%)."""
    middle = statistics.median(horizons)
    return middle > 0 and all(abs(h - middle) <= tolerance * middle for h in horizons)


def schedule(spans: Sequence[tuple[float, float]], chunk_s: float, mu: float = 0.8) -> list[tuple[float, int]]:
    """``(start, chunks)`` per span: as many whole chunks as fit in ``mu`` of the span."""
    if chunk_s <= 0:
        raise ValueError(f"chunk time must be > 0, got {chunk_s}")
    plan = []
    for start, end in spans:
        n = int(mu * (end - start) / chunk_s)
        if n > 0:
            plan.append((start, n))
    return plan


@dataclass
class Transfer:
    """One version on its way to the holders."""

    version: int
    snapshot: Snapshot
    keep: int = -1  # the committed version the agents must not overwrite; resolved before BEGIN
    position: Any = None  # where in the data the version is (for the manifest)
    captured: float = field(default_factory=time.perf_counter)
    sha256: str = ""
    error: str | None = None
    verified: int = 0  # holders whose END check passed
    done: threading.Event = field(default_factory=threading.Event)
    finished: float | None = None


class ReplicaSender:
    """Ships this rank's snapshots to its holders' agents, interleaved with training or blocking.

    Args:
        owner: this rank (the replicas' owner id at the agents).
        destinations: connections to every holder's agent, own machine first.
        chunk_bytes, subbuffers: staging layout (p sub-buffers of one chunk each).
        mode: ``"gemini"``, ``"unpipelined"`` (p = 1) or ``"blocking"`` (all at once on the caller).
        keep_for: called before a version's BEGIN; returns the version the agents must keep (it may
            wait for the previous version's commit outcome).
        on_done: called after each version's END round (commit bookkeeping).
    """

    def __init__(self, owner: int, destinations: list[AgentClient], chunk_bytes: int, subbuffers: int, mode: str,
                 keep_for: Callable[[Transfer], int], on_done: Callable[[Transfer], None], device: torch.device | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"ckpt.mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.owner, self.destinations, self.mode = owner, destinations, mode
        self.chunk_bytes = chunk_bytes
        self.subbuffers = 1 if mode == "unpipelined" else subbuffers
        pin = device is not None and device.type == "cuda"
        self.staging = torch.empty((self.subbuffers, chunk_bytes), dtype=torch.uint8, pin_memory=pin)
        self.keep_for, self.on_done = keep_for, on_done
        self.plan: list[tuple[float, int]] | None = None  # set once profiling settles
        self.chunk_times: list[float] = []  # seconds per chunk to all holders, measured
        self._jobs: queue.Queue[Transfer | None] = queue.Queue()
        self._iteration = threading.Condition()
        self._iteration_start: float | None = None
        self._deadline = threading.Event()
        self._current: Transfer | None = None
        self._thread: threading.Thread | None = None
        if mode != "blocking":
            self._thread = threading.Thread(target=self._run, daemon=True, name="gemini-sender")
            self._thread.start()

    # -- the training thread's side ---------------------------------------------------------------
    def submit(self, transfer: Transfer) -> None:
        if self.mode == "blocking":
            self._send(transfer, plan=None, iteration_start=None)
            return
        self._deadline.clear()
        self._current = transfer
        with self._iteration:  # the iteration that carries it has not started yet
            self._iteration_start = None
        self._jobs.put(transfer)

    def iteration_started(self) -> None:
        with self._iteration:
            self._iteration_start = time.perf_counter()
            self._iteration.notify_all()

    def deadline(self) -> float:
        """Block until the version in flight is fully sent and checked; returns the seconds waited."""
        transfer = self._current
        if transfer is None:
            return 0.0
        start = time.perf_counter()
        self._deadline.set()
        with self._iteration:
            self._iteration.notify_all()
        transfer.done.wait()
        self._current = None
        return time.perf_counter() - start

    def close(self) -> None:
        self.deadline()
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=30)
        for client in self.destinations:
            client.close()

    # -- the sender thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            transfer = self._jobs.get()
            if transfer is None:
                return
            with self._iteration:  # version v goes out during iteration v + 1
                self._iteration.wait_for(lambda: self._iteration_start is not None or self._deadline.is_set())
                start = self._iteration_start
            self._send(transfer, self.plan, start)

    def _send(self, transfer: Transfer, plan: list[tuple[float, int]] | None, iteration_start: float | None) -> None:
        snapshot = transfer.snapshot
        digest = hashlib.sha256()
        try:
            transfer.keep = self.keep_for(transfer)
            for client in self.destinations:
                client.begin(transfer.version, self.owner, snapshot.nbytes, transfer.keep)
            chunks = self._staged_chunks(snapshot)
            for start, count in (plan or []) if iteration_start is not None else []:
                wait = iteration_start + start - time.perf_counter()
                if wait > 0 and self._deadline.wait(wait):
                    break  # the deadline came first: everything left goes now
                if not self._send_chunks(transfer, chunks, digest, count):
                    break
            self._send_chunks(transfer, chunks, digest, None)
            transfer.sha256 = digest.hexdigest()
            for client in self.destinations:
                try:
                    client.end(transfer.version, self.owner, transfer.sha256)
                    transfer.verified += 1
                except ReplicaError as exc:
                    transfer.error = str(exc)
        except (OSError, ReplicaError, RuntimeError) as exc:
            transfer.error = f"sending version {transfer.version}: {exc}"
        transfer.finished = time.perf_counter()
        try:
            self.on_done(transfer)
        finally:
            transfer.done.set()

    def _staged_chunks(self, snapshot: Snapshot):
        """Yield ``(offset, staged bytes)``; with p > 1 a copier thread stages ahead of the sender."""
        offsets = list(range(0, snapshot.nbytes, self.chunk_bytes))

        def stage(slot: int, offset: int) -> memoryview:
            length = min(self.chunk_bytes, snapshot.nbytes - offset)
            buffer, position = self.staging[slot], 0
            for piece in snapshot.pieces(offset, length):
                buffer[position:position + piece.numel()].copy_(piece)
                position += piece.numel()
            return memoryview(buffer[:length].numpy())

        if self.subbuffers == 1:
            for offset in offsets:
                yield offset, stage(0, offset)
            return
        free: queue.Queue[int] = queue.Queue()
        for slot in range(self.subbuffers):
            free.put(slot)
        ready: queue.Queue[tuple[int, int, memoryview] | None] = queue.Queue()

        def copier() -> None:
            for offset in offsets:
                slot = free.get()
                ready.put((slot, offset, stage(slot, offset)))
            ready.put(None)

        threading.Thread(target=copier, daemon=True, name="gemini-copier").start()
        while (item := ready.get()) is not None:
            slot, offset, view = item
            yield offset, view
            free.put(slot)  # the sender is done with it

    def _send_chunks(self, transfer: Transfer, chunks, digest, count: int | None) -> bool:
        """Send ``count`` chunks (None: all left); False when none are left."""
        sent = 0
        while count is None or sent < count:
            item = next(chunks, None)
            if item is None:
                return False
            offset, view = item
            start = time.perf_counter()
            digest.update(view)
            for client in self.destinations:
                client.data(transfer.version, self.owner, offset, [view])
            if len(view) == min(self.chunk_bytes, transfer.snapshot.nbytes):  # this snapshot's typical chunk
                self.chunk_times.append(time.perf_counter() - start)
            sent += 1
        return True

    def chunk_seconds(self) -> float | None:
        """Median measured time of one full chunk to all holders, or None before any was sent."""
        return statistics.median(self.chunk_times[-50:]) if self.chunk_times else None
