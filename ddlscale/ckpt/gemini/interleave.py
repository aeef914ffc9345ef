"""Traffic interleaving: send a checkpoint in the gaps of training communication.

Over the first iterations the checkpointer records, per iteration, when training collectives were in
flight (the sync backend's timestamps) up to the deadline — the optimizer step, which mutates the
state being sent. Overlapping collectives merge into busy periods; the gaps between them are
G_0 (iteration start to the first period), G_1 ... and G_n (the last period to the deadline).
:func:`profile_gaps` takes each gap's median over the profiled iterations and :func:`chunks_per_gap`
fits whole chunks into a fraction ``mu`` < 1 of it (a chunk takes ``chunk_s``, measured).

Gaps are anchored to communication events, not to clock offsets from the iteration start: on a
shared host compute time jitters by tens of percent, and a schedule in absolute time would land
chunks on top of collectives. At run time the sender watches the ledger: in gap j it sends up to
the planned count while the wire stays idle; what did not fit goes when the deadline arrives.

Chunks leave through a small staging buffer of ``p`` sub-buffers: a copier fills sub-buffer i+1 from
the live tensors (a device-to-host copy on a GPU) while the sender puts sub-buffer i on the wire.
With ``p = 1`` copy and send alternate — the "unpipelined" mode of the comparison.
"""

from __future__ import annotations

import queue
import statistics
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ddlscale import clock
from ddlscale.ckpt.gemini.protocol import (
    AgentClient,
    ReplicaError,
    ReplicaRefused,
    ReplicaSpaceError,
    ReplicaStoreBehind,
)
from ddlscale.ckpt.state.snapshot import Snapshot
from ddlscale.ckpt.version.checksum import Checksum

MODES = ("gemini", "unpipelined", "blocking")
POLL_S = 0.001  # how often the sender looks at the wire while it waits for a gap


