"""What every experiment shares: alternating repetitions, runs of train.py, and its outputs.

BENCHMARKS.md's rules live here: methods are compared side by side in one invocation, alternating
(and rotating which goes first) so drift on a shared machine hits all alike; results are medians
with min/max; each experiment writes a CSV, a PNG and a markdown table under
``experiments/results/<name>/`` stating the machine, the commit and the time dilation it ran on and how
long the run took. Writing results.md also judges the folder's claims (``experiments/claims.py``) on the
CSVs just written and appends them to the folder's ``runs.csv``, which results.md lists at its end.
``$DDLSCALE_RESULTS_DIR`` moves that root elsewhere (``make experiments-quick`` writes its reduced
runs to ``experiments/results-quick`` so they never overwrite the real ones).

Run as a module, it regenerates every claim of ``experiments/README.md``: the table's commands in
order, each once, after printing how long each took when last run::

    python -m experiments.harness [--quick] [--dry-run]

``--quick`` runs each command with fewer repetitions, steps and cells (``QUICK`` below) into
``experiments/results-quick``; ``--dry-run`` only prints the commands and the time estimate.
"""

from __future__ import annotations

import csv
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from experiments import claims

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(os.environ.get("DDLSCALE_RESULTS_DIR") or ROOT / "experiments" / "results")
README = ROOT / "experiments" / "README.md"  # its claims table: the claims each run judges


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


# Every time-dilation factor the train.py runs of this process reported (summary.json "dilation"): what
# Results records when the experiment does not set Results.dilation itself.
DILATIONS: set[float] = set()


def train(overrides: Sequence[str], timeout: float = 900, run_dir: Path | None = None) -> dict[str, Any]:
    """Run ``train.py`` with Hydra overrides; return its summary.json (its dilation noted in DILATIONS).

    The run writes into ``run_dir`` when given (to read its metrics.csv after), else a scratch dir.
    """
    with tempfile.TemporaryDirectory(prefix="ddlscale-exp-") as scratch:
        out = Path(run_dir) if run_dir is not None else Path(scratch)
        cmd = [sys.executable, str(ROOT / "train.py"), *overrides, f"hydra.run.dir={out}",
               "trainer.enable_progress_bar=false"]
        result = run_child(cmd, timeout)
        if result.returncode != 0:
            raise RuntimeError(f"train.py {' '.join(overrides)} failed:\n{result.stderr[-4000:]}")
        return read_summary(out)


def read_summary(run_dir: Path) -> dict[str, Any]:
    """A finished run's summary.json, its dilation noted in DILATIONS: a run an experiment reads back
    (resuming) counts in the report's dilation as the runs it trains do."""
    summary = json.loads((Path(run_dir) / "summary.json").read_text())
    if "dilation" in summary:
        note_dilation(summary["dilation"])
    return summary


def finished_run(run_dir: Path, reuse: bool) -> dict[str, Any] | None:
    """With ``reuse``: the summary of the run ``run_dir`` holds when it finished, else None, and a
    stopped run's folder is set aside as ``<name>.stopped-<k>`` (kept, not overwritten: the run
    trains again into ``run_dir``, which train.py refuses to reuse)."""
    run_dir = Path(run_dir)
    if not reuse or not run_dir.exists():
        return None
    if (run_dir / "summary.json").exists():
        summary = json.loads((run_dir / "summary.json").read_text())
        if summary.get("status") == "finished":
            return read_summary(run_dir)
    k = 1
    while run_dir.with_name(f"{run_dir.name}.stopped-{k}").exists():
        k += 1
    run_dir.rename(run_dir.with_name(f"{run_dir.name}.stopped-{k}"))
    return None


def note_dilation(k: float) -> None:
    """Count a run's time-dilation factor in the report's, whether the run was trained or read back."""
    DILATIONS.add(float(k))


