"""What a new user trips on (issue 45), each reproduced: sweeps checked whole before they start, a
ddp run never labelled with a sync it does not run, failures that still leave a summary, stopped runs
whose figures match their rows, run directories never mixed, no alarming output from optional extras,
every logger holding the whole config, planned syncs' medians of the kept plan, and a README whose
links resolve."""

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from ddlscale.paths import CONF_DIR
from ddlscale.trainer import ConfigError, StepMetrics, check_config
from ddlscale.trainer.loggers import RunCSVLogger, record_config, record_summary

ROOT = Path(__file__).resolve().parents[2]
QUIET = ["trainer.enable_progress_bar=false"]
TINY = ["model=cnn", "model.width=4", "model.num_blocks=1", "model.image_size=8", "model.num_samples=256"]


def _train(*overrides, env=None, cwd=ROOT, timeout=300):
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *overrides], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def _compose(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


# ---- a sweep is checked whole before its first job ------------------------------------------------
def test_a_sweep_with_a_bad_value_in_its_second_job_runs_nothing(tmp_path):
    sweep = tmp_path / "sweep"
    result = _train("-m", "sync=compress", "compressor=topk", "compressor.ratio=0.01,2", *TINY,
                    "trainer.max_steps=2", f"hydra.sweep.dir={sweep}", *QUIET)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    refusal = re.search(r"ddlscale: invalid config: (.*) \(in sweep job 1: (.*); no job ran\)", output)
    assert refusal is not None, output[-3000:]
    assert "compressor.ratio" in refusal.group(1) and "compressor.ratio=2" in refusal.group(2).split()
    assert "Traceback" not in output and "Initializing distributed" not in output
    assert not sweep.exists()  # nothing ran: no job folder, not even the sweep's


def test_ddp_with_a_sync_it_would_not_run_is_refused_naming_both_keys():
    with pytest.raises(ConfigError, match=r"strategy._target_=.*DDPStrategy.*ignores sync._target_=.*ZenSync"):
        check_config(_compose("strategy=ddp", "sync=zen"))
    with pytest.raises(ConfigError, match="strategy=ddlscale"):
        check_config(_compose("strategy=ddp", "sync=compress", "compressor=fp16"))
    check_config(_compose("strategy=ddp", "sync=dense"))  # stock DDP computes what sync=dense does


# ---- failures past validation still leave a summary and train.log ---------------------------------
FAILURES = {
    "unwritable-ckpt-dir": ["ckpt=disk", "ckpt.every=1", "ckpt.dir=/proc/nope"],
    "gpu-on-a-cpu-host": ["trainer.accelerator=gpu"],
}


@pytest.mark.parametrize("how", [pytest.param(how, marks=pytest.mark.slow) if how == "unwritable-ckpt-dir" else how
                                 for how in FAILURES])  # unwritable-ckpt-dir: ~14 s, slow run only
def test_a_failure_after_validation_writes_a_failed_summary_and_train_log(tmp_path, how):
    if how == "gpu-on-a-cpu-host" and torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    out = tmp_path / "run"
    result = _train(*TINY, *FAILURES[how], "trainer.max_steps=3", f"hydra.run.dir={out}", *QUIET)
    assert result.returncode == 1, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["stopped_by"], summary
    assert summary["sync"] == "dense" and summary["run_name"]
    log = (out / "train.log").read_text()
    assert "Traceback" in log and "failed" in log
    assert "ddlscale: the run failed:" in result.stderr and f"run directory: {out}" in result.stdout


# ---- a stopped run's figures match its rows --------------------------------------------------------
class _StopAfterOptimizerStep(pl.Callback):
    """Raises in on_train_batch_end before StepMetrics sees the step: the optimizer has stepped
    (trainer.global_step counts it) but the step has no row, as when a signal lands between them."""

    def __init__(self, at: int):
        self.at = at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.at:
            raise RuntimeError("stopped between the optimizer step and its row")


def test_a_failed_run_reports_the_steps_metrics_csv_holds(tmp_path):
    model = instantiate(_compose(*TINY).model, _convert_="all")
    metrics = StepMetrics(tmp_path, {"sync": "dense"})
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=10, logger=RunCSVLogger(str(tmp_path)),
                         callbacks=[_StopAfterOptimizerStep(at=4), metrics], enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1)
    with pytest.raises(RuntimeError, match="stopped between"):
        trainer.fit(model)
    summary = json.loads((tmp_path / "summary.json").read_text())
    with (tmp_path / "metrics.csv").open() as handle:
        rows = [row for row in csv.DictReader(handle) if row["step_loss"]]
    assert trainer.global_step == 4 and summary["status"] == "failed"
    assert summary["steps"] == len(rows) == 3  # was 4: global_step, one more than the rows
    assert summary["final_loss"] == float(rows[-1]["step_loss"])


