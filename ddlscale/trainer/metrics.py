"""Per-step training figures and the run's ``summary.json``.

The callback times each optimizer step (all its micro-batches), reads the sync backend's byte and
time figures and the collectives it issued (how many of each op, how long in flight), logs them per
step, and at the end reduces them over ranks into the summary every experiment reads (the per-op
figures are rank 0's). Medians skip the first step, which pays one-off costs (order learning, warm-up).

``step_loss`` is the loss of an optimizer step on rank 0 as Lightning trains on it: the sum of its
micro-batches' losses, each divided by the accumulation count (their mean) — the objective whose
gradient the step applies; ``final_loss`` is its last value, the same number as metrics.csv's last
row. (No reduction over ranks per step: logging must not add collectives to what is measured.)

A run stopped by a signal or an error still writes its summary, from rank 0's figures alone
(``status``: ``interrupted`` or ``failed``): the other ranks may be gone, so nothing is gathered.

A planned sync (Espresso, Cupcake) spends its first steps profiling and trying candidates: its
summary's medians are those of the kept plan's steps (``sync_phase`` plan), and each planning phase's
medians are reported apart (``sync_phase_medians``, rank 0's), so that the figures describe the plan.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

from ddlscale import clock
from ddlscale.ckpt.checkpointer import Checkpointer
from ddlscale.ckpt.state.shard import param_sha256
from ddlscale.cluster import stop
from ddlscale.sync import GradSync
from ddlscale.trainer.loggers import RunCSVLogger, record_config, record_summary


def _median_after_warmup(values: list[float]) -> float:
    kept = values[1:] if len(values) > 1 else values
    return statistics.median(kept) if kept else float("nan")


PLAN_PHASE = "plan"  # a planned sync's steps under the plan it kept


def _phase_medians(history: dict[str, list[float]], phases: list[str]) -> dict[str, dict[str, float]]:
    """Per phase (in the order the run went through them): its steps and rank 0's medians."""
    out: dict[str, dict[str, float]] = {}
    for phase in dict.fromkeys(phases):
        rows = [i for i, p in enumerate(phases) if p == phase]
        figures = {name: statistics.median(history[key][i] for i in rows)
                   for name, key in (("step_time_s", "step_time_s"), ("sync_time_s", "sync_time_s"),
                                     ("bytes_sent_per_step", "bytes_sent"))}
        out[phase] = {"steps": len(rows), **{k: v if math.isfinite(v) else None for k, v in figures.items()}}
    return out


def _share(part: torch.Tensor, whole: torch.Tensor) -> float:
    """The smallest ratio part / whole over ranks (1 where nothing was in flight)."""
    ratios = [math.nan if math.isnan(w) else p / w if w > 0 else 1.0 for p, w in zip(part.tolist(), whole.tolist(), strict=True)]
    return min(ratios) if ratios else float("nan")


def _per_op(records: list[Any]) -> dict[str, tuple[int, float]]:
    ops: dict[str, tuple[int, float]] = {}
    for record in records:
        count, seconds = ops.get(record.op, (0, 0.0))
        ops[record.op] = (count + 1, seconds + (record.duration or 0.0))
    return ops


def _ops_summary(steps: list[dict[str, tuple[int, float]]]) -> dict[str, dict[str, float]]:
    """Rank 0's medians per step of each collective op's count and time in flight (issue to
    completion, summed: overlapping collectives each count whole), the first step skipped."""
    kept = steps[1:] if len(steps) > 1 else steps
    names = sorted({op for step in kept for op in step})
    return {op: {"per_step": statistics.median(s.get(op, (0, 0.0))[0] for s in kept),
                 "ms_per_step": statistics.median(s.get(op, (0, 0.0))[1] for s in kept) * 1e3} for op in names}


