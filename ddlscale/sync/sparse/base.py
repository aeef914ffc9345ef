"""Common machinery of the sparse backends: profile densities, route tensors, sync the sparse ones.

Every sparse backend starts as dense allreduce: during the first ``profile_steps`` steps it measures,
per tensor, the density d on each worker and the density of the sum (gamma_n = d_sum / d), agreed
across ranks by one small allreduce; backends that weigh recursive doubling (``profiles_doubling``)
also measure gamma_{2^i}, the densification of aligned groups of 2^i workers, by OR-ing non-zero
bitmaps up the doubling stages. Then each tensor whose sparse scheme beats dense allreduce on the
cost model switches to the sparse path; the rest stay in the dense buckets. Sparse tensors are
synchronized after backward, in backward order.

Density drifts (an embedding's batch vocabulary grows, a model unfreezes): after routing, every step
compares each sparse tensor's summed non-zeros — the same number on every rank, so all ranks agree
without a collective — with its profile; past a factor of ``reprofile_drift`` the backend profiles
again for ``profile_steps`` steps (tensors keep their current path meanwhile) and re-routes.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ddlscale.comm.cost import NetworkModel
from ddlscale.comm.probe import MEASURED, probe_latency
from ddlscale.sync.dense import DenseAllreduce
from ddlscale.sync.sparse.coo import coo_slices, scatter_dense, to_flat_coo
from ddlscale.sync.sparse.pushpull import INDEX_DTYPE, pack_bits
from ddlscale.sync.sparse.recursive import union_counts


class SparseSync(DenseAllreduce):
    """Base of agsparse, sparse_ps, omnireduce, sparcml and zen: subclasses implement
    :meth:`sync_sparse` and either :meth:`sparse_volume` (bytes per worker) or, for schemes whose
    time is not bytes over one bandwidth, :meth:`sparse_seconds` — the routing decision.

    Args:
        profile_steps: steps of dense sync spent measuring densities before routing tensors.
        sparse_params: ``"auto"`` (route by the volume formulas) or a list of parameter names that
            must go sparse (others stay dense), e.g. to force a scheme for a benchmark.
        network_bandwidth, network_latency: the network the routing assumes (tc units). A tensor goes
            sparse when its bytes at that bandwidth plus the scheme's extra message latencies beat
            its dense bytes; small tensors stay in the dense buckets, where latency is shared.
            ``network_latency: measured`` times small exchanges on the sync group before the first
            routing (:func:`~ddlscale.comm.probe.probe_latency`) and takes their per-message cost.
        reprofile_drift: re-profile when a sparse tensor's summed density moves by more than this
            factor from its profile (``None``: never).
        bucket_mb, first_bucket_mb: buckets of the tensors that stay dense.
    """

    profiles_doubling = False  # measure gamma_{2^i} too (backends that weigh recursive doubling)
    # Elements one fused group may span: its flat indices travel as int32 (override for other wires).
    max_group_numel = torch.iinfo(INDEX_DTYPE).max + 1

    def __init__(self, profile_steps: int = 2, sparse_params: str | Sequence[str] = "auto",
                 network_bandwidth: str = "1gbit", network_latency: str = "100us",
                 reprofile_drift: float | None = 2.0, bucket_mb: float = 25.0, first_bucket_mb: float = 1.0):
        super().__init__(bucket_mb=bucket_mb, first_bucket_mb=first_bucket_mb)
        self.measure_latency = network_latency == MEASURED
        self.network = NetworkModel.of(bandwidth=network_bandwidth, latency="0us" if self.measure_latency else network_latency)
        if not isinstance(profile_steps, int) or profile_steps < 1:
            raise ValueError(f"sync.profile_steps must be an integer >= 1, got {profile_steps!r}")
        # Any sequence of names but a string: from Hydra the list arrives as an OmegaConf ListConfig.
        if sparse_params != "auto" and (isinstance(sparse_params, str) or not isinstance(sparse_params, Sequence)):
            raise ValueError(f"sync.sparse_params must be 'auto' or a list of names, got {sparse_params!r}")
        if reprofile_drift is not None and not (isinstance(reprofile_drift, int | float) and reprofile_drift > 1):
            raise ValueError(f"sync.reprofile_drift must be a number > 1 or null, got {reprofile_drift!r}")
        self.profile_steps = profile_steps
        self.sparse_params = sparse_params if sparse_params == "auto" else list(sparse_params)
        self.reprofile_drift = reprofile_drift
        self.sparse: list[int] = []  # parameter indices on the sparse path, decided after profiling
        self.density: dict[int, float] = {}  # mean per-worker density d
        self.gamma: dict[int, float] = {}  # density of the sum / d
        self.gammas: dict[int, list[float]] = {}  # [gamma_1, gamma_2, gamma_4, ..., gamma_n] (power-of-two n)
        self.profiles = 0  # profiling rounds run (1 + re-profiles)
        self._profile_left = profile_steps  # profiling steps still to run in this round
        self._samples = 0  # steps averaged into the current round's profile

    def on_setup(self) -> None:
        if getattr(self, "names", None) and self.sparse_params != "auto":
            unknown = set(self.sparse_params) - set(self.names)
            if unknown:
                raise ValueError(f"sync.sparse_params names unknown parameters: {sorted(unknown)}")
        super().on_setup()
        self._sparse_set = set(self.sparse)
        self._local_nnz: dict[int, int] = {}
        self._local_masks: dict[int, torch.Tensor] = {}
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
            if self._profile_left:
                self._observe(index, indices)
            return
        if self._profile_left:
            self._observe(index, to_flat_coo(param.grad)[0])
        super().on_grad_ready(index, param)

    def _observe(self, index: int, indices: torch.Tensor) -> None:
        """Record one local gradient's non-zeros for the profile (and its bitmap, if asked)."""
        self._local_nnz[index] = int(indices.numel())
        if self._doubling_profiled():
            mask = torch.zeros(self.params[index].numel(), dtype=torch.bool)
            mask[indices] = True
            self._local_masks[index] = pack_bits(mask)

    def _doubling_profiled(self) -> bool:
        n = self.world_size
        return self.profiles_doubling and n > 1 and n & (n - 1) == 0

    def finish(self) -> None:
        super().finish()  # dense buckets first: they were launched during backward
        drifted = False
        for group in self._sparse_groups():
            drifted |= self._finish_group(group)
        if self._profile_left:
            self._profile()
        elif drifted:
            self._profile_left, self._samples = self.profile_steps, 0

    def _sparse_groups(self) -> list[list[int]]:
        """Sparse tensors fused by :meth:`group_key`, in backward order: one push and one pull per
        group, so the per-message latency is paid once, not once per tensor."""
        groups: dict[Any, list[list[int]]] = {}
        filled: dict[Any, int] = {}  # elements in each key's last group
        for i in self.backward_order:
            if i in self._sparse_set:
                numel, key = self.params[i].numel(), self.group_key(i)
                if numel > self.max_group_numel:
                    raise ValueError(f"{self.names[i]} has {numel} elements, more than the {self.max_group_numel} "
                                     f"its sparse indices can address on the wire; keep it dense (sync.sparse_params)")
                chain = groups.setdefault(key, [[]])
                # Past the wire's index range a new group starts, rather than indices wrapping around.
                if filled.get(key, 0) + numel > self.max_group_numel:
                    chain.append([])
                    filled[key] = 0
                chain[-1].append(i)
                filled[key] = filled.get(key, 0) + numel
        return [group for chain in groups.values() for group in chain]

    def group_key(self, index: int) -> Any:
        """Tensors with equal keys are fused: same dtype (and, in subclasses, same scheme)."""
        return str(self.params[index].dtype)

    def _finish_group(self, group: list[int]) -> bool:
        """Sync one fused group; True when a tensor's summed density drifted from its profile."""
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
        drifted = False
        for k, i in enumerate(group):
            mine = owner == k
            p = self.params[i]
            local_idx = total_idx[mine] - offsets[k]
            sparse_dim = sparse_dims.get(i)
            if sparse_dim is None:
                p.grad = scatter_dense(local_idx, total_val[mine], p)
            else:
                p.grad = coo_slices(local_idx, total_val[mine], p, sparse_dim)
            drifted |= self._drifted(i, local_idx)
        self._timers["decode"] += time.perf_counter() - start
        return drifted

    def _drifted(self, index: int, indices: torch.Tensor) -> bool:
        """Has the summed density (identical on every rank) left its profile by reprofile_drift?
        ``indices``: the tensor's flat indices in this step's sum."""
        if self.reprofile_drift is None or index not in self.density:
            return False
        summed, profiled = self.summed_size(index, indices)
        ratio = max(1.0, summed) / max(1.0, profiled)
        return not 1 / self.reprofile_drift <= ratio <= self.reprofile_drift

    def summed_size(self, index: int, indices: torch.Tensor) -> tuple[float, float]:
        """The sum's size this step and as profiled, in one unit (override where the scheme returns
        more than the non-zeros, or routes by another unit)."""
        return indices.numel(), self.density[index] * self.gamma.get(index, 1.0) * self.params[index].numel()

    def sync_sparse(self, group: list[int], numel: int, indices: torch.Tensor, values: torch.Tensor):
        """Global sum of every rank's (indices, values) over the fused index space of ``group``
        (``numel`` elements), as flat COO (override)."""
        raise NotImplementedError

    def sparse_volume(self, numel: int, density: float, gamma: float, value_bytes: int) -> float:
        """Bytes per worker this scheme moves for one tensor of ``value_bytes``-byte elements
        (override); compared with dense's."""
        raise NotImplementedError

    # -- profiling and routing -------------------------------------------------------------------
    def _profile(self) -> None:
        """Fold this step's densities into the profile (collective: every rank calls it together)."""
        everyone = range(len(self.params))
        local = torch.tensor([self._local_nnz.get(i, 0) for i in everyone], dtype=torch.float64)
        summed = [int(to_flat_coo(p.grad)[0].numel()) if p.grad is not None else 0 for p in self.params]
        if self.world_size > 1:
            self.comm.allreduce(local).wait()  # accounted: profiling traffic is real traffic
        local /= self.world_size
        fresh = self._samples == 0
        weight = self._samples / (self._samples + 1)  # running mean over this round's steps
        unions = self._profile_unions(local)
        if fresh:  # a tensor no longer a candidate must not keep, nor later blend in, the last round's gammas
            self.gammas.clear()
        for i in everyone:
            numel = self.params[i].numel()
            d = float(local[i]) / numel
            gamma = summed[i] / float(local[i]) if local[i] > 0 else 1.0
            self.density[i] = d if fresh else weight * self.density[i] + (1 - weight) * d
            self.gamma[i] = gamma if fresh else weight * self.gamma[i] + (1 - weight) * gamma
            if i in unions:
                old = self.gammas.get(i) if not fresh else None
                new = unions[i]
                self.gammas[i] = new if old is None else [weight * a + (1 - weight) * b for a, b in zip(old, new, strict=True)]
        self._local_nnz.clear()
        self._local_masks.clear()
        self._samples += 1
        self._profile_left -= 1
        if not self._profile_left:
            self.profiles += 1
            self._route()

    def _profile_unions(self, mean_nnz: torch.Tensor) -> dict[int, list[float]]:
        """gamma_{2^i} for i = 0..log2 n of the tensors sparse could serve (d below 1/2)."""
        if not self._doubling_profiled():
            return {}
        candidates = [i for i in range(len(self.params))
                      if 0 < float(mean_nnz[i]) < 0.5 * self.params[i].numel()]
        if not candidates:
            return {}
        empty = torch.empty(0, dtype=torch.uint8)
        maps = [self._local_masks.get(i, empty) for i in candidates]
        lengths = [(self.params[i].numel() + 7) // 8 for i in candidates]
        maps = [m if m.numel() else torch.zeros(n, dtype=torch.uint8) for m, n in zip(maps, lengths, strict=True)]
        stages = union_counts(self.comm, torch.cat(maps), lengths)
        # Average each group's union over all ranks (members of a group report the same count).
        mean_union = torch.tensor(stages, dtype=torch.float64)
        self.comm.allreduce(mean_union).wait()
        mean_union /= self.world_size
        gammas = {}
        for k, i in enumerate(candidates):
            per_stage = [float(mean_union[s, k]) / float(mean_nnz[i]) for s in range(len(stages))]
            # Ranks' densities differ, so clip to gamma_k's definition range [1, k].
            gammas[i] = [1.0] + [min(2.0 ** (s + 1), max(1.0, g)) for s, g in enumerate(per_stage)]
        return gammas

    def sparse_latency_steps(self) -> int:
        """Sequential message steps the sparse scheme adds per tensor (push counts, push, sizes, pull)."""
        return 4 * (self.world_size - 1)

    def sparse_seconds(self, index: int) -> float:
        """The cost model's time for one profiled tensor on the sparse path (override to refine)."""
        p = self.params[index]
        sparse_bytes = self.sparse_volume(p.numel(), self.density.get(index, 1.0), self.gamma.get(index, 1.0),
                                          p.element_size())
        return sparse_bytes * 8 / self.network.bandwidth_bps + self.sparse_latency_steps() * self.network.latency_s

    def dense_seconds(self, index: int) -> float:
        """The cost model's time for one tensor in a dense bucket, compared with :meth:`sparse_seconds`
        (override where the sparse scheme is priced over another split)."""
        p = self.params[index]
        return self.ring_seconds(p.numel(), p.element_size(), self.world_size)

    def ring_seconds(self, numel: int, value_bytes: int, n: int) -> float:
        """Ring allreduce's bytes among ``n`` at the routing's bandwidth (a bucket shares its latency)."""
        return 2 * (n - 1) / n * numel * value_bytes * 8 / self.network.bandwidth_bps

    def prefers_sparse(self, index: int) -> bool:
        """The cost model's verdict for one profiled tensor."""
        return self.sparse_seconds(index) < self.dense_seconds(index)

    def _route(self) -> None:
        if self.measure_latency and self.world_size > 1:  # every rank: _route runs after a collective profile
            probe = probe_latency(self.comm.group, self.world_size, self.network.bandwidth_bps)
            latency, = self.agreed([probe["exchange_alpha_s"]])
            self.network = dataclasses.replace(self.network, latency_s=latency)
            self.measure_latency = False  # once: re-profiles keep it, so every rank stays in step
        if self.sparse_params == "auto":
            self.sparse = [i for i in range(len(self.params)) if self.world_size > 1 and self.prefers_sparse(i)]
        else:
            self.sparse = [self.names.index(name) for name in self.sparse_params]
        self.on_setup()  # rebuild the dense buckets without the sparse tensors

    def agreed(self, values: list[float], slowest: bool = False) -> list[float]:
        """Rank 0's ``values`` on every rank (``slowest``: the largest of every rank's): measurements
        differ between ranks, routes must not."""
        if self.world_size == 1:
            return values
        tensor = torch.tensor(values, dtype=torch.float64)
        # One-off, outside the accounted traffic, like the backward order: set-up, not sync.
        if slowest:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.comm.group)
        else:
            dist.broadcast(tensor, src=self.comm._global(0), group=self.comm.group)
        return tensor.tolist()

    def routing(self) -> dict[str, dict[str, Any]]:
        """Per parameter: path, profiled density and gammas (for logs and reports)."""
        return {self.names[i]: {"path": "sparse" if i in self._sparse_set else "dense",
                                "density": self.density.get(i), "gamma": self.gamma.get(i),
                                "gammas": self.gammas.get(i)}
                for i in range(len(self.params))}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "sparse": list(self.sparse), "density": dict(self.density),
                "latency_s": None if self.measure_latency else self.network.latency_s,
                "gamma": dict(self.gamma), "gammas": dict(self.gammas), "profiles": self.profiles,
                "profile_left": self._profile_left, "samples": self._samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sparse = list(state["sparse"])
        if state.get("latency_s") is not None:  # the routing's latency, measured or configured
            self.network = dataclasses.replace(self.network, latency_s=state["latency_s"])
            self.measure_latency = False
        self.density = {int(k): v for k, v in state["density"].items()}
        self.gamma = {int(k): v for k, v in state["gamma"].items()}
        self.gammas = {int(k): list(v) for k, v in state.get("gammas", {}).items()}
        self.profiles = int(state.get("profiles", 1 if self.sparse else 0))
        self._profile_left = int(state.get("profile_left", max(0, self.profile_steps - int(state["steps"]))))
        self._samples = int(state.get("samples", 0))
        super().load_state_dict(state)
