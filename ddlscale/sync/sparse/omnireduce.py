"""OmniReduce: non-zero blocks pushed to an even contiguous split of aggregators (a Zen baseline).

OmniReduce (Fei et al., SIGCOMM '21) cuts a tensor into blocks of ``block_size`` consecutive values
and sends only the blocks that hold a non-zero. A block travels whole and is named by its position,
so no per-element index moves: a scattered non-zero costs a whole block, a dense run of non-zeros
costs almost nothing beyond its values. The blocks are split evenly and contiguously over the n
workers acting as aggregators; each aggregator sums what it receives into a compact buffer of the
blocks that arrived (incremental aggregation) and sends its non-zero sums to every worker. Under the skew of
embedding gradients the first aggregators own most non-zero blocks, so their NICs set the pace —
the imbalance Zen's hash partition removes.

Decisions the paper leaves to an implementation (ours):

- Blocks are cut per tensor: in a fused group each tensor starts on a block boundary, so a block
  never mixes two tensors and the block density profiled per tensor is exactly what travels. A
  tensor's last block may be partial; it travels padded to ``block_size`` (fixed-size rows, like
  OmniReduce's fixed-size packets), and the padding is charged.
- A block travels as one row: its int32 block id, then its values. One all-to-all carries a worker's
  blocks to every aggregator; one uneven allgather carries every aggregator's sums back.
- A block is non-zero if any value is non-zero or NaN (NaN must propagate). A summed block that
  cancels to all zeros is not sent back.

Bytes per worker and step for one tensor of M elements of s bytes, cut into nb = ceil(M / B) blocks
of which a fraction p is non-zero on a worker and gamma_b * p after summing over the n workers, with
rows of w = 4 + B s bytes: push (n-1)/n p nb w, pull (n-1)/n gamma_b p nb w, so

    (n - 1) / n * (1 + gamma_b) * p * nb * (4 + B s)

on average over workers (plus 16 (n-1) bytes of counts and sizes). That average is what routing
assumes, as for ``sparse_ps``; with the even split the busiest aggregator moves more.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from ddlscale.comm import Communicator
from ddlscale.sync.sparse.base import SparseSync
from ddlscale.sync.sparse.coo import to_flat_coo
from ddlscale.sync.sparse.partition import ContiguousPartitioner

BLOCK_ID_BYTES = 4  # block ids travel as int32


def num_blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def omnireduce_bytes(numel: int, block_density: float, block_gamma: float, n: int,
                     block_size: int = 256, elem_size: int = 4) -> float:
    """Mean bytes a worker sends (and receives) per step for one tensor (module docstring)."""
    row = BLOCK_ID_BYTES + block_size * elem_size
    return (n - 1) / n * (1 + block_gamma) * block_density * num_blocks(numel, block_size) * row


def scattered_block_density(density: float, block_size: int) -> float:
    """Fraction of non-zero blocks when non-zeros fall independently at random: a block is empty
    with probability (1 - d)^B. Clustered non-zeros (embedding rows) fill far fewer blocks."""
    return 1.0 - (1.0 - min(1.0, density)) ** block_size


class BlockLayout:
    """The block grid over a fused group: element j of tensor k lies in block
    ``first_block[k] + j // B`` at lane ``j % B``; each tensor starts on a fresh block."""

    def __init__(self, sizes: list[int], block_size: int):
        self.block_size = block_size
        self.sizes = torch.tensor(sizes, dtype=torch.int64)
        self.starts = torch.tensor([0, *itertools.accumulate(sizes)], dtype=torch.int64)
        blocks = [num_blocks(s, block_size) for s in sizes]
        self.first_block = torch.tensor([0, *itertools.accumulate(blocks)], dtype=torch.int64)
        self.num_blocks = int(self.first_block[-1])

    def to_blocks(self, indices: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused flat COO -> sorted ids of the non-zero blocks and their values, shape (k, B)."""
        tensor_of = torch.bucketize(indices, self.starts[1:-1], right=True)
        local = indices - self.starts[tensor_of]
        ids, row = torch.unique(self.first_block[tensor_of] + local // self.block_size, return_inverse=True)
        blocks = values.new_zeros((ids.numel(), self.block_size))
        blocks[row, local % self.block_size] = values
        return ids, blocks

    def to_coo(self, ids: torch.Tensor, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks -> fused flat COO of every lane that belongs to a tensor (padding dropped)."""
        tensor_of = torch.bucketize(ids, self.first_block[1:-1], right=True)
        lanes = torch.arange(self.block_size, dtype=torch.int64)
        local = (ids - self.first_block[tensor_of])[:, None] * self.block_size + lanes
        keep = local < self.sizes[tensor_of][:, None]
        return (local + self.starts[tensor_of][:, None])[keep], blocks[keep]


def pack_blocks(ids: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Blocks as rows of bytes — int32 id, then the values — so one message carries both."""
    k = ids.numel()
    rows = torch.empty((k, BLOCK_ID_BYTES + blocks.shape[1] * blocks.element_size()), dtype=torch.uint8)
    rows[:, :BLOCK_ID_BYTES] = ids.to(torch.int32).view(torch.uint8).view(k, BLOCK_ID_BYTES)
    rows[:, BLOCK_ID_BYTES:] = blocks.contiguous().view(torch.uint8)
    return rows


def unpack_blocks(rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # Fresh column blocks: a column slice of the rows is strided, and view(dtype) needs stride 1.
    id_bytes = torch.empty((rows.shape[0], BLOCK_ID_BYTES), dtype=torch.uint8).copy_(rows[:, :BLOCK_ID_BYTES])
    value_bytes = torch.empty((rows.shape[0], rows.shape[1] - BLOCK_ID_BYTES), dtype=torch.uint8)
    value_bytes.copy_(rows[:, BLOCK_ID_BYTES:])
    return id_bytes.view(torch.int32).reshape(-1).to(torch.int64), value_bytes.view(dtype)


def push_blocks(comm: Communicator, rows: torch.Tensor, servers: torch.Tensor) -> torch.Tensor:
    """All-to-all of block rows to their aggregators; ``servers`` must be sorted (ids are)."""
    send_counts = torch.bincount(servers, minlength=comm.size)
    recv_counts = torch.empty(comm.size, dtype=torch.int64)
    comm.all_to_all(recv_counts, send_counts).wait()
    recv_splits = recv_counts.tolist()
    received = rows.new_empty((sum(recv_splits), rows.shape[1]))
    comm.all_to_all(received, rows, recv_splits, send_counts.tolist()).wait()
    return received


class OmniReduceSync(SparseSync):
    """``sync=omnireduce``. Args beyond :class:`SparseSync`'s:

    block_size: values per block (OmniReduce's default 256). Larger blocks carry less id overhead
        but waste more bandwidth on the zeros around scattered non-zeros.

    Routing judges each tensor by its profiled *block* density (fraction of non-zero blocks per
    worker) and block gamma (of the sum / per worker), not by element density: 1% of elements
    scattered over every block saves nothing here, 1% in one contiguous run saves 99%. Drift
    (``reprofile_drift``) is judged in non-zero blocks too.
    """

    def __init__(self, block_size: int = 256, **kwargs: Any):
        super().__init__(**kwargs)
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"sync.block_size must be an integer >= 1, got {block_size!r}")
        self.block_size = block_size
        self.block_density: dict[int, float] = {}  # mean per-worker fraction of non-zero blocks
        self.block_gamma: dict[int, float] = {}  # non-zero blocks of the sum / per worker

    def on_setup(self) -> None:
        self.partitioner = ContiguousPartitioner(self.world_size)  # over block ids, not elements
        super().on_setup()
        self._local_blocks: dict[int, int] = {}

    # -- the scheme ------------------------------------------------------------------------------
    def sync_sparse(self, group: list[int], numel: int, indices: torch.Tensor, values: torch.Tensor):
        with self.timed("encode"):
            layout = BlockLayout([self.params[i].numel() for i in group], self.block_size)
            ids, blocks = layout.to_blocks(indices, values)
            rows = pack_blocks(ids, blocks)
            servers = self.partitioner.server_of(ids, layout.num_blocks)
        with self.timed("comm"):
            received = push_blocks(self.comm, rows, servers)
        with self.timed("decode"):
            recv_ids, recv_blocks = unpack_blocks(received, values.dtype)
            # The compact buffer holds only blocks that arrived: the work is O(received), not O(M / n).
            arrived, slot = torch.unique(recv_ids, return_inverse=True)
            compact = recv_blocks.new_zeros((arrived.numel(), self.block_size))
            compact.index_add_(0, slot, recv_blocks)  # arrival order (rank 0 first): deterministic
            nonzero = (compact != 0).any(dim=1)  # NaN != 0, so NaN blocks go back too
            summed = pack_blocks(arrived[nonzero], compact[nonzero])
        with self.timed("comm"):
            sizes = self.comm.allgather_sizes(summed.numel(), summed.device)
            pieces = self.comm.allgather_uneven(summed, sizes).wait()
        with self.timed("decode"):
            all_ids, all_blocks = unpack_blocks(torch.cat(pieces).view(-1, rows.shape[1]), values.dtype)
            return layout.to_coo(all_ids, all_blocks)

    def sparse_volume(self, numel: int, density: float, gamma: float, value_bytes: int) -> float:
        """Bytes per worker from element figures alone, were the non-zeros scattered at random.
        Routing uses the profiled block figures instead (:meth:`sparse_seconds`)."""
        local = scattered_block_density(density, self.block_size)
        summed = scattered_block_density(gamma * density, self.block_size)
        return omnireduce_bytes(numel, local, summed / local if local > 0 else 1.0, self.world_size,
                                self.block_size, value_bytes)

    # -- profiling and routing by block density -----------------------------------------------------
    def nonzero_blocks(self, indices: torch.Tensor) -> int:
        """Blocks of a tensor's own grid that hold one of these flat non-zero indices."""
        return int(torch.unique(indices // self.block_size).numel())

    def _observe(self, index: int, indices: torch.Tensor) -> None:
        super()._observe(index, indices)
        self._local_blocks[index] = self.nonzero_blocks(indices)

    def _profile(self) -> None:
        # Block figures first: the base routes at the end of its own profiling, reading them.
        everyone = range(len(self.params))
        local = torch.tensor([self._local_blocks.get(i, 0) for i in everyone], dtype=torch.float64)
        # After this step's sync p.grad is the average: its non-zero blocks are the sum's.
        summed = [self.nonzero_blocks(to_flat_coo(p.grad)[0]) if p.grad is not None else 0 for p in self.params]
        if self.world_size > 1:
            self.comm.allreduce(local).wait()  # accounted: profiling traffic is real traffic
        local /= self.world_size
        fresh = self._samples == 0
        weight = self._samples / (self._samples + 1)  # running mean over the round, as the base's
        for i in everyone:
            blocks = num_blocks(self.params[i].numel(), self.block_size)
            p = float(local[i]) / blocks if blocks else 0.0
            gamma = summed[i] / float(local[i]) if local[i] > 0 else 1.0
            self.block_density[i] = p if fresh else weight * self.block_density[i] + (1 - weight) * p
            self.block_gamma[i] = gamma if fresh else weight * self.block_gamma[i] + (1 - weight) * gamma
        self._local_blocks.clear()
        super()._profile()

    def summed_size(self, index: int, indices: torch.Tensor) -> tuple[float, float]:
        # The sum comes back as every lane of its non-zero blocks, zeros included, so count blocks
        # against the block profile: lanes against profiled non-zeros read as drift of up to B times.
        if index not in self.block_density:
            return super().summed_size(index, indices)
        blocks = num_blocks(self.params[index].numel(), self.block_size)
        return self.nonzero_blocks(indices), self.block_density[index] * self.block_gamma[index] * blocks

    def sparse_seconds(self, index: int) -> float:
        if index not in self.block_density:  # no block profile (an old checkpoint): element figures
            return super().sparse_seconds(index)
        p = self.params[index]
        sparse_bytes = omnireduce_bytes(p.numel(), self.block_density[index], self.block_gamma[index],
                                        self.world_size, self.block_size, p.element_size())
        return sparse_bytes * 8 / self.network.bandwidth_bps + self.sparse_latency_steps() * self.network.latency_s

    def routing(self) -> dict[str, dict[str, Any]]:
        table = super().routing()
        for i, name in enumerate(self.names):
            table[name].update(block_density=self.block_density.get(i), block_gamma=self.block_gamma.get(i))
        return table

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "block_density": dict(self.block_density),
                "block_gamma": dict(self.block_gamma)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.block_density = {int(k): v for k, v in state.get("block_density", {}).items()}
        self.block_gamma = {int(k): v for k, v in state.get("block_gamma", {}).items()}
        super().load_state_dict(state)
