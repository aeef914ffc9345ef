"""Zen: near-optimal sparse synchronization — Balanced Parallelism or Hierarchical Centralization.

Balanced Parallelism (BP): each tensor's non-zero indices are split among all workers acting as
servers by a fixed hash h0 (:class:`HashPartitioner`), so every worker pushes ~1/n of its non-zeros
to each server and every server owns ~1/n of the union — balanced push and pull whatever the skew.
Servers sum what they receive; workers pull the sums back as COO or as a hash bitmap, whichever is
smaller for the tensor's profiled density. Per-worker bytes (SYSTEMS.md, fp32): COO pull
8 d M (1 + gamma_n)(n-1)/n, bitmap pull (n-1)/n M (8 d + 4 gamma_n d + 1/8); with s-byte values an
(int32 index, value) pair weighs 4 + s bytes and a pulled value s.

Hierarchical Centralization (HC): recursive doubling with merging (:mod:`.recursive`), cheap when
the workers' index sets overlap (small gamma_{2^i}). Per tensor, Zen takes the scheme the T_bp and
T_hc formulas rate faster on the profiled d and gamma_{2^i}; tensors whose density makes any sparse
scheme slower than dense allreduce stay dense. With ``network_latency: measured`` the alpha is what a
message step costs on the cluster, and T_hc also pays its merges at the CPU's measured rate (on a
GPU the paper's merges are nearly free; on this host they outweigh the messages HC saves).

Hierarchical mode (``hierarchical=True``, the paper's multi-GPU machines): a dense reduce-scatter
inside each machine leaves local rank j with chunk j of the machine's sum; the sparse scheme then
runs across machines among the ranks holding the same chunk; a dense allgather inside the machine
completes the tensor. The plan is made for the machine-level density gamma_k d over m machines,
and dense allreduce is priced over the same split (a ring among machines on the chunk) so that the
two compare like with like; the reduce-scatter and allgather inside the machine would be the same
for both, so they cancel out of the comparison.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddlscale.comm import Communicator
from ddlscale.comm.cost import zen_hierarchical_centralization_time
from ddlscale.sync.sparse import pushpull
from ddlscale.sync.sparse.base import SparseSync
from ddlscale.sync.sparse.coo import to_flat_coo
from ddlscale.sync.sparse.hashing import HashPartitioner, agreed_seed
from ddlscale.sync.sparse.pushpull import INDEX_BYTES
from ddlscale.sync.sparse.recursive import Partial, SparseDoubling

PULL_FORMATS = ("auto", "coo", "bitmap")
SCHEMES = ("auto", "bp", "hc")


def zen_coo_bytes(numel: int, density: float, gamma: float, n: int, value_bytes: int) -> float:
    """Push and pull as (index, value) pairs."""
    return (INDEX_BYTES + value_bytes) * density * numel * (1 + gamma) * (n - 1) / n


def zen_bitmap_bytes(numel: int, density: float, gamma: float, n: int, value_bytes: int) -> float:
    """Push as pairs; pull as a hash bitmap (M/8 bytes in all) and the summed values."""
    return (n - 1) / n * numel * ((INDEX_BYTES + value_bytes) * density + value_bytes * gamma * density + 1 / 8)


@dataclass(frozen=True)
class Sparsity:
    """What the plan reads about one tensor among ``n`` participants: elements, density d, gamma_n,
    gamma_{2^i} for i = 0..log2 n where profiled, and bytes per value."""

    numel: int
    density: float
    gamma: float
    gammas: list[float] | None
    n: int
    value_bytes: int


def merge_seconds_per_element(size: int = 1 << 15, calls: int = 5, budget_s: float = 0.05) -> float:
    """Seconds per input element of HC's merge of two sorted sparse partial sums on this host (median
    of at least ``calls``, timed for at least ``budget_s`` so that ranks measuring together overlap)."""
    generator = torch.Generator().manual_seed(0)
    parts = [Partial(torch.randperm(size * 8, generator=generator)[:size].sort().values, torch.ones(size))
             for _ in range(2)]
    merger = SparseDoubling(None, size * 8, torch.float32, None)
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < calls or time.perf_counter() < deadline:
        start = time.perf_counter()
        merger._merged(*parts)
        times.append(time.perf_counter() - start)
    return statistics.median(times) / (2 * size)


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
    """

    profiles_doubling = True

    def __init__(self, scheme: str = "auto", pull: str = "auto", seed: int | None = 0x5EED,
                 hierarchical: bool = False, local_size: int | None = None, **kwargs):
        super().__init__(**kwargs)
        if scheme not in SCHEMES:
            raise ValueError(f"sync.scheme must be one of {', '.join(SCHEMES)}; got {scheme!r}")
        if pull not in PULL_FORMATS:
            raise ValueError(f"sync.pull must be one of {', '.join(PULL_FORMATS)}; got {pull!r}")
        if local_size is not None and not (isinstance(local_size, int) and local_size >= 1):
            raise ValueError(f"sync.local_size must be an integer >= 1 or null, got {local_size!r}")
        self.scheme, self.pull, self.seed = scheme, pull, seed
        self.hierarchical, self.local_size = bool(hierarchical), local_size
        self.plans: dict[int, str] = {}  # sparse tensor -> hc, bp-coo or bp-bitmap
        self.merge_s_per_element = 0.0  # HC's merge on this host; measured with network_latency=measured

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
        p = self.params[index]
        numel, d, value_bytes = p.numel(), self.density.get(index, 1.0), p.element_size()
        gamma, gammas = self.gamma.get(index, 1.0), self.gammas.get(index)
        if not self.hierarchical or self.local_size in (None, 1):
            return Sparsity(numel, d, gamma, gammas, self.world_size, value_bytes)
        k = self.local_size
        machines = self.world_size // k
        # A machine's sum has density gamma_k d; across machines it densifies by gamma_n / gamma_k.
        stage = k.bit_length() - 1
        exact = gammas is not None and 1 << stage == k
        gamma_k = gammas[stage] if exact else max(1.0, min(float(k), gamma))
        across = None
        if exact and len(gammas) > stage + 1:
            across = [max(1.0, min(2.0**i, g / gamma_k)) for i, g in enumerate(gammas[stage:])]
        return Sparsity(math.ceil(numel / k), min(1.0, gamma_k * d), max(1.0, min(machines, gamma / gamma_k)),
                        across, machines, value_bytes)

    def plan_times(self, index: int) -> dict[str, float]:
        """The cost model's seconds for each scheme this tensor may take (SYSTEMS.md's T_bp, T_hc)."""
        s = self.sparsity(index)
        seconds_per_byte = 8 / self.network.bandwidth_bps
        bp_alpha = 2 * (s.n - 1) * self.network.latency_s
        times = {}
        if self.scheme != "hc":
            if self.pull != "bitmap":
                times["bp-coo"] = (zen_coo_bytes(s.numel, s.density, s.gamma, s.n, s.value_bytes) * seconds_per_byte
                                   + bp_alpha)
            if self.pull != "coo":
                times["bp-bitmap"] = (zen_bitmap_bytes(s.numel, s.density, s.gamma, s.n, s.value_bytes)
                                      * seconds_per_byte + bp_alpha)
        if self.scheme == "hc" or (self.scheme == "auto" and s.gammas is not None):
            times["hc"] = self._hc_seconds(s)
        return times

    def _hc_seconds(self, s: Sparsity) -> float:
        """T_hc over the largest power of two of participants, plus folding the others in and out."""
        core = 1 << (s.n.bit_length() - 1)
        # Measured gamma_{2^i} where profiled (power-of-two n), else the bound min(2^i, gamma_n).
        gammas = s.gammas or [max(1.0, min(2.0**i, s.gamma)) for i in range(core.bit_length())]
        seconds = zen_hierarchical_centralization_time(s.numel, s.density, gammas[: core.bit_length()], core,
                                                       self.network, value_bytes=s.value_bytes)
        # Each stage merges two partial sums of gamma_{2^(i-1)} d M non-zeros on the CPU (measured cost).
        stages = core.bit_length() - 1
        seconds += self.merge_s_per_element * sum(2 * g * s.density * s.numel for g in gammas[:stages])
        if core < s.n:
            pair_bytes = INDEX_BYTES + s.value_bytes
            seconds += 2 * (self.network.latency_s
                            + pair_bytes * s.numel * s.density * (1 + s.gamma) * 8 / self.network.bandwidth_bps)
        return seconds

    def plan(self, index: int) -> str:
        """This tensor's scheme: the fastest of :meth:`plan_times` (kept until the next profile)."""
        if index not in self.plans:
            times = self.plan_times(index)
            self.plans[index] = min(times, key=times.get)
        return self.plans[index]

    def sparse_seconds(self, index: int) -> float:
        return min(self.plan_times(index).values())

    def dense_seconds(self, index: int) -> float:
        """Dense over the split the plans are priced on: all ranks, or the machines on one chunk
        (hierarchical; the machine's reduce-scatter and allgather would be the same on both paths)."""
        s = self.sparsity(index)
        return self.ring_seconds(s.numel, s.value_bytes, s.n)

    def _route(self) -> None:
        self.plans.clear()  # a new profile: choose again
        # New routes fuse new groups: drop the hash layouts of the old groups' sizes.
        for partitioner in (self.partitioner, getattr(self, "inter_partitioner", None)):
            if partitioner is not None:
                partitioner.clear_layouts()
        if self.measure_latency and self.world_size > 1 and self.scheme != "bp":
            # With the measured latency, T_hc's few stages can look cheaper than BP's many messages;
            # what HC also pays is its merges, which on a CPU cost more than the messages. Every rank
            # merges at once, as in HC's stages, and the slowest one counts, since each stage waits
            # for it: timed by rank 0 alone, emulated machines sharing cores saw a fraction of the
            # real cost, and lstm's embeddings went to HC where it ran at 1.4-2x BP's time.
            dist.barrier(group=self.comm.group)
            self.merge_s_per_element, = self.agreed([merge_seconds_per_element()], slowest=True)
        super()._route()

    def group_key(self, index: int):
        return (str(self.params[index].dtype), self.plan(index))

    def sync_sparse(self, group: list[int], numel: int, indices: torch.Tensor, values: torch.Tensor):
        plan = self.plan(group[0])
        if self.intra is not None:
            return self._sync_hierarchical(plan, numel, indices, values)
        return self._sync_flat(self.comm, self.partitioner, plan, numel, indices, values)

    def _sync_flat(self, comm: Communicator, partitioner: HashPartitioner, plan: str, numel: int,
                   indices: torch.Tensor, values: torch.Tensor):
        """The sparse scheme among ``comm``'s ranks: the global sum as flat COO."""
        if plan == "hc":
            return SparseDoubling(comm, numel, values.dtype, None, self.timed).run(indices, values)
        with self.timed("encode"):
            servers = partitioner.server_of(indices)
            owned_sets, position = partitioner.layout(numel)
        with self.timed("comm"):
            recv_idx, recv_val = pushpull.push(comm, indices, values, servers)
        with self.timed("decode"):
            compact, nonzero = pushpull.aggregate(recv_idx, recv_val, owned_sets[comm.rank], position)
        with self.timed("comm"):
            if plan == "bp-bitmap":
                return pushpull.pull_bitmap(comm, owned_sets, compact, nonzero)
            return pushpull.pull_coo(comm, owned_sets[comm.rank], compact, nonzero)

    def _sync_hierarchical(self, plan: str, numel: int, indices: torch.Tensor, values: torch.Tensor):
        """Dense reduce-scatter in the machine, sparse across machines on this rank's chunk, dense allgather."""
        k = self.local_size
        chunk = math.ceil(numel / k)
        with self.timed("encode"):
            machine_input = torch.zeros(chunk * k, dtype=values.dtype)
            machine_input[indices] = values
            mine = torch.empty(chunk, dtype=values.dtype)
        with self.timed("comm"):
            self.intra.reduce_scatter(mine, machine_input).wait()
        with self.timed("encode"):
            chunk_idx, chunk_val = to_flat_coo(mine)
        total_idx, total_val = self._sync_flat(self.inter, self.inter_partitioner, plan, chunk, chunk_idx, chunk_val)
        with self.timed("decode"):
            summed = torch.zeros(chunk, dtype=values.dtype)
            summed[total_idx] = total_val
        with self.timed("comm"):
            pieces = self.intra.allgather(summed).wait()
        with self.timed("decode"):
            return to_flat_coo(torch.cat(pieces)[:numel])

    def routing(self):
        table = super().routing()
        for i in self.sparse:
            table[self.names[i]]["plan"] = self.plan(i)
        return table

    def state_dict(self):
        # The plans too: mid re-profile they come from the last complete profile, not the partial one saved.
        return {**super().state_dict(), "seed": self.partitioner.seed, "merge_s_per_element": self.merge_s_per_element,
                "plans": dict(self.plans)}

    def load_state_dict(self, state) -> None:
        # Plans a checkpoint lacks (older ones) are re-derived from the restored profile, identically on every rank.
        self.plans = {int(k): v for k, v in state.get("plans", {}).items()}
        self.merge_s_per_element = float(state.get("merge_s_per_element", 0.0))
        super().load_state_dict(state)