def run_child(cmd: Sequence[str], timeout: float, grace_s: float = 60.0) -> subprocess.CompletedProcess:
    """Run ``cmd`` with its output captured. Not ``subprocess.run``: on Ctrl-C or SIGTERM that kills the
    child outright, and a train.py killed so leaves its emulated cluster (namespaces, agents) behind.
    Here a stop signal reaches the child as SIGTERM (``stop_on_signals``), and its output is read on
    while it tears down, up to ``grace_s``, so it never writes into a closed pipe; then the stop goes on."""
    from ddlscale.cluster.stop import stop_on_signals

    with stop_on_signals(), subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                             text=True) as child:
        try:
            stdout, stderr = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            child.terminate()
            child.communicate(timeout=grace_s)
            raise
        except KeyboardInterrupt:  # a stop signal (StopRequested): the child got SIGTERM as well
            child.communicate(timeout=grace_s)
            raise
    return subprocess.CompletedProcess(cmd, child.returncode, stdout, stderr)


def git_commit() -> str:
    """HEAD's short hash, with ``+dirty`` when tracked files outside the results folders differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)experiments/results",
                      ":(exclude)experiments/results-quick")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if changed else "")


def _number_text(value: Any) -> str:
    return f"{value:g}" if isinstance(value, int | float) else str(value)


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """Median, min and max."""
    return statistics.median(values), min(values), max(values)


class Results:
    """The output folder of one experiment.

    ``dilation``: the emulated cluster's time-dilation factor, for an experiment that drives the cluster
    itself (a number, or short text such as "4 (8 machines), 1 (2 machines)"); None: the factors its
    train.py runs reported, else 1.
    """

    def __init__(self, name: str):
        self.name = name
        self.dir = RESULTS / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.started = time.perf_counter()
        self.commit = git_commit()  # at the start: the code the run runs
        self.dilation: Any = None

    def dilation_text(self) -> str:
        if self.dilation is not None:
            return _number_text(self.dilation)
        return ", ".join(_number_text(d) for d in sorted(DILATIONS)) or "1"

    def progress(self, done: int, total: int, message: str) -> None:
        elapsed = time.perf_counter() - self.started
        print(f"[{self.name} {done}/{total} {elapsed:6.0f}s] {message}", flush=True)

    def write_csv(self, rows: list[dict[str, Any]], filename: str = "results.csv") -> Path:
        path = self.dir / filename
        with path.open("w", newline="") as f:
            # Every row's columns, in first-seen order: rows kept from an older run may lack newer ones.
            writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for row in rows for k in row)))
            writer.writeheader()
            writer.writerows(rows)
        return path

    def write_markdown(self, title: str, header: Sequence[str], table: list[Sequence[Any]],
                       notes: str = "", command: str = "", summary: dict[str, str] | None = None,
                       filename: str = "results.md") -> Path:
        """results.md: title, command, the ``summary`` header (what is compared, the emulation, what bound
        the run, repetitions, the answer: ``header_lines``) and the dilation, the table, the machine, the
        commit and the run's duration, then ``notes``. The old results.md is replaced whole; results.md
        (not another filename) then gets this run's claims appended to runs.csv and listed (``record_run``).
        The experiment writes its CSVs first: the claims are judged on them."""
        lines = [f"# {title}", ""]
        if command:
            lines += [f"Regenerate: `{command}`", ""]
        if summary:
            lines += [*header_lines(summary), f"- **Dilation:** {self.dilation_text()} (the emulated cluster's "
                                              "time-dilation factor; 1: none)", ""]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in table]
        info = machine()
        took = (time.perf_counter() - self.started) / 60
        dilation = "" if summary else f", dilation {self.dilation_text()}"
        lines += ["", "Machine: " + ", ".join(f"{k} {v}" for k, v in info.items() if v is not None)
                  + f", commit {self.commit}{dilation}; the run took {took:.1f} min"]
        if notes:
            lines += ["", notes.strip()]
        path = self.dir / filename
        path.write_text("\n".join(lines) + "\n")
        if filename == "results.md":
            self.record_run(command, info["date"])
        return path

    def record_run(self, command: str, date: str) -> None:
        """Judge every claims-table row naming this folder on the CSVs as written now (a run on a dirty tree
        is not counted), append one runs.csv row per claim with its target (claim ``-`` where none names it)
        and list every run at the end of results.md."""
        try:
            rows = [r for r in claims.claims(README) if claims.code(r["folder"]) == self.name]
        except Exception as e:  # an unreadable table must not cost the run its record
            print(f"[{self.name}] {README} unreadable, no claim judged: {type(e).__name__}: {e}", flush=True)
            rows = []
        command = command or (claims.code(rows[0]["command"]) if rows else "")
        reps = claims.reps_of(command)  # the module wrote the command: its --reps is a number
        run = {"date": date, "commit": self.commit, "dilation": self.dilation_text(), "run": date}
        judged = [{**run, "reps": "-" if reps is None else str(reps), "claim": "-", "target": "-", "figure": "-",
                   "verdict": "-"}] if not rows else []
        for row in rows:
            try:
                figure, verdict, counted = claims.judge_run(row, self.dir, claims.is_dirty(self.commit))
            except Exception as e:  # e.g. a --quick run without the cells the check reads
                print(f"[{self.name}] claim {row['id']} not judged: {type(e).__name__}: {e}", flush=True)
                figure, verdict, counted = "-", "not judged", "-"
            judged.append({**run, "reps": counted, "claim": row["id"], "target": row["target"], "figure": figure,
                           "verdict": verdict})
        claims.append_runs(self.dir, judged)
        with (self.dir / "results.md").open("a") as f:
            f.write("\n" + claims.runs_section(claims.read_runs(self.dir)))

    def figure_path(self, filename: str = "results.png") -> Path:
        return self.dir / filename


SUMMARY_KEYS = ("Compared", "Emulation", "Bound by", "Repetitions", "Answer")


def header_lines(summary: dict[str, str]) -> list[str]:
    """The header every results.md opens with, one bold-labelled line per key of ``SUMMARY_KEYS``."""
    missing = [k for k in SUMMARY_KEYS if not summary.get(k)]
    if missing:
        raise ValueError(f"results header without {missing}")
    return [f"- **{key}:** {summary[key]}" for key in SUMMARY_KEYS]


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


# ---- `python -m experiments.harness`: every claim's command, in experiments/README.md's order ----

QUICK_RESULTS = ROOT / "experiments" / "results-quick"
# The reduced run: per module, the flags that cut repetitions, steps and cells (each module's own flags).
QUICK: dict[str, dict[str, str]] = {
    "dilation": {"--ks": "1,2", "--syncs": "dense", "--reps": "1", "--steps": "6", "--big-nodes": "0"},
    "overhead": {"--reps": "2", "--steps": "20"},
    "sparse_allreduce": {"--nodes": "2", "--bandwidths": "1gbit", "--densities": "0.01", "--reps": "2",
                         "--sweep": "0"},
    "zen_speed": {"--nodes": "4", "--bandwidths": "1gbit", "--models": "lstm", "--reps": "1", "--steps": "6",
                  "--syncs": "dense,sparcml,zen"},
    "zen_volume": {"--workers": "2,4", "--densities": "0.01"},
    "zen_projection": {"--models": "lstm", "--workers": "16"},
    "native_kernels": {"--sizes": "1,1e3,1e5", "--reps": "2"},
    "costmodel_validation": {"--nodes": "2,4", "--sizes-mb": "4,64", "--reps": "2"},  # 64 MB: its calibration point
    "compression_hooks": {"--workloads": "cnn", "--steps": "10", "--reps": "1"},
    "compression_accuracy": {"--workloads": "cnn", "--compressors": "topk,fp16", "--steps": "30"},
    "compression_schemes": {"--workloads": "lstm", "--reps": "1", "--measure": "5", "--clusters": "8x1"},
    "espresso_cupcake": {"--bandwidths": "1gbit", "--workloads": "lstm", "--compressors": "dgc", "--reps": "1"},
    "espresso_planning": {"--counts": "50,100", "--seeds": "2", "--reps": "1"},
    "planned_convergence": {"--workloads": "cnn", "--compressors": "dgc", "--steps": "40", "--seeds": "0"},
    "gemini_overhead": {"--steps": "30", "--reps": "1"},
    "gemini_recovery": {"--steps": "60", "--failures": "1", "--reps": "1"},
    "dcp_async": {"--mib": "64", "--reps": "2"},
}


def claimed_commands(readme: Path = README) -> list[tuple[str, str]]:
    """(folder, command) of every claims-table row, first appearance order, each command once."""
    out: dict[str, str] = {}
    for row in claims.claims(readme):
        out.setdefault(claims.code(row["command"]), claims.code(row["folder"]))
    return [(folder, command) for command, folder in out.items()]


def quick(command: str) -> str:
    """``command`` with its module's QUICK flags in place of (or after) its own."""
    words = shlex.split(command)
    module = words[2].removeprefix("experiments.")
    for flag, value in QUICK.get(module, {}).items():
        if flag in words:
            words[words.index(flag) + 1] = value
        else:
            words += [flag, value]
    return shlex.join(words)


