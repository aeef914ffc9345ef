"""Runs a user can trust and find: figures that agree, resumed logs kept, labels of what ran, the config
and summary in every logger, names and versions, phases of planned syncs, a comparison of runs, the
help screen, and bad input refused before any worker starts."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from ddlscale.cluster import run_workers
from ddlscale.compress import TopK
from ddlscale.paths import CONF_DIR
from ddlscale.sync.compressed import EspressoSync
from ddlscale.tools import compare
from ddlscale.trainer import ConfigError, app, check_config, runinfo
from ddlscale.trainer.loggers import record_config, record_summary

ROOT = Path(__file__).resolve().parents[2]
QUIET = ["trainer.enable_progress_bar=false"]
TINY = ["model=cnn", "model.width=4", "model.num_blocks=1", "model.image_size=8", "model.num_samples=256"]


def _train(*overrides, env=None, timeout=240):
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *overrides], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def _rows(run_dir):
    with (run_dir / "metrics.csv").open() as handle:
        return list(csv.DictReader(handle))


@pytest.mark.slow  # the default run's time: make test-slow runs it
@pytest.mark.e2e
def test_a_run_reports_one_loss_keeps_its_log_and_a_resume_appends_to_it(tmp_path):
    out = tmp_path / "run"
    common = [*TINY, "trainer.accumulate_grad_batches=2", "ckpt=disk", "ckpt.every=2", f"hydra.run.dir={out}", *QUIET]
    first = _train(*common, "trainer.max_steps=4")
    assert first.returncode == 0, first.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    rows = [row for row in _rows(out) if row["step_loss"]]
    # Lightning divides each micro-batch's loss by the accumulation count: the step's loss is their sum,
    # the figure metrics.csv shows and final_loss repeats (it was half of it).
    assert summary["final_loss"] == float(rows[-1]["step_loss"])
    assert 0.7 < summary["final_loss"] / float(rows[-1]["train_loss"]) < 1.4
    assert summary["status"] == "finished" and summary["steps"] == 4 and summary["seed"] == 0
    assert "trainer.accumulate_grad_batches=2" in summary["overrides"]
    assert summary["ddlscale_version"] and summary["git_commit"]  # a git checkout has a commit
    assert summary["run_name"].startswith("dense-cnn,")
    # Every logger gets the whole config: the CSV logger's hparams.yaml.
    hparams = yaml.safe_load((out / "hparams.yaml").read_text())
    assert hparams["sync.bucket_mb"] == 25.0 and hparams["seed"] == 0 and hparams["world_size"] == 2
    assert hparams["trainer.accumulate_grad_batches"] == 2 and hparams["ckpt._target_"].endswith("DiskCheckpointer")
    # The run says where its results are, and train.log holds what the launcher and the workers printed.
    assert f"run directory: {out}" in first.stdout and "finished 4 steps" in first.stdout
    log = (out / "train.log").read_text()
    assert "finished 4 steps" in log and "Initializing distributed: GLOBAL_RANK: 1" in log
    assert "will be deleted" not in first.stderr

    resumed = _train(*common, "trainer.max_steps=6", "ckpt.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    steps = [int(row["step"]) for row in _rows(out) if row["step_loss"]]
    assert steps == [0, 1, 2, 3, 4, 5]  # the first run's rows kept, the resumed run's appended
    assert json.loads((out / "summary.json").read_text())["steps"] == 6


STRAGGLER = """
import subprocess, sys, time
from ddlscale.trainer.runlog import run_log
with run_log(sys.argv[1]):
    # Like multiprocessing's resource tracker: it inherits the run's stdout and outlives the run.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print("last line", flush=True)
    time.sleep(1)  # the copying threads wait in their read when the run ends
