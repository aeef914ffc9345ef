"""Build a training run from a composed config and fit it.

Everything that can be wrong with a config is found here, in the launching process, before any
worker starts: :class:`ConfigError` names the offending key and the values it takes.

The launching process also answers SIGINT, SIGTERM and SIGHUP by stopping every process it started
(:mod:`ddlscale.cluster.stop`), keeps what the run prints in ``train.log``, and ends by printing a
short summary and the run directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch.distributed as dist
from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf

from ddlscale.ckpt import Checkpointer, PlacementPlan
from ddlscale.ckpt.agent import remove_replicas
from ddlscale.ckpt.gemini import STORE_ENV, GeminiCheckpointer, job_name, machine_count
from ddlscale.ckpt.kvstore import ETCD
from ddlscale.ckpt.launch import (
    emulated_env,
    job_secret,
    local_gemini,
    persist_emulated,
    start_emulated_agent,
    start_emulated_etcd,
)
from ddlscale.cluster import dilation, stop
from ddlscale.cluster.control_plane import missing as etcd_missing
from ddlscale.cluster.emulated import MAX_NODES, TRAIN_SCRIPT, EmulatedCluster, unavailable_reason
from ddlscale.comm.network import PROJECTION_WORKERS, NetworkModel
from ddlscale.strategy import DDLStrategy
from ddlscale.trainer.host import keep_freed_memory
from ddlscale.trainer.metrics import StepMetrics
from ddlscale.trainer.report import print_summary, stopped_summary
from ddlscale.trainer.runlog import ENV as RUN_LOG_ENV
from ddlscale.trainer.runlog import run_log
from ddlscale.trainer.signals import StopOnSignals
from ddlscale.units import parse_bandwidth, parse_time

CLUSTER_KINDS = ("local", "torchrun", "slurm", "emulated")
FALLBACKS = ("loopback", "error")


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the key."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_in(cfg: DictConfig, key: str, least: int = 1, most: int | None = None, allow: tuple[int, ...] = ()) -> int:
    value = OmegaConf.select(cfg, key)
    if value in allow and _is_int(value):
        return value
    if not _is_int(value) or value < least or (most is not None and value > most):
        wanted = f"an integer in [{least}, {most}]" if most is not None else f"an integer >= {least}"
        also = "".join(f" or {a}" for a in allow)
        raise ConfigError(f"{key} must be {wanted}{also}, got {value!r}")
    return value


def _quantity(cfg: DictConfig, key: str, parse: Any) -> None:
    try:
        parse(OmegaConf.select(cfg, key))
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{key}: {exc}") from None


def world_size(cfg: DictConfig) -> int:
    """Ranks the config asks for: workers per machine times machines."""
    machines = cfg.cluster.get("nodes", 1) if cfg.cluster.kind == "emulated" else cfg.trainer.num_nodes
    return cfg.trainer.devices * machines


def check_config(cfg: DictConfig) -> None:
    """Reject values no component would catch before workers start."""
    _int_in(cfg, "trainer.devices")
    _int_in(cfg, "trainer.num_nodes")
    _int_in(cfg, "trainer.accumulate_grad_batches")
    _int_in(cfg, "trainer.max_steps", allow=(-1,))  # -1: no limit (then trainer.max_epochs ends the run)
    if not _is_int(cfg.seed):
        raise ConfigError(f"seed must be an integer, got {cfg.seed!r}")
    if not isinstance(cfg.get("keep_freed_memory", True), bool):
        raise ConfigError(f"keep_freed_memory must be true or false, got {cfg.keep_freed_memory!r}")
    kind = OmegaConf.select(cfg, "cluster.kind")
    if kind not in CLUSTER_KINDS:
        raise ConfigError(f"cluster.kind must be one of {', '.join(CLUSTER_KINDS)}; got {kind!r}")
    if kind == "torchrun" and "WORLD_SIZE" not in os.environ:
        raise ConfigError("cluster=torchrun, but this process was not started by torchrun (no WORLD_SIZE)")
    if OmegaConf.select(cfg, "cluster.max_restarts") is not None:
        _int_in(cfg, "cluster.max_restarts", least=0)
    if kind == "emulated":
        _check_emulated(cfg)
    _check_sync_keys(cfg)
    if not _sync_components(cfg):  # compressor= and memory= fit the sync, and the sync accepts them
        _build("sync", cfg.sync)  # any other sync checks its own keys here too
    if OmegaConf.select(cfg, "strategy._target_") is not None:
        _build("strategy", cfg.strategy)  # its own keys (strategy.timeout_s, strategy.start_method...)
    if OmegaConf.select(cfg, "ckpt._target_") is not None:
        checkpointer = _build("ckpt", cfg.ckpt)  # it checks its own keys (ckpt.every, ckpt.keep...)
        if isinstance(checkpointer, GeminiCheckpointer):
            _check_placement(cfg, checkpointer, kind)
            _check_store(checkpointer, kind)


def _check_emulated(cfg: DictConfig) -> None:
    _int_in(cfg, "cluster.nodes", 1, MAX_NODES)
    _int_in(cfg, "cluster.port", 1, 65535)
    _int_in(cfg, "cluster.max_restarts", 0)
    _quantity(cfg, "cluster.bandwidth", parse_bandwidth)
    _quantity(cfg, "cluster.latency", parse_time)
    _quantity(cfg, "cluster.dilation", dilation.parse)
    if cfg.cluster.get("fallback", "loopback") not in FALLBACKS:
        raise ConfigError(f"cluster.fallback must be one of {', '.join(FALLBACKS)}, got {cfg.cluster.fallback!r}")


def _check_sync_keys(cfg: DictConfig) -> None:
    """Sync keys that must fit the run, which the backends see only in their workers (the world
    size); ``sync.sparse_params`` is checked against the model when it is built."""
    local_size = cfg.sync.get("local_size")
    if local_size is not None:
        world = world_size(cfg)
        if not _is_int(local_size) or local_size < 1 or world % local_size:
            raise ConfigError(f"sync.local_size (ranks per machine) must be an integer >= 1 dividing the "
                              f"{world} ranks (trainer.devices x machines), or null; got {local_size!r}")


def _check_model_keys(cfg: DictConfig, model: pl.LightningModule) -> None:
    """Config keys that name the model's parameters."""
    names = cfg.sync.get("sparse_params", "auto")
    if names == "auto" or not isinstance(names, (list, ListConfig)):
        return
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    unknown = [name for name in names if name not in trainable]
    if unknown:
        raise ConfigError(f"sync.sparse_params names {unknown}, not parameters of model={type(model).__name__}; "
                          f"its parameters: {', '.join(trainable)} (or sync.sparse_params=auto)")