# ---- a run directory holds one run ----------------------------------------------------------------
def test_a_second_run_into_a_run_directory_is_refused_with_the_way_out(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "summary.json").write_text(json.dumps({"status": "finished", "steps": 5}))
    rows = "step,step_loss\n" + "".join(f"{i},1.0\n" for i in range(5))
    (out / "metrics.csv").write_text(rows)
    result = _train(*TINY, "trainer.max_steps=2", f"hydra.run.dir={out}", *QUIET)
    output = result.stdout + result.stderr
    assert result.returncode == 1 and "already holds a run" in output, output[-3000:]
    assert "ckpt.resume=auto" in output and "hydra.run.dir" in output and "Traceback" not in output
    assert (out / "metrics.csv").read_text() == rows  # nothing appended
    assert json.loads((out / "summary.json").read_text())["steps"] == 5


def test_a_resumed_run_replaces_the_rows_of_the_steps_it_redoes(tmp_path):
    (tmp_path / "metrics.csv").write_text("step,step_loss\n" + "".join(f"{i},1.0\n" for i in range(6)))
    logger = RunCSVLogger(str(tmp_path))
    for step in (4, 5, 6):  # resumed from the version of step 4: steps 4 and 5 are done again
        logger.log_metrics({"step_loss": 2.0}, step=step)
    logger.save()
    with (tmp_path / "metrics.csv").open() as handle:
        table = [(int(r["step"]), float(r["step_loss"])) for r in csv.DictReader(handle)]
    assert table == [(0, 1.0), (1, 1.0), (2, 1.0), (3, 1.0), (4, 2.0), (5, 2.0), (6, 2.0)]


# ---- installs without the optional extras print nothing alarming ---------------------------------
BLOCK_URLLIB3 = '''
import sys
class _Absent:  # an install without the etcd extra: no python-etcd, no urllib3
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("urllib3", "etcd"):
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, _Absent())
'''


