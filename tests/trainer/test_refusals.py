"""Refusals complete (issue 62): a key nothing reads, a compressing sync without a compressor, a
misspelled key or option, each refused before any worker starts, naming what the user typed with the
closest known key; one refusal that gives the whole answer; a sweep refused the same way before its
first job. What a class takes stays accepted."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from ddlscale.paths import CONF_DIR
from ddlscale.trainer import ConfigError, check_config, schemas
from ddlscale.trainer.overrides import describe

ROOT = Path(__file__).resolve().parents[2]
QUIET = ["trainer.enable_progress_bar=false"]


def _cfg(*overrides, hydra=False):
    """The composed config; ``hydra``: with Hydra's node, as a sweep's jobs are composed (the options
    chosen, which the messages name)."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=hydra)


def _refused(*overrides) -> str:
    with pytest.raises(ConfigError) as refused:
        check_config(_cfg(*overrides, hydra=True))
    return str(refused.value)


UNREAD = [  # overrides, the refusal's start, what it suggests
    (["+foo=1"], "foo: read by nothing", "known: ckpt, cluster"),
    (["+sync.bukcet_mb=1"], "sync.bukcet_mb: sync=dense takes no key bukcet_mb", "did you mean sync.bucket_mb?"),
    (["+trainer.max_step=3"], "trainer.max_step: not an argument of Lightning's Trainer", "did you mean trainer.max_steps?"),
    (["model=cnn", "+model.widht=3"], "model.widht: model=cnn takes no key widht", "did you mean model.width?"),
    (["+cluster.nods=3"], "cluster.nods: cluster=local takes no key nods", "known: kind, max_restarts"),
    (["ckpt=disk", "+ckpt.evry=3"], "ckpt.evry: ckpt=disk takes no key evry", "did you mean ckpt.every?"),
    (["logger=csv", "+logger.flush_every=3"], "logger.flush_every: logger=csv takes no key", "flush_logs_every_n_steps"),
]


@pytest.mark.parametrize("overrides,start,hint", UNREAD, ids=[" ".join(o) for o, _, _ in UNREAD])
def test_a_key_nothing_reads_is_refused_with_the_closest_known_one(overrides, start, hint):
    message = _refused(*overrides)
    assert message.startswith(start) and hint in message, message


ACCEPTED = [  # keys added with + that something reads
    ["+trainer.profiler=simple"],  # a Lightning Trainer argument the file leaves out
    ["+lr=0.5", "model.lr=${lr}"],  # a run-level key a value refers to
    ["logger=wandb", "+logger.tags=[a,b]", "+logger.entity=me"],  # wandb.init's, through Lightning's WandbLogger
    ["logger=tensorboard", "+logger.flush_secs=5"],  # the SummaryWriter's
    ["strategy=ddp", "+strategy.find_unused_parameters=true"],  # DistributedDataParallel's
]


@pytest.mark.parametrize("overrides", ACCEPTED, ids=[" ".join(o) for o in ACCEPTED])
def test_a_key_its_class_takes_is_accepted(overrides):
    if overrides[0] == "logger=wandb":
        pytest.importorskip("wandb")
    check_config(_cfg(*overrides))


def test_every_option_of_every_group_has_only_keys_its_class_takes():
    for group in (*schemas.GROUPS, "cluster", "experiment"):
        for option in schemas.options(group):
            if (group, option) == ("logger", "wandb") and importlib.util.find_spec("wandb") is None:
                continue  # an install without the wandb extra
            compressing = ["sync=compress"] if group in ("compressor", "memory") else []
            schemas.check_known_keys(_cfg(f"{group}={option}", *compressing))


def test_a_compressing_sync_without_a_compressor_is_refused_naming_the_key():
    message = _refused("sync=compress")
    assert message.startswith("compressor: sync=compress compresses every gradient") and "compressor=none" in message
    assert "topk" in message and "sync=dense" in message
    check_config(_cfg("sync=compress", "compressor=topk"))
    check_config(_cfg("sync=cupcake"))  # a planned sync plans fusion alone without one


def test_refusals_name_the_options_users_typed_not_classes():
    message = _refused("compressor=topk")
    assert message == ("compressor=topk needs a compressing sync (sync=compress, espresso or cupcake); sync=dense "
                       "does not compress"), message
    assert "ddlscale." not in _refused("memory=residual")


@pytest.mark.parametrize("sync", ["espresso", "cupcake", "compress"])
def test_powersgd_under_another_scheme_than_allreduce_gets_one_refusal_with_the_whole_answer(sync):
    message = _refused(f"sync={sync}", "compressor=powersgd", "sync.comm=allgather")
    assert message.startswith("sync.comm: compressor powersgd"), message
    assert message.endswith("Use sync.comm=allreduce"), message
    check_config(_cfg(f"sync={sync}", "compressor=powersgd", "sync.comm=allreduce"))  # and that runs


def test_logger_offline_must_be_a_boolean():
    pytest.importorskip("wandb")
    assert _refused("logger=wandb", "logger.offline=maybe").startswith("logger.offline must be true or false")
    check_config(_cfg("logger=wandb", "logger.offline=null"))


def _composition_error(*overrides) -> str:
    with pytest.raises(Exception) as failed:
        _cfg(*overrides)
    return describe(failed.value)


def test_what_hydra_cannot_compose_is_described_with_the_closest_key_or_option():
    assert _composition_error("sync.bukcet_mb=1") == "sync.bukcet_mb: no such key (did you mean sync.bucket_mb?)"
    assert _composition_error("sed=3") == "sed: no such key (did you mean seed?)"
    assert _composition_error("sync=zenn").startswith("sync=zenn: no such option (did you mean sync=zen?); sync takes ")
    # a key the option's file leaves out but its class takes: Hydra's advice to add it, kept
    assert _composition_error("trainer.profiler=simple") == (
        "trainer.profiler: not in the composed config; add it with +trainer.profiler=simple")


def _train(*overrides):
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *overrides, *QUIET], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"})


REFUSED_RUNS = [  # the command line, the one line it prints
    (["+foo=1"], "ddlscale: invalid config: foo: read by nothing"),
    (["sync=compress"], "ddlscale: invalid config: compressor: sync=compress compresses every gradient"),
    (["sync.bukcet_mb=1"], "ddlscale: invalid config: sync.bukcet_mb: no such key (did you mean sync.bucket_mb?)"),
    (["-m", "seed=1,2", "sync=compress,dense"],
     "ddlscale: invalid config: compressor: sync=compress compresses every gradient"),  # a sweep, before job 0
]


@pytest.mark.e2e
@pytest.mark.parametrize("overrides,line", REFUSED_RUNS, ids=[" ".join(o) for o, _ in REFUSED_RUNS])
def test_train_py_refuses_in_one_line_before_any_worker_starts(tmp_path, overrides, line):
    where = tmp_path / "out"
    result = _train(*overrides, f"hydra.run.dir={where}/run", f"hydra.sweep.dir={where}/sweep")
    assert result.returncode == 1 and result.stdout == "", result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stderr.startswith(line) and result.stderr.count("\n") == 1, result.stderr[-3000:]
    assert not where.exists() or not any(where.iterdir())
