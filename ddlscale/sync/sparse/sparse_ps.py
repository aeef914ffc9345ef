"""A sparse parameter server with an even contiguous split (the baseline Zen's hashing fixes).

Same push / incremental sum / COO pull as Zen, but server s owns indices [sM/n, (s+1)M/n). Under the
skew of embedding gradients (most non-zeros among the first rows) the first servers receive and
send most of the traffic, so the busiest NIC, not the average, sets the time.
"""

from __future__ import annotations

import torch

from ddlscale.sync.sparse import pushpull
from ddlscale.sync.sparse.base import SparseSync
from ddlscale.sync.sparse.partition import ContiguousPartitioner
from ddlscale.sync.sparse.zen import zen_coo_bytes


class SparsePSSync(SparseSync):
    """``sync=sparse_ps``: push/pull through contiguous partitions, COO both ways."""

    def on_setup(self) -> None:
        self.partitioner = ContiguousPartitioner(self.world_size)
        super().on_setup()

    def sparse_volume(self, numel: int, density: float, gamma: float, value_bytes: int) -> float:
        return zen_coo_bytes(numel, density, gamma, self.world_size, value_bytes)  # if it were balanced

    def sync_sparse(self, group: list[int], numel: int, indices: torch.Tensor, values: torch.Tensor):
        owned_sets, position = self.partitioner.layout(numel)
        with self.timed("comm"):
            recv_idx, recv_val = pushpull.push(self.comm, indices, values, self.partitioner.server_of(indices, numel))
        with self.timed("decode"):
            compact, nonzero = pushpull.aggregate(recv_idx, recv_val, owned_sets[self.rank], position)
        with self.timed("comm"):
            return pushpull.pull_coo(self.comm, owned_sets[self.rank], compact, nonzero)
