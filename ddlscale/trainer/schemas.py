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
only the selected classes' schemas. The files in ``ddlscale/conf/`` stay untyped, so ``sync._target_=my.Sync``
with keys of its own, or ``~sync.bucket_mb``, keep working on any option.

:func:`check` reads a composed config through the schemas of what it selects: a value of the wrong
type or out of range is refused naming the full key and the values it takes, before anything is
built. Keys a schema does not declare belong to the class selected (a subclass's own), which checks
them when it is built.

A key nothing reads is refused too (``+foo=1``, ``+sync.bukcet_mb=1``), with the known key closest to
it: a group's keys are what the selected class's constructor takes (:func:`known_keys`), the
trainer's are Lightning Trainer's arguments, the run level's are its own keys and the groups, and
any key a value refers to (``+lr=0.1 model.lr='${lr}'``) is read by that value.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.utils import get_class, get_method
from omegaconf import DictConfig, OmegaConf

from ddlscale.cluster import dilation, storage
from ddlscale.cluster.cpucap import MODES as CPU_MODES
from ddlscale.cluster.emulated import AUTO_LATENCY, MAX_NODES
from ddlscale.paths import CONF_DIR
from ddlscale.schema import Schema, boolean, choice, did_you_mean, integer, is_int, quantity
from ddlscale.units import parse_bandwidth, parse_time

GROUPS = ("sync", "compressor", "memory", "model", "ckpt", "strategy", "logger")  # built from a _target_
CLUSTER_KINDS = ("local", "torchrun", "slurm", "emulated")
FALLBACKS = ("loopback", "error")
HYDRA_KEYS = frozenset({"_target_", "_recursive_", "_convert_", "_partial_", "_args_"})  # instantiate's own
# Other libraries' classes whose **kwargs go to another callable: they cannot declare it themselves.
KWARGS_GO_TO = {
    "pytorch_lightning.loggers.wandb.WandbLogger": "wandb.init",
    "pytorch_lightning.loggers.tensorboard.TensorBoardLogger": "torch.utils.tensorboard.SummaryWriter",
    "pytorch_lightning.strategies.ddp.DDPStrategy": "torch.nn.parallel.DistributedDataParallel",
}


@dataclass
class RunConfig(Schema):
    """The run-level keys of ``ddlscale/conf/config.yaml``."""

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


def declared_schema(cls: Any) -> type[Schema] | None:
    """The schema ``cls`` declares as its ``schema`` attribute (ddlscale's components, a user's subclass
    of one); None for a class that declares none (any other library's, a user's own)."""
    declared = getattr(cls, "schema", None)  # the one place a _target_ class is asked
    return declared if isinstance(declared, type) and issubclass(declared, Schema) else None


def derived(cls: type) -> type[Schema]:
    """The schema of a class that declares none: its constructor's keyword arguments, untyped (the
    constructor checks them when the class is built)."""
    declared = declared_schema(cls)
    if declared is not None:
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


def _keywords(fn: Callable[..., Any]) -> tuple[set[str], bool]:
    """The keyword arguments ``fn`` names, and whether it takes others (``**kwargs``)."""
    params = inspect.signature(fn).parameters.values()
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"self"}
    return named, any(p.kind is p.VAR_KEYWORD for p in params)


def known_keys(cls: type) -> set[str] | None:
    """The keys a config node building ``cls`` may set, or None where that cannot be told.

    Its constructor's keyword arguments, and its declared schema's keys. A constructor that takes
    ``**kwargs`` passes them on: a class that declares a schema (ddlscale's components, a user's
    subclass of one) to its base's constructor, whose keywords count too; another library's class to
    the callable :data:`KWARGS_GO_TO` names. Any other ``**kwargs`` go where no one says: None.
    """
    schema = declared_schema(cls)
    declared = schema is not None
    keys = set(HYDRA_KEYS) | (set(schema.keys()) if declared else set())
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if klass is object or init is None:
            continue  # inherited, or object's: nothing a config sets
        named, passes_on = _keywords(init)
        keys |= named
        receiver = KWARGS_GO_TO.get(f"{klass.__module__}.{klass.__qualname__}")
        if receiver is not None:
            try:
                return keys | _keywords(get_method(receiver))[0]
            except Exception:  # not installed: the class says so when it is built
                return None
        if not passes_on:
            return keys
        if not declared:
            return None
    return keys


def _choices(cfg: DictConfig) -> dict[str, Any]:
    """The option chosen per group: from the config's own Hydra node (a sweep job's, as the checked
    sweeper composes it), else from the running Hydra job; empty outside Hydra."""
    from hydra.core.hydra_config import HydraConfig

    choices = OmegaConf.select(cfg, "hydra.runtime.choices")
    if choices is None and HydraConfig.initialized():
        choices = HydraConfig.get().runtime.choices
    return dict(choices) if choices is not None else {}