def busy_periods(intervals: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merge overlapping (start, end) intervals into disjoint busy periods, in time order."""
    periods: list[list[float]] = []
    for start, end in sorted(intervals):
        if periods and start <= periods[-1][1]:
            periods[-1][1] = max(periods[-1][1], end)
        else:
            periods.append([start, end])
    return [(a, b) for a, b in periods]


def gaps(intervals: Sequence[tuple[float, float]], horizon: float) -> list[float]:
    """Idle time before each busy period and after the last one, up to ``horizon``: G_0 ... G_n."""
    out, previous_end = [], 0.0
    for start, end in busy_periods(intervals):
        out.append(max(0.0, start - previous_end))
        previous_end = end
    out.append(max(0.0, horizon - previous_end))
    return out


def profile_gaps(profiled: Sequence[Sequence[float]]) -> list[float]:
    """Median of each gap over the iterations that have the most common number of gaps."""
    if not profiled:
        raise ValueError("profile_gaps needs at least one profiled iteration")
    count = Counter(len(g) for g in profiled).most_common(1)[0][0]
    same = [g for g in profiled if len(g) == count]
    return [statistics.median(g[i] for g in same) for i in range(count)]


def is_stable(horizons: Sequence[float], tolerance: float = 0.1) -> bool:
    """Whether the profiled iterations stay within ``tolerance`` of their median (the paper's < 10%),
    judged on the middle 80% so one outlier iteration does not reset the profile."""
    ordered = sorted(horizons)
    trim = len(ordered) // 10
    middle = statistics.median(ordered)
    kept = ordered[trim:len(ordered) - trim]
    return middle > 0 and all(abs(h - middle) <= tolerance * middle for h in kept)


def chunks_per_gap(gap_s: Sequence[float], chunk_s: float, mu: float = 0.8) -> list[int]:
    """Whole chunks that fit in ``mu`` of each gap."""
    if chunk_s <= 0:
        raise ValueError(f"chunk time must be > 0, got {chunk_s}")
    return [int(mu * g / chunk_s) for g in gap_s]


@dataclass(frozen=True)
class Wire:
    """What the training communication is doing now: busy periods completed this iteration, whether
    one is in flight, and whether the iteration's communication is over (in the last gap)."""

    completed: int
    idle: bool
    finished: bool


@dataclass
class Transfer:
    """One version on its way to the holders; the sender drops ``snapshot`` once the version is out."""

    version: int
    snapshot: Snapshot | None
    position: Any = None  # where in the data the version is (for the manifest)
    captured: float = field(default_factory=clock.now)  # emulated seconds, as finished
    checksum: str = ""  # the whole stream's MAC, "<algorithm>:<hex>"
    error: str | None = None
    space_error: str | None = None  # a holder could not reserve the version's buffer
    store_behind: str | None = None  # a holder refused BEGIN: the job's store went back (the run must stop)
    outcome: str | None = None  # its commit's outcome, as the next version's BEGIN read it (every rank alike)
    verified: list[int] = field(default_factory=list)  # holders (machines) whose END check passed
    done: threading.Event = field(default_factory=threading.Event)  # sent and checked: state may change
    settled: threading.Event = field(default_factory=threading.Event)  # commit bookkeeping finished too
    finished: float | None = None
    nbytes: int = field(init=False)  # the stream's size, kept after the snapshot is dropped

    def __post_init__(self) -> None:
        self.nbytes = self.snapshot.nbytes


class ReplicaSender:
    """Ships this rank's snapshots to its holders' agents, interleaved with training or blocking.

    Args:
        owner: this rank (the replicas' owner id at the agents).
        destinations: connections to every holder's agent, own machine first.
        holders: the machine of each destination (what a verified END acknowledges).
        chunk_bytes, subbuffers: staging layout (p sub-buffers of one chunk each).
        mode: ``"gemini"``, ``"unpipelined"`` (p = 1) or ``"blocking"`` (all at once on the caller).
        checksum, key: the MAC algorithm of the stream sent at END (:mod:`ddlscale.ckpt.version.checksum`) and
            the job's replica key.
        before_begin: called before a version's BEGIN (waits for the previous version's commit outcome,
            so that the agents see it when they pick the buffer to overwrite).
        on_done: called after each version's END round (commit bookkeeping).
        wire: the training communication's state now (see :class:`Wire`); needed once ``plan`` is set.
    """

    def __init__(self, owner: int, destinations: list[AgentClient], holders: list[int], chunk_bytes: int,
                 subbuffers: int, mode: str, checksum: str, key: bytes, before_begin: Callable[[Transfer], None],
                 on_done: Callable[[Transfer], None], wire: Callable[[], Wire] | None = None,
                 device: torch.device | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"ckpt.mode must be one of {', '.join(MODES)}, got {mode!r}")
        if len(holders) != len(destinations):
            raise ValueError("one holder machine per destination")
        self.owner, self.destinations, self.holders, self.mode = owner, destinations, holders, mode
        self.chunk_bytes, self.checksum, self.key = chunk_bytes, checksum, key
        self.subbuffers = 1 if mode == "unpipelined" else subbuffers
        pin = device is not None and device.type == "cuda"
        self.staging = torch.empty((self.subbuffers, chunk_bytes), dtype=torch.uint8, pin_memory=pin)
        self.before_begin, self.on_done = before_begin, on_done
        self.wire = wire
        self.plan: list[int] | None = None  # chunks per gap, set once profiling settles
        self.chunk_times: list[float] = []  # seconds per chunk to all holders, measured
        self._jobs: queue.Queue[Transfer | None] = queue.Queue()
        self._iteration = threading.Condition()
        self._iteration_start: float | None = None
        self._deadline = threading.Event()
        self._abandoned = threading.Event()  # training stopped: what is in flight fails quietly, uncommitted
        self._current: Transfer | None = None
        self._stale: set[AgentClient] = set()  # connections a failed request left out of step
        self._thread: threading.Thread | None = None
        if mode != "blocking":
            self._thread = threading.Thread(target=self._run, daemon=True, name="gemini-sender")
            self._thread.start()

    # -- the training thread's side ---------------------------------------------------------------
    def submit(self, transfer: Transfer) -> None:
        if self.mode == "blocking":
            self._send(transfer, plan=None)
            return
        self._deadline.clear()
        self._current = transfer
        with self._iteration:  # the iteration that carries it has not started yet
            self._iteration_start = None
        self._jobs.put(transfer)

    def iteration_started(self) -> None:
        with self._iteration:
            self._iteration_start = clock.now()
            self._iteration.notify_all()

    def deadline(self) -> float:
        """Block until the version in flight is fully sent and checked; returns the seconds waited."""
        transfer = self._current
        if transfer is None:
            return 0.0
        start = clock.now()
        self._deadline.set()
        with self._iteration:
            self._iteration.notify_all()
        transfer.done.wait()
        self._current = None
        return clock.now() - start

    def settle(self) -> None:
        """Block until the last version is sent and its commit decided (end of training)."""
        transfer = self._current
        self.deadline()
        if transfer is not None:
            transfer.settled.wait()

    def close(self) -> None:
        self.settle()
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=clock.wall(30))
        for client in self.destinations:
            client.close()

    def abandon(self) -> None:
        """Stop without waiting: training failed, so a peer may be gone and the version in flight would
        wait for a commit that cannot come (rank 0 for commit_timeout_s) and hold up the restart."""
        self._abandoned.set()
        self._deadline.set()
        self._jobs.put(None)
        for client in self.destinations:
            client.close()  # a send in progress fails at once; the daemon thread ends with the process

    @property
    def abandoned(self) -> bool:
        return self._abandoned.is_set()

    # -- the sender thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            transfer = self._jobs.get()
            if transfer is None:
                return
            with self._iteration:  # version v goes out during iteration v + 1
                self._iteration.wait_for(lambda: self._iteration_start is not None or self._deadline.is_set())
            self._send(transfer, self.plan)

    def _request(self, client: AgentClient, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)`` on ``client``; any failure but the agent's own refusal (a complete reply)
        leaves the connection out of step, so the next version gets a fresh one."""
        try:
            return call(*args)
        except ReplicaError as exc:
            if isinstance(exc, ReplicaRefused):  # the agent closed the connection after saying why
                self._stale.add(client)
            raise
        except Exception:
            self._stale.add(client)
            raise

    def _send(self, transfer: Transfer, plan: list[int] | None) -> None:
        snapshot = transfer.snapshot
        digest = Checksum(self.checksum, self.key)
        chunks = None
        try:
            self.before_begin(transfer)
            for client in list(self._stale):
                client.reconnect()  # unreachable: ReplicaError, this version fails, retried with the next
                self._stale.discard(client)
            for client in self.destinations:
                self._request(client, client.begin, transfer.version, self.owner, snapshot.nbytes)
            chunks = self._staged_chunks(snapshot)
            if plan is not None and self.wire is not None and not self._deadline.is_set():
                self._send_in_gaps(transfer, chunks, digest, plan)
            self._send_chunks(transfer, chunks, digest, None)
            transfer.checksum = digest.text()
            for client, machine in zip(self.destinations, self.holders, strict=True):
                try:
                    self._request(client, client.end, transfer.version, self.owner, transfer.checksum)
                    transfer.verified.append(machine)
                except ReplicaError as exc:
                    transfer.error = str(exc)
        except ReplicaSpaceError as exc:
            transfer.error = transfer.space_error = f"sending version {transfer.version}: {exc}"
        except ReplicaStoreBehind as exc:
            transfer.error = transfer.store_behind = f"sending version {transfer.version}: {exc}"
        except Exception as exc:  # any failure fails this version only: training must not wait on it forever
            transfer.error = f"sending version {transfer.version}: {exc}"
        finally:
            if chunks is not None:
                chunks.close()  # stops the copier of an abandoned send (it holds the snapshot)
        # Sent (or given up): drop the snapshot, whose copies (error feedback: a model's worth) would
        # otherwise live on in every finished transfer the checkpointer keeps for its figures.
        transfer.snapshot = None
        transfer.finished = clock.now()
        transfer.done.set()  # the training thread may step now; the commit needs no more of our state
        if self._abandoned.is_set():  # the failures of a send cut short on purpose are no news
            transfer.error = "abandoned: training stopped"
            transfer.settled.set()
            return
        try:
            self.on_done(transfer)
        except Exception as exc:  # the commit bookkeeping failed (the store, say): this version only
            failed = f"committing version {transfer.version}: {exc}"
            transfer.error = failed if transfer.error is None else f"{transfer.error}; {failed}"
            warnings.warn(f"gemini: {failed}", stacklevel=1)
        finally:
            transfer.settled.set()

    def _send_in_gaps(self, transfer: Transfer, chunks, digest, plan: list[int]) -> None:
        """Up to ``plan[j]`` chunks in gap j, each only while the wire is idle, until the deadline."""
        sent = [0] * len(plan)
        while not self._deadline.is_set():
            wire = self.wire()
            gap = len(plan) - 1 if wire.finished else wire.completed
            if wire.idle and gap < len(plan) and sent[gap] < plan[gap]:
                if not self._send_chunks(transfer, chunks, digest, 1):
                    return
                sent[gap] += 1
            else:
                self._deadline.wait(POLL_S)

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
        ready: queue.Queue[tuple[int, int, memoryview] | Exception | None] = queue.Queue()
        abandoned = threading.Event()

        def copier() -> None:
            try:
                for offset in offsets:
                    slot = free.get()
                    if abandoned.is_set():
                        return
                    ready.put((slot, offset, stage(slot, offset)))
                ready.put(None)
            except Exception as exc:  # to the sender, which would otherwise wait on ready forever
                ready.put(exc)

        thread = threading.Thread(target=copier, daemon=True, name="gemini-copier")
        thread.start()
        try:
            while (item := ready.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                slot, offset, view = item
                yield offset, view
                free.put(slot)  # the sender is done with it
        finally:
            # Finished, failed or abandoned: wake a copier waiting for a sub-buffer and wait for it, so
            # it neither outlives the send (holding the snapshot) nor writes the next version's staging.
            abandoned.set()
            free.put(-1)
            thread.join()

    def _send_chunks(self, transfer: Transfer, chunks, digest, count: int | None) -> bool:
        """Send ``count`` chunks (None: all left); False when none are left."""
        sent = 0
        while count is None or sent < count:
            item = next(chunks, None)
            if item is None:
                return False
            offset, view = item
            start = clock.now()
            digest.update(view)
            for client in self.destinations:
                self._request(client, client.data, transfer.version, self.owner, offset, [view])
            if len(view) == min(self.chunk_bytes, transfer.snapshot.nbytes):  # this snapshot's typical chunk
                self.chunk_times.append(clock.now() - start)
            sent += 1
        return True

    def chunk_seconds(self) -> float | None:
        """Median measured time of one full chunk to all holders, or None before any was sent."""
        return statistics.median(self.chunk_times[-50:]) if self.chunk_times else None