print("after the log", flush=True)
child.kill()
"""


@pytest.mark.multiprocess
def test_train_log_ends_with_the_run_when_a_child_still_holds_its_output(tmp_path):
    """The launcher of a run hung for ever in train.log's copying threads, joined at the end while a
    read waited on the pipe that the resource tracker keeps open."""
    log = tmp_path / "train.log"
    done = subprocess.run([sys.executable, "-c", STRAGGLER, str(log)], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0 and done.stdout.splitlines() == ["last line", "after the log"], done.stderr
    assert log.read_text() == "last line\n"


def test_labels_name_the_class_that_ran_not_the_option():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for overrides, expected in ((["sync=zen"], "zen"),
                                    (["sync._target_=my_module.MySync"], "my_module.MySync"),
                                    (["model=gpt", "model._target_=mine.Model"], "mine.Model")):
            cfg = compose("config", overrides=overrides, return_hydra_config=True)
            labels = runinfo.labels(cfg, cfg.hydra.runtime.choices)
            group = overrides[-1].split(".")[0].split("=")[0]
            assert labels[group] == expected, overrides
        assert labels["sync"] == "dense" and labels["strategy"] == "ddlscale"


def test_every_logger_gets_the_config_and_the_summary(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["logger=tensorboard"])
    logger = instantiate(cfg.logger, save_dir=str(tmp_path))
    record_config([logger], {"sync.bucket_mb": 25.0, "seed": 3, "world_size": 2})
    record_summary([logger], {"final_loss": 1.5, "step_time_s": 0.02, "sync": "dense"}, step=10)
    logger.finalize("success")
    events = EventAccumulator(str(tmp_path)).Reload()
    assert events.Scalars("summary/final_loss")[0].value == 1.5
    data = events.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(data["_hparams_/session_start_info"])
    assert {"sync.bucket_mb", "seed", "world_size"} <= set(start.session_start_info.hparams)
    experiment = plugin_data_pb2.HParamsPluginData.FromString(data["_hparams_/experiment"])
    assert {m.name.tag for m in experiment.experiment.metric_infos} == {"summary/final_loss", "summary/step_time_s"}
    assert yaml.safe_load((tmp_path / "hparams.yaml").read_text())["sync.bucket_mb"] == 25.0


@pytest.mark.slow
def test_wandb_gets_the_config_and_the_summary(tmp_path):
    pytest.importorskip("wandb")
    from pytorch_lightning.loggers import WandbLogger

    logger = WandbLogger(save_dir=str(tmp_path), offline=True, name="dense-lstm,seed=3")
    record_config([logger], {"sync.bucket_mb": 25.0, "seed": 3})
    record_summary([logger], {"final_loss": 1.5, "sync": "dense"}, step=10)
    assert logger.experiment.config["sync.bucket_mb"] == 25.0 and logger.experiment.config["seed"] == 3
    assert logger.experiment.summary["final_loss"] == 1.5 and logger.experiment.summary["sync"] == "dense"
    logger.experiment.finish()


SHAPES = {"a": (40,), "b": (8, 8), "c": (30,)}


def _espresso_phases(rank, world, steps):
    params = [(name, torch.nn.Parameter(torch.zeros(shape))) for name, shape in SHAPES.items()]
    sync = EspressoSync(TopK(ratio=0.5), memory="none", profile_steps=1, network_bandwidth="10mbit", run_dir=None,
                        trial_steps=1, calibrate_steps=1, settle_steps=1,
                        calibrate_families=[], calibrate_fused=False, calibrate_mixed=False)  # one layout
    sync.setup(params)
    phases, reports = [], []
    for step in range(steps):
        g = torch.Generator().manual_seed(10 * rank + step)
        for name, p in reversed(params):
            p.grad = torch.randn(SHAPES[name], generator=g)
            sync.grad_ready(p)
        sync.finish_step()
        phases.append(sync.step_phase)
        reports.append(sync.plan_report())
    return phases, reports


@pytest.mark.multiprocess
def test_a_planned_sync_names_the_phase_of_every_step_and_the_plan_it_kept():
    (phases, reports), _ = run_workers(_espresso_phases, 2, 12)
    assert phases[:4] == ["warmup", "profile", "settle", "calibrate"]
    assert reports[2]["plan_source"] is None and "before planning" in reports[2]["plan_state"]
    trial = [p for p in phases if p.startswith("trial")]
    assert trial[:2] == ["trial settle: espresso search", "trial: espresso search"]
    assert len(trial) == 2 * len({p.split(": ")[1] for p in trial})  # one turn (settle + measured) each
    assert "none kept" in reports[5]["plan_state"]  # the run ends mid-trial: the summary says so
    assert phases[-1] == "plan" and phases.index("plan") == 4 + len(trial)
    final = reports[-1]
    assert final["plan_state"] == "kept after its trial on the cluster"
    assert final["plan_chosen_by"] == ("model" if final["plan_candidate"] == "espresso search" else "trial")
    assert final["plan_source"] in ("espresso search", "cupcake", "dense")
    assert set(final["plan_trial_step_s"]) == {p.split(": ")[1] for p in trial}


@pytest.mark.slow  # the default run's time: make test-slow runs it
@pytest.mark.e2e
def test_compare_gathers_a_sweep_into_a_table_and_a_plot(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    result = _train("-m", "seed=1,2", *TINY, "trainer.max_steps=3", f"hydra.sweep.dir={sweep}", *QUIET)
    assert result.returncode == 0, result.stderr[-3000:]
    jobs = ("0-dense-cnn,seed=1", "1-dense-cnn,seed=2")  # each job's folder: its number and run name
    names = [json.loads((sweep / job / "summary.json").read_text())["run_name"] for job in jobs]
    assert names == ["dense-cnn,seed=1", "dense-cnn,seed=2"]  # what differs between the jobs
    out = tmp_path / "table"
    assert compare.main([str(sweep), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    header, *rows = [line for line in printed.splitlines() if line.startswith("| ") and "---" not in line]
    assert "| run | seed |" in header and "final loss" in header and len(rows) == 2
    assert rows[0].startswith("| dense-cnn,seed=1 | 1 |") and rows[1].startswith("| dense-cnn,seed=2 | 2 |")
    with (out / "compare.csv").open() as handle:
        table = list(csv.DictReader(handle))
    assert [row["seed"] for row in table] == ["1", "2"] and all(row["status"] == "finished" for row in table)
    assert (out / "compare.png").read_bytes()[:4] == b"\x89PNG" and (out / "compare.md").exists()
    assert len(compare.curves(sweep / jobs[0])["step_loss"][0]) == 3


@pytest.mark.slow  # the default run's time: make test-slow runs it
@pytest.mark.e2e
def test_help_documents_every_option_and_import_registers_the_strategy():
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), "sync=zen", "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    text = result.stdout
    for group in ("sync", "compressor", "memory", "model", "ckpt", "strategy", "cluster", "logger"):
        options = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        assert f"{group}=<{'|'.join(options)}>" in text, group
    assert "* zen" in text and "Zen: hash-balanced parallel push/pull" in text  # the selected option, its comment
    assert "sync.bucket_mb=25.0" in text and "strategy.timeout_s=600" in text and "seed=0" in text
    registered = subprocess.run(
        [sys.executable, "-c", "import ddlscale, pytorch_lightning as pl; "
         "print(type(pl.Trainer(strategy='ddlscale', accelerator='cpu', devices=1, logger=False).strategy).__name__)"],
        capture_output=True, text=True, timeout=120)
    assert registered.stdout.strip() == "DDLStrategy", registered.stderr[-2000:]


BAD = [  # overrides, the key named (the message starts with it), the cause
    (["seed=abc"], "seed", "an integer"),
    (["trainer.max_steps=-5"], "trainer.max_steps", ">= 1 or -1"),
    (["cluster=emulated", "cluster.bandwidth=fast"], "cluster.bandwidth", "bad bandwidth 'fast'"),
    (["cluster=emulated", "cluster.nodes=0"], "cluster.nodes", "[1, 250]"),
    (["cluster=emulated", "cluster.fallback=maybe"], "cluster.fallback", "loopback, error"),
    (["sync=zen", "sync.network_bandwidth=fast"], "sync.network_bandwidth", "bad bandwidth 'fast'"),
    (["sync=zen", "sync.network_latency=soon"], "sync.network_latency", "bad time 'soon'"),
    (["sync=zen", "sync.local_size=2", "trainer.devices=3"], "sync.local_size", "dividing the 3 ranks"),
    (["strategy.timeout_s=-1"], "strategy.timeout_s", "> 0"),
    (["+strategy.timeout=60"], "strategy.timeout", "datetime.timedelta"),
    (["strategy.debug_collectives=maybe"], "strategy.debug_collectives", "true or false"),
]


@pytest.mark.parametrize("overrides,key,cause", BAD, ids=[" ".join(o) for o, _, _ in BAD])
def test_bad_input_is_refused_naming_the_key(overrides, key, cause):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    with pytest.raises(ConfigError) as refused:
        check_config(cfg)
    message = str(refused.value)
    assert message.startswith(key) and cause in message, message


def test_parameter_names_are_checked_against_the_model_before_workers_start(tmp_path):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["sync=zen", "sync.sparse_params=[nope.weight]"])
    with pytest.raises(ConfigError, match=r"sync.sparse_params names \['nope.weight'\].*input_embedding.weight"):
        app.build_trainer(cfg, tmp_path, {})


@pytest.mark.e2e
@pytest.mark.parametrize("how", ["run", "sweep"])
def test_a_refused_run_leaves_no_traceback_and_no_run_directory(tmp_path, how):
    where = tmp_path / "outputs"
    args = ["seed=abc", f"hydra.run.dir={where}/run"] if how == "run" else ["-m", "seed=abc,1", f"hydra.sweep.dir={where}/sweep"]
    result = _train(*args)
    output = result.stdout + result.stderr
    assert result.returncode == 1 and "ddlscale: invalid config: seed must be an integer, got 'abc'" in output
    assert "Traceback" not in output and "Initializing distributed" not in output
    assert not where.exists() or not any(where.iterdir())
