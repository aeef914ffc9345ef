"""Helpers the checkpoint tests share: run train.py, read its outputs, compare a resumed run with a straight one."""

import csv
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUIET = ["trainer.enable_progress_bar=false"]


def train(*overrides, timeout=300):
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), *overrides, *QUIET], cwd=ROOT,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def summary(run):
    return json.loads((Path(run) / "summary.json").read_text())


def losses(run, columns=("train_loss",)):
    """{step: (column values...)} from the run's metrics.csv."""
    with open(Path(run) / "metrics.csv") as file:
        return {int(row["step"]): tuple(row[c] for c in columns) for row in csv.DictReader(file)}


def assert_continues(straight, resumed, from_step, columns=("train_loss",), restarted_in_place=False):
    """Same ``columns`` at every step from ``from_step`` on, and the same final parameters.
    ``restarted_in_place``: the resumed run restarted in its own run directory, whose metrics.csv
    goes on across the restart (a step re-run after it has its newer row last)."""
    a, b = losses(straight, columns), losses(resumed, columns)
    if restarted_in_place:
        b = {s: v for s, v in b.items() if s >= from_step}
    assert sorted(b) == [s for s in sorted(a) if s >= from_step]
    assert {s: a[s] for s in b} == b
    assert summary(resumed)["param_sha256"] == summary(straight)["param_sha256"]
