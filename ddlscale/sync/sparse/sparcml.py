"""SparCML: sparse allreduce by recursive doubling with merging, switching to dense past fill-in.

Each of the log2 n stages swaps the partial sum of 2^i workers with a partner and merges it, so a
worker receives gamma_{2^i} d M non-zeros at stage i — little while the index sets overlap, much
when they are disjoint. Once a partial sum is full enough that (index, value) pairs outweigh the
dense vector (``dense_threshold``, by default the break-even density: 1/2 for fp32 with int32
indices), it travels dense. Non-power-of-two n folds the extra ranks in first and out at the end.
"""

from __future__ import annotations

import torch

from ddlscale.sync.sparse.base import SparseSync
from ddlscale.sync.sparse.recursive import SparseDoubling, break_even_density


class SparCMLSync(SparseSync):
    """``sync=sparcml``. Args beyond :class:`SparseSync`'s:

    dense_threshold: ``"auto"`` (break-even density of the value type) or a density in (0, 1]
        past which a partial sum is sent dense.
    """

    profiles_doubling = True

    def __init__(self, dense_threshold: str | float = "auto", **kwargs):
        super().__init__(**kwargs)
        if dense_threshold != "auto" and not (isinstance(dense_threshold, int | float)
                                              and 0 < dense_threshold <= 1):
            raise ValueError(f"sync.dense_threshold must be 'auto' or a density in (0, 1], got {dense_threshold!r}")
        self.dense_threshold = dense_threshold

    def threshold(self, value_bytes: int) -> float:
        return break_even_density(value_bytes) if self.dense_threshold == "auto" else float(self.dense_threshold)

    def sync_sparse(self, group: list[int], numel: int, indices: torch.Tensor, values: torch.Tensor):
        doubling = SparseDoubling(self.comm, numel, values.dtype, self.threshold(values.element_size()), self.timed)
        return doubling.run(indices, values)

    def sparse_seconds(self, index: int) -> float:
        """Stage by stage: the partial's pairs or its dense vector, whichever it travels as."""
        p = self.params[index]
        n, numel, value = self.world_size, p.numel(), p.element_size()
        d, gamma_n = self.density.get(index, 1.0), self.gamma.get(index, 1.0)
        core = 1 << (n.bit_length() - 1)
        stages = core.bit_length() - 1
        # Measured gamma_{2^i} where profiled, else the bound min(2^i, gamma_n).
        gammas = self.gammas.get(index) or [max(1.0, min(2.0**s, gamma_n)) for s in range(stages + 1)]
        switch = self.threshold(value)

        def message(density: float) -> float:
            return numel * value if density > switch else density * numel * (4 + value)

        nbytes = sum(message(min(1.0, gammas[s] * d)) for s in range(stages))
        steps = 2 * stages
        if core < n:  # fold in (one worker's vector) and out (the sum)
            nbytes += message(d) + message(min(1.0, gamma_n * d))
            steps += 4
        return nbytes * 8 / self.network.bandwidth_bps + steps * self.network.latency_s
