"""SparCML: sparse allreduce by recursive doubling with merging, switching to dense past fill-in.

Each of the log2 n stages swaps the partial sum of 2^i workers with a partner and merges it — one
linear pass over two sorted index lists (:func:`kernels.merge_rows`) — so a worker receives
gamma_{2^i} d M units at stage i: little while the index sets overlap, much when they are disjoint.
Units are an embedding's rows (one index per row) or single elements. Once a partial sum is full
enough that (index, unit) pairs outweigh the dense vector (``dense_threshold``, by default the
break-even density: u / (4 + u) for u-byte units), it travels dense. Non-power-of-two n folds the
extra ranks in first and out at the end.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ddlscale.comm.network import NetworkModel
from ddlscale.sync.sparse.recursive import SparseDoubling, break_even_density
from ddlscale.sync.sparse.sparse_config import SparCMLConfig
from ddlscale.sync.sparse.sparse_sync import SparseSync
from ddlscale.sync.sparse.traffic import Exchanges, Sparsity, Traffic, doubling_rounds, doubling_seconds


class SparCMLCost:
    """What SparCML moves: stage by stage of recursive doubling, the partial's pairs or its dense
    vector, whichever it travels as, one message per stage each way; extra ranks fold in and out."""

    def __init__(self, dense_threshold: str | float = "auto"):
        self.dense_threshold = dense_threshold

    def threshold(self, unit_bytes: int) -> float:
        return break_even_density(unit_bytes) if self.dense_threshold == "auto" else float(self.dense_threshold)

    def traffic(self, s: Sparsity, exchanges: Exchanges) -> Traffic:
        core = 1 << (s.n.bit_length() - 1)
        stages = core.bit_length() - 1
        # Measured gamma_{2^i} where profiled, else the bound min(2^i, gamma_n).
        gammas = s.gammas or [max(1.0, min(2.0**i, s.gamma)) for i in range(stages + 1)]
        switch = self.threshold(s.unit_bytes)

        def message(density: float) -> float:
            return s.units * s.unit_bytes if density > switch else density * s.units * s.pair_bytes

        sizes = [message(min(1.0, gammas[i] * s.density)) for i in range(stages)]
        if core < s.n:  # fold in (one worker's set) and out (the sum)
            sizes += [message(s.density), message(min(1.0, s.gamma * s.density))]
        return Traffic(sum(sizes), doubling_rounds(s.n), swaps=sum(exchanges.rounds(b) for b in sizes))

    def projected_seconds(self, model: NetworkModel, sets: Sequence[torch.Tensor], numel: int,
                          unit_bytes: int) -> float:
        return doubling_seconds(model, sets, numel, unit_bytes, dense_threshold=self.threshold(unit_bytes))


class SparCMLSync(SparseSync):
    """``sync=sparcml``. Args beyond :class:`SparseSync`'s:

    dense_threshold: ``"auto"`` (break-even density of the unit) or a density in (0, 1] past which
        a partial sum is sent dense.
    """

    schema = SparCMLConfig  # its keys and their checks

    profiles_doubling = True

    def __init__(self, dense_threshold: str | float = "auto", **kwargs):
        SparCMLConfig(dense_threshold=dense_threshold, **kwargs)
        super().__init__(**kwargs)
        self.dense_threshold = dense_threshold

    def scheme_cost(self) -> SparCMLCost:
        return SparCMLCost(self.dense_threshold)

    def threshold(self, unit_bytes: int) -> float:
        return self.scheme_cost().threshold(unit_bytes)

    def sync_sparse(self, group: list[int], units: int, width: int, ids: torch.Tensor, values: torch.Tensor):
        doubling = SparseDoubling(self.sparse_comm, units, width, values.dtype,
                                  self.threshold(width * values.element_size()), self.timed)
        return doubling.run(ids, values)
