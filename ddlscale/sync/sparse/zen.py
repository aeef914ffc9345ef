"""Zen: Balanced Parallelism for sparse gradients (hash-partitioned push, incremental sums, pull).

Each tensor's non-zero indices are split among all workers acting as servers by a fixed hash h0
(:class:`HashPartitioner`), so every worker pushes ~1/n of its non-zeros to each server and every
server owns ~1/n of the union — balanced push and pull whatever the skew. Servers sum what they
receive; workers pull the sums back as COO or as a hash bitmap, whichever is smaller for the
tensor's profiled density. Per-worker bytes (SYSTEMS.md): COO pull 8 d M (1 + gamma_n)(n-1)/n,
bitmap pull (n-1)/n M (8 d + 4 gamma_n d + 1/8).
"""

from __future__ import annotations

import torch

from ddlscale.sync.sparse import pushpull
from ddlscale.sync.sparse.base import SparseSync
from ddlscale.sync.sparse.hashing import HashPartitioner, agreed_seed

PULL_FORMATS = ("auto", "coo", "bitmap")


def zen_coo_bytes(numel: int, density: float, gamma: float, n: int) -> float:
    return 8 * density * numel * (1 + gamma) * (n - 1) / n


def zen_bitmap_bytes(numel: int, density: float, gamma: float, n: int) -> float:
    return (n - 1) / n * numel * (8 * density + 4 * gamma * density + 1 / 8)


class ZenSync(SparseSync):
    """``sync=zen``. Args beyond :class:`SparseSync`'s:

    pull: ``"auto"`` (per tensor, the smaller of COO and hash bitmap), ``"coo"`` or ``"bitmap"``.
    seed: the hash seed; ``None`` draws one on rank 0. Every rank uses rank 0's, checked by a
        fingerprint collective at set-up.
    """

    def __init__(self, pull: str = "auto", seed: int | None = 0x5EED, **kwargs):
        super().__init__(**kwargs)
        if pull not in PULL_FORMATS:
            raise ValueError(f"sync.pull must be one of {', '.join(PULL_FORMATS)}; got {pull!r}")
        self.pull = pull
        self.seed = seed

    def on_setup(self) -> None:
        if not hasattr(self, "partitioner"):
            self.partitioner = HashPartitioner(self.world_size, agreed_seed(self.seed, self.comm.group))
            self.partitioner.verify_agreement(self.comm.group)
        super().on_setup()

    def pull_format(self, group: list[int]) -> str:
        """COO or hash bitmap for a fused group, from its tensors' profiled densities."""
        if self.pull != "auto":
            return self.pull
        numel = sum(self.params[i].numel() for i in group)
        nonzeros = sum(self.density.get(i, 1.0) * self.params[i].numel() for i in group)
        summed = sum(self.gamma.get(i, 1.0) * self.density.get(i, 1.0) * self.params[i].numel() for i in group)
        d, gamma = nonzeros / numel, (summed / nonzeros if nonzeros else 1.0)
        coo = zen_coo_bytes(numel, d, gamma, self.world_size)
        return "bitmap" if zen_bitmap_bytes(numel, d, gamma, self.world_size) < coo else "coo"

    def sparse_volume(self, numel: int, density: float, gamma: float) -> float:
        return min(zen_coo_bytes(numel, density, gamma, self.world_size),
                   zen_bitmap_bytes(numel, density, gamma, self.world_size))

    def sync_sparse(self, group: list[int], numel: int, indices: torch.Tensor, values: torch.Tensor):
        with self.timed("encode"):
            servers = self.partitioner.server_of(indices)
            owned_sets, position = self.partitioner.layout(numel)
        with self.timed("comm"):
            recv_idx, recv_val = pushpull.push(self.comm, indices, values, servers)
        with self.timed("decode"):
            compact, nonzero = pushpull.aggregate(recv_idx, recv_val, owned_sets[self.rank], position)
        with self.timed("comm"):
            if self.pull_format(group) == "bitmap":
                return pushpull.pull_bitmap(self.comm, owned_sets, compact, nonzero)
            return pushpull.pull_coo(self.comm, owned_sets[self.rank], compact, nonzero)

    def state_dict(self):
        return {**super().state_dict(), "seed": self.partitioner.seed}