@cache
def _option_target(group: str, option: str) -> str | None:
    path = CONF_DIR / group / f"{option}.yaml"
    return OmegaConf.load(path).get("_target_") if path.is_file() else None


def options(group: str) -> list[str]:
    """The options of config group ``group``, as ``group=<option>`` takes them."""
    return [p.stem for p in sorted((CONF_DIR / group).glob("*.yaml"))]


def chosen(cfg: DictConfig, group: str) -> str:
    """``group``'s node as the user selected it, for messages: ``compressor=topk``, or
    ``compressor._target_=my.Compressor`` where the node builds another class than its option's."""
    target = OmegaConf.select(cfg, f"{group}._target_")
    option = _choices(cfg).get(group)
    if option is not None and _option_target(group, option) in (None, target):  # None: another search path's
        return f"{group}={option}"
    if option is None:  # composed outside Hydra's run: the options that build this class
        matching = [name for name in options(group) if _option_target(group, name) == target]
        if matching:
            return f"{group}={'|'.join(matching)}"
    return f"{group}._target_={target}"


# A key a value refers to: ``${lr}``, ``${oc.select:model.lr,0.1}`` (not a resolver call: ``${now:...}``).
_REFERENCE = re.compile(r"\$\{(?:oc\.select:)?\s*([A-Za-z_][\w.]*)\s*[},]")


def _referenced(cfg: DictConfig) -> set[str]:
    text = OmegaConf.to_yaml(cfg, resolve=False)
    return set(_REFERENCE.findall(text))


def _refuse_unknown(group: str, key: str, what: str, known: Iterable[str]) -> None:
    """Refuse ``group.key`` (``key`` at the run level), with the closest of the ``known`` keys."""
    prefix = f"{group}." if group else ""
    known = sorted(set(known) - HYDRA_KEYS)
    hint = did_you_mean(key, known, prefix)  # bare names: a shared "group." would make every key look close
    if not hint and len(known) <= 30:
        hint = f"; known: {', '.join(known)}" if known else "; it takes none"
    raise ValueError(f"{prefix}{key}: {what}{hint}")


@cache
def trainer_keys() -> frozenset[str]:
    """Lightning Trainer's arguments: the keys of ``trainer.``."""
    return frozenset(_keywords(get_class("pytorch_lightning.Trainer").__init__)[0])


def run_level_keys() -> set[str]:
    return {*RunConfig.keys(), "run_name", "trainer", "cluster", *GROUPS}


def group_keys(group: str) -> set[str]:
    """Every key some option of ``group`` takes: the closest known to a key misspelled where the
    option selected is not known (a config Hydra could not compose)."""
    if group == "trainer":
        return set(trainer_keys())
    if group == "cluster":
        return set(EmulatedClusterConfig.keys())
    keys: set[str] = set()
    for option in options(group):
        node = OmegaConf.load(CONF_DIR / group / f"{option}.yaml")
        cls = _target_class(node)
        keys |= {key for key in node if key != "defaults"} | ((known_keys(cls) or set()) if cls else set())
    return keys - HYDRA_KEYS


def check_known_keys(cfg: DictConfig) -> None:
    """Refuse a key nothing reads, naming it and the known key closest to it (see the module doc)."""
    read = _referenced(cfg)
    for key in cfg:
        if key not in run_level_keys() | {"hydra"} and key not in read:
            _refuse_unknown("", key, "read by nothing (not a run-level key or a group, and no value refers to it)",
                            run_level_keys())
    for key in cfg.get("trainer", {}):
        if key not in trainer_keys() and f"trainer.{key}" not in read:
            _refuse_unknown("trainer", key, "not an argument of Lightning's Trainer", trainer_keys())
    cluster = cfg.get("cluster", {})
    schema = EmulatedClusterConfig if cluster.get("kind") == "emulated" else ClusterConfig
    nodes = [("cluster", cluster, f"cluster={cluster.get('kind')}", set(schema.keys()))]
    for group in GROUPS:
        cls = _target_class(cfg.get(group))
        if cls is not None:
            nodes.append((group, cfg[group], chosen(cfg, group), known_keys(cls)))
    for group, node, selected, known in nodes:
        for key in node if known is not None else ():
            if key not in known and f"{group}.{key}" not in read:
                _refuse_unknown(group, key, f"{selected} takes no key {key}", known)


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
    check_known_keys(cfg)  # first: a misspelled key's value would be refused as a missing one's
    RunConfig.of({k: cfg[k] for k in ("seed", "keep_freed_memory") if k in cfg})
    TrainerConfig.of(_values(cfg.trainer))
    cluster = _values(cfg.cluster)
    (EmulatedClusterConfig if cluster.get("kind") == "emulated" else ClusterConfig).of(cluster)
    for group in GROUPS:
        node = cfg.get(group)
        cls = _target_class(node)
        schema = declared_schema(cls)
        if schema is not None:
            schema.of(_values(node))
