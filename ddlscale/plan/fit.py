"""Compression cost against tensor size: the measured curve, or a constant-then-linear one.

Below a knee the cost of a call is its fixed overhead (Python, kernel launches); above it the cost
grows with the elements touched — but not along one straight line over four decades of sizes: cache
sizes, allocator thresholds and page faults bend it. A single line fitted to a grid from 256 to 4M
elements is dominated by its ends and lands mid sizes an order of magnitude off (DGC on this host:
1.2 ms measured at 262,144 elements, 0.16 ms from the line). So :meth:`CostFit.fit` keeps the
measured points, made non-decreasing, and interpolates between them:

- below the smallest measured size: the smallest's cost (the fixed overhead);
- between two measured sizes: linear;
- above the largest: the last segment's slope carried on.

The parametric form ``max(floor_s, intercept_s + per_element_s * numel)`` remains for synthetic
profiles and for profiles saved before the points were kept.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import numpy as np


@dataclass(frozen=True)
class CostFit:
    """seconds(numel): through ``points`` when there are any, else the constant-then-linear form;
    0 for an empty tensor."""

    floor_s: float = 0.0
    intercept_s: float = 0.0
    per_element_s: float = 0.0
    points: tuple[tuple[float, float], ...] = ()  # (numel, seconds), sizes increasing, seconds non-decreasing

    def __call__(self, numel: float) -> float:
        if numel <= 0:
            return 0.0
        if not self.points:
            return max(self.floor_s, self.intercept_s + self.per_element_s * numel)
        (s0, t0), last = self.points[0], self.points[-1]
        if numel <= s0:
            return t0
        if numel >= last[0]:
            before = self.points[-2] if len(self.points) > 1 else (0.0, 0.0)
            return last[1] + (numel - last[0]) * (last[1] - before[1]) / (last[0] - before[0])
        above = bisect.bisect_left(self.points, numel, key=itemgetter(0))  # the first point at or above numel
        (sa, ta), (sb, tb) = self.points[above - 1], self.points[above]
        return ta + (numel - sa) * (tb - ta) / (sb - sa)

    def many(self, numel: np.ndarray, seconds: float | np.ndarray = 0.0,
             per_element_s: float | np.ndarray = 0.0) -> np.ndarray:
        """``self.plus(seconds, per_element_s)(numel)`` for every element at once (the extras may be
        arrays too): what a fusion DP evaluates for a whole row of candidate groups."""
        x = np.asarray(numel, dtype=float)
        if not self.points:
            out = np.maximum(self.floor_s + seconds,
                             self.intercept_s + seconds + (self.per_element_s + per_element_s) * x)
        elif len(self.points) == 1:  # the line through the origin and the point, floored at it
            (s0, t0), = self.points
            t0 = t0 + seconds + per_element_s * s0
            out = np.where(x <= s0, t0, t0 + (x - s0) * t0 / s0)
        else:
            sizes, times = np.array(self.points).T
            slope = (times[-1] - times[-2]) / (sizes[-1] - sizes[-2])
            inside = np.interp(x, sizes, times)  # the smallest's cost below it
            out = np.where(x > sizes[-1], times[-1] + (x - sizes[-1]) * slope, inside)
            out = out + seconds + per_element_s * np.maximum(x, sizes[0])  # plus() moves every point
        return np.where(x > 0, out, 0.0)

    @classmethod
    def fit(cls, sizes: Sequence[float], seconds: Sequence[float]) -> CostFit:
        """The measured curve through (size, seconds) points (sizes need not be sorted; repeated
        sizes are averaged), made non-decreasing by pooling adjacent violators: a larger tensor
        never costs less, and one noisy point is averaged with its neighbours, not copied onto them."""
        by_size: dict[float, list[float]] = {}
        for s, t in zip(sizes, seconds, strict=True):
            if s > 0:
                if not math.isfinite(t) or t < 0:
                    raise ValueError(f"CostFit.fit: seconds must be finite and >= 0, got {t!r} at size {s}")
                by_size.setdefault(float(s), []).append(float(t))
        if not by_size:
            raise ValueError("CostFit.fit needs at least one (size > 0, seconds) point")
        points = sorted((s, sum(ts) / len(ts)) for s, ts in by_size.items())
        times = _non_decreasing([t for _, t in points])
        return cls(floor_s=times[0], points=tuple((s, t) for (s, _), t in zip(points, times, strict=True)))

    def scaled(self, factor: float) -> CostFit:
        """Every cost times ``factor`` (a calibration against costs measured in training)."""
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"CostFit.scaled: factor must be finite and > 0, got {factor!r}")
        return CostFit(self.floor_s * factor, self.intercept_s * factor, self.per_element_s * factor,
                       tuple((s, t * factor) for s, t in self.points))

    def plus(self, seconds: float, per_element_s: float = 0.0) -> CostFit:
        """Every non-empty call ``seconds`` plus ``per_element_s`` per element dearer (a per-call
        overhead measured in training; the work fusing adds)."""
        for what, value in (("seconds", seconds), ("per_element_s", per_element_s)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"CostFit.plus: {what} must be finite and >= 0, got {value!r}")
        first = self.points[0][0] if self.points else 0.0  # calls at or below it cost its point
        return CostFit(self.floor_s + seconds + per_element_s * first, self.intercept_s + seconds,
                       self.per_element_s + per_element_s,
                       tuple((s, t + seconds + per_element_s * s) for s, t in self.points))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"floor_s": self.floor_s, "intercept_s": self.intercept_s,
                               "per_element_s": self.per_element_s}
        if self.points:
            out["points"] = [list(p) for p in self.points]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostFit:
        points = tuple((float(s), float(t)) for s, t in data.get("points", ()))
        return cls(float(data["floor_s"]), float(data["intercept_s"]), float(data["per_element_s"]), points)


def _non_decreasing(values: Sequence[float]) -> list[float]:
    """The least-squares non-decreasing sequence (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, c2), (m1, c1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return [m for m, c in blocks for _ in range(int(c))]
