"""Checkpointer: the part every checkpoint tier shares, as a Lightning callback.

It decides *when* (every K optimizer steps, or "highfreq": K = ceil(t_ckpt / T_iter) measured on a
probe checkpoint, whose write training does not wait for), restores at train start what Lightning's
own restore leaves out (RNG, data position), and reports checkpoint figures for ``summary.json``. A tier subclasses it and implements
:meth:`save` (and :meth:`resume_path` to offer a version to resume from).

Launch hooks, called by the app and the launch modes for whatever tier is configured, so that they
name none: :meth:`validate_launch` before anything starts, :meth:`services` around the workers (a
tier that needs processes beside the trainers, such as Gemini's store and agents, starts them there).

Invariants a subclass must keep: :meth:`save` runs on every rank at the same step and may use
collectives; the state it persists is :func:`ddlscale.ckpt.state.shard.capture_shard`'s, taken inside
``save`` (at on_train_batch_end, after the optimizer step, where Lightning's restore expects it).
"""

from __future__ import annotations

import math
import os
import statistics
import warnings
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

from ddlscale import clock
from ddlscale.ckpt.state.shard import RANK_STATE_KEY, param_sha256, restore_local
from ddlscale.ckpt.version.io import ManifestCheckpointIO
from ddlscale.ckpt.version.manifest import manifest_names
from ddlscale.cluster.context import Launch, Services

HIGHFREQ = "highfreq"
PROGRESS_FILE = "ckpt_progress.log"  # in the run directory
# HighFreq's probe: the first checkpoint, after two steps whose time is not warm-up.
HIGHFREQ_PROBE_STEP = 3


