"""The compressing syncs' typed configs: CompressSync's keys, and the planned syncs' (Espresso,
Cupcake) on top of them, every range and choice checked in one place.

The compressor and memory objects come from their own groups (``compressor=``, ``memory=``); here
``memory`` is only ever a name (or null: the compressor's default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddlscale.comm.probe import MEASURED
from ddlscale.compress.memory import MEMORIES
from ddlscale.schema import boolean, choice, integer, is_number, quantity
from ddlscale.sync.compressed.schemes import SCHEMES
from ddlscale.sync.dense_config import DenseConfig
from ddlscale.units import parse_bandwidth, parse_time

FUSIONS = ("tensor", "bucket")


@dataclass
class CompressConfig(DenseConfig):
    """``sync.*`` of :class:`~ddlscale.sync.compressed.CompressSync`."""

    comm: str = "allgather"
    memory: Any = None  # a memory's name, or None: the compressor's default
    memory_beta: float = 0.9
    hierarchical: bool = False
    local_size: Any = None  # ranks per machine, or None: LOCAL_WORLD_SIZE
    fusion: str = "tensor"

    def check(self) -> None:
        super().check()
        choice(self.key("comm"), self.comm, SCHEMES)
        if self.memory is not None:
            choice(self.key("memory"), self.memory, MEMORIES)
        choice(self.key("fusion"), self.fusion, FUSIONS)
        if self.local_size is not None:
            integer(self.key("local_size"), self.local_size, allow=(None,))


# sync.trial_steps' and sync.calibrate_budget's defaults here, in PlannedSync and in
# ddlscale/conf/sync/{espresso,cupcake}.yaml (a test holds them equal). The calibration of every family took
# the trial's place: its budget is what the earlier default spent in compressed steps before its plan
# ran, 3 settling and 3 layer-wise steps and a trial of 18 (3 candidates x 3 turns x 2 steps).
TRIAL_STEPS = 0
CALIBRATE_BUDGET = 24
ALL = "all"  # sync.calibrate_families: every family the planner may choose


@dataclass
class PlannedConfig(DenseConfig):
    """``sync.*`` of the planned syncs (:class:`~ddlscale.sync.compressed.planned.PlannedSync`)."""

    comm: str = "allgather"
    memory: Any = None
    memory_beta: float = 0.9
    hierarchical: bool = False
    profile_steps: int = 3
    network_bandwidth: str = "1gbit"
    network_latency: str = MEASURED
    gpus_per_machine: int = 1
    run_dir: Any = None  # a directory, or None: the Hydra run directory
    bench_budget_s: float = 0.02
    trial_steps: int = TRIAL_STEPS
    calibrate_steps: int = 3
    warmup_steps: int = 1
    settle_steps: int = 3
    calibrate_families: Any = ALL  # all, or scheme names, /hier for the hierarchical layout (PlannedSync checks them)
    calibrate_fused: bool = True
    calibrate_budget: int = CALIBRATE_BUDGET

    def check(self) -> None:
        integer(self.key("gpus_per_machine"), self.gpus_per_machine)
        boolean(self.key("calibrate_fused"), self.calibrate_fused)
        integer(self.key("calibrate_budget"), self.calibrate_budget)
        super().check()
        choice(self.key("comm"), self.comm, SCHEMES)
        if self.memory is not None:
            choice(self.key("memory"), self.memory, MEMORIES)
        integer(self.key("profile_steps"), self.profile_steps)
        bandwidth = quantity(self.key("network_bandwidth"), self.network_bandwidth, parse_bandwidth)
        if self.network_latency != MEASURED:
            quantity(self.key("network_latency"), self.network_latency, parse_time)
        if not bandwidth > 0:
            raise ValueError(f"{self.key('network_bandwidth')} must be > 0, got {self.network_bandwidth!r}")
        if not (is_number(self.bench_budget_s) and self.bench_budget_s > 0):
            raise ValueError(f"{self.key('bench_budget_s')} must be > 0, got {self.bench_budget_s!r}")
        for name, least in (("trial_steps", 0), ("calibrate_steps", 0), ("warmup_steps", 1), ("settle_steps", 1)):
            integer(self.key(name), getattr(self, name), least=least)


@dataclass
class EspressoConfig(PlannedConfig):
    offload: bool = False
    fuse: bool = True
    calibrate_mixed: bool = True

    def check(self) -> None:
        super().check()
        boolean(self.key("offload"), self.offload)
        boolean(self.key("fuse"), self.fuse)
        boolean(self.key("calibrate_mixed"), self.calibrate_mixed)
