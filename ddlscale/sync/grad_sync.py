"""The GradSync seam: how a backend sees gradients and hands back their global average.

Life of one optimizer step, driven by :class:`ddlscale.strategy.DDLStrategy`:

1. during backward, each parameter's post-accumulate-grad hook calls :meth:`GradSync.grad_ready`,
   which forwards to :meth:`on_grad_ready` — a subclass packs, compresses or sparsifies the
   gradient and launches asynchronous collectives as it likes;
2. before clipping and the optimizer step, :meth:`finish_step` calls :meth:`finish`, which must leave
   every ``p.grad`` holding the average over all ranks, then closes the step's statistics.

Invariants a subclass must keep: every rank issues the same collectives in the same order (launch in
a rank-independent order such as :attr:`backward_order`, never in raw hook order), and ``finish``
handles parameters whose hook never fired this step (unused parameters) on every rank alike.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddlscale import clock
from ddlscale.comm import CollectiveRecord, CommLedger, Communicator
from ddlscale.compress.compressor import Compressor


def in_flight(records: Sequence[CollectiveRecord], finishing: float, now: float) -> tuple[float, float]:
    """(seconds some collective was in flight, of which before ``finishing``): the union of the
    records' issue-to-completion spans (one without a completion counts to ``now``), whole and cut
    at the moment the training thread began to wait."""
    spans = sorted((r.start, r.end if r.end is not None else now) for r in records)
    total = hidden = 0.0
    run_start = run_end = None
    for start, end in [*spans, (float("inf"), float("inf"))]:
        if run_end is not None and start > run_end:  # a run of overlapping spans closed
            total += run_end - run_start
            hidden += max(0.0, min(run_end, finishing) - run_start)
            run_start = None
        if run_start is None:
            run_start, run_end = start, end
        else:
            run_end = max(run_end, end)
    return total, hidden


@dataclass
class StepSyncStats:
    """What one rank's backend did for one optimizer step."""

    bytes_sent: int = 0
    bytes_recv: int = 0
    encode_s: float = 0.0  # packing / compressing / hashing on the training thread
    comm_s: float = 0.0  # training thread blocked on collectives
    decode_s: float = 0.0  # unpacking / decompressing
    collectives: list[CollectiveRecord] = field(default_factory=list)
    in_flight_s: float = 0.0  # time some collective of the step was in flight (their union)
    overlapped_s: float = 0.0  # ... of it, before finish() began: hidden behind backward

    @property
    def sync_s(self) -> float:
        """Time the training thread spent on synchronization (what a faster backend saves)."""
        return self.encode_s + self.comm_s + self.decode_s


