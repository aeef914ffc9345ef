"""Common machinery of the sparse backends: profile densities, route tensors, sync the sparse ones.

Every sparse backend starts as dense allreduce: during the first ``profile_steps`` steps it measures,
per tensor, the density d on each worker and the density of the sum (gamma_n = d_sum / d), agreed
across ranks by one small allreduce. Then each tensor whose sparse scheme moves fewer bytes than
dense allreduce (the backend's own volume formula) switches to the sparse path for good; the rest
stay in the dense buckets. Sparse tensors are synchronized after backward, in backward order.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import torch

from ddlscale.comm.cost import NetworkModel
from ddlscale.sync.dense import DenseAllreduce
from ddlscale.sync.sparse.coo import scatter_dense, to_flat_coo


class SparseSync(DenseAllreduce):
    """Base of agsparse, sparse_ps, omnireduce, sparcml and zen: subclasses implement
    :meth:`sparse_volume` (bytes per worker, to decide routing) and :meth:`sync_sparse`.

    Args:
        profile_steps: steps of dense sync spent measuring densities before routing tensors.
        sparse_params: ``"auto"`` (route by the volume formulas) or a list of parameter names that
            must go sparse (others stay dense), e.g. to force a scheme for a benchmark.
        network_bandwidth, network_latency: the network the routing assumes (tc units). A tensor goes
            sparse when its bytes at that bandwidth plus the scheme's extra message latencies beat
            its dense bytes; small tensors stay in the dense buckets, where latency is shared.
        bucket_mb, first_bucket_mb: buckets of the tensors that stay dense.
    """

    def __init__(self, profile_steps: int = 2, sparse_params: str | list[str] = "auto",
                 network_bandwidth: str = "1gbit", network_latency: str = "100us",
                 bucket_mb: float = 25.0, first_bucket_mb: float = 1.0):
        super().__init__(bucket_mb=bucket_mb, first_bucket_mb=first_bucket_mb)
        self.network = NetworkModel.of(bandwidth=network_bandwidth, latency=network_latency)
        if not isinstance(profile_steps, int) or profile_steps < 1:
            raise ValueError(f"sync.profile_steps must be an integer >= 1, got {profile_steps!r}")
        if sparse_params != "auto" and not isinstance(sparse_params, list | tuple):
            raise ValueError(f"sync.sparse_params must be 'auto' or a list of names, got {sparse_params!r}")
        self.profile_steps = profile_steps
        self.sparse_params = sparse_params if sparse_params == "auto" else list(sparse_params)
        self.sparse: list[int] = []  # parameter indices on the sparse path, decided after profiling
        self.density: dict[int, float] = {}  # mean per-worker density d
        self.gamma: dict[int, float] = {}  # density of the sum / d

    def on_setup(self) -> None:
        if getattr(self, "names", None) and self.sparse_params != "auto":
            unknown = set(self.sparse_params) - set(self.names)
            if unknown:
                raise ValueError(f"sync.sparse_params names unknown parameters: {sorted(unknown)}")
        super().on_setup()
        self._sparse_set = set(self.sparse)
        self._local_nnz: dict[int, int] = {}
        self._pending_sparse: dict[int, tuple[torch.Tensor, torch.Tensor, int | None]] = {}

    def _assign(self, order: list[int]) -> list[list[int]]:
        sparse = set(self.sparse)
        return super()._assign([i for i in order if i not in sparse])

    # -- per step ------------------------------------------------------------------------------
    def on_grad_ready(self, index: int, param: torch.nn.Parameter) -> None:
        if index in self._sparse_set:
            start = time.perf_counter()
            grad = param.grad
            indices, values = to_flat_coo(grad)
            # Scale before summing, as the dense path does, so exact data gives the same bits.
            self._pending_sparse[index] = (indices, values * (1.0 / self.world_size),
                                           grad.sparse_dim() if grad.is_sparse else None)
            self._timers["encode"] += time.perf_counter() - start
            return
        if self.steps < self.profile_steps:
            self._local_nnz[index] = int(to_flat_coo(param.grad)[0].numel())
        super().on_grad_ready(index, param)

    def finish(self) -> None:
        super().finish()  # dense buckets first: they were launched during backward
        for group in self._sparse_groups():
            self._finish_group(group)
        if self.steps < self.profile_steps:
            self._profile()

    def _sparse_groups(self) -> list[list[int]]:
        """Sparse tensors fused by dtype, in backward order: one push and one pull per group, so
        the per-message latency is paid once, not once per tensor."""
        groups: dict[torch.dtype, list[int]] = {}
        for i in self.backward_order:
            if i in self._sparse_set:
                groups.setdefault(self.params[i].dtype, []).append(i)
        return list(groups.values())

    def _finish_group(self, group: list[int]) -> None:
        start = time.perf_counter()
        sizes = [self.params[i].numel() for i in group]
        offsets = [0, *itertools.accumulate(sizes)]
        parts_idx, parts_val, sparse_dims = [], [], {}
        for k, i in enumerate(group):
            pending = self._pending_sparse.pop(i, None)
            if pending is None:  # no gradient this step on this rank: contribute nothing
                continue
            indices, values, sparse_dims[i] = pending
            parts_idx.append(indices + offsets[k])  # one index space over the fused tensors
            parts_val.append(values)
        dtype = self.params[group[0]].dtype
        indices = torch.cat(parts_idx) if parts_idx else torch.empty(0, dtype=torch.int64)
        values = torch.cat(parts_val) if parts_val else torch.empty(0, dtype=dtype)
        self._timers["encode"] += time.perf_counter() - start
        total_idx, total_val = self.sync_sparse(group, offsets[-1], indices, values)
        start = time.perf_counter()
        owner = torch.bucketize(total_idx, torch.tensor(offsets[1:-1], dtype=torch.int64), right=True)
        for k, i in enumerate(group):
            mine = owner == k
            p = self.params[i]
            average = scatter_dense(total_idx[mine] - offsets[k], total_val[mine], p)
            sparse_dim = sparse_dims.get(i)
            p.grad = average.to_sparse(sparse_dim) if sparse_dim is not None else average
        self._timers["decode"] += time.perf_counter() - start

    def sync_sparse(self, group: list[int], numel: int, indices: torch.Tensor, values: torch.Tensor):
        """Global sum of every rank's (indices, values) over the fused index space of ``group``
        (``numel`` elements), as flat COO (override)."""
        raise NotImplementedError

    def sparse_volume(self, numel: int, density: float, gamma: float) -> float:
        """Bytes per worker this scheme moves for one tensor (override); compared with dense's."""
        raise NotImplementedError

    # -- profiling and routing -------------------------------------------------------------------
    def _profile(self) -> None:
        dense = [i for i in range(len(self.params)) if i not in self._sparse_set]
        local = torch.tensor([self._local_nnz.get(i, 0) for i in dense], dtype=torch.float64)
        summed = torch.tensor([int(to_flat_coo(self.params[i].grad)[0].numel()) if self.params[i].grad is not None
                               else 0 for i in dense], dtype=torch.float64)
        if self.world_size > 1:
            self.comm.allreduce(local).wait()  # accounted: profiling traffic is real traffic
        local /= self.world_size
        for k, i in enumerate(dense):
            numel = self.params[i].numel()
            d = float(local[k]) / numel
            gamma = float(summed[k]) / float(local[k]) if local[k] > 0 else 1.0
            # Average over the profiling steps.
            seen = self.steps
            self.density[i] = (self.density.get(i, 0.0) * seen + d) / (seen + 1)
            self.gamma[i] = (self.gamma.get(i, 0.0) * seen + gamma) / (seen + 1)
        self._local_nnz.clear()
        if self.steps + 1 == self.profile_steps:
            self._route()

    def sparse_latency_steps(self) -> int:
        """Sequential message steps the sparse scheme adds per tensor (push counts, push, sizes, pull)."""
        return 4 * (self.world_size - 1)

    def prefers_sparse(self, index: int) -> bool:
        """The cost model's verdict for one profiled tensor (bytes in a dense bucket share latency)."""
        p = self.params[index]
        n, b = self.world_size, self.network.bandwidth_bps
        dense_s = 2 * (n - 1) / n * p.numel() * p.element_size() * 8 / b
        sparse_bytes = self.sparse_volume(p.numel(), self.density.get(index, 1.0), self.gamma.get(index, 1.0))
        sparse_s = sparse_bytes * 8 / b + self.sparse_latency_steps() * self.network.latency_s
        return sparse_s < dense_s

    def _route(self) -> None:
        if self.sparse_params == "auto":
            self.sparse = [i for i in range(len(self.params)) if self.world_size > 1 and self.prefers_sparse(i)]
        else:
            self.sparse = [self.names.index(name) for name in self.sparse_params]
        self.on_setup()  # rebuild the dense buckets without the sparse tensors

    def routing(self) -> dict[str, dict[str, Any]]:
        """Per parameter: path, profiled density and gamma (for logs and reports)."""
        return {self.names[i]: {"path": "sparse" if i in self._sparse_set else "dense",
                                "density": self.density.get(i), "gamma": self.gamma.get(i)}
                for i in range(len(self.params))}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "sparse": list(self.sparse), "density": dict(self.density),
                "gamma": dict(self.gamma)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sparse = list(state["sparse"])
        self.density = {int(k): v for k, v in state["density"].items()}
        self.gamma = {int(k): v for k, v in state["gamma"].items()}
        super().load_state_dict(state)