def process_started_unix() -> float | None:
    """When this process started (Linux: /proc), on :func:`ddlscale.clock.timestamp`'s scale (unix / k), so a
    restart's time can be split at the worker's launch."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rpartition(")")[2].split()[19])
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return (boot + ticks / os.sysconf("SC_CLK_TCK")) / clock.dilation()


def parse_every(every: Any, key: str = "ckpt.every") -> int | str:
    if every == HIGHFREQ:
        return HIGHFREQ
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"{key} must be an integer >= 1 or '{HIGHFREQ}', got {every!r}")
    return every


class Checkpointer(pl.Callback):
    """Base of checkpoint tiers. Place it before the metrics callback so a blocking checkpoint's time
    shows in the step time, as it would in training.

    Args:
        every: optimizer steps between checkpoints, or ``"highfreq"``.
        resume: ``None`` (start fresh), ``"auto"`` (newest verified version) or a tier-specific path.
    """

    def __init__(self, every: int | str = 1, resume: str | None = None) -> None:
        self.every = parse_every(every)
        if resume is not None and not isinstance(resume, str):
            raise ValueError(f"ckpt.resume must be null, 'auto' or a path, got {resume!r}")
        self.resume = resume
        self.interval: int | None = None if self.every == HIGHFREQ else int(self.every)
        self.anchor = 0  # checkpoints fall on steps anchor + j * interval
        self.times: list[float] = []  # this rank's seconds per checkpoint
        self.resumed_step: int | None = None
        self.resumed_world_size: int | None = None  # the world size the resumed version was saved at
        self.loaded_param_sha256: str | None = None  # rank 0's parameters as restored
        self._step_times: list[float] = []
        self._probe_step: int | None = None  # HighFreq: the step of the probe checkpoint being written
        self._batch_start: float | None = None
        self._last_step = 0
        self._pending_local: dict[str, Any] | None = None
        self.recovery: dict[str, Any] = {}  # how the resumed state was retrieved (source, seconds)
        # Rank 0 appends "step N unix" per step, "launched|setup 0 unix" and "start|resumed N unix
        # retrieve_s" per (re)start: where a failure left training, and how long getting back took (and
        # where that time went), survive the processes.
        self.progress_path: Path | None = None

    # -- to implement --------------------------------------------------------------------------
    def save(self, trainer: pl.Trainer, batch_idx: int) -> None:
        """Persist the state after batch ``batch_idx`` (every rank; collectives allowed)."""
        raise NotImplementedError

    def written_seconds(self) -> float | None:
        """Seconds from the newest checkpoint's save until it was whole on its tier, None while it is
        still being written (HighFreq's t_ckpt). This default: a tier that writes inside :meth:`save`."""
        return self.times[-1] if self.times else None

    def resume_path(self, world_size: int) -> str | None:
        """What ``trainer.fit(ckpt_path=)`` should load, decided before workers start (None: fresh)."""
        return None

    def load_path(self, path: str) -> dict[str, Any] | None:
        """This rank's restorable dict for a tier-specific ``path`` (in the workers, process group up);
        None for paths the tier does not own (manifests on disk are loaded for every tier)."""
        return None

    def figures(self, trainer: pl.Trainer) -> dict[str, Any]:
        """Tier-specific summary figures (every rank calls this; collectives allowed). This default:
        :meth:`local_figures`."""
        return self.local_figures(trainer)

    def local_figures(self, trainer: pl.Trainer) -> dict[str, Any]:
        """The tier's figures this rank has alone, with no collective: what a run that stopped
        reports (its other ranks may be gone)."""
        return {}

    def persisted_dir(self) -> Path | None:
        """The directory on this host where the tier leaves versions a later launch resumes from
        (None: none this process can look into)."""
        return None

    # -- launch hooks: in the launching process, before and around the workers --------------------
    def validate_launch(self, launch: Launch) -> None:
        """Refuse a launch this tier cannot work in (ValueError naming the key), before anything starts.
        Also called in each worker, with ``launch.is_worker``."""

    def continue_overrides(self) -> list[str] | None:
        """After a launch ended: the overrides with which the same command continues from the newest
        version in :meth:`persisted_dir` (None: no version there to continue from)."""
        directory = self.persisted_dir()
        if directory is None or not directory.is_dir() or not manifest_names(directory):
            return None
        return [] if self.resume == "auto" else ["ckpt.resume=auto"]

    def services(self, launch: Launch) -> AbstractContextManager[Services]:
        """What the tier needs running beside the workers of ``launch``: started on entering, stopped on
        leaving (after the workers are done), and what the launch must pass on to them. Every launch
        mode calls it, the workers too (``launch.is_worker``: a launcher above them already did)."""
        return nullcontext(Services())

    # -- schedule ------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        if self.interval is None:  # HighFreq: one probe, then none until its write has set K
            return self._probe_step is None and step >= HIGHFREQ_PROBE_STEP
        return step > self.anchor and (step - self.anchor) % self.interval == 0

    def _settle_highfreq(self, trainer: pl.Trainer, step: int) -> None:
        """Once every rank's probe is written: K = ceil(t_ckpt / T_iter), from the slowest rank's figures
        so every rank agrees, and the next checkpoint at the next step. Training runs on meanwhile: the
        probe costs what any checkpoint costs, not its whole write (one small reduce per step until then)."""
        written = self.written_seconds()
        steps = self._step_times[1:] or self._step_times
        local = torch.tensor([1.0 if written is None else 0.0, written or 0.0, statistics.median(steps)],
                             dtype=torch.float64, device=trainer.strategy.root_device)
        writing, t_ckpt, t_iter = (float(v) for v in trainer.strategy.reduce(local, reduce_op="max").cpu())
        if writing:
            return
        self.interval = max(1, math.ceil(t_ckpt / t_iter)) if t_iter > 0 else 1
        self.anchor = step + 1 - self.interval

    # -- Lightning hooks -----------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Runs before Lightning loads ckpt_path: let it read our manifests.
        strategy = trainer.strategy
        # Lightning warns that a mid-epoch resume of a plain DataLoader is unreliable; restore_local
        # repositions the loader, so the warning would mislead.
        warnings.filterwarnings("ignore", message=r".*resuming from a checkpoint that ended before the epoch ended.*")
        if not isinstance(strategy.checkpoint_io, ManifestCheckpointIO):
            strategy.checkpoint_io = ManifestCheckpointIO(strategy.checkpoint_io, trainer.global_rank, self.load_path,
                                                          trainer.world_size)
        # Where a (re)start's time goes: the process launched, then got here with its trainer and process
        # group up; "start"/"resumed" follows once the state is restored.
        launched = process_started_unix()
        if launched is not None:
            self._progress(trainer, f"launched {trainer.global_step} {launched:.3f}")
        self._progress(trainer, f"setup {trainer.global_step} {clock.timestamp():.3f}")

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        self._pending_local = checkpoint.get(RANK_STATE_KEY)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pending_local is not None:
            local, self._pending_local = self._pending_local, None
            restore_local(trainer, local)
            self.resumed_step = trainer.global_step
            self.resumed_world_size = int(local.get("resharded_from") or local["world_size"])
            if trainer.is_global_zero:
                self.loaded_param_sha256 = param_sha256(pl_module)
        self._last_step = trainer.global_step
        if self.resumed_step is not None:
            self._progress(trainer, f"resumed {trainer.global_step} {clock.timestamp():.3f} {self.recovery.get('retrieve_s', 0):.4f}")
        else:
            self._progress(trainer, f"start {trainer.global_step} {clock.timestamp():.3f}")

    def _progress(self, trainer: pl.Trainer, line: str) -> None:
        if self.progress_path is not None and trainer.is_global_zero:
            with open(self.progress_path, "a") as file:
                file.write(line + "\n")

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._batch_start is None:
            self._batch_start = clock.now()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._last_step:
            return  # a micro-batch that only accumulated
        self._last_step = step
        if self._batch_start is not None:
            self._step_times.append(clock.now() - self._batch_start)
        self._batch_start = None
        self._progress(trainer, f"step {step} {clock.timestamp():.3f}")
        if self.interval is None and self._probe_step is not None:
            self._settle_highfreq(trainer, step)
        if not self.due(step):
            return
        start = clock.now()
        self.save(trainer, batch_idx)
        self.times.append(clock.now() - start)
        if self.interval is None:
            self._probe_step = step

    def state_dict(self) -> dict[str, Any]:
        return {"interval": self.interval, "anchor": self.anchor}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.every == HIGHFREQ:  # a fixed interval stays as configured
            self.interval = state_dict.get("interval")
            self.anchor = int(state_dict.get("anchor", 0))

    # -- summary -------------------------------------------------------------------------------
    def summary_figures(self, trainer: pl.Trainer, alone: bool = False) -> dict[str, Any]:
        """``ckpt_*`` keys for summary.json; every rank calls this (it reduces over ranks), or, with
        ``alone``, one rank that reports by itself: its own figures, no collective."""
        per_ckpt = list(self.times)
        if self.times and not alone:  # every rank checkpointed at the same steps
            local = torch.tensor(self.times, dtype=torch.float64, device=trainer.strategy.root_device)
            gathered = trainer.strategy.all_gather(local).reshape(-1, len(self.times)).cpu()
            per_ckpt = [float(v) for v in gathered.max(dim=0).values]
        figures = {
            "ckpt_count": len(per_ckpt),
            "ckpt_time_s": statistics.median(per_ckpt) if per_ckpt else None,
            "ckpt_times_s": per_ckpt,
            "ckpt_interval": self.interval,
            "ckpt_resumed_step": self.resumed_step,
            "ckpt_resumed_world_size_saved": self.resumed_world_size,
            "ckpt_resumed_world_size": trainer.world_size if self.resumed_step is not None else None,
            "ckpt_loaded_param_sha256": self.loaded_param_sha256,
            "ckpt_retrieve_s": self.recovery.get("retrieve_s"),
        }
        figures.update(self.local_figures(trainer) if alone else self.figures(trainer))
        return figures
