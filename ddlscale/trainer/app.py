"""Build a training run from a composed config and fit it.

Everything that can be wrong with a config is found here, in the launching process, before any
worker starts: :class:`ConfigError` names the offending key and the values it takes.

The launching process also answers SIGINT, SIGTERM, SIGHUP and SIGUSR1 by stopping every process it started
(:mod:`ddlscale.cluster.stop`), keeps what the run prints in ``train.log``, and ends by printing a
short summary and the run directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch.distributed as dist
from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf
from pytorch_lightning.loggers import CSVLogger

from ddlscale.ckpt import Checkpointer
from ddlscale.cluster import slurm, stop
from ddlscale.cluster.context import ELASTIC, EMULATED, IN_PROCESS, WORKER, Launch, no_services
from ddlscale.cluster.emulated import unavailable_reason
from ddlscale.cluster.launch import ServicesOf, run_on_emulated_cluster, run_with_restarts
from ddlscale.compress.dgc import DGC
from ddlscale.schema import is_int
from ddlscale.strategy import DDLStrategy
from ddlscale.sync.grad_sync import GradSync
from ddlscale.trainer import pairing, rundir, runinfo, schemas
from ddlscale.trainer.host import keep_freed_memory
from ddlscale.trainer.loggers import RunCSVLogger
from ddlscale.trainer.metrics import StepMetrics
from ddlscale.trainer.report import RunFailed, error_line, failed_summary, print_summary, stopped_summary
from ddlscale.trainer.runlog import ENV as RUN_LOG_ENV
from ddlscale.trainer.runlog import run_log
from ddlscale.trainer.signals import StopOnSignals


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the key."""


def world_size(cfg: DictConfig) -> int:
    """Ranks the config asks for: workers per machine times machines."""
    machines = cfg.cluster.get("nodes", 1) if cfg.cluster.kind == "emulated" else cfg.trainer.num_nodes
    return cfg.trainer.devices * machines


def launch_context(cfg: DictConfig, run_dir: str | Path | None = None) -> Launch:
    """This process's part in the launch the config describes: the one place that asks the environment
    whether this process is a launcher or one of the ranks (torchrun sets WORLD_SIZE; SLURM starts one
    task per rank, where Lightning takes the ranks from SLURM's variables)."""
    kind = OmegaConf.select(cfg, "cluster.kind")
    if "WORLD_SIZE" in os.environ or kind == "slurm" and slurm.in_task():
        mode = WORKER
    elif kind == "emulated":
        mode = EMULATED
    elif kind == "local" and OmegaConf.select(cfg, "cluster.max_restarts"):
        mode = ELASTIC
    else:
        mode = IN_PROCESS
    # Read as configured, checked by check_config: a bad value is reported there, naming its key.
    machines = OmegaConf.select(cfg, "cluster.nodes", default=1) if kind == "emulated" else (
        OmegaConf.select(cfg, "trainer.num_nodes"))
    storage = kind == "emulated" and OmegaConf.select(cfg, "cluster.storage.bandwidth", default=None) is not None
    return Launch(mode, kind, machines, OmegaConf.select(cfg, "trainer.devices"),
                  Path(run_dir) if run_dir is not None else None, storage=storage)


def check_config(cfg: DictConfig, launch: Launch | None = None, submitted: bool = False) -> None:
    """Reject values no component would catch before workers start (``launch``: the launch they are
    checked for, by default :func:`launch_context`'s; ``submitted``: a sweep's job that Hydra's launcher
    hands to SLURM, whose tasks will run it, rather than one this process runs)."""
    launch = launch if launch is not None else launch_context(cfg)
    try:
        schemas.check(cfg)  # every value against its group's schema: types, ranges, choices
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    kind = OmegaConf.select(cfg, "cluster.kind")
    if kind == "torchrun" and not launch.is_worker:
        raise ConfigError("cluster=torchrun, but this process was not started by torchrun (no WORLD_SIZE)")
    if kind == "slurm" and not launch.is_worker and not submitted:
        raise ConfigError(slurm.refusal())  # it would train here, labelled slurm
    _check_sync_keys(cfg)
    _check_batches(cfg)
    try:
        pairing.check_strategy_runs_sync(cfg)
    except pairing.MismatchedChoices as exc:
        raise ConfigError(str(exc)) from None
    if not _sync_components(cfg):  # compressor= and memory= fit the sync, and the sync accepts them
        _build("sync", cfg.sync)  # any other sync checks its own keys here too
    if OmegaConf.select(cfg, "strategy._target_") is not None:
        _build("strategy", cfg.strategy)  # its own keys (strategy.timeout_s, strategy.start_method...)
    if OmegaConf.select(cfg, "ckpt._target_") is not None:
        checkpointer = _build("ckpt", cfg.ckpt)  # it checks its own keys (ckpt.every, ckpt.keep...)
        if isinstance(checkpointer, Checkpointer):  # and what it needs of the launch
            try:
                checkpointer.validate_launch(launch)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None


