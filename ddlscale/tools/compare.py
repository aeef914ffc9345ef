"""Runs side by side: one table (markdown and CSV) and a plot of loss and step time per run.

    python -m ddlscale.tools.compare multirun/2025-01-31/12-00-00          # every job of a sweep
    python -m ddlscale.tools.compare outputs/2025-01-31/10-00-00 outputs/2025-01-31/11-30-00
    python -m ddlscale.tools.compare DIR ... --out my_table --columns final_loss,step_time_s

Each DIR is a run directory (it holds ``summary.json``) or a folder with runs below it (a sweep).
The table has one row per run: what differs between the runs (overrides and labels that are not
the same in all of them), then the summary's figures; the CSV holds every summary key. The plot
reads each run's ``metrics.csv`` (a resumed run's last row per step). Files go to ``--out``
(default ``outputs/compare/<date>_<time>``); the table is printed too.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from ddlscale.trainer.loggers import metrics_rows

FIGURES = {  # summary key -> (column title, scale, digits)
    "status": ("status", None, None),
    "steps": ("steps", None, None),
    "world_size": ("workers", None, None),
    "final_loss": ("final loss", 1.0, 4),
    "samples_per_s": ("samples/s", 1.0, 0),
    "step_time_s": ("step ms", 1e3, 2),
    "sync_time_s": ("sync ms", 1e3, 2),
    "bytes_sent_per_step": ("sent MB/step", 1e-6, 3),
    "imbalance": ("imbalance", 1.0, 3),
    "plan_source": ("plan", None, None),
}
LABELS = ("sync", "compressor", "memory", "ckpt", "model", "strategy", "cluster", "seed")


def find_runs(dirs: list[Path]) -> list[Path]:
    """Run directories (holding ``summary.json``) at or below ``dirs``, sweeps in job order."""
    def order(path: Path) -> list[Any]:
        return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]

    runs: list[Path] = []
    for top in dirs:
        found = [top] if (top / "summary.json").is_file() else sorted(
            (p.parent for p in top.rglob("summary.json")), key=order)
        runs += [run for run in found if run not in runs]
    return runs


def _overrides(summary: dict[str, Any]) -> dict[str, str]:
    pairs = (o.lstrip("+~").split("=", 1) for o in summary.get("overrides") or [] if "=" in o)
    return {key: value for key, value in pairs if not key.startswith("hydra.")}


def differing(summaries: list[dict[str, Any]]) -> list[str]:
    """Keys (overrides, then labels) whose value is not the same in every run."""
    overrides = [_overrides(s) for s in summaries]
    keys = sorted({k for o in overrides for k in o if len({o.get(k) for o in overrides}) > 1})
    keys += [k for k in LABELS if k not in keys and len({str(s.get(k)) for s in summaries}) > 1]
    return keys


def _cell(value: Any, scale: float | None, digits: int | None) -> str:
    if value is None:
        return ""
    if scale is not None and isinstance(value, int | float) and not isinstance(value, bool):
        return f"{value * scale:.{digits}f}"
    return str(value)


def table(runs: list[Path], summaries: list[dict[str, Any]], columns: list[str] | None = None
          ) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the comparison: run (its name), what differs, then the figures."""
    keys = differing(summaries)
    figures = columns or list(FIGURES)
    header = ["run", *keys, *(FIGURES.get(k, (k,))[0] for k in figures)]
    names = [s.get("run_name") for s in summaries]
    if None in names or len(set(names)) < len(names):  # runs that share a name go by their folders
        names = [str(run) for run in runs]
    rows = []
    for name, summary in zip(names, summaries, strict=True):
        overrides = _overrides(summary)
        rows.append([name,
                     *(overrides.get(k, str(summary.get(k, ""))) for k in keys),
                     *(_cell(summary.get(k), *FIGURES.get(k, (k, None, None))[1:]) for k in figures)])
    return header, rows


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def write_csv(path: Path, runs: list[Path], summaries: list[dict[str, Any]]) -> None:
    keys = list(dict.fromkeys(k for s in summaries for k in s))
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["run", *keys])
        for run, summary in zip(runs, summaries, strict=True):
            writer.writerow([str(run), *(json.dumps(v) if isinstance(v, dict | list) else v
                                         for v in (summary.get(k) for k in keys))])


