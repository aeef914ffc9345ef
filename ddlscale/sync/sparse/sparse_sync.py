"""Common machinery of the sparse backends: profile densities, route tensors, sync the sparse ones.

**Units.** A sparse sync moves a tensor's non-zero *units*: the rows of a (rows, width) view of its
gradient (:mod:`.rows`). A gradient that arrives as sparse COO (``nn.Embedding(sparse=True)``) is
counted in its stored slices; a dense gradient of a matrix in rows when its zeros come in whole rows
(sending rows beats sending elements: non-zero elements x (4 + s) >= non-zero rows x (4 + width s)),
else in single elements. Densities, gammas, the hash partition and the cost formulas are all in
units, agreed on every rank from the profile.

**Profiling and routing.** Every sparse backend starts as dense allreduce: during the first
``profile_steps`` steps it measures, per tensor, the density d of units on each worker and the
density of the sum (gamma_n = d_sum / d), agreed across ranks by one small allreduce; backends that
weigh recursive doubling (``profiles_doubling``) also measure gamma_{2^i} by OR-ing non-zero bitmaps
up the doubling stages. Then each tensor whose sparse scheme beats dense allreduce on the cost model
(``route: auto``), or every tensor with a sparse gradient or a unit density of at most 1/2
(``route: sparse``, the same tensors for every method), switches to the sparse path; the rest stay
in the dense buckets. Under ``route: sparse`` the parameters the module declares sparse-gradient
(``Embedding(sparse=True)``) are on the sparse path from the first step, profiled there. Every
backend prices the messages it really sends and the bytes it moves with
the same alpha and beta (``network_latency``, ``network_bandwidth``).

**Tables that share row ids** (DeepFM's factor and first-order tables, looked up with the same ids;
an LSTM's output embedding and its bias, gathered at the same candidates) are one *unit set*: a unit
is a row id with every member's row side by side, so the pair costs one index, one hash and one
place in a chain, not two. Which tables share is measured, not declared: tensors whose gradients
arrive sparse, with as many rows and one dtype, whose row sets were identical on every rank in every
profiled step (agreed in the profile's allreduce). A step where they differ is still exact: a member
absent from a row contributes zeros there, and its rows whose sum is zero are dropped from its
gradient, as a lone tensor's are.

**Route decisions** are robust to the noise of measured rounds (:func:`.traffic.decide`): the routes
within ``route_margin`` of the fastest are in the running, and among them the one with the fewest
bytes (a figure of the profile, the same in every repetition of a job) is taken, or on a re-profile
the one in force. Each decision is recorded (``route_decisions`` in summary.json).

**Overlap.** Sparse tensors are fused into groups (same dtype and width, in backward order). A group
is synchronized as soon as its last member's gradient is ready, on a lane of its own (a thread and a
process group, :mod:`.lane`) so the rest of backward goes on meanwhile, as the dense buckets'
allreduces do; groups launch in group order on every rank. ``overlap: false`` runs them after
backward instead. A gradient that came in sparse comes back sparse: coalesced, averaged.

Density drifts (an embedding's batch vocabulary grows, a model unfreezes): after routing, every step
compares each sparse tensor's summed units — the same number on every rank, so all ranks agree
without a collective — with its profile; past a factor of ``reprofile_drift`` the backend profiles
again for ``profile_steps`` steps (tensors keep their current path meanwhile) and re-routes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ddlscale import clock
from ddlscale.comm import Communicator
from ddlscale.comm.network import NetworkModel
from ddlscale.comm.probe import MEASURED, probe_bandwidth, probe_latency
from ddlscale.sync.dense import DenseAllreduce
from ddlscale.sync.sparse.lane import shared_lane
from ddlscale.sync.sparse.pushpull import INDEX_BYTES, INDEX_DTYPE
from ddlscale.sync.sparse.recursive import union_counts
from ddlscale.sync.sparse.rows import grad_of, row_width, slice_width, units_of
from ddlscale.sync.sparse.sparse_config import SparseSyncConfig
from ddlscale.sync.sparse.traffic import Exchanges, Option, RoundCosts, Sparsity, Traffic, decide

FORCED_DENSITY = 0.5  # route=sparse: units at most this dense go sparse (above it, no format beats dense)


@dataclass
class TensorRoute:
    """What a sparse sync knows of one tensor and the path it takes (one per parameter:
    :attr:`SparseSync.routes`). Figures are None until profiled."""

    sparse: bool = False  # on the sparse path (routing's decision, in force from the set-up that follows)
    carried: bool = False  # dense, but carried index-free in the sparse scheme's exchange (Zen), not a bucket
    seen: bool = False  # its gradient was observed while profiling ...
    sparse_dim: int | None = None  # ... arriving as sparse COO over this many dims (None: dense)
    width: int | None = None  # values per unit as profiled (a row, or 1: elements); None: rows
    density: float | None = None  # mean per-worker density of units, d
    gamma: float | None = None  # density of the sum / d
    gammas: list[float] | None = None  # [gamma_1, gamma_2, gamma_4, ..., gamma_n] (power-of-two n)
    plan: str | None = None  # Zen: hc, bp-coo or bp-bitmap, or bp-dense / hc-dense where carried
    block_density: float | None = None  # OmniReduce: mean per-worker fraction of non-zero blocks
    block_gamma: float | None = None  # OmniReduce: non-zero blocks of the sum / per worker


@dataclass
class GroupJob:
    """One fused group's sync for one step: its members' gradients in, their averages out."""

    members: list[int]
    grads: dict[int, tuple[torch.Tensor, int | None]]  # member -> (local gradient, sparse_dim or None)
    future: Future | None = None
    phases: list[tuple[str, float, float]] = dataclasses.field(default_factory=list)


class SparseSync(DenseAllreduce):
    """Base of agsparse, gloo_sparse, sparse_ps, omnireduce, sparcml and zen: subclasses implement
    :meth:`sync_sparse` (collectives through :attr:`sparse_comm`) and :meth:`scheme_cost`, their
    scheme's cost object (:mod:`.traffic`: what it moves for one tensor), which routing prices.

    Args:
        profile_steps: steps of dense sync spent measuring densities before routing tensors.
        sparse_params: ``"auto"`` (route by ``route``) or a list of parameter names that must go
            sparse (others stay dense), e.g. to force a scheme for a benchmark.
        route: ``"auto"`` (a tensor goes sparse where the cost model rates its scheme faster than
            dense) or ``"sparse"`` (every tensor with a sparse gradient or unit density <= 1/2 does,
            whatever the scheme: identical routing for every method).
        network_bandwidth, network_latency: the network the cost model assumes (tc units), the same
            for every method: on the emulated cluster its configured bandwidth. ``measured`` times
            exchanges on the sync group before the first routing (:mod:`ddlscale.comm.probe`).
        reprofile_drift: re-profile when a sparse tensor's summed units move by more than this
            factor from its profile (``None``: never).
        route_margin: routes within this fraction of the fastest are in the running, and the one with
            the fewest bytes among them is taken (:func:`.traffic.decide`).
        overlap: run a sparse group's sync on its own lane as soon as its gradients are ready
            (``False``: after backward, on the training thread).
        bucket_mb, first_bucket_mb: buckets of the tensors that stay dense.
    """

    schema = SparseSyncConfig
    profiles_doubling = False  # measure gamma_{2^i} too (backends that weigh recursive doubling)
    # Units one fused group may span: its indices travel as int32 (override for other wires).
    max_group_units = torch.iinfo(INDEX_DTYPE).max + 1
    shares_rows = True  # tables that share row ids travel as one unit set (a scheme whose units are not rows opts out)

    def __init__(self, profile_steps: int = 2, sparse_params: str | Sequence[str] = "auto", route: str = "auto",
                 network_bandwidth: str = "1gbit", network_latency: str = MEASURED,
                 reprofile_drift: float | None = 2.0, overlap: bool = True, bucket_mb: float = 25.0,
                 first_bucket_mb: float = 1.0, route_margin: float = 0.15):
        SparseSyncConfig(bucket_mb=bucket_mb, first_bucket_mb=first_bucket_mb, profile_steps=profile_steps,
                         sparse_params=sparse_params, route=route, network_bandwidth=network_bandwidth,
                         network_latency=network_latency, reprofile_drift=reprofile_drift,
                         overlap=overlap, route_margin=route_margin)  # refuses what no run can use
        super().__init__(bucket_mb=bucket_mb, first_bucket_mb=first_bucket_mb)
        self.measure_latency = network_latency == MEASURED
        self.measure_bandwidth = network_bandwidth == MEASURED
        try:
            self.network = NetworkModel.of(bandwidth="1gbit" if self.measure_bandwidth else network_bandwidth,
                                           latency="0us" if self.measure_latency else network_latency)
        except ValueError as error:
            raise ValueError(str(error).replace("cluster.", "sync.network_")) from None
        self.profile_steps = profile_steps
        self.sparse_params = sparse_params if sparse_params == "auto" else list(sparse_params)
        self.route = route
        self.reprofile_drift = reprofile_drift
        self.overlap = overlap
        self.route_margin = route_margin
        self.routes: list[TensorRoute] = []  # per parameter: its figures and its path (from set-up)
        self.measured_rounds: dict[str, float] | None = None  # the probed rounds routing prices
        self.shared_rows: list[tuple[int, ...]] = []  # tables whose row sets were identical, as profiled
        self.route_decisions: list[dict[str, Any]] = []  # the last routing's decisions, as recorded
        self.profiles = 0  # profiling rounds run (1 + re-profiles)
        self._profile_left = profile_steps  # profiling steps still to run in this round
        self._samples = 0  # steps averaged into the current round's profile

    def on_setup(self) -> None:
        if len(self.routes) != len(self.params):
            self.routes = [TensorRoute() for _ in self.params]
        if getattr(self, "names", None) and self.sparse_params != "auto":
            unknown = set(self.sparse_params) - set(self.names)
            if unknown:
                raise ValueError(f"sync.sparse_params names unknown parameters: {sorted(unknown)}")
            if not self.profiles:  # named tensors go sparse from the first step: no dense table's allreduce
                self._choose_sparse(self.names.index(name) for name in self.sparse_params)
        elif self.route == "sparse" and not self.profiles and self.world_size > 1:
            # route=sparse sends every sparse gradient sparse; known from the module, it does so from
            # the first step rather than densifying a whole table into a bucket while profiling.
            self._choose_sparse(i for i, name in enumerate(self.names) if name in self.sparse_grads)
        if not hasattr(self, "sparse_comm"):
            # The lane needs every world rank at this point, so only for the world group.
            self.lane = shared_lane() if self.overlap and self.comm.group is None and dist.is_initialized() else None
            self.sparse_comm = Communicator(self.lane.group, self.ledger) if self.lane else self.comm
        self._routing_set = {i: members for members in self.routing_sets() for i in members}
        self._row_pairs = self._row_sharing_candidates()
        self._position = {i: k for k, i in enumerate(self.backward_order)}
        super().on_setup()
        self.groups = self._sparse_groups()
        self.group_of = {i: g for g, group in enumerate(self.groups) for i in group}
        self._local: dict[int, tuple[int, torch.Tensor]] = {}  # profiling: (non-zero elements, non-zero rows)
        self._jobs: list[GroupJob] = [GroupJob(group, {}) for group in self.groups]
        self._next_group = 0

    def _assign(self, order: list[int]) -> list[list[int]]:
        return super()._assign([i for i in order if not self.on_lane(i)])

    def on_lane(self, index: int) -> bool:
        """Synced by this scheme's groups (sparse, or dense carried in its exchange), not a dense bucket."""
        route = self.routes[index]
        return route.sparse or route.carried

    def _choose_sparse(self, indices) -> None:
        """Route exactly these parameters sparse (the rest dense, in buckets), from the next set-up on."""
        chosen = set(indices)
        for i, route in enumerate(self.routes):
            route.sparse, route.carried = i in chosen, False

    @property
    def sparse(self) -> list[int]:
        """The parameters on the sparse path, in index order."""
        return [i for i, route in enumerate(self.routes) if route.sparse]

    # -- units -----------------------------------------------------------------------------------
    def row_width(self, index: int) -> int:
        """Values per row: a stored slice for a sparse gradient, else a slice over dim 0."""
        shape = self.params[index].shape
        sparse_dim = self.routes[index].sparse_dim
        return slice_width(shape, sparse_dim) if sparse_dim is not None else row_width(shape)

    def unit_width(self, index: int) -> int:
        """Values per unit as routed (rows until a profile says elements)."""
        width = self.routes[index].width
        return width if width is not None else self.row_width(index)

    def units(self, index: int) -> int:
        return self.params[index].numel() // self.unit_width(index)

    def routing_sets(self) -> list[tuple[int, ...]]:
        """Every parameter once, in index order: tables that share row ids together (where this scheme
        fuses them, and the routing's constraints never part them), the others alone. Routing gives a
        set one path."""
        fused = {i: members for members in self.shared_rows if self.shares_rows
                 and len({self.may_route((i,)) for i in members}) == 1 for i in members}
        return list(dict.fromkeys(fused.get(i, (i,)) for i in range(len(self.params))))

    def unit_set(self, index: int) -> tuple[int, ...]:
        """The tensors synced as one set of units with this one (itself alone unless it shares row ids
        with tables on the sparse path beside it)."""
        members = self._routing_set.get(index, (index,))
        return members if len(members) > 1 and all(self.routes[i].sparse for i in members) else (index,)

    def sets_in(self, members: Sequence[int]) -> list[tuple[int, ...]]:
        """The unit sets of a group's members (each set's members lie side by side), in group order."""
        return [self.unit_set(i) for i in members if self.unit_set(i)[0] == i]

    def set_width(self, members: Sequence[int]) -> int:
        """Values per unit of a unit set: its members' rows side by side."""
        return sum(self.unit_width(i) for i in members)

    def sparsity(self, index: int) -> Sparsity:
        """The profile of this tensor's unit set as the sparse scheme sees it."""
        return self.set_sparsity(self.unit_set(index))

    def set_sparsity(self, members: Sequence[int]) -> Sparsity:
        """The profile of a unit set as the sparse scheme sees it: its members' figures (identical:
        they share their rows), its units as wide as their rows together (Zen's hierarchical mode
        overrides)."""
        route, first = self.routes[members[0]], self.params[members[0]]
        width = self.set_width(members)
        return Sparsity(self.units(members[0]), 1.0 if route.density is None else route.density,
                        1.0 if route.gamma is None else route.gamma, route.gammas, self.world_size, width,
                        width * first.element_size())

    # -- per step ------------------------------------------------------------------------------
    def on_grad_ready(self, index: int, param: torch.nn.Parameter) -> None:
        grad = param.grad
        if self._profile_left:
            self._observe(index, grad)
        if index not in self.group_of:
            super().on_grad_ready(index, param)
            return
        job = self._jobs[self.group_of[index]]
        if index in job.grads:
            raise RuntimeError(f"gradient of {self.names[index]!r} became ready twice in one step "
                               "(backward called twice before the optimizer step?)")
        job.grads[index] = (grad, grad.sparse_dim() if grad.is_sparse else None)
        self._launch_ready_groups()

    def _launch_ready_groups(self, everything: bool = False) -> None:
        # Strictly in group order, so every rank issues the same sequence on the lane.
        while self._next_group < len(self._jobs):
            job = self._jobs[self._next_group]
            if not everything and len(job.grads) < len(job.members):
                return
            if self.lane is not None:
                job.future = self.lane.submit(self._run_job, job)
            self._next_group += 1

    def _run_job(self, job: GroupJob) -> list[tuple[int, torch.Tensor, int]]:
        with self.record_phases(job.phases):
            return self._sync_group(job)

    def _sync_group(self, job: GroupJob) -> list[tuple[int, torch.Tensor, int | None]]:
        """One fused group: its unit sets in one index space, synced; (member, average, summed units)."""
        sets = self.sets_in(job.members)
        width, dtype = self.set_width(sets[0]), self.params[job.members[0]].dtype
        with self.timed("encode"):
            offsets, ids, values = self.encode_units(job, sets, width, dtype)
        total_ids, total_values = self.sync_sparse(job.members, offsets[-1], width, ids, values)
        with self.timed("decode"):
            return self.decode_units(job, sets, offsets, total_ids, total_values)

    def encode_units(self, job: GroupJob, sets: list[tuple[int, ...]], width: int, dtype: torch.dtype,
                     start: int = 0) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """``sets``' local units laid end to end from id ``start``: (each set's first id and the end,
        ids ascending, rows of ``width`` scaled by 1/n)."""
        offsets, ids, values = [start], [], []
        for members in sets:
            offsets.append(offsets[-1] + self.units(members[0]))
            local = self._local_units(job, members, width, dtype)
            if local is None:  # no gradient this step on this rank: contribute nothing
                continue
            ids.append(local[0] + offsets[-2])
            # Scale before summing, as the dense path does, so exact data gives the same bits.
            values.append(local[1] * (1.0 / self.world_size))
        ids = torch.cat(ids) if ids else torch.empty(0, dtype=torch.int64, device=self.device)
        values = torch.cat(values) if values else torch.empty((0, width), dtype=dtype, device=self.device)
        return offsets, ids, values

    def _local_units(self, job: GroupJob, members: tuple[int, ...], width: int,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A unit set's units on this rank: each member's row side by side under one id, zeros where a
        member lacks the row (None: no member has a gradient)."""
        present = [i for i in members if i in job.grads]
        if not present:
            return None
        if len(members) == 1:
            return units_of(job.grads[members[0]][0], width)
        parts = {i: units_of(job.grads[i][0], self.unit_width(i)) for i in present}
        ids = parts[present[0]][0]
        if len(present) == len(members) and all(torch.equal(parts[i][0], ids) for i in present[1:]):
            return ids, torch.cat([parts[i][1] for i in members], dim=1)  # the usual case: the same rows
        ids = torch.unique(torch.cat([parts[i][0] for i in present]))
        rows = torch.zeros((ids.numel(), width), dtype=dtype, device=ids.device)
        column = 0
        for i in members:
            if i in parts:
                rows[torch.searchsorted(ids, parts[i][0]), column: column + self.unit_width(i)] = parts[i][1]
            column += self.unit_width(i)
        return ids, rows

    def decode_units(self, job: GroupJob, sets: list[tuple[int, ...]], offsets: list[int], total_ids: torch.Tensor,
                     total_values: torch.Tensor) -> list[tuple[int, torch.Tensor, int | None]]:
        """The summed units of ``sets`` (ids from ``offsets[0]``, any order) back into each member's
        gradient, in its own layout: (member, average, summed units)."""
        if total_ids.numel() > 1 and not bool((total_ids[1:] > total_ids[:-1]).all()):
            order = torch.argsort(total_ids)
            total_ids, total_values = total_ids[order], total_values[order]
        cuts = torch.searchsorted(total_ids, torch.tensor(offsets, device=total_ids.device)).tolist()
        out = []
        for k, members in enumerate(sets):
            ids, rows = total_ids[cuts[k]: cuts[k + 1]] - offsets[k], total_values[cuts[k]: cuts[k + 1]]
            column = 0
            for i in members:
                mine_ids, mine = ids, rows
                if len(members) > 1:  # its columns; its rows whose sum is zero dropped, as alone
                    mine = rows[:, column: column + self.unit_width(i)]
                    column += self.unit_width(i)
                    keep = (mine != 0).any(dim=1)  # NaN != 0
                    if not bool(keep.all()):
                        mine_ids, mine = ids[keep], mine[keep]
                sparse_dim = job.grads[i][1] if i in job.grads else self.routes[i].sparse_dim
                out.append((i, grad_of(mine_ids, mine, self.params[i], sparse_dim, ids_sorted=True), mine_ids.numel()))
        return out

    def finish(self) -> None:
        super().finish()  # dense buckets first: they were launched during backward
        self._launch_ready_groups(everything=True)
        drifted = False
        for job in self._jobs:
            if job.future is None:
                results = self._sync_group(job)
            else:
                start = clock.now()
                results = job.future.result()
                self.fold_phases(job.phases, (start, clock.now()))
            for i, grad, summed in results:
                self.params[i].grad = grad
                drifted |= summed is not None and self._drifted(i, summed)
            job.grads, job.future, job.phases = {}, None, []
        self._next_group = 0
        if self._profile_left:
            self._profile()
        elif drifted:
            self._profile_left, self._samples = self.profile_steps, 0

    def _sparse_groups(self) -> list[list[int]]:
        """The unit sets on the lane fused by :meth:`group_key`, in backward order: one push and one
        pull per group, so the per-message latency is paid once, not once per tensor."""
        groups: dict[Any, list[list[int]]] = {}
        filled: dict[Any, int] = {}  # units in each key's last group
        for members in self.lane_sets():
            units, key = self.index_units(members), self.group_key(members[0])
            if units > self.max_group_units:
                raise ValueError(f"{self.names[members[0]]} has {units} units, more than the {self.max_group_units} "
                                 f"its sparse indices can address on the wire; keep it dense (sync.sparse_params)")
            chain = groups.setdefault(key, [[]])
            # Past the wire's index range a new group starts, rather than indices wrapping around.
            if filled.get(key, 0) + units > self.max_group_units:
                chain.append([])
                filled[key] = 0
            chain[-1] += members
            filled[key] = filled.get(key, 0) + units
        return sorted((group for chain in groups.values() for group in chain), key=self.ready_position)

    def lane_sets(self) -> list[tuple[int, ...]]:
        """The unit sets synced on the lane, in backward order (a set where its last member is ready)."""
        return sorted({self.unit_set(i) for i in range(len(self.params)) if self.on_lane(i)}, key=self.ready_position)

    def ready_position(self, members: Sequence[int]) -> int:
        """Where in backward order the last of ``members`` becomes ready."""
        return max(self._position[i] for i in members)

    def index_units(self, members: Sequence[int]) -> int:
        """The ids a unit set takes in its group's index space on the wire."""
        return self.units(members[0]) if self.routes[members[0]].sparse else 0

    def group_key(self, index: int) -> Any:
        """Unit sets with equal keys are fused: same dtype and unit width (subclasses add their scheme)."""
        return str(self.params[index].dtype), self.set_width(self.unit_set(index))

    def _drifted(self, index: int, summed_units: int) -> bool:
        """Has the summed density (identical on every rank) left its profile by reprofile_drift?"""
        if self.reprofile_drift is None or self.routes[index].density is None:
            return False
        summed, profiled = self.summed_size(index, summed_units)
        ratio = max(1.0, summed) / max(1.0, profiled)
        return not 1 / self.reprofile_drift <= ratio <= self.reprofile_drift

    def summed_size(self, index: int, summed_units: int) -> tuple[float, float]:
        """The sum's size this step and as profiled, in one unit (override where routing counts
        another unit)."""
        route = self.routes[index]
        return summed_units, route.density * (1.0 if route.gamma is None else route.gamma) * self.units(index)

    def sync_sparse(self, group: list[int], units: int, width: int, ids: torch.Tensor,
                    values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Global sum of every rank's units (``ids`` < ``units``, rows ``values`` of ``width``) over the
        fused index space of ``group``, as (distinct ids, rows) in any order (override). Runs on the
        lane when overlapping: collectives go through :attr:`sparse_comm`."""
        raise NotImplementedError

    # -- the cost model ---------------------------------------------------------------------------
    def scheme_cost(self) -> Any:
        """This scheme's cost object (override): ``traffic(sparsity, exchanges)``, the bytes and
        rounds of one tensor (:mod:`.traffic`)."""
        raise NotImplementedError

    @property
    def exchanges(self) -> Exchanges:
        """How many rounds a message takes in an exchange on :attr:`sparse_comm` (before set-up: as
        where sizes go first)."""
        return Exchanges(self.sparse_comm.piece_bytes if hasattr(self, "sparse_comm") else None)

    def round_costs(self, n: int | None = None) -> RoundCosts:
        """The price list routing uses: each kind of round as measured on the sync group (where
        ``network_latency`` is measured), else the configured alpha per message step among ``n``
        participants (default: every rank)."""
        rounds = self.measured_rounds
        if rounds is None:
            return RoundCosts.textbook(self.network, n or self.world_size)
        return RoundCosts(self.network.bandwidth_bps, rounds["exchange_round_s"], rounds["swap_s"],
                          rounds["allreduce_s"], rounds["allgather_s"])

    def sparse_traffic(self, index: int) -> Traffic:
        """What one profiled tensor's unit set moves on the sparse path, per worker (override to refine)."""
        return self.set_traffic(self.unit_set(index))

    def set_traffic(self, members: Sequence[int]) -> Traffic:
        """What a unit set moves on the sparse path, per worker (override to refine)."""
        return self.scheme_cost().traffic(self.set_sparsity(members), self.exchanges)

    def dense_bytes(self, index: int) -> float:
        """Bytes per worker of one tensor in a dense bucket: a ring allreduce's (override where the
        sparse scheme is priced over another split). Its bucket's allreduce is paid whatever it holds."""
        p = self.params[index]
        return 2 * (self.world_size - 1) / self.world_size * p.numel() * p.element_size()

    def group_rounds(self, group: list[int]) -> int:
        """Collectives one fused group issues on the busiest rank, as its scheme's cost object counts them."""
        return self.sparse_traffic(group[0]).rounds

    def collectives_per_step(self) -> int:
        """The collectives a step issues on the busiest rank once routed (no profiling step): one per
        dense bucket and each sparse group's rounds. The run's ledger must count the same."""
        if self.world_size == 1:
            return 0
        return len(self.buckets) + sum(self.group_rounds(group) for group in self.groups)

    def report(self) -> dict[str, Any]:
        return {**super().report(), "routing": self.routing()}

    def summary_fields(self) -> dict[str, Any]:
        return {**super().summary_fields(), "collectives_priced": self.collectives_per_step(),
                "latency_s": self.network.latency_s, "bandwidth_bps": self.network.bandwidth_bps,
                "measured_rounds": self.measured_rounds, "route_margin": self.route_margin,
                "route_decisions": self.route_decisions}

    def may_route(self, members: Sequence[int]) -> tuple[bool, bool]:
        """(may go sparse, may stay dense) for these tensors under ``sparse_params`` and ``route``:
        a listed tensor, or under ``route: sparse`` one with a sparse gradient or at most half its units
        non-zero, goes sparse; the others stay dense; ``route: auto`` leaves both to the cost model."""
        if self.sparse_params != "auto":
            listed = [self.names[i] in self.sparse_params for i in members]
            return all(listed), not any(listed)
        if self.route == "sparse":
            forced = [self.routes[i].sparse_dim is not None or self.names[i] in self.sparse_grads
                      or (1.0 if self.routes[i].density is None else self.routes[i].density) <= FORCED_DENSITY
                      for i in members]
            return all(forced), not any(forced)
        return True, True

    def decide_routes(self) -> None:
        """Each routing set's path (override where tensors share rounds): sparse where the cost model
        rates its scheme faster than dense allreduce, decided robustly (:func:`.traffic.decide`)."""
        self.route_decisions = []
        if self.world_size == 1 and self.sparse_params == "auto":
            self._choose_sparse(())
            return
        costs, chosen = self.round_costs(), []
        for members in self.routing_sets():
            may_sparse, may_dense = self.may_route(members)
            if may_sparse and may_dense:
                dense = sum(self.dense_bytes(i) for i in members)
                traffic = self.set_traffic(members)
                options = {"dense": Option(dense, costs.wire_seconds(dense)),
                           "sparse": Option(traffic.nbytes, traffic.seconds(costs))}
                incumbent = ("sparse" if self.routes[members[0]].sparse else "dense") if self.profiles > 1 else None
                decision = decide(options, self.route_margin, incumbent)
                self.route_decisions.append({"tensors": [self.names[i] for i in members], **decision})
                may_sparse = decision["chosen"] == "sparse"
            if may_sparse:
                chosen += members
        self._choose_sparse(chosen)

    # -- profiling and routing -------------------------------------------------------------------
    def _observe(self, index: int, grad: torch.Tensor) -> None:
        """Record one local gradient's non-zero elements and rows for the profile."""
        route = self.routes[index]
        route.seen, route.sparse_dim = True, grad.sparse_dim() if grad.is_sparse else None
        width = self.row_width(index)
        rows, _ = units_of(grad, width)
        elements = rows.numel() * width if grad.is_sparse else int(torch.count_nonzero(grad.reshape(-1) != 0))
        self._local[index] = (elements, rows)

    def _footprint(self, grad: torch.Tensor | None, index: int) -> tuple[int, int]:
        """(non-zero elements, non-zero rows) of a gradient (the sum, after this step's sync)."""
        if grad is None:
            return 0, 0
        width = self.row_width(index)
        rows = units_of(grad, width)[0].numel()
        return (rows * width if grad.is_sparse else int(torch.count_nonzero(grad.reshape(-1) != 0))), rows

    def _profile(self) -> None:
        """Fold this step's densities into the profile (collective: every rank calls it together)."""
        everyone = range(len(self.params))
        local = torch.tensor([[self._local[i][0], self._local[i][1].numel()] if i in self._local else [0, 0]
                              for i in everyone], dtype=torch.float64).reshape(-1, 2)
        summed = [self._footprint(p.grad, i) for i, p in enumerate(self.params)]
        # Per candidate pair of tables: did their row sets differ on this rank? (Summed with the figures.)
        rows_of = {i: self._local[i][1] if i in self._local else torch.empty(0, dtype=torch.int64)
                   for pair in self._row_pairs for i in pair}
        differ = torch.tensor([float(not torch.equal(rows_of[i], rows_of[j])) for i, j in self._row_pairs],
                              dtype=torch.float64)
        figures = torch.cat([local.reshape(-1), differ])
        if self.world_size > 1:
            self.comm.allreduce(figures).wait()  # accounted: profiling traffic is real traffic
        local, differ = figures[:local.numel()].view_as(local) / self.world_size, figures[local.numel():]
        fresh = self._samples == 0
        earlier = getattr(self, "_rows_differ", None)  # this round's steps so far (none after a resume)
        self._rows_differ = differ if fresh or earlier is None or earlier.shape != differ.shape else earlier + differ
        weight = self._samples / (self._samples + 1)  # running mean over this round's steps
        mean_units = {}
        for i in everyone:
            route = self.routes[i]
            elements, rows = float(local[i, 0]), float(local[i, 1])
            width = self._decide_width(i, elements, rows)
            if fresh:
                route.width = width
            units = rows if route.width == self.row_width(i) else elements
            summed_units = summed[i][1] if route.width == self.row_width(i) else summed[i][0]
            mean_units[i] = units
            d = units / self.units(i)
            gamma = summed_units / units if units > 0 else 1.0
            route.density = d if fresh else weight * route.density + (1 - weight) * d
            route.gamma = gamma if fresh else weight * route.gamma + (1 - weight) * gamma
        unions = self._profile_unions(mean_units)
        if fresh:  # a tensor no longer a candidate must not keep, nor later blend in, the last round's gammas
            for route in self.routes:
                route.gammas = None
        for i, new in unions.items():
            old = self.routes[i].gammas if not fresh else None
            self.routes[i].gammas = new if old is None else [weight * a + (1 - weight) * b
                                                             for a, b in zip(old, new, strict=True)]
        self._local.clear()
        self._samples += 1
        self._profile_left -= 1
        if self._profile_left == 0:
            self.profiles += 1
            self._samples = 0
            self.shared_rows = self._tables_sharing_rows()
            self._route()

    def _row_sharing_candidates(self) -> list[tuple[int, int]]:
        """Pairs of tables that may share row ids: gradients declared sparse (the same on every rank,
        so every rank profiles the same pairs), as many rows, one dtype."""
        if not self.shares_rows or self.world_size == 1:
            return []
        tables = [i for i, name in enumerate(self.names) if name in self.sparse_grads and self.params[i].dim() >= 2]
        return [(i, j) for k, i in enumerate(tables) for j in tables[k + 1:]
                if self.params[i].shape[0] == self.params[j].shape[0] and self.params[i].dtype == self.params[j].dtype]

    def _tables_sharing_rows(self) -> list[tuple[int, ...]]:
        """The tables whose row sets were identical on every rank in every step of this profile (and
        not empty), as sets: equality is transitive, so each is a clique of such pairs."""
        leader: dict[int, int] = {}  # pairs come first index first: a table's leader is known before it leads
        for (i, j), differ in zip(self._row_pairs, self._rows_differ.tolist(), strict=True):
            rows = all(self.unit_width(k) == self.row_width(k) and (self.routes[k].density or 0.0) > 0 for k in (i, j))
            if differ == 0 and rows and j not in leader:
                leader[j] = leader.get(i, i)
        sets: dict[int, list[int]] = {}
        for j, first in leader.items():
            sets.setdefault(first, [first]).append(j)
        return sorted(tuple(sorted(members)) for members in sets.values())

    def _decide_width(self, index: int, elements: float, rows: float) -> int:
        """Rows for sparse gradients; for dense ones rows when sending them beats sending elements."""
        width = self.row_width(index)
        if self.routes[index].sparse_dim is not None or width == 1:
            return width
        value = self.params[index].element_size()
        return width if elements * (INDEX_BYTES + value) >= rows * (INDEX_BYTES + width * value) else 1

    def _profile_unions(self, mean_units: dict[int, float]) -> dict[int, list[float]]:
        """gamma_{2^i} per candidate tensor from this step's non-zero units (power-of-two n only),
        where the units are the profiled rows (tensors counted in single elements of wider rows keep
        the bound min(2^i, gamma_n))."""
        if not self._doubling_profiled():
            return {}
        candidates = [i for i in range(len(self.params)) if self.unit_width(i) == self.row_width(i)
                      and 0 < mean_units[i] < 0.5 * self.units(i)]
        if not candidates:
            return {}
        empty = torch.empty(0, dtype=torch.int64)
        stages = union_counts(self.comm, [self._local[i][1].cpu() if i in self._local else empty for i in candidates])
        # Average each group's union over all ranks (members of a group report the same count).
        mean_union = torch.tensor(stages, dtype=torch.float64)
        self.comm.allreduce(mean_union).wait()
        mean_union /= self.world_size
        gammas = {}
        for k, i in enumerate(candidates):
            per_stage = [float(mean_union[s, k]) / mean_units[i] for s in range(len(stages))]
            # Ranks' densities differ, so clip to gamma_k's definition range [1, k].
            gammas[i] = [1.0] + [min(2.0 ** (s + 1), max(1.0, g)) for s, g in enumerate(per_stage)]
        return gammas

    def _doubling_profiled(self) -> bool:
        n = self.world_size
        return self.profiles_doubling and n > 1 and n & (n - 1) == 0

    def _route(self) -> None:
        if self.world_size > 1 and (self.measure_latency or self.measure_bandwidth):
            self._measure_network()  # every rank: _route runs after a collective profile
        self.decide_routes()
        self.on_setup()  # rebuild the dense buckets without the sparse tensors, and the sparse groups

    def _measure_network(self) -> None:
        """Once, on every rank alike: the routing's alpha and/or beta as the sync group shows them."""
        latency, bandwidth = self.network.latency_s, self.network.bandwidth_bps
        if self.measure_latency:
            probe = probe_latency(self.comm.group, self.world_size, self.network.bandwidth_bps)
            kinds = ("exchange_round_s", "swap_s", "allreduce_s", "allgather_s")
            latency, *rounds = self.agreed([probe["exchange_alpha_s"], *(probe[kind] for kind in kinds)])
            self.measured_rounds = {**dict(zip(kinds, rounds, strict=True)), "calls": probe["calls"]}
        if self.measure_bandwidth:
            bandwidth, = self.agreed([probe_bandwidth(self.comm.group, self.world_size)])
        self.network = dataclasses.replace(self.network, latency_s=latency, bandwidth_bps=bandwidth)
        self.measure_latency = self.measure_bandwidth = False  # re-profiles keep it: every rank stays in step

    def agreed(self, values: list[float], slowest: bool = False) -> list[float]:
        """Rank 0's ``values`` on every rank (``slowest``: the largest of every rank's): measurements
        differ between ranks, routes must not."""
        if self.world_size == 1:
            return values
        tensor = torch.tensor(values, dtype=torch.float64)
        # One-off, outside the accounted traffic, like the backward order: set-up, not sync.
        if slowest:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.comm.group)
        else:
            dist.broadcast(tensor, src=self.comm._global(0), group=self.comm.group)
        return tensor.tolist()

    def routing(self) -> dict[str, dict[str, Any]]:
        """Per parameter: path, whether its gradient arrives sparse, unit width, profiled density and
        gammas (for logs, reports and summary.json)."""
        table = {self.names[i]: {"path": "sparse" if route.sparse else "dense",
                                 "sparse_grad": route.sparse_dim is not None,
                                 "width": self.unit_width(i), "density": route.density,
                                 "gamma": route.gamma, "gammas": route.gammas}
                 for i, route in enumerate(self.routes)}
        for i in range(len(self.params)):
            if len(self.unit_set(i)) > 1:  # synced as one unit set with these
                table[self.names[i]]["shares_rows_with"] = [self.names[k] for k in self.unit_set(i) if k != i]
        return table

    def state_dict(self) -> dict[str, Any]:
        measured = self.measure_latency or self.measure_bandwidth
        return {**super().state_dict(), "sparse": self.sparse, **self._figures(("density", "width")),
                "carried": [i for i, route in enumerate(self.routes) if route.carried],
                "shared_rows": [list(members) for members in self.shared_rows],
                "route_decisions": self.route_decisions,
                "layout": {i: route.sparse_dim for i, route in enumerate(self.routes) if route.seen},
                "latency_s": None if measured else self.network.latency_s,
                "bandwidth_bps": None if measured else self.network.bandwidth_bps,
                "measured_rounds": None if measured else self.measured_rounds,
                **self._figures(("gamma", "gammas")), "profiles": self.profiles,
                "profile_left": self._profile_left, "samples": self._samples}

    def _figures(self, names: Sequence[str]) -> dict[str, dict[int, Any]]:
        """Per figure name, {parameter index: value} where it was profiled (the checkpoint's form)."""
        return {name: {i: getattr(route, name) for i, route in enumerate(self.routes)
                       if getattr(route, name) is not None} for name in names}

    def load_routes(self, state: dict[str, Any]) -> None:
        """The per-tensor figures and paths a checkpoint holds (subclasses add theirs)."""
        self.routes = [TensorRoute() for _ in self.params]
        self._choose_sparse(state["sparse"])
        for i in state.get("carried", []):
            self.routes[int(i)].carried = True
        self.shared_rows = [tuple(members) for members in state.get("shared_rows", [])]
        self.route_decisions = list(state.get("route_decisions", []))
        for name, figures in (("density", state["density"]), ("gamma", state["gamma"]),
                              ("width", state.get("width", {})), ("gammas", state.get("gammas", {}))):
            for i, value in figures.items():
                setattr(self.routes[int(i)], name, int(value) if name == "width" else list(value) if name == "gammas"
                        else value)
        for i, sparse_dim in state.get("layout", {}).items():
            self.routes[int(i)].seen, self.routes[int(i)].sparse_dim = True, sparse_dim

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.load_routes(state)
        if state.get("latency_s") is not None:  # the routing's network, measured or configured
            self.network = dataclasses.replace(self.network, latency_s=state["latency_s"],
                                               bandwidth_bps=state.get("bandwidth_bps") or self.network.bandwidth_bps)
            self.measure_latency = self.measure_bandwidth = False
            self.measured_rounds = state.get("measured_rounds")  # the rounds it priced, or its alpha's textbook
        self.profiles = int(state.get("profiles", 1 if self.sparse else 0))
        self._profile_left = int(state.get("profile_left", max(0, self.profile_steps - int(state["steps"]))))
        self._samples = int(state.get("samples", 0))
        super().load_state_dict(state)
