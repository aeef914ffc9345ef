"""What every logger records of a run: its whole configuration at the start, its summary at the end.

Lightning's loggers record the model's hyper-parameters only; a run's sync, compressor, memory,
checkpointer, trainer arguments, seed and world size are what a sweep varies, so they go to every
logger, flattened (``sync.bucket_mb``), and the summary follows at the end: TensorBoard's HParams
view pairs them, wandb keeps them as the run's config and summary, the CSV logger writes
``hparams.yaml`` (its summary is ``summary.json``).

:class:`RunCSVLogger` is Lightning's CSV logger for a run directory: it continues ``metrics.csv``
instead of deleting it, and carries text columns (a planned sync's phase) that ``self.log`` cannot.
"""

from __future__ import annotations

import csv
import json
import numbers
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_fabric.utilities.logger import _add_prefix
from pytorch_lightning.core.saving import save_hparams_to_yaml
from pytorch_lightning.loggers import CSVLogger, Logger, TensorBoardLogger, WandbLogger
from pytorch_lightning.loggers.csv_logs import ExperimentWriter
from pytorch_lightning.utilities.rank_zero import rank_zero_only

from ddlscale.schema import Schema, boolean


class _ContinuedWriter(ExperimentWriter):
    """Lightning's writer, except that an existing ``metrics.csv`` is continued: a run resumed in its
    directory appends its steps after the earlier ones (Lightning's deletes the file, and warns so on
    every run, since Hydra's ``.hydra/`` is always there first)."""

    def __init__(self, log_dir: str) -> None:
        self.text: dict[str, str] = {}  # columns for the next row
        self._continued = False  # earlier rows checked against this run's first step
        super().__init__(log_dir)
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as file:
                header = next(csv.reader(file), [])
            self.metrics_keys = sorted(header)  # the order Lightning's writer keeps its columns in
            if header != self.metrics_keys:
                self._rewrite_with_new_header(self.metrics_keys)

    def _check_log_dir_exists(self) -> None:
        """Nothing to warn about or delete: see the class doc."""

    def log_metrics(self, metrics_dict: dict[str, float], step: int | None = None) -> None:
        if not self._continued and step is not None:
            self._continue_before(step)
        super().log_metrics(metrics_dict, step)
        self.metrics[-1].update(self.text)
        self.text = {}

    def _continue_before(self, step: int) -> None:
        """Keep the earlier rows of steps before this run's first: a run resumed from an older version
        than the last step logged redoes the steps after it, whose rows it replaces (and says so)."""
        self._continued = True
        if not self._fs.isfile(self.metrics_file_path):
            return
        with self._fs.open(self.metrics_file_path, "r", newline="") as file:
            reader = csv.DictReader(file)
            header, rows = reader.fieldnames or [], list(reader)
        kept = [row for row in rows if not row.get("step", "").isdigit() or int(row["step"]) < step]
        if len(kept) == len(rows):
            return
        with self._fs.open(self.metrics_file_path, "w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=header)
            writer.writeheader()
            writer.writerows(kept)
        print(f"metrics.csv: {len(rows) - len(kept)} rows of steps >= {step} from an earlier run replaced by "
              "this run's", flush=True)


class RunCSVLogger(CSVLogger):
    """``metrics.csv`` (and ``hparams.yaml``) in the run directory; see the module doc.

    Args: as Lightning's CSVLogger; ``flush_logs_every_n_steps`` defaults to 1 here, so the file is
        current while the run goes (one appended row per step) and complete if it is killed.
    """

    def __init__(self, save_dir: str, name: str | None = "", version: int | str | None = "", prefix: str = "",
                 flush_logs_every_n_steps: int = 1):
        super().__init__(save_dir, name=name, version=version, prefix=prefix,
                         flush_logs_every_n_steps=flush_logs_every_n_steps)

    @property
    def experiment(self) -> _ContinuedWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _ContinuedWriter(log_dir=self.log_dir)
        return self._experiment

    @rank_zero_only
    def annotate(self, **text: str) -> None:
        """Text columns joined to the next row of metrics (the current step's, when called from a
        callback's ``on_train_batch_end``)."""
        self.experiment.text.update(_add_prefix(text, self._prefix, self.LOGGER_JOIN_CHAR))


OFFLINE_MODES = ("offline", "dryrun")  # WANDB_MODE's values for a run kept on disk


@dataclass
class WandbConfig(Schema):
    """``logger.*`` of :class:`RunWandbLogger` that ddlscale reads itself; every other key is Lightning's
    WandbLogger's or ``wandb.init``'s (``logger.group``, ``logger.tags``, ``logger.entity``...)."""

    group = "logger"
    offline: Any = None  # None: WANDB_MODE decides

    def check(self) -> None:
        if self.offline is not None:
            boolean(self.key("offline"), self.offline)


class RunWandbLogger(WandbLogger):
    """Lightning's W&B logger, except that:

    - ``offline=None`` (the config's default) lets ``WANDB_MODE`` decide, as W&B users expect, and
      keeps the run offline where it is unset; ``true`` or ``false`` decide whatever it says;
    - the run is made where it is used, rank 0 of the workers: Lightning's makes it in the launching
      process when a spawn launcher pickles the logger and attaches each worker to it, and an attached
      run has the worker's default settings, so wandb's closing lines sent ``wandb sync`` to
      ``<cwd>/wandb``, where nothing is (the run is in ``<run dir>/wandb``);
    - the run is finished when training ends: W&B writes a run's ``config.yaml`` and
      ``wandb-summary.json`` (what ``wandb sync`` and the W&B page show) when it is finished, and
      Lightning never finishes it, so an offline run left its config in the binary log only.
    """

    schema = WandbConfig

    def __init__(self, *args: Any, offline: bool | None = None, **kwargs: Any) -> None:
        WandbConfig(offline=offline)
        if offline is None:
            offline = os.environ.get("WANDB_MODE", OFFLINE_MODES[0]) in OFFLINE_MODES
        elif not offline:
            kwargs.setdefault("mode", "online")  # asked for in the config: over WANDB_MODE
        super().__init__(*args, offline=offline, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()  # no run made here (see the class doc), none to attach to
        state["_experiment"] = None
        return state

    @rank_zero_only
    def finalize(self, status: str) -> None:
        super().finalize(status)
        if self._experiment is not None and not getattr(self, "_run_finished", False):
            self._run_finished = True  # Lightning may finalize twice (a failed fit, then its teardown)
            self._experiment.finish(exit_code=0 if status == "success" else 1)


def log_run_files(logger: WandbLogger, files: Sequence[Path]) -> None:
    """Upload ``files`` (the summary, a planned sync's plan) with the run, as one artifact of type
    ``run-outputs`` (offline: kept in the run's folder until ``wandb sync``)."""
    import wandb

    run = logger.experiment
    artifact = wandb.Artifact(f"run-outputs-{run.id}", type="run-outputs",
                              description="ddlscale's summary.json and the run's plan, if it made one")
    for path in files:
        artifact.add_file(str(path))
    run.log_artifact(artifact)


def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A nested dict as one level of dotted keys; lists become JSON text, None stays None."""
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flat(value, f"{prefix}{key}."))
        return out
    key = prefix[:-1]
    if isinstance(tree, list | tuple):
        return {key: json.dumps(tree)}
    return {key: tree}


@rank_zero_only
def record_config(loggers: list[Logger], config: dict[str, Any]) -> None:
    """Give every logger the run's flattened config (its hyper-parameters)."""
    for logger in loggers:
        logger.log_hyperparams(config)
        if isinstance(logger, TensorBoardLogger):
            # Lightning writes hparams.yaml once, with the model's hyper-parameters it logs first: rewrite
            # it with the whole config (the model's keys kept), as the logger's help promises.
            os.makedirs(logger.log_dir, exist_ok=True)
            save_hparams_to_yaml(os.path.join(logger.log_dir, logger.NAME_HPARAMS_FILE), logger.hparams)


@rank_zero_only
def record_summary(loggers: list[Logger], summary: dict[str, Any], step: int, files: Sequence[Path] = ()) -> None:
    """Give every logger the run's summary: wandb's run summary (and ``files``, the run's
    ``summary.json`` and plan, as an artifact), TensorBoard's HParams metrics (beside the config),
    ``summary/<key>`` scalars for any other logger; the CSV logger has ``summary.json`` beside it."""
    numbers_only = {k: float(v) for k, v in summary.items()
                    if isinstance(v, numbers.Real) and not isinstance(v, bool)}
    for logger in loggers:
        if isinstance(logger, CSVLogger):
            continue
        if isinstance(logger, WandbLogger):
            logger.experiment.summary.update({k: v for k, v in summary.items() if v is not None})
            if files:
                log_run_files(logger, files)
        elif isinstance(logger, TensorBoardLogger):
            logger.log_hyperparams(logger.hparams, metrics={f"summary/{k}": v for k, v in numbers_only.items()},
                                   step=step)
        else:
            logger.log_metrics({f"summary/{k}": v for k, v in numbers_only.items()}, step=step)
        logger.save()


def metrics_rows(run_dir: str | os.PathLike) -> list[dict[str, str]]:
    """The rows of a run's ``metrics.csv`` (empty when it has none)."""
    path = os.path.join(run_dir, "metrics.csv")
    if not os.path.isfile(path):
        return []
    with open(path, newline="") as file:
        return list(csv.DictReader(file))
