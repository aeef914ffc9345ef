"""AGsparse: allgather every worker's units and sum locally (Horovod's sparse allreduce).

One-shot centralization: no partition, no incremental sum, so each worker receives all n-1 other
workers' units — (4 + u) d M (n-1) bytes for M units of u bytes (an embedding row, or one value). In
fp32 elements, 8 d M (n-1): it beats dense allreduce only when d < 1/n. At row granularity it is the
algorithm PyTorch's gloo sparse allreduce runs (:mod:`.gloo_sparse`), with int32 indices and one
exchange where gloo takes three ring allgathers.
"""

from __future__ import annotations

import torch

from ddlscale.sync.sparse import pushpull
from ddlscale.sync.sparse.base import SparseSync, Sparsity


class AGSparseSync(SparseSync):
    """``sync=agsparse``: allgather of (int32 row index, row) sets, summed on every worker."""

    def sparse_volume(self, s: Sparsity) -> float:
        return s.pair_bytes * s.density * s.units * (s.n - 1)

    def sparse_messages(self, s: Sparsity) -> int:
        return self.exchange_steps(s.n, s.pair_bytes * s.density * s.units)

    def sync_sparse(self, group: list[int], units: int, width: int, ids: torch.Tensor, values: torch.Tensor):
        comm = self.sparse_comm
        pieces = pushpull.pull_coo(comm, ids, values, self.timed)  # the same allgather of row sets
        with self.timed("decode"):
            return pushpull.aggregate(pieces)  # in rank order: deterministic
