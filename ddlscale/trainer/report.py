"""What a run tells its user at the end: a few printed lines, and a summary even when it was stopped.

Also the clean-up of a run refused before it started: Hydra makes its directory before the config
is checked, and a refused run leaves nothing behind.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from ddlscale.trainer.loggers import metrics_rows


class RunFailed(RuntimeError):
    """The run failed after its config was accepted; its ``failed`` summary and train.log are written."""


def error_line(exc: BaseException) -> str:
    """The error in one line: a worker's error reaches the launcher as its whole traceback (Lightning's
    spawn launcher), whose last line is the error itself."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    if len(lines) > 1 and any(line.startswith("Traceback") for line in lines):
        return lines[-1].strip()[:500]
    return f"{type(exc).__name__}: {' '.join(lines)}"[:500]


def stopped_summary(output_dir: Path, info: dict[str, Any], signal_name: str, since: float) -> dict[str, Any]:
    """The summary rank 0 wrote when the run (started at ``since``, epoch seconds) stopped, or, where
    it could not (killed in a collective, or a strategy whose workers write none), what metrics.csv
    says, marked as such. ``stopped_by`` is the signal the launcher got: its workers were stopped by
    the SIGTERM it sent them whatever the user sent it."""
    return _ended_summary(output_dir, info, since, "interrupted", signal_name)


def failed_summary(output_dir: Path, info: dict[str, Any], error: BaseException, since: float) -> dict[str, Any]:
    """The summary of a run that failed (an error, not a signal): rank 0's ``failed`` summary where it
    wrote one, else what metrics.csv says (it may hold no step: a worker that failed while starting)."""
    return _ended_summary(output_dir, info, since, "failed", error_line(error))


def _ended_summary(output_dir: Path, info: dict[str, Any], since: float, status: str, cause: str) -> dict[str, Any]:
    path = output_dir / "summary.json"
    if path.exists() and path.stat().st_mtime >= since:  # not an earlier run's in the same directory
        summary = json.loads(path.read_text())
        if summary.get("status") == "finished" or (status == "failed" and summary.get("status") == "failed"):
            return summary  # a worker's own error says more than what the launcher caught of it
        summary.update(status=status, stopped_by=cause)
        # Rank 0 wrote its summary while stopping; a step's row may have reached metrics.csv after it.
        # The workers are gone now: metrics.csv is final, and the summary counts what it holds.
        rows = [row for row in metrics_rows(output_dir) if row.get("step_loss")]
        if rows and int(rows[-1]["step"]) + 1 > int(summary.get("steps") or 0):
            summary.update(steps=int(rows[-1]["step"]) + 1, final_loss=float(rows[-1]["step_loss"]))
    else:
        rows = [row for row in metrics_rows(output_dir) if row.get("step_loss")]
        summary = {**info, "status": status, "stopped_by": cause,
                   "figures_from": "metrics.csv (no rank wrote a summary before it stopped)",
                   "steps": int(rows[-1]["step"]) + 1 if rows else 0,
                   "final_loss": float(rows[-1]["step_loss"]) if rows else None}
    output_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def print_summary(summary: dict[str, Any], output_dir: Path) -> None:
    """A few lines at the end of a run: what ran, how it went, where its files are."""
    def number(key: str, scale: float = 1.0, unit: str = "", digits: int = 1) -> str:
        value = summary.get(key)
        return "n/a" if value is None else f"{value * scale:,.{digits}f}{unit}"

    what = f"{summary.get('world_size', '?')} workers, sync={summary.get('sync')}, model={summary.get('model')}"
    status = summary.get("status", "finished")
    head = (f"finished {summary.get('steps')} steps" if status == "finished"
            else f"{status} ({summary.get('stopped_by')}) after {summary.get('steps')} steps")
    sent = summary.get("bytes_sent_per_step")
    volume = "n/a" if sent is None else f"{sent / 1e6:,.2f} MB" if sent >= 1e5 else f"{sent / 1e3:,.1f} kB"
    lines = [f"ddlscale: {head} ({what})",
             f"  final loss {number('final_loss', digits=4)}, {number('samples_per_s', digits=0)} samples/s, "
             f"step {number('step_time_s', 1e3, ' ms')} (sync {number('sync_time_s', 1e3, ' ms')}), "
             f"{volume} sent per step"]
    if (summary.get("dilation") or 1) != 1:
        lines.append(f"  times in emulated seconds: wall time / {summary['dilation']:g} (time dilation)")
    if summary.get("figures_from"):
        lines.append(f"  figures from {summary['figures_from']}")
    if "plan_state" in summary:
        chosen = f" (chosen by the {summary['plan_chosen_by']})" if summary.get("plan_chosen_by") else ""
        lines.append(f"  plan: {summary.get('plan_source') or 'none'}, {summary['plan_state']}{chosen}")
        lines += plan_lines(summary)
    files = ", ".join(name for name in ("summary.json", "metrics.csv", "train.log") if (output_dir / name).exists())
    lines.append(f"  run directory: {output_dir.resolve()} ({files})")
    print("\n".join(lines), flush=True)


def plan_lines(summary: dict[str, Any]) -> list[str]:
    """What the kept plan gains: each candidate's measured step in the trial (the kept one marked) and
    the kept one's against each other's; without a trial, the model's predicted step."""
    trial, kept = summary.get("plan_trial_step_s") or {}, summary.get("plan_candidate")
    predicted = summary.get("plan_predicted_step_s")
    if not trial:
        return [f"  predicted step {predicted * 1e3:.1f} ms (not checked on the cluster)"] if predicted else []
    measured = ", ".join(f"{label}{' (kept)' if label == kept else ''} {seconds * 1e3:.1f} ms"
                         for label, seconds in trial.items())
    lines = [f"  trial, median step measured on the cluster: {measured}"]
    if kept in trial and len(trial) > 1:
        against = "; ".join(f"{label} {trial[kept] / seconds:.2f}x" for label, seconds in trial.items()
                            if label != kept and seconds > 0)
        lines.append(f"  the kept plan's step over the others': {against}"
                     + (f" (it was predicted {predicted * 1e3:.1f} ms)" if predicted else ""))
    return lines


def discard_refused_run(output_dir: str | Path, sweep_dir: str | Path | None = None) -> None:
    """Remove the directory Hydra made for a run refused before it started (only Hydra's files in
    it), the sweep's too when nothing else is left there, and parents left empty."""
    run_dir = Path(output_dir)
    hydra_files = {".hydra", "train.log", "multirun.yaml"}
    if run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= hydra_files:
        shutil.rmtree(run_dir)
        top = Path(sweep_dir) if sweep_dir is not None else run_dir
        if sweep_dir is not None and top.is_dir() and {p.name for p in top.iterdir()} <= hydra_files:
            shutil.rmtree(top)
        cwd = Path.cwd()
        for parent in top.resolve().parents:  # outputs/<date> once its last run is gone, inside cwd only
            if parent == cwd or cwd not in parent.parents or any(parent.iterdir()):
                break
            parent.rmdir()
