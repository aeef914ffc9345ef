"""Compression cost against tensor size: a constant per call, then linear in the size.

Espresso's measurements (and ours, experiments/compressor_speed) show the same shape on every
device: below a knee the cost of a call is its fixed overhead (Python, kernel launches), above it
the cost grows with the elements touched. :class:`CostFit` is that curve,

    seconds(numel) = max(floor_s, intercept_s + per_element_s * numel)

fitted to measured (size, seconds) points by trying every knee and keeping the one with the least
squared *relative* error (small sizes matter as much as large ones: a model has many small tensors).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class CostFit:
    """seconds(numel) = max(floor_s, intercept_s + per_element_s * numel); 0 for an empty tensor."""

    floor_s: float = 0.0
    intercept_s: float = 0.0
    per_element_s: float = 0.0

    def __call__(self, numel: float) -> float:
        if numel <= 0:
            return 0.0
        return max(self.floor_s, self.intercept_s + self.per_element_s * numel)

    @classmethod
    def fit(cls, sizes: Sequence[float], seconds: Sequence[float]) -> CostFit:
        """The best constant-then-linear curve through the points (sizes need not be sorted)."""
        points = sorted((float(s), float(t)) for s, t in zip(sizes, seconds, strict=True) if s > 0)
        if not points:
            raise ValueError("CostFit.fit needs at least one (size > 0, seconds) point")
        if any(not math.isfinite(t) or t < 0 for _, t in points):
            raise ValueError(f"CostFit.fit: seconds must be finite and >= 0, got {[t for _, t in points]}")
        best, best_error = cls(floor_s=statistics.median(t for _, t in points)), math.inf
        for knee in range(len(points)):
            # The constant covers the points up to the knee; the line the points from it on.
            floor = statistics.median(t for _, t in points[: knee + 1])
            candidate = cls(floor, *_line(points[knee:])) if len(points) - knee >= 2 else cls(floor)
            error = sum(((candidate(s) - t) / max(t, 1e-9)) ** 2 for s, t in points)
            if error < best_error - 1e-12:
                best, best_error = candidate, error
        return best

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostFit:
        return cls(float(data["floor_s"]), float(data["intercept_s"]), float(data["per_element_s"]))


def _line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least squares (intercept, slope) with a slope >= 0: a cost never falls with size."""
    n = len(points)
    mean_s = sum(s for s, _ in points) / n
    mean_t = sum(t for _, t in points) / n
    var = sum((s - mean_s) ** 2 for s, _ in points)
    slope = max(0.0, sum((s - mean_s) * (t - mean_t) for s, t in points) / var) if var > 0 else 0.0
    return mean_t - slope * mean_s, slope
