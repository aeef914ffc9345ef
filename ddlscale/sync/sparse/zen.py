"""Zen: near-optimal sparse synchronization — Balanced Parallelism or Hierarchical Centralization.

Balanced Parallelism (BP): each tensor's non-zero indices are split among all workers acting as
servers by a fixed hash h0 (:class:`HashPartitioner`), so every worker pushes ~1/n of its non-zeros
to each server and every server owns ~1/n of the union — balanced push and pull whatever the skew.
Servers sum what they receive; workers pull the sums back as COO or as a hash bitmap, whichever is
smaller for the tensor's profiled density. Per-worker bytes (SYSTEMS.md): COO pull
8 d M (1 + gamma_n)(n-1)/n, bitmap pull (n-1)/n M (8 d + 4 gamma_n d + 1/8).

Hierarchical Centralization (HC): recursive doubling with merging (:mod:`.recursive`), cheap when
the workers' index sets overlap (small gamma_{2^i}). Per tensor, Zen takes the scheme the T_bp and
T_hc formulas rate faster on the profiled d and gamma_{2^i}; tensors whose density makes any sparse
scheme slower than dense allreduce stay dense.
"""

from __future__ import annotations

import torch

from ddlscale.comm.cost import zen_hierarchical_centralization_time
from ddlscale.sync.sparse import pushpull
from ddlscale.sync.sparse.base import SparseSync
from ddlscale.sync.sparse.hashing import HashPartitioner, agreed_seed
from ddlscale.sync.sparse.recursive import SparseDoubling

PULL_FORMATS = ("auto", "coo", "bitmap")
SCHEMES = ("auto", "bp", "hc")


def zen_coo_bytes(numel: int, density: float, gamma: float, n: int) -> float:
    return 8 * density * numel * (1 + gamma) * (n - 1) / n


def zen_bitmap_bytes(numel: int, density: float, gamma: float, n: int) -> float:
    return (n - 1) / n * numel * (8 * density + 4 * gamma * density + 1 / 8)


class ZenSync(SparseSync):
    """``sync=zen``. Args beyond :class:`SparseSync`'s:

    scheme: ``"auto"`` (per tensor, BP or HC by the cost formulas), ``"bp"`` or ``"hc"``.
    pull: BP's pull format — ``"auto"`` (per tensor, the smaller of COO and hash bitmap), ``"coo"``
        or ``"bitmap"``.
    seed: the hash seed; ``None`` draws one on rank 0. Every rank uses rank 0's, checked by a
        fingerprint collective at set-up.
    """

    profiles_doubling = True

    def __init__(self, scheme: str = "auto", pull: str = "auto", seed: int | None = 0x5EED, **kwargs):
        super().__init__(**kwargs)
        if scheme not in SCHEMES:
            raise ValueError(f"sync.scheme must be one of {', '.join(SCHEMES)}; got {scheme!r}")
        if pull not in PULL_FORMATS:
            raise ValueError(f"sync.pull must be one of {', '.join(PULL_FORMATS)}; got {pull!r}")
        self.scheme, self.pull, self.seed = scheme, pull, seed
        self.plans: dict[int, str] = {}  # sparse tensor -> hc, bp-coo or bp-bitmap

    def on_setup(self) -> None:
        if not hasattr(self, "partitioner"):
            self.partitioner = HashPartitioner(self.world_size, agreed_seed(self.seed, self.comm.group))
            self.partitioner.verify_agreement(self.comm.group)
        super().on_setup()

    # -- the per-tensor plan: hc, bp-coo or bp-bitmap ---------------------------------------------
    def plan_times(self, index: int) -> dict[str, float]:
        """The cost model's seconds for each scheme this tensor may take (SYSTEMS.md's T_bp, T_hc)."""
        p = self.params[index]
        n, numel = self.world_size, p.numel()
        d, gamma = self.density.get(index, 1.0), self.gamma.get(index, 1.0)
        seconds_per_byte = 8 / self.network.bandwidth_bps
        bp_alpha = 2 * (n - 1) * self.network.latency_s
        times = {}
        if self.scheme != "hc":
            if self.pull != "bitmap":
                times["bp-coo"] = zen_coo_bytes(numel, d, gamma, n) * seconds_per_byte + bp_alpha
            if self.pull != "coo":
                times["bp-bitmap"] = zen_bitmap_bytes(numel, d, gamma, n) * seconds_per_byte + bp_alpha
        if self.scheme == "hc" or (self.scheme == "auto" and index in self.gammas):
            times["hc"] = self._hc_seconds(index)
        return times

    def _hc_seconds(self, index: int) -> float:
        """T_hc over the largest power of two of ranks, plus folding the others in and out."""
        p = self.params[index]
        numel, d, gamma = p.numel(), self.density.get(index, 1.0), self.gamma.get(index, 1.0)
        core = 1 << (self.world_size.bit_length() - 1)
        # Measured gamma_{2^i} where profiled (power-of-two n), else the bound min(2^i, gamma_n).
        gammas = self.gammas.get(index) or [max(1.0, min(2.0**s, gamma)) for s in range(core.bit_length())]
        seconds = zen_hierarchical_centralization_time(numel, d, gammas, core, self.network)
        if core < self.world_size:
            seconds += 2 * (self.network.latency_s + 8 * numel * d * (1 + gamma) * 8 / self.network.bandwidth_bps)
        return seconds

    def plan(self, index: int) -> str:
        """This tensor's scheme: the fastest of :meth:`plan_times` (kept until the next profile)."""
        if index not in self.plans:
            times = self.plan_times(index)
            self.plans[index] = min(times, key=times.get)
        return self.plans[index]

    def sparse_seconds(self, index: int) -> float:
        return min(self.plan_times(index).values())

    def _route(self) -> None:
        self.plans.clear()  # a new profile: choose again
        super()._route()

    def group_key(self, index: int):
        return (str(self.params[index].dtype), self.plan(index))

    def sync_sparse(self, group: list[int], numel: int, indices: torch.Tensor, values: torch.Tensor):
        plan = self.plan(group[0])
        if plan == "hc":
            return SparseDoubling(self.comm, numel, values.dtype, None, self.timed).run(indices, values)
        with self.timed("encode"):
            servers = self.partitioner.server_of(indices)
            owned_sets, position = self.partitioner.layout(numel)
        with self.timed("comm"):
            recv_idx, recv_val = pushpull.push(self.comm, indices, values, servers)
        with self.timed("decode"):
            compact, nonzero = pushpull.aggregate(recv_idx, recv_val, owned_sets[self.rank], position)
        with self.timed("comm"):
            if plan == "bp-bitmap":
                return pushpull.pull_bitmap(self.comm, owned_sets, compact, nonzero)
            return pushpull.pull_coo(self.comm, owned_sets[self.rank], compact, nonzero)

    def routing(self):
        table = super().routing()
        for i in self.sparse:
            table[self.names[i]]["plan"] = self.plan(i)
        return table

    def state_dict(self):
        return {**super().state_dict(), "seed": self.partitioner.seed}

    def load_state_dict(self, state) -> None:
        self.plans.clear()  # re-derived from the restored profile, identically on every rank
        super().load_state_dict(state)