class GradSync:
    """Base class of every gradient-synchronization backend.

    Subclasses override :meth:`on_grad_ready` and :meth:`finish` (and :meth:`on_setup` /
    :meth:`on_backward_order` to build their buffers). Time spent inside ``with self.timed("encode")``
    (or ``"comm"``, ``"decode"``) and bytes moved through :attr:`comm` are reported per step. A
    backend may run others as its executors (:meth:`serve`): the planned syncs run dense allreduce
    while they profile and CompressSync after.
    """

    # Whether a config must give this sync a compressor (``compressor=``): one that compresses every
    # gradient would otherwise run dense under its own name. (The planned syncs plan fusion alone
    # without one.)
    needs_compressor = False
    # What this step did, when the backend runs in phases (a planned sync: profile, calibrate, trial,
    # plan), for the trainer's metrics; None for a backend with one phase.
    step_phase: str | None = None

    def __init__(self) -> None:
        self.ledger = CommLedger()
        self.last_stats = StepSyncStats()
        self.steps = 0
        self._timers = {"encode": 0.0, "comm": 0.0, "decode": 0.0}
        self._order_known = False
        self._ready_log: list[int] = []
        self._thread_phases = threading.local()  # a background job's own phase record (see timed)

    def __getstate__(self) -> dict[str, Any]:
        # Backends travel to spawned workers before set-up; a thread-local cannot be pickled.
        state = self.__dict__.copy()
        state.pop("_thread_phases", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._thread_phases = threading.local()

    # -- set-up --------------------------------------------------------------------------------
    def setup(
        self,
        named_params: Sequence[tuple[str, torch.nn.Parameter]],
        group: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
        sparse_grads: Collection[str] = (),
    ) -> None:
        """Bind to the parameters (in registration order) and the process group. ``sparse_grads``
        names the parameters whose gradients arrive sparse (``nn.Embedding(sparse=True)``), as the
        module says before any backward."""
        self.names = [name for name, _ in named_params]
        self.sparse_grads = frozenset(sparse_grads)
        self.params = [p for _, p in named_params]
        self.index_of = {id(p): i for i, p in enumerate(self.params)}
        self.device = device or (self.params[0].device if self.params else torch.device("cpu"))
        self.comm = Communicator(group, self.ledger)
        self.world_size = self.comm.size
        self.rank = self.comm.rank
        # DDP's first guess: gradients arrive roughly in reverse registration order.
        self.backward_order = list(reversed(range(len(self.params))))
        self.on_setup()

    @property
    def is_set_up(self) -> bool:
        """Bound to its parameters and process group (:meth:`setup`): a rank's backend, with state."""
        return hasattr(self, "params")

    def serve(self, owner: GradSync) -> None:
        """Run as ``owner``'s executor: its parameters and process group, its ledger and step timers
        (so what this one moves and spends is the owner's step), its backward order. The owner calls
        this before each :meth:`on_setup` of this one, so what it learns (the order) reaches here."""
        self.names, self.sparse_grads, self.params, self.index_of = (owner.names, owner.sparse_grads, owner.params,
                                                                     owner.index_of)
        self.device, self.comm, self.world_size, self.rank = owner.device, owner.comm, owner.world_size, owner.rank
        self.ledger, self._timers = owner.ledger, owner._timers
        self.backward_order, self._order_known = owner.backward_order, owner._order_known

    def on_setup(self) -> None:
        """Build buffers for :attr:`backward_order` (override)."""

    def on_backward_order(self) -> None:
        """React to the backward order learned on the first step (override; default rebuilds)."""
        self.on_setup()

    # -- per step ------------------------------------------------------------------------------
    def grad_ready(self, param: torch.nn.Parameter) -> None:
        index = self.index_of[id(param)]
        if not self._order_known:
            self._ready_log.append(index)
        self.on_grad_ready(index, param)

    def on_grad_ready(self, index: int, param: torch.nn.Parameter) -> None:
        """Gradient ``param.grad`` of parameter ``index`` is final for this step (override)."""
        raise NotImplementedError

    def finish(self) -> None:
        """Complete all communication; leave every ``p.grad`` the global average (override)."""
        raise NotImplementedError

    def finish_step(self) -> StepSyncStats:
        """Finish the step, learn the backward order after the first one, and close the stats."""
        finishing = clock.now()
        self.finish()
        if not self._order_known:
            self._adopt_backward_order()
        self.steps += 1
        records = self.ledger.drain()
        self.last_stats = StepSyncStats(
            bytes_sent=sum(r.bytes_sent for r in records),
            bytes_recv=sum(r.bytes_recv for r in records),
            encode_s=self._timers["encode"],
            comm_s=self._timers["comm"],
            decode_s=self._timers["decode"],
            collectives=records,
            **dict(zip(("in_flight_s", "overlapped_s"), in_flight(records, finishing, clock.now()), strict=True)),
        )
        for phase in self._timers:  # in place: executors serving this backend share the dict
            self._timers[phase] = 0.0
        return self.last_stats

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Charge the time inside to ``phase`` of this step. On a thread running a background job
        (:meth:`record_phases`), the spans go to that job's record instead, for :meth:`finish` to
        fold in without counting twice what overlapped the training thread's wait."""
        start = clock.now()
        try:
            yield
        finally:
            end = clock.now()
            record = getattr(self._thread_phases, "record", None)
            if record is None:
                self._timers[phase] += end - start
            else:
                record.append((phase, start, end))

    @contextmanager
    def record_phases(self, record: list[tuple[str, float, float]]) -> Iterator[None]:
        """On this thread, collect :meth:`timed` spans as (phase, start, end) into ``record``."""
        self._thread_phases.record = record
        try:
            yield
        finally:
            self._thread_phases.record = None

    def fold_phases(self, record: list[tuple[str, float, float]], waited: tuple[float, float]) -> None:
        """Charge a background job's spans to this step: its encode and decode work as they ran, and
        as comm the part of the training thread's wait (``waited``: start, end) not spent on them."""
        start, end = waited
        busy = 0.0
        for phase, a, b in record:
            if phase in ("encode", "decode"):
                self._timers[phase] += b - a
                busy += max(0.0, min(b, end) - max(a, start))
        self._timers["comm"] += max(0.0, end - start - busy)

    def summary_fields(self) -> dict[str, Any]:
        """What the backend adds to the run's summary.json, overriding the config's names: here that
        it keeps no error feedback (a compressing sync says which it resolved)."""
        return {"memory": "none"}

    def report(self) -> dict[str, Any]:
        """Everything the backend says of itself in the run's summary.json: :meth:`summary_fields`
        here; a planned sync adds its kept plan, a sparse sync its routing."""
        return self.summary_fields()

    def default_compressor(self) -> Compressor | None:
        """The compressor the config gave this backend (``compressor=``), if it takes one."""
        return None

    def written_files(self) -> list[Path]:
        """Files this backend wrote for the run (a planned sync's plan), which loggers keep with its
        summary (W&B: as an artifact). None here."""
        return []

    # -- checkpointed state ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Backend state a checkpoint must capture (error feedback, profiles...); override and extend."""
        return {"steps": self.steps, "backward_order": list(self.backward_order)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        self.backward_order = list(state["backward_order"])
        self._order_known = True
        self.on_backward_order()

    def load_resharded(self, states: list[dict[str, Any]], rank: int, world_size: int) -> None:
        """Restore rank ``rank`` of ``world_size`` from the states of a run of ``len(states)`` ranks.

        Here: the step count and backward order (the same on every rank). Whatever was measured for the
        old world size (sparsity profiles, plans made from them) is left fresh, so it is measured again.
        A backend with per-rank state that must not be lost (error feedback) overrides this, merges that
        state over the saved ranks and calls it.
        """
        GradSync.load_state_dict(self, {"steps": states[0]["steps"], "backward_order": states[0]["backward_order"]})

    # -- helpers -------------------------------------------------------------------------------
    def machine_communicators(self, local_size: int | None) -> tuple[int, Communicator, Communicator]:
        """(k, intra, inter) for hierarchical schemes: this rank's machine (ranks r*k .. r*k+k-1) and
        the ranks holding the same local position on every machine. ``local_size`` None reads
        ``LOCAL_WORLD_SIZE`` (torchrun, Lightning). Every rank creates every group, as new_group
        requires; both share this backend's ledger."""
        k = local_size or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if self.world_size % k:
            raise ValueError(f"sync.local_size={k} does not divide the {self.world_size} ranks")
        intra = inter = None
        for m in range(self.world_size // k):
            group = dist.new_group(list(range(m * k, (m + 1) * k)))
            if self.rank // k == m:
                intra = Communicator(group, self.ledger)
        for j in range(k):
            group = dist.new_group(list(range(j, self.world_size, k)))
            if self.rank % k == j:
                inter = Communicator(group, self.ledger)
        return k, intra, inter

    def _adopt_backward_order(self) -> None:
        """Take rank 0's observed order, so every rank fuses and launches identically."""
        seen = list(dict.fromkeys(self._ready_log))
        unused = [i for i in reversed(range(len(self.params))) if i not in set(seen)]
        order = [seen + unused]
        if self.world_size > 1:
            # One-off, outside the accounted traffic: it is set-up, not gradient synchronization.
            dist.broadcast_object_list(order, src=self.comm._global(0), group=self.comm.group)
        self._order_known = True
        self._ready_log = []
        if order[0] != self.backward_order:
            self.backward_order = order[0]
            self.on_backward_order()
