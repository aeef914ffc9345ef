"""Build a training run from a composed config and fit it.

Everything that can be wrong with a config is found here, in the launching process, before any
worker starts: :class:`ConfigError` names the offending key.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

from ddlscale.strategy import DDLStrategy
from ddlscale.trainer.metrics import StepMetrics

CLUSTER_KINDS = ("local", "torchrun", "slurm")


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the key."""


def _positive_int(cfg: DictConfig, key: str, allow: tuple[int, ...] = ()) -> None:
    value = OmegaConf.select(cfg, key)
    if value in allow:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{key} must be an integer >= 1, got {value!r}")


def check_config(cfg: DictConfig) -> None:
    """Reject values no component would catch before workers start."""
    _positive_int(cfg, "trainer.devices")
    _positive_int(cfg, "trainer.num_nodes")
    _positive_int(cfg, "trainer.accumulate_grad_batches")
    _positive_int(cfg, "trainer.max_steps", allow=(-1,))
    if not isinstance(cfg.seed, int):
        raise ConfigError(f"seed must be an integer, got {cfg.seed!r}")
    kind = OmegaConf.select(cfg, "cluster.kind")
    if kind not in CLUSTER_KINDS:
        raise ConfigError(f"cluster.kind must be one of {', '.join(CLUSTER_KINDS)}; got {kind!r}")
    if kind == "torchrun" and "WORLD_SIZE" not in os.environ:
        raise ConfigError("cluster=torchrun, but this process was not started by torchrun (no WORLD_SIZE)")
    for group in ("compressor", "ckpt"):
        target = OmegaConf.select(cfg, f"{group}._target_")
        if target is not None:
            raise ConfigError(f"{group}={target} is not available in this version of ddlscale")


def _build(group: str, cfg: DictConfig, **kwargs: Any) -> Any:
    try:
        return instantiate(cfg, **kwargs)
    except InstantiationException as exc:
        cause = exc.__cause__ or exc
        message = str(cause)
        raise ConfigError(message if message.startswith(f"{group}.") else f"{group}: {message}") from exc


def build_trainer(cfg: DictConfig, output_dir: Path, run_info: dict[str, Any]) -> tuple[pl.Trainer, pl.LightningModule]:
    """Instantiate model, sync backend, strategy, logger and Trainer from the config."""
    check_config(cfg)
    model = _build("model", cfg.model)
    strategy_cfg = cfg.strategy
    try:
        strategy_cls = get_class(strategy_cfg._target_)
    except Exception as exc:
        raise ConfigError(f"strategy._target_: cannot import {strategy_cfg._target_!r} ({exc})") from exc
    extra: dict[str, Any] = {}
    if issubclass(strategy_cls, DDLStrategy):
        extra["sync"] = _build("sync", cfg.sync)
    strategy = _build("strategy", strategy_cfg, **extra)
    logger = _build("logger", cfg.logger, save_dir=str(output_dir))
    trainer_args = OmegaConf.to_container(cfg.trainer, resolve=True)
    try:
        trainer = pl.Trainer(
            **trainer_args,
            strategy=strategy,
            logger=logger,
            callbacks=[StepMetrics(output_dir, run_info)],
            enable_checkpointing=False,
            default_root_dir=str(output_dir),
        )
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"trainer: {exc}") from exc
    return trainer, model


def run(cfg: DictConfig, output_dir: str | Path, run_info: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train as configured; return the summary (written to ``output_dir/summary.json``)."""
    output_dir = Path(output_dir)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    info = {"sync": "custom", "compressor": "none", "ckpt": "none", "model": "custom", **(run_info or {})}
    trainer, model = build_trainer(cfg, output_dir, info)
    trainer.fit(model)
    summary_path = output_dir / "summary.json"
    return json.loads(summary_path.read_text()) if summary_path.exists() else {}
