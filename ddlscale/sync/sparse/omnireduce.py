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

- A block is a run of whole units (rows of an embedding table, or elements): ``block_size // width``
  rows of ``width`` values, at least one row. A row never straddles two blocks, so the sparse
  gradient's rows map to blocks without touching the rest of the table.
- Blocks are cut per tensor: in a fused group each tensor starts on a block boundary, so a block
  never mixes two tensors and the block density profiled per tensor is exactly what travels. A
  tensor's last block may be partial; it travels padded (fixed-size rows, like OmniReduce's
  fixed-size packets), and the padding is charged.
- A block travels as one row of the sparse syncs' wire format (int32 block id, then its values).
  One exchange carries a worker's blocks to every aggregator; one exchange carries every
  aggregator's sums back.
- A block is non-zero if any value is non-zero or NaN (NaN must propagate). A summed block that
  cancels to all zeros is not sent back.

Bytes per worker and step for one tensor of M values of s bytes, cut into nb blocks of B values of
which a fraction p is non-zero on a worker and gamma_b * p after summing over the n workers, with
rows of w = 4 + B s bytes: push (n-1)/n p nb w, pull (n-1)/n gamma_b p nb w, so

    (n - 1) / n * (1 + gamma_b) * p * nb * (4 + B s)

on average over workers. That average is what routing assumes, as for ``sparse_ps``; with the even
split the busiest aggregator moves more.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import Any

import torch

from ddlscale.comm.network import NetworkModel
from ddlscale.sync.sparse import pushpull
from ddlscale.sync.sparse.partition import ContiguousPartitioner
from ddlscale.sync.sparse.pushpull import INDEX_BYTES
from ddlscale.sync.sparse.rows import units_of
from ddlscale.sync.sparse.sparse_config import OmniReduceConfig
from ddlscale.sync.sparse.sparse_sync import SparseSync
from ddlscale.sync.sparse.traffic import (
    PUSH_PULL_ROUNDS,
    Exchanges,
    Sparsity,
    Traffic,
    partitioned_seconds,
    push_pull_exchanges,
)


