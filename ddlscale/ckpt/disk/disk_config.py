"""The disk tier's typed config: ``ckpt=disk``'s keys, every range and choice checked in one place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddlscale.ckpt.checkpointer import parse_every
from ddlscale.schema import Schema, boolean, integer
from ddlscale.units import parse_bandwidth


def write_rate(bandwidth: str | float | None, key: str = "ckpt.bandwidth") -> float | None:
    """Bits per second of an emulated write rate (None: full speed); a bad value names ``key``."""
    if bandwidth is None:
        return None
    try:
        bps = parse_bandwidth(bandwidth)
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None
    if bps == 0:
        raise ValueError(f"{key} must be > 0 (or null for no limit)")
    return bps


@dataclass
class DiskConfig(Schema):
    """``ckpt.*`` of :class:`~ddlscale.ckpt.disk.disk_checkpointer.DiskCheckpointer` (its docstring says
    what each key does)."""

    group = "ckpt"
    every: Any = 10  # steps, or "highfreq"
    dir: Any = None
    keep: int = 3
    bandwidth: Any = None
    resume: Any = None  # None, "auto" or a manifest's path
    async_save: bool = True

    def check(self) -> None:
        parse_every(self.every, self.key("every"))
        if self.resume is not None and not isinstance(self.resume, str):
            raise ValueError(f"{self.key('resume')} must be null, 'auto' or a path, got {self.resume!r}")
        integer(self.key("keep"), self.keep)
        boolean(self.key("async_save"), self.async_save)
        write_rate(self.bandwidth, self.key("bandwidth"))
