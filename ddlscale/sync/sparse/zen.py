"""Zen: near-optimal sparse synchronization — Balanced Parallelism or Hierarchical Centralization.

Zen works on the gradient's units (:mod:`.rows`): an embedding's rows, one index each, or single
elements where zeros are scattered. Balanced Parallelism (BP): each tensor's non-zero units are split
among all workers acting as servers by a fixed hash h0 of the unit's index (:class:`HashPartitioner`),
so every worker pushes ~1/n of its units to each server and every server owns ~1/n of the union —
balanced push and pull whatever the skew. Servers sum what they receive; workers pull the sums back
as COO or as a hash bitmap, whichever is smaller for the tensor's profiled density. Per-worker bytes
for M units of u bytes (an int32 index and a row: a pair of 4 + u bytes): COO pull
(4 + u) d M (1 + gamma_n)(n-1)/n, bitmap pull (n-1)/n M ((4 + u) d + u gamma_n d + 1/8); with fp32
elements (u = 4) these are SYSTEMS.md's 8 d M (1 + gamma_n)(n-1)/n and (n-1)/n M (8d + 4 gamma_n d + 1/8).
A push and a pull are one exchange each (:meth:`Communicator.exchange`: each message carries its own
length): two rounds of messages per group. With ``batch: backward`` or ``step`` every BP tensor of a
step is one group whatever its width and dtype (:mod:`.sections`: one index space, a section per
width, dtype and pull format), so a step pays two rounds, or a few more where ``backward`` cuts the
batch to overlap backward's computation (:meth:`ZenSync._sparse_groups`).

Hierarchical Centralization (HC): recursive doubling with merging (:mod:`.recursive`), cheap when
the workers' index sets overlap (small gamma_{2^i}). Per tensor, Zen takes the scheme the T_bp and
T_hc formulas rate faster on the profiled d and gamma_{2^i}, each charged the messages it sends;
tensors whose density makes any sparse scheme slower than dense allreduce stay dense. T_hc also
pays its merges, at the rate measured on the sync's device when routing (on a GPU the paper's merges
are nearly free; on a CPU they can outweigh the messages HC saves). With ``network_latency:
measured`` the alpha is what a message step costs on the cluster.

Hierarchical mode (``hierarchical=True``, the paper's multi-GPU machines): a dense reduce-scatter
inside each machine leaves local rank j with chunk j of the machine's sum (the paper uses NVLink for
this: it is the one place a sparse tensor goes through its dense rows); the sparse scheme then
runs across machines among the ranks holding the same chunk; a dense allgather inside the machine
completes the tensor. The plan is made for the machine-level density gamma_k d over m machines, and
dense allreduce is priced over the same split (a ring among machines on the chunk), so the two
compare like with like; the steps inside the machine are the same for both and cancel out.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ddlscale import clock
from ddlscale.comm import Communicator
from ddlscale.comm.network import NetworkModel
from ddlscale.sync.sparse import kernels, pushpull, sections
from ddlscale.sync.sparse.base import GroupJob, SparseSync
from ddlscale.sync.sparse.config import ZenConfig
from ddlscale.sync.sparse.hashing import HashPartitioner, agreed_seed
from ddlscale.sync.sparse.pushpull import INDEX_BYTES
from ddlscale.sync.sparse.recursive import SparseDoubling
from ddlscale.sync.sparse.rows import units_of
from ddlscale.sync.sparse.traffic import (
    PUSH_PULL_ROUNDS,
    Exchanges,
    Sparsity,
    Traffic,
    coo_bytes,
    doubling_rounds,
    doubling_seconds,
    partitioned_seconds,
)


def bitmap_bytes(s: Sparsity) -> float:
    """Push as pairs; pull as a hash bitmap (M/8 bytes in all) and the summed rows:
    (n-1)/n M ((4 + u) d + u gamma_n d + 1/8) bytes per worker."""
    return (s.n - 1) / s.n * s.units * ((INDEX_BYTES + s.unit_bytes) * s.density + s.unit_bytes * s.gamma * s.density
                                        + 1 / 8)


class ZenCost:
    """What Zen moves for one tensor under each of its schemes: Balanced Parallelism with a COO pull
    (``bp-coo``, SYSTEMS.md's T_bp) or a hash-bitmap pull (``bp-bitmap``), and Hierarchical
    Centralization (``hc``, T_hc), each with the messages it sends; ``scheme`` and ``pull`` limit
    them as ``sync.scheme`` and ``sync.pull`` do. HC also pays its merges at ``merge_s_per_byte``."""

    def __init__(self, scheme: str = "auto", pull: str = "auto", merge_s_per_byte: float = 0.0):
        self.scheme, self.pull, self.merge_s_per_byte = scheme, pull, merge_s_per_byte

    def traffics(self, s: Sparsity, exchanges: Exchanges) -> dict[str, Traffic]:
        """Per scheme this tensor may take: its traffic (HC only where gamma_{2^i} were profiled,
        unless forced)."""
        out = {}
        push = exchanges.steps(s.n, s.density * s.units / s.n * s.pair_bytes)
        if self.scheme != "hc":
            if self.pull != "bitmap":
                pull = exchanges.steps(s.n, s.gamma * s.density * s.units / s.n * s.pair_bytes)
                out["bp-coo"] = Traffic(coo_bytes(s), push + pull, PUSH_PULL_ROUNDS)
            if self.pull != "coo":
                pull = exchanges.steps(s.n, (s.units / 8 + s.gamma * s.density * s.units * s.unit_bytes) / s.n)
                out["bp-bitmap"] = Traffic(bitmap_bytes(s), push + pull, PUSH_PULL_ROUNDS)
        if self.scheme == "hc" or (self.scheme == "auto" and s.gammas is not None):
            out["hc"] = self.hc(s, exchanges)
        return out

    def hc(self, s: Sparsity, exchanges: Exchanges) -> Traffic:
        """T_hc over the largest power of two of participants, plus folding the others in and out:
        stage i sends the merged units of 2^i workers (gamma_{2^i} d M pairs) in one message."""
        core = 1 << (s.n.bit_length() - 1)
        stages = core.bit_length() - 1
        # Measured gamma_{2^i} where profiled (power-of-two n), else the bound min(2^i, gamma_n).
        gammas = s.gammas or [max(1.0, min(2.0**i, s.gamma)) for i in range(stages + 1)]
        stage_bytes = [g * s.density * s.units * s.pair_bytes for g in gammas[:stages]]
        nbytes, messages = sum(stage_bytes), sum(exchanges.steps(2, b) for b in stage_bytes)
        if core < s.n:  # fold one worker's set in, and the sum out
            fold = [s.density * s.units * s.pair_bytes, s.gamma * s.density * s.units * s.pair_bytes]
            nbytes += sum(fold)
            messages += sum(exchanges.steps(2, b) for b in fold)
        # Each stage merges two partial sums on the CPU (measured cost).
        return Traffic(nbytes, messages, doubling_rounds(s.n), self.merge_s_per_byte * 2 * sum(stage_bytes))

    def projected_seconds(self, model: NetworkModel, sets: Sequence[torch.Tensor], numel: int,
                          unit_bytes: int) -> float:
        """From every worker's index set: BP through the hash partition, each server pulling COO or
        hash bitmap, whichever is smaller, or HC's doubling, whichever is faster."""
        n, pair = len(sets), INDEX_BYTES + unit_bytes
        hashing = HashPartitioner(n)
        owned = torch.bincount(hashing.server_of(torch.arange(numel)), minlength=n).tolist()

        def pull(server: int, mine: torch.Tensor) -> float:
            coo, bitmap = mine.numel() * pair, owned[server] / 8 + mine.numel() * unit_bytes
            return {"coo": coo, "bitmap": bitmap}.get(self.pull, min(coo, bitmap))
        bp = partitioned_seconds(model, sets, hashing.server_of, n, pair, pull)
        hc = doubling_seconds(model, sets, numel, unit_bytes, dense_threshold=None)
        return {"bp": bp, "hc": hc}.get(self.scheme, min(bp, hc))


def merge_seconds_per_byte(rows: int = 1 << 12, width: int = 16, calls: int = 5, budget_s: float = 0.05,
                           device: torch.device | str = "cpu") -> float:
    """Seconds per (index, row) byte of HC's merge of two sorted row sets on ``device`` (median of at
    least ``calls``, timed for at least ``budget_s`` so that ranks measuring together overlap)."""
    generator = torch.Generator().manual_seed(0)
    sets = [(torch.randperm(rows * 8, generator=generator)[:rows].sort().values.to(device),
             torch.ones(rows, width, device=device)) for _ in range(2)]
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    times: list[float] = []
    deadline = clock.now() + budget_s
    while len(times) < calls or clock.now() < deadline:
        start = clock.now()
        kernels.merge_rows(*sets[0], *sets[1])
        sync()
        times.append(clock.now() - start)
    return statistics.median(times) / (2 * rows * (INDEX_BYTES + 4 * width))


class ZenSync(SparseSync):
    """``sync=zen``. Args beyond :class:`SparseSync`'s:

    scheme: ``"auto"`` (per tensor, BP or HC by the cost formulas), ``"bp"`` or ``"hc"``.
    pull: BP's pull format — ``"auto"`` (per tensor, the smaller of COO and hash bitmap), ``"coo"``
        or ``"bitmap"``.
    seed: the hash seed; ``None`` draws one on rank 0. Every rank uses rank 0's, checked by a
        fingerprint collective at set-up.
    hierarchical: dense inside a machine, sparse across machines (see the module doc).
    local_size: ranks per machine for the hierarchical mode (``None``: ``LOCAL_WORLD_SIZE``, as
        torchrun and Lightning set it); ranks r*k .. r*k+k-1 share machine r.
    batch: which BP tensors share a push and a pull: ``"backward"`` (all of them, whatever their
        width and dtype (:mod:`.sections`), split only where backward, as profiled, computes longer
        between two of them than a batch's rounds cost: there the earlier batch syncs meanwhile),
        ``"step"`` (all of them: two rounds a step), ``"width"`` (those of one dtype, width and pull
        format) or ``"tensor"`` (each alone). HC tensors fuse by dtype and width.
    """

    schema = ZenConfig  # its keys and their checks

    profiles_doubling = True

    def __init__(self, scheme: str = "auto", pull: str = "auto", seed: int | None = 0x5EED,
                 hierarchical: bool = False, local_size: int | None = None, batch: str = "backward", **kwargs):
        ZenConfig(scheme=scheme, pull=pull, seed=seed, hierarchical=hierarchical, local_size=local_size, batch=batch,
                  **kwargs)
        super().__init__(**kwargs)
        self.scheme, self.pull, self.seed, self.batch = scheme, pull, seed, batch
        self.hierarchical, self.local_size = bool(hierarchical), local_size
        self.merge_s_per_byte = 0.0  # HC's merge on this device, measured when routing with scheme auto
        self._ready_at: dict[int, float] = {}  # profiling: when each gradient became ready this step
        self._hooks_s = 0.0  # ... and the time spent in the hooks before it
        self.ready_offsets: dict[int, float] = {}  # as profiled, agreed: seconds after the step's first gradient

    def on_setup(self) -> None:
        if not hasattr(self, "partitioner"):
            seed = agreed_seed(self.seed, self.comm.group)
            self.partitioner = HashPartitioner(self.world_size, seed)
            self.partitioner.verify_agreement(self.comm.group)
            self.intra = self.inter = None
            if self.hierarchical and self.world_size > 1:
                self.local_size, self.intra, self.inter = self.machine_communicators(self.local_size)
                self.inter_partitioner = HashPartitioner(self.world_size // self.local_size, seed)
        super().on_setup()

    # -- the per-tensor plan: hc, bp-coo or bp-bitmap ---------------------------------------------
    def sparsity(self, index: int) -> Sparsity:
        """The profile as the sparse scheme sees it: over all ranks, or over machines (hierarchical)."""
        flat = super().sparsity(index)
        if not self.hierarchical or self.local_size in (None, 1):
            return flat
        k = self.local_size
        machines = self.world_size // k
        d, gamma, gammas = flat.density, flat.gamma, flat.gammas
        # A machine's sum has density gamma_k d; across machines it densifies by gamma_n / gamma_k.
        stage = k.bit_length() - 1
        exact = gammas is not None and 1 << stage == k
        gamma_k = gammas[stage] if exact else max(1.0, min(float(k), gamma))
        across = None
        if exact and len(gammas) > stage + 1:
            across = [max(1.0, min(2.0**i, g / gamma_k)) for i, g in enumerate(gammas[stage:])]
        return Sparsity(math.ceil(flat.units / k), min(1.0, gamma_k * d), max(1.0, min(machines, gamma / gamma_k)),
                        across, machines, flat.width, flat.unit_bytes)

    def scheme_cost(self) -> ZenCost:
        return ZenCost(self.scheme, self.pull, self.merge_s_per_byte)

    def plan_times(self, index: int) -> dict[str, float]:
        """The cost model's seconds for each scheme this tensor may take (SYSTEMS.md's T_bp, T_hc),
        each with the messages it sends."""
        traffics = self.scheme_cost().traffics(self.sparsity(index), self.exchanges)
        return {plan: traffic.seconds(self.network) for plan, traffic in traffics.items()}

    def plan(self, index: int) -> str:
        """This tensor's scheme (kept until the next profile): see :meth:`choose_plans`.
        A tensor forced sparse before its first profile pulls COO, or as ``scheme``/``pull`` say."""
        route = self.routes[index]
        if route.density is None:
            return "hc" if self.scheme == "hc" else "bp-bitmap" if self.pull == "bitmap" else "bp-coo"
        if route.plan is None:
            self.choose_plans([index, *(i for i in self.sparse if i != index)])
        return route.plan

    def batched(self) -> bool:
        """Do BP tensors of any width share a push and a pull (``batch: backward`` or ``step``, flat mode)?"""
        return self.batch in ("backward", "step") and not (self.hierarchical and self.local_size not in (None, 1))

    def on_grad_ready(self, index: int, param: torch.nn.Parameter) -> None:
        if not self._profile_left:
            super().on_grad_ready(index, param)
            return
        # Backward's own time between gradients: less what the hooks spent (profiling's counting
        # would otherwise pass for computation and cut batches that nothing overlaps).
        start = clock.now()
        self._ready_at[index] = start - self._hooks_s
        super().on_grad_ready(index, param)
        self._hooks_s += clock.now() - start

    def _profile(self) -> None:
        if self._ready_at:  # this step's readiness, relative to its first gradient (the last profiled step counts)
            first = min(self._ready_at.values())
            self.ready_offsets = {i: t - first for i, t in self._ready_at.items()}
            self._ready_at, self._hooks_s = {}, 0.0
        super()._profile()

    def _sparse_groups(self) -> list[list[int]]:
        """The fused groups; with ``batch: backward`` a BP batch is cut where backward computes, between
        two of its members' gradients, longer than the batch's push and pull cost: the members before
        the cut then sync during that computation (their rounds hidden) instead of all after it."""
        groups = super()._sparse_groups()
        if self.batch != "backward" or not self.batched() or not self.ready_offsets:
            return groups
        out = []
        for group in groups:
            if len(group) < 2 or self.plan(group[0]) == "hc" or any(i not in self.ready_offsets for i in group):
                out.append(group)
                continue
            rounds_s = max(self.scheme_cost().traffics(self.sparsity(i), self.exchanges)[self.plan(i)].messages
                           for i in group) * self.network.latency_s
            out.append([group[0]])
            for before, after in zip(group, group[1:], strict=False):
                if self.ready_offsets[after] - self.ready_offsets[before] > rounds_s:
                    out.append([])
                out[-1].append(after)
        return sorted(out, key=lambda group: self.backward_order.index(group[-1]))

    def choose_plans(self, indices: Sequence[int]) -> None:
        """Give each profiled tensor of ``indices`` without a plan the one that makes the step fastest.

        Alone, that is the fastest of :meth:`plan_times`. Batched, BP's two rounds are paid once for
        every BP tensor of the step, so a tensor's BP costs only its bytes once any tensor takes BP,
        and HC (whose rounds are its own) wins only where its stages beat that: the tensors choose
        together, between HC for those it beats BP's bytes on (BP's rounds paid if any stay) and HC
        for all (no BP round at all)."""
        todo = [i for i in dict.fromkeys(indices) if self.routes[i].density is not None and self.routes[i].plan is None]
        if not todo:
            return
        cost, exchanges, network = self.scheme_cost(), self.exchanges, self.network
        traffics = {i: cost.traffics(self.sparsity(i), exchanges) for i in todo}
        if not self.batched():
            for i in todo:
                self.routes[i].plan = min(traffics[i], key=lambda plan: traffics[i][plan].seconds(network))
            return
        bytes_only = {i: {plan: dataclasses.replace(t, messages=0).seconds(network) for plan, t in traffics[i].items()
                          if plan != "hc"} for i in todo}
        bp = {i: min(options, key=options.get) for i, options in bytes_only.items() if options}
        hc = {i: traffics[i]["hc"].seconds(network) for i in todo if "hc" in traffics[i]}
        # The batch's rounds: its push and pull, as many message steps as its largest member's.
        rounds = max((traffics[i][plan].messages for i, plan in bp.items()), default=0) * network.latency_s
        mixed = {i: "hc" if i not in bp or (i in hc and hc[i] < bytes_only[i][bp[i]]) else bp[i] for i in todo}
        stays_bp = any(plan != "hc" for plan in mixed.values())
        mixed_s = sum(hc[i] if plan == "hc" else bytes_only[i][plan] for i, plan in mixed.items()) + rounds * stays_bp
        chosen = mixed
        if stays_bp and len(hc) == len(todo) and sum(hc.values()) < mixed_s:
            chosen = dict.fromkeys(todo, "hc")
        for i, plan in chosen.items():
            self.routes[i].plan = plan

    def auto_sparse(self) -> list[int]:
        """Batched, a BP tensor does not pay its own rounds: the step's push and pull are paid once for
        every BP tensor, so pricing each tensor with them alone (the base's verdict) keeps dense what
        would ride the batch for its bytes. The tensors are routed together: each to the cheapest of
        dense, HC (its own stages) and BP (its bytes), the batch's rounds charged once if any takes BP,
        against the routing without a batch (each to dense or HC). Exact for this model where every BP
        plan takes as many message steps (flat: one exchange each way, COO or bitmap)."""
        if not self.batched():
            return super().auto_sparse()
        cost, network = self.scheme_cost(), self.network
        without, batched, steps = {}, {}, {}
        for i in range(len(self.params)):
            traffics = cost.traffics(self.sparsity(i), self.exchanges)
            dense = ("dense", self.dense_seconds(i))
            hc = ("hc", traffics["hc"].seconds(network)) if "hc" in traffics else dense
            without[i] = min(dense, hc, key=lambda option: option[1])
            bp = {plan: dataclasses.replace(t, messages=0).seconds(network) for plan, t in traffics.items()
                  if plan != "hc"}
            batched[i] = without[i]
            plan = min(bp, key=bp.get, default=None)
            if plan is not None and bp[plan] < without[i][1]:
                batched[i], steps[i] = ("bp", bp[plan]), traffics[plan].messages
        batch_s = sum(s for _, s in batched.values()) + max(steps.values(), default=0) * network.latency_s
        chosen = batched if steps and batch_s < sum(s for _, s in without.values()) else without
        return [i for i, (path, _) in chosen.items() if path != "dense"]

    def forget_plans(self) -> None:
        """Choose every tensor's scheme again, from the profile, when next asked."""
        for route in self.routes:
            route.plan = None

    def sparse_traffic(self, index: int) -> Traffic:
        """The traffic of the fastest of :meth:`plan_times`."""
        traffics = self.scheme_cost().traffics(self.sparsity(index), self.exchanges)
        return min(traffics.values(), key=lambda traffic: traffic.seconds(self.network))

    def dense_seconds(self, index: int) -> float:
        """Dense over the split the plans are priced on: all ranks, or the machines on one chunk
        (hierarchical; the machine's reduce-scatter and allgather would be the same on both paths)."""
        s = self.sparsity(index)
        return self.ring_seconds(s.units * s.unit_bytes // self.params[index].element_size(),
                                 self.params[index].element_size(), s.n)

    def _route(self) -> None:
        self.forget_plans()  # a new profile: choose again
        # New routes fuse new groups: drop the owned sets of the old groups' sizes.
        for partitioner in (self.partitioner, getattr(self, "inter_partitioner", None)):
            if partitioner is not None:
                partitioner.clear()
        if self.world_size > 1:
            # Rank 0's readiness on every rank: the batches it cuts must be the same everywhere.
            everyone = range(len(self.params))
            offsets = self.agreed([self.ready_offsets.get(i, -1.0) for i in everyone])
            self.ready_offsets = {i: t for i, t in zip(everyone, offsets, strict=True) if t >= 0}
        if self.world_size > 1 and self.scheme == "auto":
            # What HC pays beside its messages is its merges, which on a CPU cost more than the
            # messages it saves; priced at the rate this sync's device merges. Every rank merges at
            # once, as in HC's stages, and the slowest one counts, since each stage waits for it:
            # timed by rank 0 alone, emulated machines sharing cores saw a fraction of the real cost.
            dist.barrier(group=self.comm.group)
            self.merge_s_per_byte, = self.agreed([merge_seconds_per_byte(device=self.device)], slowest=True)
        super()._route()

    def group_key(self, index: int):
        plan = self.plan(index)
        if self.batch == "tensor":
            return ("tensor", index)
        if plan != "hc" and self.batched():
            return ("bp",)  # one push and one pull for every BP tensor: its sections are made per step
        return (*super().group_key(index), plan)

    def section_key(self, index: int) -> tuple[str, int, str]:
        """Members with one key share a section of a batch: dtype, unit width and plan."""
        return str(self.params[index].dtype), self.unit_width(index), self.plan(index)

    def group_rounds(self, group: list[int]) -> int:
        """Collectives one fused group issues on its busiest rank: a push and a pull, or HC's stages."""
        if self.plan(group[0]) == "hc":
            return self.scheme_cost().hc(self.sparsity(group[0]), self.exchanges).rounds
        return 2

    def _sync_group(self, job: GroupJob) -> list[tuple[int, torch.Tensor, int]]:
        if len({self.section_key(i) for i in job.members}) == 1:
            return super()._sync_group(job)
        return self._sync_sections(job)

    def _sync_sections(self, job: GroupJob) -> list[tuple[int, torch.Tensor, int]]:
        """A batch of BP tensors of several widths, dtypes or pull formats: one push, one pull."""
        by_key: dict[tuple, list[int]] = {}
        for i in job.members:
            by_key.setdefault(self.section_key(i), []).append(i)
        comm, parts, start = self.sparse_comm, [], 0
        with self.timed("encode"):
            for (_, width, plan), members in by_key.items():
                offsets, ids, values = self.encode_units(job, members, width, self.params[members[0]].dtype, start)
                parts.append((plan, members, offsets, ids, values))
                start = offsets[-1]
        received = sections.push(comm, [(ids, values) for *_, ids, values in parts], self.partitioner.group,
                                 self.timed)
        with self.timed("decode"):
            sums = [pushpull.aggregate(pieces) for pieces in received]
        owned: list[list[torch.Tensor] | None] = [None] * len(parts)
        if any(plan == "bp-bitmap" for plan, *_ in parts):
            everyone = self.partitioner.owned(start, self.device)
            owned = [sections.owned_in(everyone, offsets[0], offsets[-1]) if plan == "bp-bitmap" else None
                     for plan, _, offsets, *_ in parts]
        pulled = sections.pull(comm, sums, owned, self.timed)
        out = []
        with self.timed("decode"):
            for (_, members, offsets, *_), pieces in zip(parts, pulled, strict=True):
                out += self.decode_units(job, members, offsets, torch.cat([p[0] for p in pieces]),
                                         torch.cat([p[1] for p in pieces]))
        return out

    def sync_sparse(self, group: list[int], units: int, width: int, ids: torch.Tensor, values: torch.Tensor):
        plan = self.plan(group[0])
        if self.intra is not None:
            return self._sync_hierarchical(plan, units, width, ids, values)
        return self._sync_flat(self.sparse_comm, self.partitioner, plan, units, ids, values)

    def _sync_flat(self, comm: Communicator, partitioner: HashPartitioner, plan: str, units: int,
                   ids: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sparse scheme among ``comm``'s ranks: the global sum as (ids, rows)."""
        if plan == "hc":
            return SparseDoubling(comm, units, values.shape[1], values.dtype, None, self.timed).run(ids, values)
        received = pushpull.push(comm, ids, values, partitioner.group, self.timed)
        with self.timed("decode"):
            summed_ids, summed_values = pushpull.aggregate(received)
        if plan == "bp-bitmap":
            pieces = pushpull.pull_bitmap(comm, partitioner.owned(units, ids.device), summed_ids, summed_values,
                                          self.timed)
        else:
            pieces = pushpull.pull_coo(comm, summed_ids, summed_values, self.timed)
        with self.timed("decode"):
            return torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])

    def _sync_hierarchical(self, plan: str, units: int, width: int, ids: torch.Tensor, values: torch.Tensor):
        """Dense reduce-scatter in the machine, sparse across machines on this rank's chunk, dense allgather."""
        k = self.local_size
        chunk = math.ceil(units / k)
        with self.timed("encode"):
            machine_input = torch.zeros((chunk * k, width), dtype=values.dtype, device=values.device)
            machine_input[ids] = values
            mine = torch.empty((chunk, width), dtype=values.dtype, device=values.device)
        with self.timed("comm"):
            self.intra.reduce_scatter(mine, machine_input).wait()
        with self.timed("encode"):
            chunk_ids, chunk_values = units_of(mine, width)
        total_ids, total_values = self._sync_flat(self.inter, self.inter_partitioner, plan, chunk, chunk_ids,
                                                  chunk_values)
        with self.timed("decode"):
            summed = torch.zeros((chunk, width), dtype=values.dtype, device=values.device)
            summed[total_ids] = total_values
        with self.timed("comm"):
            pieces = self.intra.allgather(summed).wait()
        with self.timed("decode"):
            return units_of(torch.cat(pieces)[:units], width)

    def routing(self):
        table = super().routing()
        for i in self.sparse:
            table[self.names[i]]["plan"] = self.plan(i)
        return table

    def state_dict(self):
        # The plans too: mid re-profile they come from the last complete profile, not the partial one saved.
        return {**super().state_dict(), "seed": self.partitioner.seed, "merge_s_per_byte": self.merge_s_per_byte,
                "plans": self._figures(("plan",))["plan"], "ready_offsets": dict(self.ready_offsets)}

    def load_routes(self, state) -> None:
        super().load_routes(state)
        # Plans a checkpoint lacks are re-derived from the restored profile, identically on every rank.
        for i, plan in state.get("plans", {}).items():
            self.routes[int(i)].plan = plan
        # The readiness the batches were cut on (agreed: rank 0's), so a resumed run cuts them alike.
        self.ready_offsets = {int(i): float(t) for i, t in state.get("ready_offsets", {}).items()}

    def load_state_dict(self, state) -> None:
        self.merge_s_per_byte = float(state.get("merge_s_per_byte", 0.0))
        super().load_state_dict(state)
