"""Lightning as users expect (issue 62): ``trainer.save_checkpoint()`` after a spawned fit; a stopped
run's summary counting the checkpoints it took; the printed command that continues a stopped run,
which does."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from pytorch_lightning.demos.boring_classes import BoringModel
from test_new_user import _StopAfterOptimizerStep

from ddlscale.ckpt import Checkpointer
from ddlscale.ckpt.state.shard import SYNC_STATE_KEY
from ddlscale.ckpt.version.manifest import manifest_names, step_of
from ddlscale.paths import CONF_DIR
from ddlscale.strategy import DDLStrategy
from ddlscale.trainer import StepMetrics, rundir

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model=cnn", "model.width=4", "model.num_blocks=1", "model.image_size=8", "model.num_samples=256"]


def _trainer(steps: int, devices: int, **kwargs) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=devices, max_steps=steps, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, **kwargs)


@pytest.mark.slow  # the default run's time: make test-slow runs it
@pytest.mark.multiprocess
def test_save_checkpoint_after_a_spawned_fit_holds_the_weights_and_resumes(tmp_path):
    os.environ.pop("MASTER_PORT", None)  # a fresh port per fit (see conftest.py)
    model = BoringModel()
    trainer = _trainer(2, 2, strategy=DDLStrategy())
    trainer.fit(model)  # spawn: rank 0's weights come back; the workers' backends are gone
    path = tmp_path / "after_fit.ckpt"
    trainer.save_checkpoint(path)  # raised AttributeError: 'DenseAllreduce' object has no attribute 'backward_order'
    saved = torch.load(path, weights_only=False)
    assert all(torch.equal(saved["state_dict"][name], value) for name, value in model.state_dict().items())
    assert SYNC_STATE_KEY not in saved  # no rank ran in this process: no backend state to hold
    os.environ.pop("MASTER_PORT", None)
    resumed = BoringModel()
    _trainer(3, 2, strategy=DDLStrategy()).fit(resumed, ckpt_path=path)  # the backend starts afresh
    assert not torch.equal(resumed.layer.weight, saved["state_dict"]["layer.weight"])  # it trained on from them


class _CountingTier(Checkpointer):
    """A tier whose save writes nothing: the base class counts and times each."""

    def save(self, trainer, batch_idx):
        pass


def test_a_stopped_run_s_summary_counts_the_checkpoints_it_took(tmp_path):
    metrics = StepMetrics(tmp_path, {"ckpt": "counting"})
    trainer = _trainer(10, 1, callbacks=[_StopAfterOptimizerStep(at=4), _CountingTier(every=1), metrics])
    with pytest.raises(RuntimeError, match="stopped between"):
        trainer.fit(BoringModel())
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps"] == 3
    assert summary["ckpt_count"] == 3 and len(summary["ckpt_times_s"]) == 3 and summary["ckpt_interval"] == 1  # was null


def test_the_continuing_command_is_this_one_with_its_run_directory(monkeypatch):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["ckpt=disk", "seed=3", "ckpt.resume=null", "hydra.run.dir=outputs/x",
                                           "hydra.job.chdir=false"], return_hydra_config=True)
    monkeypatch.setattr(sys, "orig_argv", ["python", "-X", "dev", "train.py", "--config-name=config", "ckpt=disk",
                                           "seed=3", "ckpt.resume=null", "hydra.run.dir=outputs/x", "hydra.job.chdir=false"])
    monkeypatch.setattr(sys, "argv", ["train.py", *sys.orig_argv[4:]])
    hydra = HydraConfig.instance()
    try:
        hydra.set_config(cfg)
        command = rundir.continuing_command(Path("/runs/it's here"), ["ckpt.resume=auto"])
    finally:
        hydra.cfg = None
    assert shlex.split(command) == ["python", "-X", "dev", "train.py", "--config-name=config", "ckpt=disk", "seed=3",
                                    "hydra.job.chdir=false", "ckpt.resume=auto", "hydra.run.dir=/runs/it's here"]


@pytest.mark.slow  # the default run's time: make test-slow runs it
@pytest.mark.e2e
def test_a_stopped_run_prints_the_command_that_continues_it_and_that_command_does(tmp_path):
    out = tmp_path / "run"
    checkpoints = out / "checkpoints"
    # Each step idles 50 ms (strategy.device_time_s): the run is still going when its third version is in.
    first = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *TINY, "ckpt=disk", "ckpt.every=2",
                              "trainer.max_steps=60", "strategy.device_time_s=0.05", "trainer.enable_progress_bar=false",
                              f"hydra.run.dir={out}"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 600  # train.py's start and 6 steps: minutes on a busy host
        while not (checkpoints.is_dir() and len(manifest_names(checkpoints)) >= 3):
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0][-3000:]
            time.sleep(0.2)
        first.send_signal(signal.SIGTERM)
        output = first.communicate(timeout=120)[0]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    stopped = json.loads((out / "summary.json").read_text())
    assert stopped["status"] == "interrupted" and stopped["ckpt_count"] >= 3, output[-3000:]
    newest = step_of(manifest_names(checkpoints)[0])
    lines = [line for line in output.splitlines() if "continue it from its newest checkpoint: " in line]
    assert len(lines) == 1, output[-3000:]
    command = shlex.split(lines[0].split("checkpoint: ", 1)[1])
    assert command[-2:] == ["ckpt.resume=auto", f"hydra.run.dir={out}"]
    resumed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 60 and summary["ckpt_resumed_step"] == newest
