"""Deep Gradient Compression (Lin et al., 2018): sampled-threshold top-k with the paper's four
techniques, each switchable — momentum correction, local gradient clipping, momentum factor
masking, and a warm-up of exponentially rising sparsity."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ddlscale.compress.compressor import (
    Segment,
    check_int,
    check_ratio,
    check_seed,
    check_unit_interval,
    count_of,
    counts_of,
    wide,
)
from ddlscale.compress.sparse import SparseCompressor, top_indices

MIN_SAMPLE = 1024  # below this many sampled magnitudes the estimate is too noisy to be worth it
WARMUP_STAGES, WARMUP_FIRST = 4, 0.25  # the paper: 25%, 6.25%, 1.5625%, 0.4% kept, a quarter each stage


class DGC(SparseCompressor):
    """Selection: a threshold estimated from a sample of ``sample_ratio * numel`` magnitudes (at least
    ``MIN_SAMPLE``, drawn with replacement), then every element at or above it is kept — one
    comparison pass instead of an exact top-k over the whole tensor. With k = ceil(ratio * numel)
    and k_s = k * samples / numel its share of the sample, the estimate is the sample's
    min(1.5 k_s, k_s + 3 sqrt(k_s))-th largest magnitude: three binomial standard deviations above k
    (aiming at k itself would undershoot half the time and pay for an exact top-k), capped at the
    middle of the accepted range. The rule when the count still misses (c = elements passing):
    k <= c <= 2k: keep all c; c > 2k: exact top-k among those c candidates (they contain the true
    top-k); c < k: exact top-k over the whole tensor. So the kept count is always in [k, 2k] and every
    kept magnitude >= every dropped one. Tensors too small to sample use exact top-k directly.

    The paper's techniques (:meth:`precondition` and :meth:`sent`, applied by the backend once per
    step and group, before error feedback):

    - ``momentum`` (momentum correction; 0: off): each rank keeps u_t = momentum u_{t-1} + g_t and
      sparsifies its accumulation v_t = v_{t-1} + u_t instead of the gradient's (the accumulation is
      the run's error feedback, memory=residual: p = e + u). Set it to the optimizer's momentum and
      run the optimizer without one (``model.momentum=0``), as the paper does — both at once would
      apply momentum twice.
    - ``momentum_masking`` (momentum factor masking): u is zeroed where v was sent, so stale momentum
      does not keep pushing a coordinate that was just applied.
    - ``clip_norm`` (local gradient clipping; null: off): each tensor's gradient on each rank is
      clipped to L2 norm clip_norm / sqrt(ranks) before it is accumulated — the sum over ranks then
      has about norm clip_norm — so one rank's outlier does not sit in the accumulation for steps.
    - ``warmup_steps`` (0: off): the kept fraction starts at 25% and falls by a quarter in each of 4
      equal stages of ``warmup_steps`` steps in all (25%, 6.25%, 1.56%, 0.39%: the paper's epochs),
      never below ``ratio``, then stays at ``ratio``. Steps synced dense before (a planned sync's
      profiling: :meth:`synced_dense`) count as warm-up steps: they sent everything.

    ``compressor=dgc`` (ddlscale/conf/compressor/dgc.yaml) turns all four on, as the paper runs it: momentum
    correction with the optimizer's momentum (``model.momentum``; the trainer then runs the optimizer
    without it, :func:`ddlscale.trainer.app.move_momentum`), masking, clipping at 5 / sqrt(ranks)
    per tensor, and a 100-step warm-up. The constructor's own defaults are the bare selection.

    Under a planned sync (Espresso, Cupcake), which sends some tensors dense, the four stay on: the
    groups it compresses get the correction, masking and clipping; the tensors it sends dense (its
    dense steps, the groups a plan keeps dense) get the optimizer's momentum from
    :meth:`precondition_dense` — u_t = momentum u_{t-1} + g_t on each rank, sent whole, no masking,
    no clipping. Momentum is linear, so the ranks' u sum to the momentum of the averaged gradient:
    what the optimizer's own buffer would hold. Both kinds of group keep u in the same per-rank
    state, laid out like the group, which a re-plan splits by member and joins again with the
    residuals (:mod:`ddlscale.sync.compressed.regroup`, keeping its sum over ranks): a tensor moving
    from dense to compressed starts its correction from its momentum, and one moving to dense keeps
    its velocity as its momentum (its accumulated residual is sent in its first dense step). The
    warm-up's steps run dense there (:meth:`synced_dense`).

    Fusion: like top-k, DGC selects over the whole group (the threshold is sampled from the group and
    k..2k kept of it: the operator Cupcake and Espresso fuse tensors for; per member it would be the
    layer-wise selection again). Its techniques do not change with fusion: momentum and masking are
    elementwise and clipping is per member (``segments``), so a fused group is preconditioned bit for
    bit as its members alone.

    Payload: ``[values (kept), indices (kept, int32)]``; kept varies with the data.
    """

    name = "dgc"
    fixed_size = False

    def __init__(self, ratio: float = 0.01, sample_ratio: float = 0.01, seed: int = 0, momentum: float = 0.0,
                 momentum_masking: bool = True, clip_norm: float | None = None, warmup_steps: int = 0) -> None:
        super().__init__()
        self.ratio = check_ratio(ratio)
        self.sample_ratio = check_ratio(sample_ratio, "compressor.sample_ratio")
        self.seed = check_seed(seed)
        self.momentum = check_unit_interval(momentum, "compressor.momentum")
        if not isinstance(momentum_masking, bool):
            raise ValueError(f"compressor.momentum_masking must be true or false, got {momentum_masking!r}")
        self.momentum_masking = momentum_masking
        if clip_norm is not None and (isinstance(clip_norm, bool) or not isinstance(clip_norm, (int, float))
                                      or not clip_norm > 0):
            raise ValueError(f"compressor.clip_norm must be a number > 0 or null, got {clip_norm!r}")
        self.clip_norm = None if clip_norm is None else float(clip_norm)
        self.warmup_steps = check_int(warmup_steps, "compressor.warmup_steps", 0)
        self._velocity: dict[str, torch.Tensor] = {}  # u per group (momentum correction)
        self._rounds: dict[str, int] = {}  # preconditioned steps per group: the warm-up's clock
        self._dense = 0  # steps synced dense before the next compressed one (synced_dense): on the clock too
        self._clock = 0

    # -- the paper's techniques ----------------------------------------------------------------
    def precondition(self, tensor: torch.Tensor, name: str, segments: Sequence[int | Segment] | None = None,
                     ranks: int = 1) -> torch.Tensor:
        self._rounds[name] = self._rounds.get(name, 0) + 1
        self._clock = self._dense + max(self._rounds.values()) - 1  # this step from 0, whatever the grouping
        if self.clip_norm is None and not self.momentum:
            return tensor
        g = wide(tensor.reshape(-1))
        if self.clip_norm is not None:
            limit = self.clip_norm / math.sqrt(max(1, ranks))
            sizes = [int(s.numel if isinstance(s, Segment) else s) for s in segments] if segments else [g.numel()]
            norms = torch.stack([p.norm() if p.numel() else p.new_zeros(()) for p in g.split(sizes)])
            factors = (limit / norms.clamp(min=torch.finfo(g.dtype).tiny)).clamp(max=1.0)
            g = g * torch.repeat_interleave(factors, torch.tensor(sizes, device=g.device))
        if self.momentum:
            g = self._accelerated(g, name)
        return g.reshape(tensor.shape)

    def _accelerated(self, g: torch.Tensor, name: str) -> torch.Tensor:
        """u = momentum u + g, kept under ``name``: its own tensor, never the caller's buffer (masking
        edits it in place after the step)."""
        previous = self._velocity.get(name)
        if previous is not None and previous.shape != g.shape:
            raise ValueError(f"dgc: tensor {name!r} changed size from {previous.numel()} to {g.numel()}; "
                             "names must identify tensors")
        u = g.clone() if previous is None else self.momentum * previous.to(g.device) + g
        self._velocity[name] = u
        return u

    @property
    def prepares_dense(self) -> bool:
        return self.momentum > 0

    def precondition_dense(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """The optimizer's momentum for a group sent dense: u = momentum u + g (float32 or wider), kept
        under ``name`` as the correction's velocity is; no clipping, and no masking (everything is
        sent, and masking would zero u each step: no momentum at all)."""
        if not self.momentum:
            return tensor
        return self._accelerated(wide(tensor.reshape(-1)), name).reshape(tensor.shape)

    def sent(self, name: str, decoded: torch.Tensor) -> None:
        velocity = self._velocity.get(name)
        if self.momentum_masking and velocity is not None:
            velocity[decoded.reshape(-1).to(velocity.device) != 0] = 0

    def warmup_steps_left(self) -> int:
        return max(0, self.warmup_steps - (self._dense + max(self._rounds.values(), default=0)))

    def synced_dense(self, steps: int) -> None:
        self._dense += check_int(steps, "steps", 0)

    def density(self) -> float:
        """The fraction to keep at this step: ``ratio``, or the warm-up's higher one."""
        if self._clock >= self.warmup_steps:
            return self.ratio
        stage = self._clock * WARMUP_STAGES // self.warmup_steps
        return max(self.ratio, WARMUP_FIRST * 4.0 ** -stage)

    # -- selection -----------------------------------------------------------------------------
    def estimate(self, magnitude: torch.Tensor, name: str, k: int) -> torch.Tensor | None:
        """The threshold for keeping about ``k``, or None where the tensor is too small to sample."""
        n = magnitude.numel()
        samples = max(MIN_SAMPLE, math.ceil(self.sample_ratio * n))
        if samples >= n:
            return None
        gen = self.generator(name, magnitude.device)
        sample = magnitude[torch.randint(n, (samples,), generator=gen, device=magnitude.device)]
        share = k * samples / n
        rank = min(samples, max(1, math.ceil(min(1.5 * share, share + 3 * math.sqrt(share)))))
        return torch.topk(sample, rank, sorted=False).values.min()

    def select(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        k = count_of(self.density(), flat.numel())
        magnitude = flat.abs()
        threshold = self.estimate(magnitude, name, k)
        if threshold is None:
            return top_indices(magnitude, k)
        candidates = torch.nonzero(magnitude >= threshold).reshape(-1)
        if k <= candidates.numel() <= 2 * k:
            return candidates
        if candidates.numel() > 2 * k:
            return candidates[top_indices(magnitude[candidates], k)]
        return top_indices(magnitude, k)

    def kept_max(self, numel: int) -> int:
        return min(numel, 2 * count_of(self.density(), numel))

    def kept_max_many(self, numels: np.ndarray) -> np.ndarray:
        return np.minimum(numels, 2 * counts_of(self.density(), numels))

    # -- checkpointed state --------------------------------------------------------------------
    def group_states(self) -> list[dict[str, torch.Tensor]]:
        return [self._velocity]

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "velocity": {k: v.clone() for k, v in self._velocity.items()},
                "rounds": dict(self._rounds), "clock": self._clock, "dense_steps": self._dense}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._velocity = {k: v.clone() for k, v in state.get("velocity", {}).items()}
        self._rounds = {str(k): int(v) for k, v in state.get("rounds", {}).items()}
        self._clock = int(state.get("clock", 0))
        self._dense = int(state.get("dense_steps", 0))
