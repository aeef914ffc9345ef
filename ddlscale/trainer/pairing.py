"""Choices of different groups that only work together: checked with the rest of the config.

A strategy that is not ddlscale's (``strategy=ddp``: stock Lightning DDP) synchronizes gradients its
own way and never builds ``sync``; a run asking for another sync there would train with DDP while
every label said otherwise, so it is refused instead.
"""

from __future__ import annotations

from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

DENSE_SYNC = "ddlscale.sync.DenseAllreduce"  # what stock DDP computes, bit for bit


class MismatchedChoices(ValueError):
    """Two groups' choices that cannot run together; the message names both keys."""


def check_strategy_runs_sync(cfg: DictConfig) -> None:
    strategy = OmegaConf.select(cfg, "strategy._target_")
    sync = OmegaConf.select(cfg, "sync._target_")
    if strategy is None or sync is None or sync == DENSE_SYNC:
        return
    try:
        from ddlscale.strategy import DDLStrategy

        runs_sync = issubclass(get_class(strategy), DDLStrategy)
    except Exception:  # a strategy that cannot be imported is reported where it is built, naming its key
        return
    if not runs_sync:
        raise MismatchedChoices(
            f"strategy._target_={strategy} synchronizes gradients itself and ignores sync._target_={sync}: "
            "use strategy=ddlscale to run that sync, or sync=dense with this strategy")