def curves(run: Path) -> dict[str, tuple[list[int], list[float]]]:
    """Per metric, (steps, values) from the run's metrics.csv, the last row of each step."""
    last: dict[int, dict[str, str]] = {}
    for row in metrics_rows(run):
        if row.get("step", "").isdigit():
            last.setdefault(int(row["step"]), {}).update({k: v for k, v in row.items() if v != ""})
    out = {}
    for metric in ("step_loss", "step_time_s"):
        points = [(step, float(row[metric])) for step, row in sorted(last.items()) if row.get(metric)]
        out[metric] = ([p[0] for p in points], [p[1] for p in points])
    return out


def plot(path: Path, labels: list[str], runs: list[Path]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, time_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for label, run in zip(labels, runs, strict=True):
        data = curves(run)
        loss_ax.plot(*data["step_loss"], label=label)
        steps, seconds = data["step_time_s"]
        time_ax.plot(steps, [s * 1e3 for s in seconds], label=label)
    loss_ax.set(xlabel="optimizer step", ylabel="loss (rank 0)", title="loss")
    time_ax.set(xlabel="optimizer step", ylabel="step time (ms, rank 0)", title="step time")
    if len(runs) <= 12:
        loss_ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def relative_steps(labels: list[str], summaries: list[dict[str, Any]]) -> str | None:
    """Each run's step time against the first run's, in one line (None: fewer than two timed runs)."""
    timed = [(label, s["step_time_s"]) for label, s in zip(labels, summaries, strict=True) if s.get("step_time_s")]
    if len(timed) < 2:
        return None
    (first, base), rest = timed[0], timed[1:]
    return f"step time against {first}'s: " + ", ".join(
        f"{label} {t / base:.2f}x" + (f" ({base / t:.1f}x faster)" if t < base else "") for label, t in rest)


def write(out: Path, runs: list[Path], summaries: list[dict[str, Any]], columns: list[str] | None = None,
          heading: str = "") -> str:
    """compare.md, compare.csv and compare.png in ``out``; returns the table (and the step-time line)."""
    header, rows = table(runs, summaries, columns)
    labels = [s.get("run_name") or row[0] for s, row in zip(summaries, rows, strict=True)]
    text = markdown(header, rows)
    relative = relative_steps(labels, summaries)
    if relative:
        text += f"\n\n{relative}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.md").write_text(f"{heading}{text}\n")
    write_csv(out / "compare.csv", runs, summaries)
    plot(out / "compare.png", labels, runs)
    return text


class SweepComparison(Callback):
    """A sweep ends with its runs side by side: the table printed, and compare.md, .csv and .png written
    into the sweep's directory (a Hydra callback, so any sweeper and launcher that runs the jobs here
    gets it). Runs that wrote no summary (refused, or killed) are left out; one run alone prints nothing."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep = Path(config.hydra.sweep.dir)
        runs = find_runs([sweep]) if sweep.is_dir() else []
        if len(runs) < 2:
            return
        summaries = [json.loads((run / "summary.json").read_text()) for run in runs]
        text = write(sweep, runs, summaries, heading=f"Runs of the sweep {sweep}\n\n")
        print(f"\nddlscale: the sweep's {len(runs)} runs side by side (also {sweep / 'compare.md'}, "
              f".csv and .png)\n{text}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddlscale.tools.compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", nargs="+", type=Path, help="run directories or folders of runs (a sweep)")
    parser.add_argument("--out", type=Path, help="where compare.md, compare.csv, compare.png go "
                                                 "(default outputs/compare/<date>_<time>)")
    parser.add_argument("--columns", help=f"summary keys to show (default: {','.join(FIGURES)})")
    args = parser.parse_args(argv)
    missing = [str(d) for d in args.dirs if not d.is_dir()]
    if missing:
        parser.error(f"not a directory: {', '.join(missing)}")
    runs = find_runs(args.dirs)
    if not runs:
        parser.error(f"no summary.json at or below {', '.join(map(str, args.dirs))}")
    summaries = [json.loads((run / "summary.json").read_text()) for run in runs]
    out = args.out or Path("outputs") / "compare" / time.strftime("%Y-%m-%d_%H-%M-%S")
    text = write(out, runs, summaries, args.columns.split(",") if args.columns else None,
                 heading=f"Runs: {', '.join(map(str, args.dirs))}\n\n")
    print(text)
    print(f"\nwrote {out / 'compare.md'}, {out / 'compare.csv'}, {out / 'compare.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
