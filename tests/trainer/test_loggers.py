"""W&B and the loggers as users expect (issue 62): metrics.csv whatever the logger, WANDB_MODE deciding
online or offline, the run made where it runs (so W&B's `wandb sync` line names its real folder), a
group per sweep, the summary and plan as an artifact."""

import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from test_new_user import _wandb_records

from ddlscale.paths import CONF_DIR
from ddlscale.trainer import app, runinfo
from ddlscale.trainer.loggers import RunCSVLogger, metrics_rows

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model=cnn", "model.width=4", "model.num_blocks=1", "model.image_size=8", "model.num_samples=256"]


def _cfg(*overrides, hydra=False):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=hydra)


def _wandb_logger(tmp_path, *overrides):
    pytest.importorskip("wandb")
    return instantiate(_cfg("logger=wandb", *overrides).logger, save_dir=str(tmp_path))


MODES = [  # WANDB_MODE (None: unset), logger.offline, offline?, the mode given to wandb.init (None: WANDB_MODE's)
    (None, "null", True, None),
    ("online", "null", False, None),
    ("dryrun", "null", True, None),
    ("disabled", "null", False, None),
    ("offline", "false", False, "online"),  # the config decides over the environment
    ("online", "true", True, None),
]


@pytest.mark.parametrize("env,offline,expected,mode", MODES, ids=[f"WANDB_MODE={e} offline={o}" for e, o, _, _ in MODES])
def test_wandb_mode_decides_online_or_offline_unless_the_config_says(tmp_path, monkeypatch, env, offline, expected, mode):
    if env is None:
        monkeypatch.delenv("WANDB_MODE", raising=False)
    else:
        monkeypatch.setenv("WANDB_MODE", env)
    logger = _wandb_logger(tmp_path, f"logger.offline={offline}")
    assert logger._offline is expected and logger._wandb_init.get("mode") == mode


def test_a_spawn_launcher_pickling_the_logger_makes_no_run_in_the_launching_process(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    logger = _wandb_logger(tmp_path)
    copy = pickle.loads(pickle.dumps(logger))  # what Lightning's spawn launcher does to reach its workers
    assert logger._experiment is None and copy._experiment is None
    assert not (tmp_path / "wandb").exists()  # Lightning's WandbLogger made the run here, and attached workers to it


@pytest.mark.parametrize("logger", ["csv", "tensorboard", "wandb"])
def test_metrics_csv_is_written_whatever_the_logger(tmp_path, logger):
    if logger == "wandb":
        pytest.importorskip("wandb")
    trainer, _ = app.build_trainer(_cfg(f"logger={logger}", *TINY), tmp_path, {})
    csv_loggers = [lg for lg in trainer.loggers if isinstance(lg, RunCSVLogger)]
    assert len(csv_loggers) == 1 and Path(csv_loggers[0].log_dir) == tmp_path
    assert (trainer.logger is csv_loggers[0]) == (logger == "csv")  # the logger asked for comes first


def test_a_sweep_s_jobs_share_a_wandb_group_named_by_the_sweep(monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv(runinfo.SWEEP_ENV, raising=False)
    hydra = HydraConfig.instance()
    try:
        sweep = _cfg("logger=wandb", "hydra.mode=MULTIRUN", "hydra.sweep.dir=multirun/2026-01-31/12-00-00", hydra=True)
        hydra.set_config(sweep)
        assert sweep.logger.group == "multirun/2026-01-31/12-00-00"
        single = _cfg("logger=wandb", hydra=True)
        hydra.set_config(single)
        assert single.logger.group is None
        monkeypatch.setenv(runinfo.SWEEP_ENV, "multirun/x")  # a worker torchrun started for a sweep's job
        assert single.logger.group == "multirun/x"
    finally:
        hydra.cfg = None


@pytest.mark.slow  # the default run's time: make test-slow runs it
@pytest.mark.e2e
def test_a_wandb_run_keeps_metrics_csv_and_its_sync_line_names_its_folder(tmp_path):
    pytest.importorskip("wandb")
    out = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "offline"}
    env.pop("WANDB_SILENT", None)
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), *TINY, "logger=wandb", "trainer.max_steps=3",
                             "trainer.enable_progress_bar=false", f"hydra.run.dir={out}"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert [row["step"] for row in metrics_rows(out) if row.get("step_loss")] == ["0", "1", "2"]
    synced = re.findall(r"wandb sync (\S+)", output)
    assert synced and all(Path(path).parent == out / "wandb" and Path(path).is_dir() for path in synced), output[-3000:]
    # Read once train.py has exited: the workers, and W&B's service with them, are gone.
    records = _wandb_records(next((out / "wandb").glob("offline-run-*/run-*.wandb")))
    summary = {}
    for record in records:
        if record.WhichOneof("record_type") == "summary":
            summary.update({item.key: json.loads(item.value_json) for item in record.summary.update})
    assert summary["final_loss"] == json.loads((out / "summary.json").read_text())["final_loss"]
    artifacts = [r.artifact for r in records if r.WhichOneof("record_type") == "artifact"]
    assert [[e.path for e in a.manifest.contents] for a in artifacts] == [["summary.json"]]
