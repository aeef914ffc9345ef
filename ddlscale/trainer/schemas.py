"""Every config group's schema, registered in Hydra's ConfigStore, and the check of a composed config
against them.

A component's schema is the :class:`~ddlscale.schema.Schema` its class declares (``schema = ...``:
the syncs, Gemini); a class without one (a compressor, a memory, a model, a checkpointer, a user's own
class) gets one derived from its constructor's signature, whose checks are the constructor's own.
The run's own keys (``seed``, ``trainer.*``, ``cluster.*``) have their schemas here.

:func:`register` stores each as ``schema/<group>/<option>`` (``schema/sync/zen``; ``schema/run`` for
the top level), so a config of one's own can extend it (``defaults: [/schema/sync/zen@_here_,
_self_]`` gives a typed node) once its script has called it before composing. train.py does not: it
would import every option's class (seconds, in every worker of an emulated run), and its check needs
only the selected classes' schemas. The files in ``conf/`` stay untyped, so ``sync._target_=my.Sync``
with keys of its own, or ``~sync.bucket_mb``, keep working on any option.

:func:`check` reads a composed config through the schemas of what it selects: a value of the wrong
type or out of range is refused naming the full key and the values it takes, before anything is
built. Keys a schema does not declare belong to the class selected (a subclass's own), which checks
them when it is built.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from ddlscale.cluster import dilation, storage
from ddlscale.cluster.cpucap import MODES as CPU_MODES
from ddlscale.cluster.emulated import AUTO_LATENCY, MAX_NODES
from ddlscale.schema import Schema, boolean, choice, integer, is_int, quantity
from ddlscale.units import parse_bandwidth, parse_time

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
GROUPS = ("sync", "compressor", "memory", "model", "ckpt", "strategy", "logger")  # built from a _target_
CLUSTER_KINDS = ("local", "torchrun", "slurm", "emulated")
FALLBACKS = ("loopback", "error")


@dataclass
class RunConfig(Schema):
    """The run-level keys of ``conf/config.yaml``."""

    seed: int = 0
    keep_freed_memory: bool = True

    def check(self) -> None:
        if not is_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        boolean("keep_freed_memory", self.keep_freed_memory)


@dataclass
class TrainerConfig(Schema):
    """The Lightning Trainer keys ddlscale reads itself (the rest go to ``pl.Trainer``, which checks them)."""

    group = "trainer"
    devices: int = 2
    num_nodes: int = 1
    accumulate_grad_batches: int = 1
    max_steps: int = 100

    def check(self) -> None:
        for name in ("devices", "num_nodes", "accumulate_grad_batches"):
            integer(self.key(name), getattr(self, name))
        integer(self.key("max_steps"), self.max_steps, allow=(-1,))  # -1: no limit (trainer.max_epochs ends it)


@dataclass
class ClusterConfig(Schema):
    """``cluster.*`` of every launch mode."""

    group = "cluster"
    kind: str = "local"
    max_restarts: Any = 0  # torchrun restarts after a failure (None: none)

    def check(self) -> None:
        choice(self.key("kind"), self.kind, CLUSTER_KINDS)
        if self.max_restarts is not None:
            integer(self.key("max_restarts"), self.max_restarts, least=0)


@dataclass
class EmulatedClusterConfig(ClusterConfig):
    """``cluster=emulated``: machines as network namespaces behind shaped links."""

    kind: str = "emulated"
    nodes: int = 2
    bandwidth: str = "1gbit"
    latency: str = "auto"
    dilation: Any = "auto"
    cpu: str = "shares"
    port: int = 29400
    fallback: str = "loopback"
    storage: Any = None  # {bandwidth, root}: the storage machine (ddlscale.cluster.storage); null bandwidth: none

    def check(self) -> None:
        super().check()
        integer(self.key("nodes"), self.nodes, 1, MAX_NODES)
        integer(self.key("port"), self.port, 1, 65535)
        integer(self.key("max_restarts"), self.max_restarts, least=0)
        quantity(self.key("bandwidth"), self.bandwidth, parse_bandwidth)
        if str(self.latency).strip().lower() != AUTO_LATENCY:
            quantity(self.key("latency"), self.latency, parse_time)
        quantity(self.key("dilation"), self.dilation, dilation.parse)
        choice(self.key("cpu"), self.cpu, CPU_MODES)
        choice(self.key("fallback"), self.fallback, FALLBACKS)
        storage.check_config(self.storage, self.key("storage"))


def derived(cls: type) -> type[Schema]:
    """The schema of a class that declares none: its constructor's keyword arguments, untyped (the
    constructor checks them when the class is built)."""
    declared = getattr(cls, "schema", None)
    if isinstance(declared, type) and issubclass(declared, Schema):
        return declared
    fields = []
    for name, p in inspect.signature(cls.__init__).parameters.items():
        if name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        default = p.default if p.default is not p.empty else None
        if not isinstance(default, (int, float, str, bool, type(None))):
            default = None  # a live object (a compressor, a memory) comes from its own group
        fields.append((name, Any, dataclasses.field(default=default)))
    return dataclasses.make_dataclass(f"{cls.__name__}Config", fields, bases=(Schema,))


def _target_class(node: Any) -> type | None:
    target = OmegaConf.select(node, "_target_") if isinstance(node, DictConfig) else None
    if not target:
        return None
    try:
        return get_class(target)
    except Exception:  # named by the build that follows, with the import's own error
        return None


def _with_target(schema: type[Schema], cls: type) -> type:
    """The schema as a node that builds ``cls``: its keys and ``_target_`` (Hydra's, not an argument)."""
    target = f"{cls.__module__}.{cls.__qualname__}"
    return dataclasses.make_dataclass(schema.__name__, [("_target_", str, dataclasses.field(default=target))],
                                      bases=(schema,))


@cache
def register() -> ConfigStore:
    """Store every option's schema as ``schema/<group>/<option>`` (once per process)."""
    store = ConfigStore.instance()
    store.store(group="schema", name="run", node=RunConfig)
    store.store(group="schema/trainer", name="default", node=TrainerConfig)
    for path in sorted((CONF_DIR / "cluster").glob("*.yaml")):
        node = EmulatedClusterConfig if path.stem == "emulated" else ClusterConfig
        store.store(group="schema/cluster", name=path.stem, node=node)
    for group in GROUPS:
        for path in sorted((CONF_DIR / group).glob("*.yaml")):
            cls = _target_class(OmegaConf.load(path))
            if cls is not None:
                store.store(group=f"schema/{group}", name=path.stem, node=_with_target(derived(cls), cls))
    return store


def _values(node: DictConfig) -> dict[str, Any]:
    try:
        return OmegaConf.to_container(node, resolve=True)
    except Exception:  # an interpolation only Hydra's run resolves: checked as written
        return OmegaConf.to_container(node, resolve=False)


def check(cfg: DictConfig) -> None:
    """Refuse (ValueError naming the key) a value of ``cfg`` its schema does not allow."""
    RunConfig.of({k: cfg[k] for k in ("seed", "keep_freed_memory") if k in cfg})
    TrainerConfig.of(_values(cfg.trainer))
    cluster = _values(cfg.cluster)
    (EmulatedClusterConfig if cluster.get("kind") == "emulated" else ClusterConfig).of(cluster)
    for group in GROUPS:
        node = cfg.get(group)
        cls = _target_class(node)
        schema = getattr(cls, "schema", None)
        if isinstance(schema, type) and issubclass(schema, Schema):
            schema.of(_values(node))
