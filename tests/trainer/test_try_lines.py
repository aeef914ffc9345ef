"""The README's try-lines: each system's effect printed where the user looks. In-process here: the plan's
trial lines, the sweep's closing comparison, the recovery drill's report, a worker's run name. Slow and
on the emulated cluster (root): each line run as the README gives it, within 3 minutes."""

import csv
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from ddlscale.cluster.emulated import unavailable_reason
from ddlscale.testing.recover_drill import report, step_losses
from ddlscale.tools.compare import SweepComparison, relative_steps
from ddlscale.trainer import runinfo
from ddlscale.trainer.report import plan_lines

ROOT = Path(__file__).resolve().parents[2]


def test_a_kept_plan_is_shown_against_every_candidate_the_trial_measured():
    summary = {"plan_candidate": "cupcake", "plan_predicted_step_s": 0.0486,
               "plan_trial_step_s": {"cupcake": 0.0594, "layer-wise efsignsgd/allgather": 0.1164,
                                     "dense, DDP buckets": 0.0824}}
    trial, gain = plan_lines(summary)
    assert "cupcake (kept) 59.4 ms" in trial and "dense, DDP buckets 82.4 ms" in trial
    assert "layer-wise efsignsgd/allgather 0.51x; dense, DDP buckets 0.72x" in gain and "48.6 ms" in gain
    # No trial: the model's prediction alone, said to be unchecked; nothing planned: nothing.
    assert plan_lines({"plan_predicted_step_s": 0.05}) == ["  predicted step 50.0 ms (not checked on the cluster)"]
    assert plan_lines({"plan_state": "none"}) == []


def _run(folder: Path, name: str, step_s: float, losses=(1.0, 0.9)) -> None:
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({"run_name": name, "sync": name.split("-")[0], "status": "finished",
                                                     "steps": len(losses), "step_time_s": step_s,
                                                     "final_loss": losses[-1], "overrides": [f"sync={name[:-5]}"]}))
    with open(folder / "metrics.csv", "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["step", "step_loss", "step_time_s"])
        writer.writerows([i, loss, step_s] for i, loss in enumerate(losses))


def test_a_sweep_ends_with_its_runs_side_by_side_and_each_step_against_the_first(tmp_path, capsys):
    _run(tmp_path / "0-dense-lstm", "dense-lstm", 0.9574)
    _run(tmp_path / "1-zen-lstm", "zen-lstm", 0.0972)
    SweepComparison().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))
    out = capsys.readouterr().out
    assert "the sweep's 2 runs side by side" in out and "| dense-lstm |" in out and "| zen-lstm |" in out
    assert "step time against dense-lstm's: zen-lstm 0.10x (9.8x faster)" in out
    assert {"compare.md", "compare.csv", "compare.png"} <= {p.name for p in tmp_path.iterdir()}
    assert "zen-lstm 0.10x" in (tmp_path / "compare.md").read_text()


def test_a_sweep_with_one_run_left_prints_no_comparison(tmp_path, capsys):
    _run(tmp_path / "0-dense-lstm", "dense-lstm", 0.5)
    (tmp_path / "1-zen-lstm").mkdir()  # refused or killed: no summary
    SweepComparison().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))
    assert capsys.readouterr().out == "" and not (tmp_path / "compare.md").exists()


def test_relative_steps_say_slower_plainly():
    line = relative_steps(["a", "b"], [{"step_time_s": 0.1}, {"step_time_s": 0.25}])
    assert line == "step time against a's: b 2.50x"
    assert relative_steps(["a", "b"], [{"step_time_s": 0.1}, {"step_time_s": None}]) is None


def test_a_worker_takes_its_launchers_run_name(monkeypatch):
    monkeypatch.setenv(runinfo.RUN_NAME_ENV, "zen-lstm")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert runinfo.run_name() != "zen-lstm"  # the launcher names the run itself (and sets the variable)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert runinfo.run_name() == "zen-lstm"


def test_the_recovery_report_shows_the_rerun_steps_losses_before_and_after(tmp_path):
    with open(tmp_path / "metrics.csv", "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["step", "train_loss"])
        writer.writerows([[0, "2.1"], [1, "2.0"], [2, "1.9"], [3, "1.8"], [2, "1.9"], [3, "1.8"], [4, "1.7"]])
    assert step_losses(tmp_path)[2] == ["1.9", "1.9"] and step_losses(tmp_path)[4] == ["1.7"]
    (tmp_path / "summary.json").write_text(json.dumps({
        "ckpt_recovery": {"source": "peer:0", "retrieve_s": 0.0123}, "ckpt_recovery_sources": ["local", "peer:0"],
        "ckpt_resumed_step": 2, "steps": 5, "final_loss": 1.7}))
    text = "\n".join(report(tmp_path, 1, 3.25))
    assert "after version 1 was committed" in text and "replaced 3.2 s later" in text
    assert "recovered from: local, peer:0" in text and "12.3 ms" in text
    assert "resumed at step 2; 2 steps re-run" in text
    assert "step 2: 1.9 / 1.9, step 3: 1.8 / 1.8 (identical)" in text
    assert "around the resume: 0: 2.1000, 1: 2.0000, 2: 1.9000, 3: 1.8000" in text


REASON = unavailable_reason()
TRY_LINES = {  # README line -> what its output must say
    "python train.py -m experiment=try_zen": r"step time against dense-lstm's: zen-lstm 0\.\d\dx \(\d+\.\dx faster\)",
    "python train.py experiment=try_espresso": r"trial, median step measured on the cluster: espresso search .*"
                                               r"the kept plan's step over the others'",
    "python train.py experiment=try_cupcake": r"trial, median step measured on the cluster: cupcake.*"
                                              r"the kept plan's step over the others'",
    "python -m ddlscale.testing.drill recover": r"recovered from: .*peer:0.*loss by step around the resume",
}


def test_the_readme_gives_the_try_lines():
    text = (ROOT / "README.md").read_text()
    assert all(line in text for line in TRY_LINES)


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.skipif(REASON is not None, reason=f"emulated cluster unavailable: {REASON}")
@pytest.mark.parametrize("line", list(TRY_LINES))
def test_each_try_line_prints_its_effect_within_three_minutes(line, tmp_path):
    words = line.split()[1:]  # as the README gives it, after "python"
    if "-m" in words and "train.py" in words:
        where = [f"hydra.sweep.dir={tmp_path}"]
    else:
        where = [f"hydra.run.dir={tmp_path / 'run'}"] if "train.py" in words else ["--run-dir", str(tmp_path / "run")]
    command = [sys.executable, *words, *where]
    started = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    took = time.monotonic() - started
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(TRY_LINES[line], done.stdout, re.S), done.stdout[-3000:]
    assert took <= 180, f"{line} took {took:.0f} s"