def _check_sync_keys(cfg: DictConfig) -> None:
    """Sync keys that must fit the run, which the backends see only in their workers (the world
    size); ``sync.sparse_params`` is checked against the model when it is built."""
    local_size = cfg.sync.get("local_size")
    if local_size is not None:
        world = world_size(cfg)
        if not is_int(local_size) or local_size < 1 or world % local_size:
            raise ConfigError(f"sync.local_size (ranks per machine) must be an integer >= 1 dividing the "
                              f"{world} ranks (trainer.devices x machines), or null; got {local_size!r}")


def _check_batches(cfg: DictConfig) -> None:
    """Every rank trains: Lightning's DistributedSampler gives each rank ceil(num_samples / ranks)
    samples and the loader drops a partial batch, so fewer than a batch would leave the fit with no
    step and no summary."""
    samples, batch = OmegaConf.select(cfg, "model.num_samples"), OmegaConf.select(cfg, "model.batch_size")
    if not (is_int(samples) and is_int(batch)) or samples < 1 or batch < 1:
        return  # not this model's keys, or a bad value the model itself refuses, naming it
    ranks = world_size(cfg)
    each = -(-samples // ranks)
    if each < batch:
        raise ConfigError(f"model.num_samples={samples} gives each of the {ranks} ranks {each} samples, fewer than "
                          f"model.batch_size={batch}: no rank would train a step (model.num_samples >= "
                          f"{batch * ranks}, or a smaller model.batch_size)")


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


def _sync_components(cfg: DictConfig) -> dict[str, Any]:
    """The compressor and memory a compressing sync takes from their groups (empty for other syncs).

    Syncs that compress declare ``compressor:`` and ``memory:`` keys; any other sync refuses a
    compressor rather than silently ignore it, and a sync that needs a compressor (its class says
    so) refuses to run without one. Building the sync here also validates the pair (an allreduce of
    top-k payloads, say) before any worker starts.
    """
    compressing = "compressor" in cfg.sync
    compressor_target = OmegaConf.select(cfg, "compressor._target_")
    memory_target = OmegaConf.select(cfg, "memory._target_")
    if not compressing:
        needs = f"needs a compressing sync (sync=compress, espresso or cupcake); {schemas.chosen(cfg, 'sync')} does not compress"
        if compressor_target is not None:
            raise ConfigError(f"{schemas.chosen(cfg, 'compressor')} {needs}")
        if memory_target is not None and not memory_target.endswith("NoMemory"):
            raise ConfigError(f"{schemas.chosen(cfg, 'memory')} {needs}")
        return {}
    if compressor_target is None and getattr(schemas._target_class(cfg.sync), "needs_compressor", False):
        offered = ", ".join(o for o in schemas.options("compressor") if o != "none")
        raise ConfigError(f"compressor: {schemas.chosen(cfg, 'sync')} compresses every gradient with a compressor and "
                          f"has none ({schemas.chosen(cfg, 'compressor')}); choose one of {offered} (e.g. "
                          "compressor=topk), or sync=dense to train uncompressed")
    parts = {"compressor": _build("compressor", cfg.compressor) if compressor_target is not None else None}
    if "memory" in cfg.sync and memory_target is not None:
        parts["memory"] = _build("memory", cfg.memory)
    _build("sync", cfg.sync, **parts)
    return parts


def move_momentum(sync: Any, model: Any) -> bool:
    """DGC's momentum correction applies the optimizer's momentum on each rank before compressing
    (compressor.momentum, tied to model.momentum by ddlscale/conf/compressor/dgc.yaml): the optimizer then runs
    plain SGD, or momentum would apply twice. Returns whether it moved it.

    A planned sync (Espresso, Cupcake) sends some tensors dense (every one in its dense steps, the
    groups its plan keeps dense): DGC gives those the optimizer's momentum itself
    (:meth:`~ddlscale.compress.dgc.DGC.precondition_dense`), so the momentum moves there too and every
    tensor has it, corrected where it is compressed."""
    compressor = sync.default_compressor() if isinstance(sync, GradSync) else None
    # The model is any LightningModule: one that names no SGD momentum keeps its own optimizer.
    tied = (isinstance(compressor, DGC) and compressor.momentum > 0
            and getattr(model, "optimizer_name", None) == "sgd" and getattr(model, "momentum", 0) == compressor.momentum)
    if tied:
        model.momentum = 0.0
    return tied


def _build(group: str, cfg: DictConfig, **kwargs: Any) -> Any:
    try:
        # Plain lists and dicts, not OmegaConf's: arguments end up in checkpoints (a model's
        # hyper-parameters), which hold plain values only.
        return instantiate(cfg, _convert_="all", **kwargs)
    except InstantiationException as exc:
        cause = exc.__cause__ or exc
        message = str(cause)
        named = message.startswith((f"{group}.", f"{group}="))  # the message names the key already
        raise ConfigError(message if named else f"{group}: {message}") from exc


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
        move_momentum(extra["sync"], model)
    strategy = _build("strategy", strategy_cfg, **extra)
    logger = _build("logger", cfg.logger, save_dir=str(output_dir))
    # metrics.csv whatever the logger: beside summary.json it is the run's record, which
    # ddlscale.tools.compare and a stopped run's summary read.
    loggers = [logger] if isinstance(logger, CSVLogger) else [logger, RunCSVLogger(str(output_dir))]
    callbacks: list[pl.Callback] = [StepMetrics(output_dir, run_info, config), StopOnSignals()]
    if OmegaConf.select(cfg, "ckpt._target_") is not None:
        # First, so that a blocking checkpoint's time shows in the step time the metrics measure.
        callbacks.insert(0, _build("ckpt", cfg.ckpt, run_dir=str(output_dir)))
    trainer_args = OmegaConf.to_container(cfg.trainer, resolve=True)
    try:
        trainer = pl.Trainer(
            **trainer_args,
            strategy=strategy,
            logger=loggers,
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
    launch = launch_context(cfg, output_dir)
    check_config(cfg, launch)
    if not launch.is_worker:
        try:
            rundir.check_continues_or_fresh(cfg, output_dir, sweep=_in_sweep())
        except rundir.RunDirectoryTaken as exc:
            raise ConfigError(str(exc)) from None
    info = {"sync": "custom", "compressor": "none", "ckpt": "none", "model": "custom", **(run_info or {})}
    launching = not launch.is_worker
    if launching and _in_sweep():  # the workers torchrun starts run single Hydra jobs: tell them the sweep
        os.environ[runinfo.SWEEP_ENV] = runinfo.sweep()
    if launching and info.get("run_name"):  # ... and this job's name, which only the launcher's command line gives
        os.environ[runinfo.RUN_NAME_ENV] = str(info["run_name"])
    if launch.kind == "slurm":  # a SLURM task (check_config refused anything else): the job it ran in
        info["slurm_job_id"] = os.environ.get("SLURM_JOB_ID")
    rank0 = _global_rank() == 0
    # A worker under ddlscale's emulated cluster: the launcher above keeps its output and reports.
    reporting = launching or not os.environ.get(RUN_LOG_ENV)
    started = time.time()
    failure: list[str] = []  # the traceback of a failure past validation, for train.log alone
    try:
        with run_log(output_dir / "train.log") if rank0 else contextlib.nullcontext():
            try:
                with stop.stop_on_signals() if launching else contextlib.nullcontext():
                    summary = _run(cfg, launch, info, overrides or [], config)
            except ConfigError:
                raise  # refused before anything started: train.py removes the run directory
            except BaseException as exc:
                signal_name = stop.received() if launching else None
                if signal_name is not None:
                    print_summary(stopped_summary(output_dir, info, signal_name, started), output_dir)
                    _print_continuation(cfg, output_dir)
                    raise stop.StopRequested(signal.Signals[signal_name]) from exc
                if not launching or not isinstance(exc, Exception):
                    raise
                # Past validation: the run directory keeps a failed summary, train.log the traceback.
                failure.append(traceback.format_exc())
                print_summary(failed_summary(output_dir, info, exc, started), output_dir)
                _print_continuation(cfg, output_dir)
                raise RunFailed(error_line(exc)) from exc
            if summary and reporting:
                print_summary(summary, output_dir)
    except RunFailed:
        if rank0 and failure:
            with open(output_dir / "train.log", "a") as log:
                log.write(failure[0])
        raise
    return summary


def _run(cfg: DictConfig, launch: Launch, info: dict[str, Any], overrides: list[str],
         config: dict[str, Any] | None) -> dict[str, Any]:
    """Dispatch to the launch mode: the emulated cluster, torchrun with restarts, or Lightning here."""
    output_dir = launch.run_dir
    if launch.mode == EMULATED:
        reason = unavailable_reason()
        if reason is None:
            if isinstance(cfg.sync.get("sparse_params"), ListConfig):  # checked where the workers cannot
                _check_model_keys(cfg, _build("model", cfg.model))
            return run_on_emulated_cluster(launch, cfg.cluster, overrides, _services(cfg, output_dir))
        if cfg.cluster.get("fallback", "loopback") != "loopback":
            raise ConfigError(f"cluster=emulated cannot run here: {reason} (cluster.fallback={cfg.cluster.fallback})")
        warnings.warn(f"emulated cluster unavailable ({reason}): running on loopback, NO bandwidth limit",
                      stacklevel=2)
        info["cluster"] = f"emulated-fallback-loopback: {reason}"
        cfg = cfg.copy()
        cfg.trainer.devices = cfg.trainer.devices * cfg.cluster.nodes
        launch = replace(launch, mode=IN_PROCESS, machines=cfg.trainer.num_nodes, devices=cfg.trainer.devices)
    if launch.mode == ELASTIC:
        if OmegaConf.select(cfg, "ckpt._target_") is None:
            warnings.warn("cluster.max_restarts without a checkpointer (ckpt=none): restarts begin at step 0",
                          stacklevel=2)
        return run_with_restarts(launch, int(cfg.cluster.max_restarts), overrides, _services(cfg, output_dir))
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    trainer, model = build_trainer(cfg, output_dir, info, config, check=False)
    checkpointer = _checkpointer(trainer)
    with checkpointer.services(launch) if checkpointer is not None else contextlib.nullcontext():
        ckpt_path = resume_path(trainer)
        with _own_rendezvous_port(launch):
            trainer.fit(model, ckpt_path=ckpt_path)
    if dist.is_initialized():  # a rank run in this process (start_method=popen): end its groups while Python runs
        dist.destroy_process_group()
    summary_path = output_dir / "summary.json"
    # Under torchrun or SLURM every rank gets here; only rank 0 wrote the summary, so only it reads it back.
    if _global_rank() != 0 or not summary_path.exists():
        return {}
    return json.loads(summary_path.read_text())


def _global_rank() -> int:
    """This process's rank as its launcher numbered it: torchrun's RANK, SLURM's task number, else 0."""
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def _in_sweep() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _print_continuation(cfg: DictConfig, output_dir: Path) -> None:
    """Below a stopped or failed run's summary: the command that continues it from its checkpoints,
    where its checkpointer left a version to continue from."""
    target = OmegaConf.select(cfg, "ckpt._target_")
    if target is None or not issubclass(get_class(target), Checkpointer):
        return
    overrides = _build("ckpt", cfg.ckpt, run_dir=str(output_dir)).continue_overrides()
    command = rundir.continuing_command(output_dir, overrides) if overrides is not None else None
    if command is not None:
        print(f"  continue it from its newest checkpoint: {command}", flush=True)


def _checkpointer(trainer: pl.Trainer) -> Checkpointer | None:
    return next((c for c in trainer.callbacks if isinstance(c, Checkpointer)), None)


def _services(cfg: DictConfig, output_dir: Path) -> ServicesOf:
    """The services of the run's checkpointer, built as its workers will build it (none without one)."""
    target = OmegaConf.select(cfg, "ckpt._target_")
    if target is None or not issubclass(get_class(target), Checkpointer):
        return no_services
    return _build("ckpt", cfg.ckpt, run_dir=str(output_dir)).services


def resume_path(trainer: pl.Trainer) -> str | None:
    """The checkpoint a checkpointer callback asks to resume from, decided here, before workers start."""
    for callback in trainer.callbacks:
        if isinstance(callback, Checkpointer):
            try:
                return callback.resume_path(trainer.world_size)
            except ValueError as exc:
                raise ConfigError(str(exc)) from exc
    return None


@contextlib.contextmanager
def _own_rendezvous_port(launch: Launch) -> Iterator[None]:
    """Let each fit started here pick a fresh free port, then put the environment back.

    Lightning's spawn launcher writes its port into MASTER_PORT for good; the next job of a sweep
    would reuse it while the last job's socket may still hold it. Under torchrun or SLURM the
    variable belongs to the launcher and is left alone.
    """
    if launch.is_worker:
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
