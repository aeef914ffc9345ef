"""The dense sync's typed config, the base of every sync's that buckets dense tensors."""

from __future__ import annotations

from dataclasses import dataclass

from ddlscale.schema import Schema, number


@dataclass
class DenseConfig(Schema):
    """``sync.*`` of :class:`~ddlscale.sync.dense.DenseAllreduce`: DDP's buckets."""

    group = "sync"
    bucket_mb: float = 25.0
    first_bucket_mb: float = 1.0

    def check(self) -> None:
        number(self.key("bucket_mb"), self.bucket_mb, above=0)
        number(self.key("first_bucket_mb"), self.first_bucket_mb, above=0)
