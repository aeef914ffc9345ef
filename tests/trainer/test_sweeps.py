"""A sweep is checked whole before any job runs whichever sweeper and launcher run it: Hydra's basic
sweeper, the Optuna sweeper, and the joblib launcher that runs jobs in parallel (the check is a Hydra
callback, ddlscale/trainer/sweep.py)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from ddlscale.trainer.sweep import BASIC_SWEEPER, sweep_jobs

ROOT = Path(__file__).resolve().parents[2]
QUIET = ["trainer.enable_progress_bar=false"]
TINY = ["model=cnn", "model.width=4", "model.num_blocks=1", "model.image_size=8", "model.num_samples=256"]
OPTUNA = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"
# compressor.ratio must be in (0, 1]: 2 is refused, naming the key.
BAD_SECOND_JOB = ["sync=compress", "compressor=topk", "compressor.ratio=0.01,2"]


def _train(*overrides, timeout=300):
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *overrides], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ))


def _multirun_config(target, params, task):
    return OmegaConf.create({"hydra": {"sweeper": {"_target_": target, "params": params},
                                       "overrides": {"task": task}}})


def _parse(arguments):
    return OverridesParser.create().parse_overrides(arguments)


def test_the_basic_sweeper_s_jobs_are_checked_exactly_as_it_runs_them_in_its_order():
    params = {"seed": "range(1,9,4)", "sync": "dense"}
    task = ["model=cnn,lstm", "sync=zen", "trainer.max_steps=2"]
    jobs, exact = sweep_jobs(_multirun_config(BASIC_SWEEPER, params, task), _parse)
    arguments = [f"{key}={value}" for key, value in params.items()] + task
    (runs,) = BasicSweeper.split_arguments(_parse(arguments), None)
    assert exact and jobs == runs and len(jobs) == 4  # seed 1, 5 (not 9) by model; sync=zen replaced dense


def test_a_sampling_sweeper_s_jobs_cover_every_choice_and_both_ends_of_intervals_and_ranges():
    params = {"seed": "range(1,9,4)"}  # Optuna draws 1, 5 or 9: its ranges end at their last step, included
    task = ["compressor.ratio=interval(0.01,1.0)", "model=choice(cnn,lstm)"]
    jobs, exact = sweep_jobs(_multirun_config(OPTUNA, params, task), _parse)
    assert not exact
    assert {tuple(job) for job in jobs} == {
        (f"seed={seed}", f"compressor.ratio={ratio}", f"model={model}")
        for seed in (1, 5, 9) for ratio in (0.01, 1.0) for model in ("cnn", "lstm")}


def _refusal(result):
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert "Traceback" not in output and "Initializing distributed" not in output, output[-3000:]  # no job ran
    refusal = re.search(r"^ddlscale: invalid config: (.*) \((.*): (.*); no job ran\)$", result.stderr, re.M)
    assert refusal is not None, output[-3000:]
    return refusal.groups()


@pytest.mark.e2e
def test_a_joblib_sweep_with_a_bad_value_in_its_second_job_runs_nothing(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    sweep = tmp_path / "sweep"
    why, where, job = _refusal(_train("-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", *BAD_SECOND_JOB,
                                      *TINY, "trainer.max_steps=2", f"hydra.sweep.dir={sweep}", *QUIET))
    assert "compressor.ratio" in why and where == "in sweep job 1" and "compressor.ratio=2" in job.split()
    assert not sweep.exists()


@pytest.mark.e2e
def test_an_optuna_sweep_whose_interval_reaches_a_bad_value_runs_nothing(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    sweep = tmp_path / "sweep"
    why, where, job = _refusal(_train("-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=2", "sync=compress",
                                      "compressor=topk", "compressor.ratio=interval(0.01,2.0)", *TINY,
                                      "trainer.max_steps=2", f"hydra.sweep.dir={sweep}", *QUIET))
    # Optuna could draw any ratio up to 2: the end is refused, before Optuna draws anything.
    assert "compressor.ratio" in why and where == "with values the sweep may try"
    assert "compressor.ratio=2.0" in job.split()
    assert not sweep.exists()


@pytest.mark.slow  # ~50 s on 2 busy cores: two 2-worker jobs at once
@pytest.mark.e2e
def test_an_optuna_sweep_runs_its_trials_in_parallel_jobs_and_minimizes_the_final_loss(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    sweep = tmp_path / "sweep"
    result = _train("-m", "hydra/sweeper=optuna", "hydra/launcher=joblib", "hydra.sweeper.n_trials=2",
                    "hydra.sweeper.n_jobs=2", "hydra.launcher.n_jobs=2", "seed=range(1,3)", *TINY,
                    "trainer.max_steps=2", f"hydra.sweep.dir={sweep}", *QUIET)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "Joblib.Parallel(n_jobs=2" in result.stdout  # both trials handed to joblib in one batch
    summaries = [json.loads(path.read_text()) for path in sorted(sweep.glob("*/summary.json"))]
    assert len(summaries) == 2 and all(s["status"] == "finished" and s["steps"] == 2 for s in summaries)
    best = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert best["best_value"] == pytest.approx(min(s["final_loss"] for s in summaries))  # the app's return value