class StepMetrics(pl.Callback):
    """Log per-step loss, throughput, sync time and bytes; write ``summary.json`` on rank 0.

    Args:
        output_dir: where ``summary.json`` goes.
        run_info: fixed keys copied into the summary (sync, compressor, ckpt, model names, seed...).
        config: the run's flattened config, given to every logger at the start (with the world size).
    """

    def __init__(self, output_dir: str | Path, run_info: dict[str, Any] | None = None,
                 config: dict[str, Any] | None = None):
        self.output_dir = Path(output_dir)
        self.run_info = dict(run_info or {})
        self.config = dict(config or {})
        self.history: dict[str, list[float]] = {
            k: [] for k in ("step_time_s", "sync_time_s", "bytes_sent", "bytes_recv", "loss",
                            "encode_time_s", "comm_time_s", "decode_time_s", "collectives", "cpu_s",
                            "in_flight_s", "overlapped_s")
        }
        self.phases: dict[str, int] = {}  # steps per sync phase, for backends that have phases
        self.step_phases: list[str] = []  # each recorded step's phase (empty: a sync without phases)
        self.ops: list[dict[str, tuple[int, float]]] = []  # per step: collective op -> (count, seconds in flight)
        self._step_start: float | None = None
        self._step_cpu = 0.0  # the process's CPU seconds (all its threads) at the step's start
        self._last_step_end: float | None = None  # for the period: one optimizer step's end to the next
        self._step_loss: torch.Tensor | None = None
        self._last_global_step = 0
        # The newest step whose metrics.csv row is written (Lightning logs a step's row after the
        # callbacks' on_train_batch_end), with its loss: what a run that stops reports, so that its
        # summary and its rows agree whichever line the signal or error interrupted.
        self._logged = (0, 0)  # (that step, how many steps of history this process had recorded then)
        self._started = False  # training ran in this process (not so in a spawn launcher's own)
        self._written = False

    def _sync(self, trainer: pl.Trainer) -> GradSync | None:
        sync = getattr(trainer.strategy, "sync", None)
        return sync if isinstance(sync, GradSync) else None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._started, self._last_global_step = True, trainer.global_step
        self._logged = (trainer.global_step, len(self.history["loss"]))
        if trainer.is_global_zero and self.config:
            record_config(trainer.loggers, {**self.config, "world_size": trainer.world_size})

    def _confirm_logged(self) -> None:
        """The step recorded last is logged once the loop is past its end (the next batch, or the end)."""
        recorded = min(len(values) for values in self.history.values())
        if self._last_global_step > self._logged[0] and recorded > self._logged[1]:
            self._logged = (self._last_global_step, recorded)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._confirm_logged()
        if self._step_start is None:
            self._step_start, self._step_cpu = clock.now(), time.process_time()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # Lightning hands over each micro-batch's loss divided by the accumulation count.
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is not None:
            part = loss.detach().float()
            self._step_loss = part if self._step_loss is None else self._step_loss + part
        if trainer.global_step == self._last_global_step or self._step_start is None:
            return  # a micro-batch that only accumulated
        self._last_global_step = trainer.global_step
        now = clock.now()
        step_time = now - self._step_start
        # The period also holds what the loop does between batches (data, logging, callbacks): the
        # iteration time throughput sees, and what the planners' profiles and predictions measure.
        period = now - self._last_step_end if self._last_step_end is not None else None
        self._step_start, self._last_step_end = None, now
        sync = self._sync(trainer)
        stats = sync.last_stats if sync is not None else None
        step_loss, self._step_loss = self._step_loss, None
        row = {
            "step_time_s": step_time,
            "sync_time_s": stats.sync_s if stats else float("nan"),
            "bytes_sent": float(stats.bytes_sent) if stats else float("nan"),
            "bytes_recv": float(stats.bytes_recv) if stats else float("nan"),
            "loss": float(step_loss) if step_loss is not None else float("nan"),
            # Where the sync time goes: packing/hashing, blocked on the wire, unpacking/summing.
            "encode_time_s": stats.encode_s if stats else float("nan"),
            "comm_time_s": stats.comm_s if stats else float("nan"),
            "decode_time_s": stats.decode_s if stats else float("nan"),
            # Collectives issued: each pays a round's fixed cost (launch, latency) whatever its bytes.
            "collectives": float(len(stats.collectives)) if stats else float("nan"),
            # CPU seconds this rank used in the step: against its step time, how CPU-bound it ran.
            # Not divided by the dilation: a capped machine spends the same CPU work k times slower.
            "cpu_s": time.process_time() - self._step_cpu,
            # Communication in flight, and how much of it ran before the sync's wait: during backward.
            "in_flight_s": stats.in_flight_s if stats else float("nan"),
            "overlapped_s": stats.overlapped_s if stats else float("nan"),
        }
        for key, value in row.items():
            self.history[key].append(value)
        if stats:
            self.ops.append(_per_op(stats.collectives))
        phase = sync.step_phase if sync is not None else None
        if phase is not None:
            self.phases[phase] = self.phases.get(phase, 0) + 1
            self.step_phases.append(phase)
            for logger in trainer.loggers:
                if isinstance(logger, RunCSVLogger):  # the run's metrics.csv: a text column per row
                    logger.annotate(sync_phase=phase)
        if step_loss is not None:
            pl_module.log("step_loss", step_loss, on_step=True, on_epoch=False, rank_zero_only=True)
        global_batch = self._global_batch(trainer)
        pl_module.log_dict(
            {
                "step_time_s": step_time,
                "sync_time_s": row["sync_time_s"],
                "bytes_sent": row["bytes_sent"],
                "bytes_recv": row["bytes_recv"],
                "encode_time_s": row["encode_time_s"],
                "decode_time_s": row["decode_time_s"],
            },
            on_step=True, on_epoch=False, rank_zero_only=True,
        )
        if period is not None:
            pl_module.log("step_period_s", period, on_step=True, on_epoch=False, rank_zero_only=True)
        pl_module.log("samples_per_s", global_batch / step_time, on_step=True, on_epoch=False,
                      prog_bar=True, rank_zero_only=True)

    @staticmethod
    def _global_batch(trainer: pl.Trainer) -> int:
        loader = trainer.train_dataloader
        batch_size = getattr(loader, "batch_size", None) or 1
        return int(batch_size) * trainer.world_size * trainer.accumulate_grad_batches

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._confirm_logged()
        h = self._reported(self.history)
        local = torch.tensor(
            [
                _median_after_warmup(h["step_time_s"]),
                _median_after_warmup(h["sync_time_s"]),
                _median_after_warmup(h["bytes_sent"]),
                _median_after_warmup(h["bytes_recv"]),
                h["loss"][-1] if h["loss"] else float("nan"),
                _median_after_warmup(h["encode_time_s"]),
                _median_after_warmup(h["comm_time_s"]),
                _median_after_warmup(h["decode_time_s"]),
                _median_after_warmup(h["collectives"]),
                _median_after_warmup(h["cpu_s"]),
                _median_after_warmup(h["in_flight_s"]),
                _median_after_warmup(h["overlapped_s"]),
            ],
            dtype=torch.float64,
        )
        ranks = trainer.strategy.all_gather(local).reshape(-1, local.numel()).cpu()
        # Other callbacks' figures (checkpoint times...): every rank asks, as they may reduce over ranks.
        extra: dict[str, Any] = {}
        for callback in trainer.callbacks:
            if isinstance(callback, Checkpointer):
                extra.update(callback.summary_figures(trainer))
        if not trainer.is_global_zero:
            return
        step_time = float(ranks[:, 0].max())
        traffic = ranks[:, 2] + ranks[:, 3]
        summary = {
            **self.run_info,
            "status": "finished",
            "dilation": clock.dilation(),  # every time here is wall time / this k
            "world_size": trainer.world_size,
            "steps": trainer.global_step,
            "final_loss": float(ranks[0, 4]),
            "samples_per_s": self._global_batch(trainer) / step_time,
            "step_time_s": step_time,
            "sync_time_s": float(ranks[:, 1].max()),
            "bytes_sent_per_step": float(ranks[:, 2].max()),
            "bytes_recv_per_step": float(ranks[:, 3].max()),
            "imbalance": float(traffic.max() / traffic.mean()) if float(traffic.mean()) > 0 else 1.0,
            "encode_time_s": float(ranks[:, 5].max()),
            "comm_time_s": float(ranks[:, 6].max()),
            "decode_time_s": float(ranks[:, 7].max()),
            "collectives_per_step": float(ranks[:, 8].max()),
            "cpu_s_per_step": float(ranks[:, 9].max()),
            # The step's communication in flight (busiest rank) and the share of it that overlapped
            # backward (the least-overlapped rank's).
            "comm_in_flight_s": float(ranks[:, 10].max()),
            "comm_overlap": _share(ranks[:, 11], ranks[:, 10]),
            "param_sha256": param_sha256(pl_module),
            **self._sync_figures(trainer),
        }
        summary.update({k: v for k, v in extra.items() if k not in summary})
        self._write(trainer, summary)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """A stopped or failed run: rank 0 writes what it has, alone (see the module doc)."""
        if not self._started or self._written or not trainer.is_global_zero:
            return
        signal_name = exception.name if isinstance(exception, stop.StopRequested) else stop.received()
        if signal_name is None and isinstance(exception, KeyboardInterrupt):
            signal_name = "SIGINT"
        logged_step, kept = self._logged
        # Figures of the logged steps only: a step the exception cut short has no row, so none here.
        h = self._reported({key: values[:kept] for key, values in self.history.items()})
        step_time = _median_after_warmup(h["step_time_s"])
        summary = {
            **self.run_info,
            "status": "interrupted" if signal_name else "failed",
            "stopped_by": signal_name or f"{type(exception).__name__}: {exception}"[:500],
            "figures_from": "rank 0 alone (the run did not finish)",
            "dilation": clock.dilation(),
            "world_size": trainer.world_size,
            "steps": logged_step,  # as many as metrics.csv has rows (trainer.global_step may count one more)
            "final_loss": h["loss"][-1] if h["loss"] else None,
            "samples_per_s": self._global_batch(trainer) / step_time if step_time > 0 else None,
            "step_time_s": step_time,
            "sync_time_s": _median_after_warmup(h["sync_time_s"]),
            "bytes_sent_per_step": _median_after_warmup(h["bytes_sent"]),
            "bytes_recv_per_step": _median_after_warmup(h["bytes_recv"]),
            "encode_time_s": _median_after_warmup(h["encode_time_s"]),
            "comm_time_s": _median_after_warmup(h["comm_time_s"]),
            "decode_time_s": _median_after_warmup(h["decode_time_s"]),
            "collectives_per_step": _median_after_warmup(h["collectives"]),
            "cpu_s_per_step": _median_after_warmup(h["cpu_s"]),
            "comm_in_flight_s": _median_after_warmup(h["in_flight_s"]),
            "comm_overlap": _share(torch.tensor([_median_after_warmup(h["overlapped_s"])]),
                                   torch.tensor([_median_after_warmup(h["in_flight_s"])])),
            "param_sha256": param_sha256(pl_module),
            **self._sync_figures(trainer),
        }
        for callback in trainer.callbacks:  # a checkpointer's own count and times, gathered from no one
            if isinstance(callback, Checkpointer):
                summary.update({k: v for k, v in callback.summary_figures(trainer, alone=True).items() if k not in summary})
        self._write(trainer, summary)

    def _reported(self, history: dict[str, list[float]]) -> dict[str, list[float]]:
        """The steps the summary's medians are of: a planned sync's kept-plan steps once it has some."""
        phases = self.step_phases[:len(history["loss"])]
        if PLAN_PHASE not in phases:
            return history
        rows = [i for i, phase in enumerate(phases) if phase == PLAN_PHASE]
        return {key: [values[i] for i in rows] for key, values in history.items()}

    def _sync_figures(self, trainer: pl.Trainer) -> dict[str, Any]:
        """What the backend says of itself (a planned sync's kept plan) and the steps of each phase."""
        sync = self._sync(trainer)
        # What the backend resolved (memory=default: the error feedback it chose), a planned sync's kept
        # plan, a sparse sync's routing (which tensors went sparse, in what units, how dense).
        figures = sync.report() if sync is not None else {}
        if self.phases:
            figures["sync_phase_steps"] = dict(self.phases)
            recorded = min(len(values) for values in self.history.values())
            phases = self.step_phases[:recorded]
            figures["medians_of"] = ("the kept plan's steps (sync_phase plan), the first skipped"
                                     if PLAN_PHASE in phases else "every step: the run kept no plan")
            figures["sync_phase_medians"] = _phase_medians(self.history, phases)
        if self.ops:
            figures["collective_ops"] = _ops_summary(self.ops)
        return figures

    def _write(self, trainer: pl.Trainer, summary: dict[str, Any]) -> None:
        # Figures a run could not measure (no ddlscale backend, say) are null, never NaN.
        summary = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in summary.items()}
        self.output_dir.mkdir(parents=True, exist_ok=True)
        partial = self.output_dir / "summary.json.partial"
        partial.write_text(json.dumps(summary, indent=2) + "\n")
        os.replace(partial, self.output_dir / "summary.json")  # readers never see half a file
        self._written = True
        sync = self._sync(trainer)
        files = [self.output_dir / "summary.json", *(sync.written_files() if sync is not None else [])]
        record_summary(trainer.loggers, summary, trainer.global_step, files)
