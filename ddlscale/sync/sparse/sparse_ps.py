"""A sparse parameter server with an even contiguous split (the baseline Zen's hashing fixes).

Same push / incremental sum / COO pull as Zen, at the same granularity (rows of an embedding), but
server s owns units [sM/n, (s+1)M/n). Under the skew of embedding gradients (most non-zeros among
the first rows) the first servers receive and send most of the traffic, so the busiest NIC, not the
average, sets the time.
"""

from __future__ import annotations

import functools

import torch

from ddlscale.sync.sparse import pushpull
from ddlscale.sync.sparse.base import SparseSync, Sparsity
from ddlscale.sync.sparse.partition import ContiguousPartitioner
from ddlscale.sync.sparse.zen import zen_coo_bytes


class SparsePSSync(SparseSync):
    """``sync=sparse_ps``: push/pull through contiguous partitions, COO both ways."""

    def on_setup(self) -> None:
        self.partitioner = ContiguousPartitioner(self.world_size)
        super().on_setup()

    def sparse_volume(self, s: Sparsity) -> float:
        return zen_coo_bytes(s.units, s.density, s.gamma, s.n, s.unit_bytes)  # as if it were balanced

    def sync_sparse(self, group: list[int], units: int, width: int, ids: torch.Tensor, values: torch.Tensor):
        comm = self.sparse_comm
        group_by = functools.partial(self.partitioner.group, numel=units)  # ids ascending: runs, no reorder
        received = pushpull.push(comm, ids, values, group_by, self.timed)
        with self.timed("decode"):
            summed = pushpull.aggregate(received)
        pieces = pushpull.pull_coo(comm, *summed, self.timed)
        with self.timed("decode"):
            return torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])
