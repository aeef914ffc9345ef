"""gloo's built-in sparse allreduce, as PyTorch ships it: the reference point for "where it applies".

``dist.all_reduce`` on a sparse COO tensor over gloo exchanges non-zero counts, ring-allgathers every
rank's int64 indices and values, and sums locally — AGsparse with 8-byte indices, so each worker
receives 12 d M (n-1) bytes of fp32 pairs. NCCL has no sparse allreduce: CPU (gloo) only.
"""

from __future__ import annotations

import torch

from ddlscale.sync.sparse.base import SparseSync


class GlooSparseSync(SparseSync):
    """``sync=gloo_sparse``: each fused group through ``dist.all_reduce`` of one sparse COO tensor."""

    max_group_numel = torch.iinfo(torch.int64).max  # gloo sends int64 indices

    def on_setup(self) -> None:
        if self.world_size > 1 and self.device.type != "cpu":
            raise ValueError(f"sync=gloo_sparse runs on CPU tensors over gloo, got device {self.device}")
        super().on_setup()

    def sparse_volume(self, numel: int, density: float, gamma: float, value_bytes: int) -> float:
        return (torch.int64.itemsize + value_bytes) * density * numel * (self.world_size - 1)

    def sync_sparse(self, group: list[int], numel: int, indices: torch.Tensor, values: torch.Tensor):
        with self.timed("encode"):
            local = torch.sparse_coo_tensor(indices[None], values, (numel,), check_invariants=False)
        with self.timed("comm"):
            total = self.comm.sparse_allreduce(local).wait()
        with self.timed("decode"):
            total = total.coalesce()
            return total.indices()[0], total.values()
