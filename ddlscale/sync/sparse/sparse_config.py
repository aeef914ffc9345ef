"""The sparse syncs' typed configs: the keys every one takes (``ddlscale/conf/base/sync_sparse.yaml``) and
each scheme's own, with every range and choice checked in one place."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ddlscale.comm.probe import MEASURED
from ddlscale.schema import boolean, choice, integer, is_int, number, quantity
from ddlscale.sync.dense_config import DenseConfig
from ddlscale.units import parse_bandwidth, parse_time

ROUTES = ("auto", "sparse")
PULL_FORMATS = ("auto", "coo", "bitmap")
SCHEMES = ("auto", "bp", "hc")
BATCHES = ("backward", "step", "width", "tensor")  # which BP tensors share a push and a pull (ZenSync)


@dataclass
class SparseSyncConfig(DenseConfig):
    """``sync.*`` of every sparse sync (:class:`~ddlscale.sync.sparse.sparse_sync.SparseSync`'s arguments)."""

    profile_steps: int = 2
    sparse_params: Any = "auto"  # "auto" or a list of parameter names
    route: str = "auto"
    network_bandwidth: str = "1gbit"
    network_latency: str = MEASURED
    reprofile_drift: Any = 2.0  # a factor > 1, or None
    overlap: bool = True
    route_margin: float = 0.15  # a fraction in [0, 1)

    def check(self) -> None:
        super().check()
        integer(self.key("profile_steps"), self.profile_steps)
        # Any sequence of names but a string: from Hydra the list arrives as an OmegaConf ListConfig.
        names = self.sparse_params
        if names != "auto" and (isinstance(names, str) or not isinstance(names, Sequence)):
            raise ValueError(f"{self.key('sparse_params')} must be 'auto' or a list of names, got {names!r}")
        choice(self.key("route"), self.route, ROUTES)
        if self.network_bandwidth != MEASURED and not quantity(key := self.key("network_bandwidth"),
                                                                self.network_bandwidth, parse_bandwidth) > 0:
            raise ValueError(f"{key} must be > 0, got {self.network_bandwidth!r}")
        if self.network_latency != MEASURED:
            quantity(self.key("network_latency"), self.network_latency, parse_time)
        drift = self.reprofile_drift
        if drift is not None and not (isinstance(drift, int | float) and not isinstance(drift, bool) and drift > 1):
            raise ValueError(f"{self.key('reprofile_drift')} must be a number > 1 or null, got {drift!r}")
        boolean(self.key("overlap"), self.overlap)
        number(self.key("route_margin"), self.route_margin, least=0, below=1, what="a fraction")


@dataclass
class ZenConfig(SparseSyncConfig):
    scheme: str = "auto"
    pull: str = "auto"
    seed: Any = 0x5EED  # an integer, or None: draw one
    hierarchical: bool = False
    local_size: Any = None  # ranks per machine, or None: LOCAL_WORLD_SIZE
    batch: str = "backward"
    carry_dense: bool = True

    def check(self) -> None:
        super().check()
        choice(self.key("scheme"), self.scheme, SCHEMES)
        boolean(self.key("carry_dense"), self.carry_dense)
        choice(self.key("batch"), self.batch, BATCHES)
        choice(self.key("pull"), self.pull, PULL_FORMATS)
        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"{self.key('seed')} must be an integer or null, got {self.seed!r}")
        if self.local_size is not None:
            integer(self.key("local_size"), self.local_size, allow=(None,))


@dataclass
class OmniReduceConfig(SparseSyncConfig):
    block_size: int = 256

    def check(self) -> None:
        super().check()
        integer(self.key("block_size"), self.block_size)


@dataclass
class SparCMLConfig(SparseSyncConfig):
    dense_threshold: Any = "auto"  # "auto", or a density in (0, 1]

    def check(self) -> None:
        super().check()
        value = self.dense_threshold
        if value != "auto" and not (isinstance(value, int | float) and not isinstance(value, bool) and 0 < value <= 1):
            raise ValueError(f"{self.key('dense_threshold')} must be 'auto' or a density in (0, 1], got {value!r}")
