"""What every experiment shares: alternating repetitions, runs of train.py, and its outputs.

BENCHMARKS.md's rules live here: methods are compared side by side in one invocation, alternating
(and rotating which goes first) so drift on a shared machine hits all alike; results are medians
with min/max; each experiment writes a CSV, a PNG and a markdown table under
``experiments/results/<name>/`` stating the machine it ran on.
"""

from __future__ import annotations

import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"


def machine() -> dict[str, Any]:
    """The facts a reader needs to weigh a timing: cores, memory, software versions."""
    import torch

    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "memory_gib": round(mem_gib, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def alternating(methods: Sequence[str], reps: int) -> Iterator[tuple[int, str]]:
    """(rep, method) pairs: every method once per rep, the starting method rotating."""
    for rep in range(reps):
        shift = rep % len(methods)
        for method in [*methods[shift:], *methods[:shift]]:
            yield rep, method


def train(overrides: Sequence[str], timeout: float = 900, run_dir: Path | None = None) -> dict[str, Any]:
    """Run ``train.py`` with Hydra overrides; return its summary.json.

    The run writes into ``run_dir`` when given (to read its metrics.csv after), else a scratch dir.
    """
    with tempfile.TemporaryDirectory(prefix="ddlscale-exp-") as scratch:
        out = Path(run_dir) if run_dir is not None else Path(scratch)
        cmd = [sys.executable, str(ROOT / "train.py"), *overrides, f"hydra.run.dir={out}",
               "trainer.enable_progress_bar=false"]
        result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"train.py {' '.join(overrides)} failed:\n{result.stderr[-4000:]}")
        return json.loads((out / "summary.json").read_text())


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """Median, min and max."""
    return statistics.median(values), min(values), max(values)


class Results:
    """The output folder of one experiment."""

    def __init__(self, name: str):
        self.name = name
        self.dir = RESULTS / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.started = time.perf_counter()

    def progress(self, done: int, total: int, message: str) -> None:
        elapsed = time.perf_counter() - self.started
        print(f"[{self.name} {done}/{total} {elapsed:6.0f}s] {message}", flush=True)

    def write_csv(self, rows: list[dict[str, Any]], filename: str = "results.csv") -> Path:
        path = self.dir / filename
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        return path

    def write_markdown(self, title: str, header: Sequence[str], table: list[Sequence[Any]],
                       notes: str = "", command: str = "") -> Path:
        lines = [f"# {title}", ""]
        if command:
            lines += [f"Regenerate: `{command}`", ""]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in table]
        info = machine()
        lines += ["", "Machine: " + ", ".join(f"{k} {v}" for k, v in info.items() if v is not None)]
        if notes:
            lines += ["", notes.strip()]
        path = self.dir / "results.md"
        path.write_text("\n".join(lines) + "\n")
        return path

    def figure_path(self, filename: str = "results.png") -> Path:
        return self.dir / filename


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