@pytest.mark.slow  # the default run's time: make test-slow runs it
def test_without_urllib3_a_refused_run_prints_only_its_refusal(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(BLOCK_URLLIB3)
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    imported = subprocess.run([sys.executable, "-c", "import urllib3"], capture_output=True, text=True, env={
        **os.environ, **env})
    assert imported.returncode != 0  # the blocker works
    rendezvous = subprocess.run([sys.executable, "-c", "import torch.distributed.elastic.rendezvous as r; "
                                 "print(sorted(r.rendezvous_handler_registry._registry))"],
                                capture_output=True, text=True, env={**os.environ, **env}, timeout=120)
    assert rendezvous.stderr == "" and "ddlscale-etcd" in rendezvous.stdout, rendezvous.stderr[-3000:]
    result = _train("seed=abc", f"hydra.run.dir={tmp_path / 'run'}", env=env)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == "ddlscale: invalid config: seed must be an integer, got 'abc'\n", result.stderr[-3000:]


# ---- every logger records the whole config where its users look -----------------------------------
def test_tensorboard_hparams_yaml_holds_the_whole_config_after_the_model_s(tmp_path):
    logger = instantiate(_compose("logger=tensorboard").logger, save_dir=str(tmp_path))
    logger.log_hyperparams({"width": 4, "lr": 0.1})  # what Lightning logs first: the model's
    logger.save()  # and Lightning's save writes hparams.yaml once
    record_config([logger], {"sync.bucket_mb": 25.0, "seed": 3, "world_size": 2})
    logger.finalize("success")
    hparams = yaml.safe_load((tmp_path / "hparams.yaml").read_text())
    assert hparams["sync.bucket_mb"] == 25.0 and hparams["seed"] == 3 and hparams["width"] == 4


def _wandb_records(path: Path) -> list:
    """The records of an offline run's ``.wandb`` file (what ``wandb sync`` uploads): LevelDB-style
    blocks of 32 KiB after a 7-byte header, each record a 7-byte header (crc, length, kind) and its data,
    long ones split into first/middle/last pieces."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, pos, pieces, records = path.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pieces, pos = pieces + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a whole record, or its last piece
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            records.append(record)
            pieces = b""
    return records


def test_wandb_records_the_whole_config_as_the_run_config_and_finishes_the_run(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    files = [tmp_path / "summary.json", tmp_path / "plan.txt"]
    for path in files:
        path.write_text(path.name)
    logger = instantiate(_compose("logger=wandb", "logger.name=dense-cnn-seed3").logger, save_dir=str(tmp_path))
    logger.log_hyperparams({"width": 4})  # the model's, as Lightning logs them first
    record_config([logger], {"sync.bucket_mb": 25.0, "seed": 3})
    record_summary([logger], {"final_loss": 1.5, "sync": "dense"}, step=10, files=files)
    logger.finalize("success")
    # W&B's service process writes the file: read it once that process has ended (on a busy host the
    # records were read before it had written them all).
    wandb.teardown()
    records = _wandb_records(next((tmp_path / "wandb").glob("offline-run-*/run-*.wandb")))
    artifacts = [r.artifact for r in records if r.WhichOneof("record_type") == "artifact"]
    assert [(a.type, sorted(e.path for e in a.manifest.contents)) for a in artifacts] == [
        ("run-outputs", ["plan.txt", "summary.json"])]
    config, summary, exits = {}, {}, []
    for record in records:
        kind = record.WhichOneof("record_type")
        updates = {"config": lambda r: r.config.update, "run": lambda r: r.run.config.update,
                   "summary": lambda r: r.summary.update}.get(kind)
        if updates is not None:
            (summary if kind == "summary" else config).update(
                {item.key: json.loads(item.value_json) for item in updates(record)})
        if kind == "exit":
            exits.append(record.exit.exit_code)
    assert config["sync.bucket_mb"] == 25.0 and config["seed"] == 3 and config["width"] == 4
    assert summary["final_loss"] == 1.5 and summary["sync"] == "dense"
    assert exits == [0]  # finished (Lightning left it running: W&B showed it as crashed)


# ---- a planned sync's summary is of its kept plan --------------------------------------------------
class _Strategy:
    sync = None


class _Trainer:
    strategy = _Strategy()


def test_planned_sync_medians_are_of_the_kept_plan_with_the_planning_phases_apart():
    metrics = StepMetrics(".")
    phases = ["warmup", "profile", "profile", "trial: cupcake", "trial: cupcake", "plan", "plan", "plan", "plan"]
    times = [0.9, 0.5, 0.5, 0.3, 0.3, 0.1, 0.12, 0.1, 0.1]
    for phase, seconds in zip(phases, times, strict=True):
        for key in metrics.history:
            metrics.history[key].append(seconds if key == "step_time_s" else 1.0)
        metrics.step_phases.append(phase)
        metrics.phases[phase] = metrics.phases.get(phase, 0) + 1
    reported = metrics._reported(metrics.history)
    assert reported["step_time_s"] == [0.1, 0.12, 0.1, 0.1]  # the plan's steps alone
    figures = metrics._sync_figures(_Trainer())
    assert figures["medians_of"].startswith("the kept plan's steps")
    medians = figures["sync_phase_medians"]
    assert list(medians) == ["warmup", "profile", "trial: cupcake", "plan"]
    assert medians["profile"] == {"steps": 2, "step_time_s": 0.5, "sync_time_s": 1.0, "bytes_sent_per_step": 1.0}
    # A run that ended before keeping a plan reports every step, and says so.
    short = StepMetrics(".")
    short.history = {k: v[:3] for k, v in metrics.history.items()}
    short.step_phases, short.phases = phases[:3], {"warmup": 1, "profile": 2}
    assert short._reported(short.history) == short.history
    assert short._sync_figures(_Trainer())["medians_of"] == "every step: the run kept no plan"


# ---- the README: one screen, links that resolve ---------------------------------------------------
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _documents():
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "experiments" / "README.md"]


def test_the_readme_is_one_screen_and_runs_each_system():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 90
    for command in ("sync=zen", "sync=espresso", "sync=cupcake", "ckpt=gemini", "python train.py -m",
                    "ddlscale.tools.compare", "make train", "make test"):
        assert command in text, command
    assert "experiments/README.md" in text and "docs/options.md" in text


def test_the_readme_s_commands_for_each_system_are_accepted():
    text = (ROOT / "README.md").read_text()
    block = text[text.index("## Try each system"):].split("```")[1]
    runs = [line.split("#")[0].split()[2:] for line in block.splitlines() if line.startswith("python train.py")]
    assert len(runs) == 5
    for overrides in runs:
        if overrides[0] == "-m":  # a sweep: its first job
            overrides = [o.split(",")[0] for o in overrides[1:]]
        check_config(_compose(*overrides))


@pytest.mark.parametrize("document", _documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_in_the_clone(document):
    text = document.read_text()
    bad = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        resolved = (document.parent / path).resolve() if path else document
        if ROOT not in (resolved, *resolved.parents) or not resolved.exists():
            bad.append(f"{target}: outside the repository or missing")
            continue
        ignored = subprocess.run(["git", "check-ignore", "-q", str(resolved)], cwd=ROOT).returncode == 0
        if ignored:  # a build output or a run's file: not in a clone
            bad.append(f"{target}: ignored by git")
        if anchor and resolved.suffix == ".md":
            headings = {_anchor(h) for h in re.findall(r"^#+ (.+)$", resolved.read_text(), re.M)}
            if anchor not in headings:
                bad.append(f"{target}: no heading #{anchor}")
    assert not bad, bad


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_a_workers_error_is_told_by_its_own_last_line():
    from ddlscale.trainer.report import error_line

    spawned = RuntimeError("\n-- Process 1 terminated with the following error:\nTraceback (most recent call last):\n"
                           '  File "x.py", line 1, in f\nValueError: ckpt.resume: no intact replica\n')
    assert error_line(spawned) == "ValueError: ckpt.resume: no intact replica"
    assert error_line(OSError("disk full")) == "OSError: disk full"