RESUMED = "results.md, a resumed run: more in full"


def took_minutes(folder: str) -> tuple[float | None, str]:
    """How long the folder's last run took, and the source of the figure (None: unknown)."""
    path = RESULTS / folder / "results.md"
    text = path.read_text() if path.exists() else ""
    recorded = re.search(r"^Machine: .*the run took ([\d.]+) min", text, re.M)
    if not recorded:
        return None, "not recorded"
    resumed = "Resumed (--resume)" in text  # its time is the part after the stop only
    return float(recorded.group(1)), RESUMED if resumed else "results.md"


def run_all(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Regenerate every claim of experiments/README.md, in order.")
    parser.add_argument("--quick", action="store_true", help=f"reduced runs, written to {QUICK_RESULTS}")
    parser.add_argument("--dry-run", action="store_true", help="print the commands and the time estimate only")
    args = parser.parse_args(argv)
    commands = claimed_commands()
    known, unknown, partial = 0.0, [], False
    print(f"{len(commands)} commands (from {README.relative_to(ROOT)}); the last full run of each took:")
    for folder, _ in commands:
        minutes, source = took_minutes(folder)
        if minutes is None:
            unknown.append(folder)
        else:
            known += minutes
        partial |= source == RESUMED
        print(f"  {folder:22s} {'unknown' if minutes is None else f'{minutes:5.0f} min'}  ({source})")
    missing = f", plus {', '.join(unknown)}, whose time is not recorded" if unknown else ""
    print(f"Full run: {'at least ' if unknown or partial else 'about '}{known / 60:.1f} h{missing}. "
          "The emulated-cluster ones need root.")
    env = dict(os.environ)
    if args.quick:
        env["DDLSCALE_RESULTS_DIR"] = str(QUICK_RESULTS)
        print(f"--quick: reduced runs into {QUICK_RESULTS} (the committed results are left alone); about "
              "21 min on 2 cores when timed on 2026-12-04")
    failed = []
    for done, (folder, command) in enumerate(commands, start=1):
        line = quick(command) if args.quick else command
        print(f"[{done}/{len(commands)}] {line}", flush=True)
        if args.dry_run:
            continue
        words = shlex.split(line)
        started = time.perf_counter()
        result = subprocess.run([sys.executable, *words[1:]], cwd=ROOT, env=env)
        print(f"[{done}/{len(commands)}] {folder}: exit {result.returncode} after "
              f"{(time.perf_counter() - started) / 60:.1f} min", flush=True)
        if result.returncode:
            failed.append(folder)
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run_all())