def _check_placement(cfg: DictConfig, gemini: GeminiCheckpointer, kind: str) -> None:
    """m replicas need m machines: emulated machines, nodes, or (one machine) one per worker — as the
    workers count them (:func:`ddlscale.ckpt.gemini.machine_layout`)."""
    machines = machine_count({"emulated": cfg.cluster.get("nodes", 1),
                              "local": cfg.trainer.devices * cfg.trainer.num_nodes}.get(kind, cfg.trainer.num_nodes))
    try:
        PlacementPlan(int(machines), gemini.replicas, gemini.placement)
    except ValueError as exc:
        raise ConfigError(f"ckpt.replicas / ckpt.placement: {exc}") from None


def _check_store(gemini: GeminiCheckpointer, kind: str) -> None:
    """ckpt.store=etcd: the launcher starts the members (cluster=local, emulated), so etcd must be here;
    elsewhere the members' address comes from $DDLSCALE_STORE (or ckpt.store=etcd://...)."""
    if gemini.store_address != ETCD:
        return
    if "WORLD_SIZE" in os.environ or kind not in ("local", "emulated"):
        if not os.environ.get(STORE_ENV, "").startswith("etcd"):
            raise ConfigError(f"ckpt.store=etcd with cluster={kind}: nothing starts etcd members here; give their "
                              "address as ckpt.store=etcd://HOST:PORT,... (or $DDLSCALE_STORE)")
        return
    reason = etcd_missing(server=True)
    if reason:
        raise ConfigError(f"ckpt.store=etcd cannot run here: {reason}")


