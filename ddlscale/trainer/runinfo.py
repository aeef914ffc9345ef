"""What identifies a run: labels of what actually ran, its name, its overrides, the code's version.

Computed once in the launching process (inside Hydra's job) and written into ``summary.json``, given
to every logger, and used to name the run (``run_name``, wandb's run name).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

import ddlscale
from ddlscale.trainer.loggers import flat

LABELLED_GROUPS = ("sync", "compressor", "memory", "ckpt", "model", "strategy", "cluster")
NAME_GROUPS = ("sync", "model")  # what a run name starts with; the overrides that differ follow
MAX_NAME = 120


def _hydra() -> Any:
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get() if HydraConfig.initialized() else None


def _option_target(group: str, option: str) -> str | None:
    """The ``_target_`` that config group option ``group/option`` sets (None where it cannot be read)."""
    from hydra import compose

    try:
        return OmegaConf.select(compose(config_name=f"{group}/{option}"), f"{group}._target_")
    except Exception:  # an option Hydra's composition API cannot load alone (a search-path plug-in)
        return None


def labels(cfg: DictConfig, choices: dict[str, Any]) -> dict[str, Any]:
    """Per group, what ran: the option's name where the config runs that option's class, else the
    class configured in its place (``sync._target_=my.Sync`` runs ``my.Sync``, not ``dense``)."""
    out: dict[str, Any] = {}
    for group in LABELLED_GROUPS:
        choice = choices.get(group)
        target = OmegaConf.select(cfg, f"{group}._target_", default=None)
        if target is not None and choice is not None:
            expected = _option_target(group, str(choice))
            if expected is not None and expected != target:
                choice = target
        out[group] = choice
    return out


def task_overrides() -> list[str]:
    """The command line's overrides of this job (a sweep job's own values)."""
    hydra = _hydra()
    return list(hydra.overrides.task) if hydra is not None else []


def _swept_keys() -> set[str] | None:
    """Keys the command line sweeps (``seed=1,2``), None when not a sweep read from this command line."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode

    hydra = _hydra()
    if hydra is None or hydra.mode != RunMode.MULTIRUN:
        return None

    try:
        parsed = OverridesParser.create().parse_overrides([a for a in sys.argv[1:] if not a.startswith("-")])
    except Exception:  # a launcher that runs jobs from another command line (submitit)
        return None
    return {o.key_or_group for o in parsed if o.is_sweep_override()}


def run_name() -> str:
    """``<sync>-<model>`` and what differs: a sweep job's swept values, or a single run's overrides
    (Hydra's own and the labels' aside)."""
    if "WORLD_SIZE" in os.environ and os.environ.get(RUN_NAME_ENV):
        # A worker the launcher started (emulated cluster, restarts): its command line holds the job's
        # values but not which of them the sweep varies, so it takes the launcher's name.
        return os.environ[RUN_NAME_ENV]
    hydra = _hydra()
    if hydra is None:
        return "ddlscale"
    choices = hydra.runtime.choices
    swept = _swept_keys()
    parts = []
    for override in task_overrides():
        key = override.split("=", 1)[0].lstrip("+~")
        if key.startswith("hydra.") or key in NAME_GROUPS or (swept is not None and key not in swept):
            continue  # Hydra's own, the name's start, or the same in every job of the sweep
        parts.append(override.lstrip("+~"))
    name = "-".join(str(choices.get(group)) for group in NAME_GROUPS)
    return (",".join([name, *parts]))[:MAX_NAME]


def job_dir() -> str:
    """A sweep job's folder: its number (the order it ran in), then its run name, a single path part."""
    hydra = _hydra()
    number = hydra.job.num if hydra is not None else 0
    name = run_name().replace(os.sep, "_").lstrip(".")
    return f"{number}-{name}"


RUN_NAME_ENV = "DDLSCALE_RUN_NAME"  # the launcher's run name, for the workers it starts
SWEEP_ENV = "DDLSCALE_SWEEP"  # the sweep a job's launcher runs in, for the workers torchrun starts
W_AND_B_GROUP_MAX = 128  # W&B's longest group name


def sweep() -> str | None:
    """The sweep this run is a job of, by its directory as configured (``multirun/<date>/<time>``), None
    for a single run: what groups a sweep's runs in W&B. A worker that torchrun or the emulated cluster
    started runs its own Hydra job, a single run: it reads its launcher's, from the environment."""
    from hydra.types import RunMode

    hydra = _hydra()
    if hydra is not None and hydra.mode == RunMode.MULTIRUN:
        return str(hydra.sweep.dir)[-W_AND_B_GROUP_MAX:]
    return os.environ.get(SWEEP_ENV)


OmegaConf.register_new_resolver("ddlscale_run_name", run_name, replace=True)
OmegaConf.register_new_resolver("ddlscale_job_dir", job_dir, replace=True)
OmegaConf.register_new_resolver("ddlscale_sweep", sweep, replace=True)


@functools.cache
def version() -> dict[str, Any]:
    """ddlscale's version and, in a git checkout, its commit (``-dirty`` with tracked changes)."""
    root = Path(ddlscale.__file__).resolve().parents[1]
    out: dict[str, Any] = {"ddlscale_version": ddlscale.__version__, "git_commit": None}
    if not (root / ".git").exists():
        return out

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return out
    out["git_commit"] = commit + ("-dirty" if dirty else "")
    return out


def logged_config(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as one level of dotted keys (``sync.bucket_mb``), for the loggers."""
    return flat(OmegaConf.to_container(cfg, resolve=True))
