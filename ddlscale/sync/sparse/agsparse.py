"""AGsparse: allgather every worker's COO and sum locally (gloo's sparse allreduce, Horovod).

One-shot centralization: no partition, no incremental sum, so each worker receives all n-1 other
workers' non-zeros — (4 + s) d M (n-1) bytes for s-byte values. In fp32, 8 d M (n-1): it beats
dense allreduce only when d < 1/n.
"""

from __future__ import annotations

import torch

from ddlscale.sync.sparse.base import SparseSync
from ddlscale.sync.sparse.pushpull import INDEX_BYTES, pack_pairs, unpack_pairs


class AGSparseSync(SparseSync):
    """``sync=agsparse``: allgather of (int32 index, value) pairs, summed on every worker."""

    def sparse_volume(self, numel: int, density: float, gamma: float, value_bytes: int) -> float:
        return (INDEX_BYTES + value_bytes) * density * numel * (self.world_size - 1)

    def sync_sparse(self, group: list[int], numel: int, indices: torch.Tensor, values: torch.Tensor):
        with self.timed("comm"):
            rows = pack_pairs(indices, values)
            sizes = self.comm.allgather_sizes(rows.numel(), rows.device)
            pieces = self.comm.allgather_uneven(rows, sizes).wait()
            all_idx, all_val = unpack_pairs(torch.cat(pieces).view(-1, rows.shape[1]), values.dtype)
        with self.timed("decode"):
            total = torch.zeros(numel, dtype=values.dtype)
            total.index_add_(0, all_idx, all_val)  # in rank order: deterministic
            nonzero = torch.nonzero(total).reshape(-1)  # NaN counts as non-zero
            return nonzero, total[nonzero]