def _sync_components(cfg: DictConfig) -> dict[str, Any]:
    """The compressor and memory a compressing sync takes from their groups (empty for other syncs).

    Syncs that compress declare ``compressor:`` and ``memory:`` keys; any other sync refuses a
    compressor rather than silently ignore it. Building the sync here also validates the pair (an
    allreduce of top-k payloads, say) before any worker starts.
    """
    compressing = "compressor" in cfg.sync
    compressor_target = OmegaConf.select(cfg, "compressor._target_")
    memory_target = OmegaConf.select(cfg, "memory._target_")
    if not compressing:
        if compressor_target is not None:
            raise ConfigError(f"compressor={compressor_target} needs a compressing sync (sync=compress, espresso "
                              f"or cupcake); sync={OmegaConf.select(cfg, 'sync._target_')} does not compress")
        if memory_target is not None and not memory_target.endswith("NoMemory"):
            raise ConfigError(f"memory={memory_target} needs a compressing sync (sync=compress, espresso or cupcake)")
        return {}
    parts = {"compressor": _build("compressor", cfg.compressor) if compressor_target is not None else None}
    if "memory" in cfg.sync and memory_target is not None:
        parts["memory"] = _build("memory", cfg.memory)
    _build("sync", cfg.sync, **parts)
    return parts


def _build(group: str, cfg: DictConfig, **kwargs: Any) -> Any:
    try:
        # Plain lists and dicts, not OmegaConf's: arguments end up in checkpoints (a model's
        # hyper-parameters), which hold plain values only.
        return instantiate(cfg, _convert_="all", **kwargs)
    except InstantiationException as exc:
        cause = exc.__cause__ or exc
        message = str(cause)
        raise ConfigError(message if message.startswith(f"{group}.") else f"{group}: {message}") from exc


def build_trainer(cfg: DictConfig, output_dir: Path, run_info: dict[str, Any],
                  config: dict[str, Any] | None = None, check: bool = True) -> tuple[pl.Trainer, pl.LightningModule]:
    """Instantiate model, sync backend, strategy, logger and Trainer from the config (``check``:
    :func:`check_config` first). ``config`` is what the loggers record as the run's config."""
    if check:
        check_config(cfg)
    model = _build("model", cfg.model)
    _check_model_keys(cfg, model)
    strategy_cfg = cfg.strategy
    try:
        strategy_cls = get_class(strategy_cfg._target_)
    except Exception as exc:
        raise ConfigError(f"strategy._target_: cannot import {strategy_cfg._target_!r} ({exc})") from exc
    extra: dict[str, Any] = {}
    if issubclass(strategy_cls, DDLStrategy):
        extra["sync"] = _build("sync", cfg.sync, **_sync_components(cfg))
    strategy = _build("strategy", strategy_cfg, **extra)
    logger = _build("logger", cfg.logger, save_dir=str(output_dir))
    callbacks: list[pl.Callback] = [StepMetrics(output_dir, run_info, config), StopOnSignals()]
    if OmegaConf.select(cfg, "ckpt._target_") is not None:
        # First, so that a blocking checkpoint's time shows in the step time the metrics measure.
        callbacks.insert(0, _build("ckpt", cfg.ckpt, run_dir=str(output_dir)))
    trainer_args = OmegaConf.to_container(cfg.trainer, resolve=True)
    try:
        trainer = pl.Trainer(
            **trainer_args,
            strategy=strategy,
            logger=logger,
            callbacks=callbacks,
            enable_checkpointing=False,
            default_root_dir=str(output_dir),
        )
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"trainer: {exc}") from exc
    return trainer, model