def num_blocks(units: int, rows_per_block: int) -> int:
    return -(-units // rows_per_block)


def rows_per_block(block_size: int, width: int) -> int:
    """Whole units in a block of about ``block_size`` values (at least one)."""
    return max(1, block_size // width)


def omnireduce_bytes(units: int, block_density: float, block_gamma: float, n: int, block_rows: int,
                     unit_bytes: int) -> float:
    """Mean bytes a worker sends (and receives) per step for one tensor (module docstring)."""
    row = INDEX_BYTES + block_rows * unit_bytes
    return (n - 1) / n * (1 + block_gamma) * block_density * num_blocks(units, block_rows) * row


def scattered_block_density(density: float, block_rows: int) -> float:
    """Fraction of non-zero blocks when non-zero units fall independently at random: a block is empty
    with probability (1 - d)^B. Clustered non-zeros (embedding rows) fill far fewer blocks."""
    return 1.0 - (1.0 - min(1.0, density)) ** block_rows


class OmniReduceCost:
    """What OmniReduce moves: non-zero blocks of ``block_size`` values, each with its int32 block id,
    pushed to an even contiguous split of aggregators and pulled back summed (module doc).

    From figures it is priced on the profiled block density and block gamma (``blocks``) where they
    exist, else from the unit figures as if the non-zero units were scattered at random."""

    def __init__(self, block_size: int = 256):
        self.block_size = block_size

    def traffic(self, s: Sparsity, exchanges: Exchanges, blocks: tuple[float, float] | None = None) -> Traffic:
        block_rows = rows_per_block(self.block_size, s.width)
        if blocks is None:
            local = scattered_block_density(s.density, block_rows)
            summed = scattered_block_density(s.gamma * s.density, block_rows)
            nbytes = omnireduce_bytes(s.units, local, summed / local if local > 0 else 1.0, s.n, block_rows,
                                      s.unit_bytes)
            return Traffic(nbytes, PUSH_PULL_ROUNDS, exchanges=push_pull_exchanges(s, exchanges))
        density, gamma = blocks
        nbytes = omnireduce_bytes(s.units, density, gamma, s.n, block_rows, s.unit_bytes)
        per_peer = nbytes / max(1, 2 * (s.n - 1))
        return Traffic(nbytes, PUSH_PULL_ROUNDS, exchanges=2 * exchanges.rounds(per_peer))

    def projected_seconds(self, model: NetworkModel, sets: Sequence[torch.Tensor], numel: int,
                          unit_bytes: int) -> float:
        """From element index sets: every block that holds one, pushed to its aggregator."""
        n, block = len(sets), rows_per_block(self.block_size, 1)
        blocks = num_blocks(numel, block)
        block_sets = [torch.unique(s // block) for s in sets]

        def by_block(items):
            return items * n // blocks
        block_bytes = INDEX_BYTES + block * unit_bytes  # a block id and the values
        return partitioned_seconds(model, block_sets, by_block, n, block_bytes,
                                   lambda s, mine: mine.numel() * block_bytes)


class BlockLayout:
    """The block grid over a fused group: unit j of tensor k lies in block ``first_block[k] + j // B``
    at slot ``j % B`` (B units per block); each tensor starts on a fresh block."""

    def __init__(self, sizes: list[int], block_rows: int):
        self.block_rows = block_rows
        self.sizes = torch.tensor(sizes, dtype=torch.int64)
        self.starts = torch.tensor([0, *itertools.accumulate(sizes)], dtype=torch.int64)
        blocks = [num_blocks(s, block_rows) for s in sizes]
        self.first_block = torch.tensor([0, *itertools.accumulate(blocks)], dtype=torch.int64)
        self.num_blocks = int(self.first_block[-1])

    def to_blocks(self, ids: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Fused unit ids (ascending) and rows -> sorted ids of the non-zero blocks and their values,
        shape (k, B * width)."""
        width = values.shape[1]
        tensor_of = torch.bucketize(ids, self.starts[1:-1], right=True)
        local = ids - self.starts[tensor_of]
        block = self.first_block[tensor_of] + local // self.block_rows
        block_ids, slot = torch.unique_consecutive(block, return_inverse=True)  # ids ascending: blocks too
        blocks = values.new_zeros((block_ids.numel(), self.block_rows, width))
        blocks[slot, local % self.block_rows] = values
        return block_ids, blocks.view(block_ids.numel(), self.block_rows * width)

    def to_units(self, block_ids: torch.Tensor, blocks: torch.Tensor, width: int):
        """Blocks -> fused unit ids and rows of every non-zero unit that belongs to a tensor (padding dropped)."""
        tensor_of = torch.bucketize(block_ids, self.first_block[1:-1], right=True)
        slots = torch.arange(self.block_rows, dtype=torch.int64)
        local = (block_ids - self.first_block[tensor_of])[:, None] * self.block_rows + slots
        rows = blocks.view(-1, self.block_rows, width)
        keep = (local < self.sizes[tensor_of][:, None]) & (rows != 0).any(dim=2)  # NaN != 0
        return (local + self.starts[tensor_of][:, None])[keep], rows[keep]


class OmniReduceSync(SparseSync):
    """``sync=omnireduce``. Args beyond :class:`SparseSync`'s:

    block_size: values per block (OmniReduce's default 256). Larger blocks carry less id overhead
        but waste more bandwidth on the zeros around scattered non-zeros.

    Routing judges each tensor by its profiled *block* density (fraction of non-zero blocks per
    worker) and block gamma (of the sum / per worker), not by element density: 1% of elements
    scattered over every block saves nothing here, 1% in one contiguous run saves 99%. Drift
    (``reprofile_drift``) is judged in non-zero units, as for every sparse sync.
    """

    schema = OmniReduceConfig  # its keys and their checks
    # A block is a run of rows as wide as one tensor's, profiled on that tensor's own grid: fusing tables
    # that share row ids would change the grid routing priced.
    shares_rows = False

    def __init__(self, block_size: int = 256, **kwargs: Any):
        OmniReduceConfig(block_size=block_size, **kwargs)
        super().__init__(**kwargs)
        self.block_size = block_size

    def on_setup(self) -> None:
        self.partitioner = ContiguousPartitioner(self.world_size)  # over block ids, not elements
        super().on_setup()
        self._local_blocks: dict[int, int] = {}

    # -- the scheme ------------------------------------------------------------------------------
    def sync_sparse(self, group: list[int], units: int, width: int, ids: torch.Tensor, values: torch.Tensor):
        comm = self.sparse_comm
        with self.timed("encode"):
            layout = BlockLayout([self.units(i) for i in group], rows_per_block(self.block_size, width))
            block_ids, blocks = layout.to_blocks(ids, values)
        # Block ids ascend, so each aggregator's blocks are already one contiguous run.
        group_by = functools.partial(self.partitioner.group, numel=layout.num_blocks)
        received = pushpull.push(comm, block_ids, blocks, group_by, self.timed)
        with self.timed("decode"):
            summed = pushpull.aggregate(received)  # arrival order (rank 0 first): deterministic
        pieces = pushpull.pull_coo(comm, *summed, self.timed)
        with self.timed("decode"):
            return layout.to_units(torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces]), width)

    def scheme_cost(self) -> OmniReduceCost:
        return OmniReduceCost(self.block_size)

    # -- profiling and routing by block density -----------------------------------------------------
    def _row_blocks(self, index: int) -> int:
        """Units per block on the tensor's grid of rows (its profiled rows)."""
        return rows_per_block(self.block_size, self.row_width(index))

    def _nonzero_blocks(self, index: int, rows: torch.Tensor) -> int:
        """Blocks of a tensor's own grid that hold one of these non-zero rows."""
        return int(torch.unique(rows // self._row_blocks(index)).numel())

    def _observe(self, index: int, grad: torch.Tensor) -> None:
        super()._observe(index, grad)
        self._local_blocks[index] = self._nonzero_blocks(index, self._local[index][1])

    def _profile(self) -> None:
        # Block figures first: the base routes at the end of its own profiling, reading them.
        everyone = range(len(self.params))
        local = torch.tensor([self._local_blocks.get(i, 0) for i in everyone], dtype=torch.float64)
        # After this step's sync p.grad is the average: its non-zero blocks are the sum's.
        summed = [0 if p.grad is None else self._nonzero_blocks(i, units_of(p.grad, self.row_width(i))[0])
                  for i, p in enumerate(self.params)]
        if self.world_size > 1:
            self.comm.allreduce(local).wait()  # accounted: profiling traffic is real traffic
        local /= self.world_size
        fresh = self._samples == 0
        weight = self._samples / (self._samples + 1)  # running mean over the round, as the base's
        for i in everyone:
            blocks = num_blocks(self.params[i].numel() // self.row_width(i), self._row_blocks(i))
            p = float(local[i]) / blocks if blocks else 0.0
            gamma = summed[i] / float(local[i]) if local[i] > 0 else 1.0
            route = self.routes[i]
            route.block_density = p if fresh else weight * route.block_density + (1 - weight) * p
            route.block_gamma = gamma if fresh else weight * route.block_gamma + (1 - weight) * gamma
        self._local_blocks.clear()
        super()._profile()

    def set_traffic(self, members):
        """Priced on the profiled block figures, where they are in the units routed (else the unit
        figures, as if scattered)."""
        index, = members
        route, blocks = self.routes[index], None
        if route.block_density is not None and self.unit_width(index) == self.row_width(index):
            blocks = (route.block_density, route.block_gamma)
        return self.scheme_cost().traffic(self.sparsity(index), self.exchanges, blocks)

    def routing(self) -> dict[str, dict[str, Any]]:
        table = super().routing()
        for name, route in zip(self.names, self.routes, strict=True):
            table[name].update(block_density=route.block_density, block_gamma=route.block_gamma)
        return table

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), **self._figures(("block_density", "block_gamma"))}

    def load_routes(self, state: dict[str, Any]) -> None:
        super().load_routes(state)
        for name in ("block_density", "block_gamma"):
            for i, value in state.get(name, {}).items():
                setattr(self.routes[int(i)], name, value)
