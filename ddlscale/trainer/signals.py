"""A worker's answer to SIGINT, SIGTERM, SIGHUP and SIGUSR1 (SLURM's warning) while it trains (:mod:`ddlscale.cluster.stop`)."""

from __future__ import annotations

from collections.abc import Callable

import pytorch_lightning as pl

from ddlscale.cluster.stop import raise_on_signals


class StopOnSignals(pl.Callback):
    """From the first training step to the end, a stop signal stops this worker at once (the run's
    callbacks then write what they have). Installed at ``on_train_start``, after Lightning's own
    SIGTERM handler, which it replaces (see :mod:`ddlscale.cluster.stop` for why)."""

    def __init__(self) -> None:
        self._restore: Callable[[], None] | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._restore = raise_on_signals()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._restore is not None:
            self._restore()
            self._restore = None