def run(
    cfg: DictConfig,
    output_dir: str | Path,
    run_info: dict[str, Any] | None = None,
    overrides: list[str] | None = None,
    config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train as configured; return the summary (written to ``output_dir/summary.json``).

    ``overrides`` are the command line's Hydra overrides: an emulated cluster re-runs train.py with
    them on every emulated machine. ``config`` is what the loggers record as the run's config. A stop
    signal ends the run with :class:`~ddlscale.cluster.stop.StopRequested` once every process it
    started is gone and the summary of what it did is written.
    """
    output_dir = Path(output_dir)
    if cfg.get("keep_freed_memory", True) is True:  # before any tensor, and inherited by every worker
        keep_freed_memory()
    check_config(cfg)
    info = {"sync": "custom", "compressor": "none", "ckpt": "none", "model": "custom", **(run_info or {})}
    launching = "WORLD_SIZE" not in os.environ  # else torchrun or SLURM started this process as a worker
    rank0 = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))) == 0
    # A worker under ddlscale's emulated cluster: the launcher above keeps its output and reports.
    reporting = launching or not os.environ.get(RUN_LOG_ENV)
    started = time.time()
    with run_log(output_dir / "train.log") if rank0 else contextlib.nullcontext():
        try:
            with stop.stop_on_signals() if launching else contextlib.nullcontext():
                summary = _run(cfg, output_dir, info, overrides or [], config)
        except BaseException as exc:
            signal_name = stop.received() if launching else None
            if signal_name is None:
                raise
            print_summary(stopped_summary(output_dir, info, signal_name, started), output_dir)
            raise stop.StopRequested(signal.Signals[signal_name]) from exc
        if summary and reporting:
            print_summary(summary, output_dir)
    return summary


def _run(cfg: DictConfig, output_dir: Path, info: dict[str, Any], overrides: list[str],
         config: dict[str, Any] | None) -> dict[str, Any]:
    if cfg.cluster.kind == "emulated" and "WORLD_SIZE" not in os.environ:
        reason = unavailable_reason()
        if reason is None:
            if isinstance(cfg.sync.get("sparse_params"), ListConfig):  # checked where the workers cannot
                _check_model_keys(cfg, _build("model", cfg.model))
            return run_on_emulated_cluster(cfg, output_dir, overrides)
        if cfg.cluster.get("fallback", "loopback") != "loopback":
            raise ConfigError(f"cluster=emulated cannot run here: {reason} (cluster.fallback={cfg.cluster.fallback})")
        warnings.warn(f"emulated cluster unavailable ({reason}): running on loopback, NO bandwidth limit",
                      stacklevel=2)
        info["cluster"] = f"emulated-fallback-loopback: {reason}"
        cfg = cfg.copy()
        cfg.trainer.devices = cfg.trainer.devices * cfg.cluster.nodes
    if cfg.cluster.kind == "local" and cfg.cluster.get("max_restarts", 0) and "WORLD_SIZE" not in os.environ:
        check_config(cfg)
        return run_with_restarts(cfg, output_dir, overrides or [])
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    trainer, model = build_trainer(cfg, output_dir, info, config, check=False)
    with _gemini_infrastructure(trainer, output_dir):
        ckpt_path = resume_path(trainer)
        with _own_rendezvous_port():
            trainer.fit(model, ckpt_path=ckpt_path)
    if dist.is_initialized():  # a rank run in this process (start_method=popen): end its groups while Python runs
        dist.destroy_process_group()
    summary_path = output_dir / "summary.json"
    # Under torchrun every rank gets here; only rank 0 wrote the summary, so only it reads it back.
    if int(os.environ.get("RANK", "0")) != 0 or not summary_path.exists():
        return {}
    return json.loads(summary_path.read_text())


def resume_path(trainer: pl.Trainer) -> str | None:
    """The checkpoint a checkpointer callback asks to resume from, decided here, before workers start."""
    for callback in trainer.callbacks:
        if isinstance(callback, Checkpointer):
            try:
                return callback.resume_path(trainer.world_size)
            except ValueError as exc:
                raise ConfigError(str(exc)) from exc
    return None


def _gemini_infrastructure(trainer: pl.Trainer, output_dir: Path) -> contextlib.AbstractContextManager:
    """Store and agents for ckpt=gemini when this process launches the workers and nobody else did."""
    gemini = next((c for c in trainer.callbacks if isinstance(c, GeminiCheckpointer)), None)
    if gemini is None or gemini.store_address not in (None, ETCD) or os.environ.get(STORE_ENV) or "WORLD_SIZE" in os.environ:
        return contextlib.nullcontext()
    return _local_gemini(gemini, trainer.world_size, output_dir)


def _local_gemini(gemini: GeminiCheckpointer, machines: int, output_dir: Path) -> contextlib.AbstractContextManager:
    etcd_dir = output_dir / "etcd" if gemini.store_address == ETCD else None
    return local_gemini(machines, job_name(str(output_dir)), gemini.persist_dir, etcd_dir=etcd_dir)


def project_step_time(summary: dict[str, Any], network: NetworkModel) -> dict[str, float]:
    """Step time at 16-1024 workers: this run's non-sync time plus the model's allreduce of its gradients.

    The gradient bytes are recovered from the measured ring volume, 2 (n-1)/n of them per rank.
    """
    world = summary["world_size"]
    grad_bytes = summary["bytes_sent_per_step"] * world / (2 * (world - 1))
    local = max(summary["step_time_s"] - summary["sync_time_s"], 0.0)
    return {str(n): local + network.allreduce(grad_bytes, n) for n in PROJECTION_WORKERS}


def _wait_all_or_first_failure(agents: list[Any], poll_s: float = 0.5) -> list[int | None]:
    """Exit codes of all agents, or as soon as one fails (its peers could wait on it forever; the
    cluster's teardown then kills them)."""
    while True:
        codes = [agent.poll() for agent in agents]
        if all(code is not None for code in codes) or any(code for code in codes):
            return codes
        time.sleep(poll_s)


@contextlib.contextmanager
def _own_rendezvous_port() -> Iterator[None]:
    """Let each fit started here pick a fresh free port, then put the environment back.

    Lightning's spawn launcher writes its port into MASTER_PORT for good; the next job of a sweep
    would reuse it while the last job's socket may still hold it. Under torchrun or SLURM the
    variable belongs to the launcher and is left alone.
    """
    if "WORLD_SIZE" in os.environ:
        yield
        return
    saved = os.environ.get("MASTER_PORT")
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("MASTER_PORT", None)
        else:
            os.environ["MASTER_PORT"] = saved


def _configured_gemini(cfg: DictConfig, output_dir: Path) -> GeminiCheckpointer | None:
    """The run's Gemini checkpointer, as its workers will build it; None for other tiers."""
    target = OmegaConf.select(cfg, "ckpt._target_")
    if target is None or not issubclass(get_class(target), GeminiCheckpointer):
        return None
    return _build("ckpt", cfg.ckpt, run_dir=str(output_dir))


def run_with_restarts(cfg: DictConfig, output_dir: Path, overrides: list[str]) -> dict[str, Any]:
    """``cluster=local`` with ``cluster.max_restarts`` > 0: torchrun's elastic agent (torch's restart
    engine) runs train.py's workers on this machine and restarts them all when one dies, up to that
    many times; each restart resumes from the checkpointer. Gemini's store and agents belong to this
    process, so they outlive the workers, and restarted workers recover from their memory."""
    devices = int(cfg.trainer.devices)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={devices}",
            f"--max-restarts={int(cfg.cluster.max_restarts)}", str(TRAIN_SCRIPT), *overrides,
            f"hydra.run.dir={output_dir}"]
    if OmegaConf.select(cfg, "ckpt._target_") is None:
        warnings.warn("cluster.max_restarts without a checkpointer (ckpt=none): restarts begin at step 0", stacklevel=2)
    gemini = _configured_gemini(cfg, output_dir)
    with (_local_gemini(gemini, devices, output_dir) if gemini else contextlib.nullcontext()):
        code = subprocess.run(argv).returncode
    if code:
        raise RuntimeError(f"torchrun exited with code {code} after at most {cfg.cluster.max_restarts} restarts; "
                           "see the output above")
    return json.loads((output_dir / "summary.json").read_text())


def run_on_emulated_cluster(cfg: DictConfig, output_dir: Path, overrides: list[str]) -> dict[str, Any]:
    """Bring up the emulated machines, run train.py under one torchrun agent per machine, tear down.

    Every agent gets the same overrides, plus the machine count and this run's directory, so all
    ranks write one run's outputs; the summary gains the cost model's view of the network.
    """
    nodes, devices = int(cfg.cluster.nodes), int(cfg.trainer.devices)
    worker_args = [*overrides, f"trainer.num_nodes={nodes}", f"hydra.run.dir={output_dir}"]
    choice = dilation.choose(dilation.parse(cfg.cluster.get("dilation", 1)), nodes, devices,
                             parse_bandwidth(cfg.cluster.bandwidth), parse_time(cfg.cluster.latency))
    with job_secret() as secret, EmulatedCluster(nodes, str(cfg.cluster.bandwidth), str(cfg.cluster.latency),
                                                 dilation=choice.k, ranks_per_machine=devices) as cluster:
        cpu_cap = cluster.cpu_cap()
        print(f"emulated cluster {cluster.name}: {nodes} machines x {devices} workers, "
              f"{cfg.cluster.bandwidth} NICs, {choice.describe()}; CPU: {cpu_cap}; every time "
              f"reported is wall time / {choice.k:g}", flush=True)
        # All emulated machines share this host's cores: split them, or OpenMP pools oversubscribe.
        threads = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // (nodes * devices)))}
        port = int(cfg.cluster.port)
        gemini = _configured_gemini(cfg, output_dir)
        job = job_name(str(output_dir))
        etcd = None
        if gemini and gemini.store_address == ETCD:  # members on the first three machines: rendezvous and keys
            etcd = start_emulated_etcd(cluster, output_dir / "etcd", job)
            store = str(etcd.address)
            print(f"control plane: etcd members at {etcd.address.rendezvous_endpoint}", flush=True)
        else:
            cluster.start_rendezvous_store(port)
            store = f"{cluster.address(0)}:{port}"
        envs = [dict(threads) for _ in range(nodes)]
        if gemini:  # one replica agent per machine; the rendezvous store carries Gemini's keys
            for i in range(nodes):
                start_emulated_agent(cluster, i, store, job, secret)
                envs[i].update(emulated_env(cluster, i, store, job, secret))
        agents = [cluster.torchrun(i, worker_args, nproc_per_node=devices, port=port, env=envs[i],
                                   max_restarts=int(cfg.cluster.get("max_restarts", 0)),
                                   etcd=etcd.address if etcd else None, run_id=job)
                  for i in range(nodes)]
        try:
            codes = _wait_all_or_first_failure(agents)
        except BaseException:
            cluster.down(grace_s=stop.GRACE_S)  # SIGTERM first: the workers write what they have
            raise
        finally:
            if gemini:  # the same command in this run directory then continues from it
                persist_emulated(cluster, store, job, secret, gemini.persist_dir)
            cluster.down()
            if gemini:
                remove_replicas(job)  # the agents died with the cluster; their shared memory goes too
    if any(codes):
        raise RuntimeError(f"emulated-cluster agents exited with codes {codes}; see the output above")
    summary_path = output_dir / "summary.json"
    summary = json.loads(summary_path.read_text())
    network = cluster.network_model(gpus_per_machine=devices)
    summary["cluster_nodes"] = nodes
    summary["cluster_bandwidth_bps"] = cluster.bandwidth_bps
    summary.update(choice.summary())
    summary["cpu_cap"] = cpu_cap
    world = summary["world_size"]
    if summary.get("bytes_sent_per_step") and world > 1:
        # A ring laid out machine by machine crosses each NIC once: one rank's volume per NIC.
        summary["wire_time_per_step_s"] = summary["bytes_sent_per_step"] * 8 / network.bandwidth_bps
        summary["projected_step_time_s"] = project_step_time(summary, network)
        print("projected step time (cost model, dense ring allreduce not overlapped): " + ", ".join(
            f"{n} workers {t * 1e3:.0f} ms" for n, t in summary["projected_step_time_s"].items()), flush=True)
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    return summary
