"""A sweep is checked whole before its first job starts: every job's config, composed as Hydra will
compose it for that job, goes through the same validation as a single run (:func:`check_config`).

Hydra's sweepers only compose each job as they launch it (a typo in a key fails then, a bad value not
until the app runs), and the launcher runs them one after the other or a few at a time: a bad value in
the tenth job stopped the sweep after nine jobs' time. :class:`CheckJobsFirst`, a Hydra callback
(``hydra.callbacks`` in ddlscale/conf/hydra/default.yaml), does the check at ``on_multirun_start``, before the
sweeper is even built, so it holds whichever sweeper (``hydra/sweeper=basic``, ``optuna``) and
launcher (``hydra/launcher=joblib``, ``submitit_slurm``) the sweep uses.

The jobs checked are those the sweep's overrides (``hydra.sweeper.params`` and the command line's, as
both Hydra's basic sweeper and the Optuna sweeper read them) can produce: every combination of each
swept key's values, an ``interval(a, b)`` by its two ends and a ``range`` by its end too for a sweeper
that samples (Optuna's ranges include it). A search space a sweeper builds in code of its own (Optuna's
``custom_search_space``) is not seen here; each of its jobs is still checked as it starts.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


class SweepRefused(ValueError):
    """A job of the sweep has a config that cannot work; the message names the job and the key."""


def check_jobs(jobs: Sequence[Sequence[str]], compose: Callable[[list[str]], DictConfig], numbered: bool = True,
               submitted: bool = False) -> None:
    """Compose and check every job (its overrides, in order); raise :class:`SweepRefused` for the first
    job that fails, naming it by its overrides (a swept key Hydra cannot compose too) and, where the
    jobs are exactly those the sweeper runs (``numbered``), its number. ``submitted``: the launcher hands
    each job to SLURM (see :func:`check_config`)."""
    from hydra.errors import CompactHydraException

    from ddlscale.trainer.app import ConfigError, check_config
    from ddlscale.trainer.overrides import describe

    for number, overrides in enumerate(jobs):
        try:
            check_config(compose(list(overrides)), submitted=submitted)
        except (ConfigError, CompactHydraException) as exc:
            why = describe(exc) if isinstance(exc, CompactHydraException) else exc
            where = f"in sweep job {number}" if numbered else "with values the sweep may try"
            raise SweepRefused(f"{why} ({where}: {' '.join(overrides)}; no job ran)") from None


def sweep_jobs(config: DictConfig, parse: Callable[[list[str]], list[Override]]) -> tuple[list[list[str]], bool]:
    """The jobs a multirun's config can run, each as its overrides, and whether they are exactly the jobs
    its sweeper runs (Hydra's basic sweeper: every combination, in its order) rather than the values a
    sampling sweeper draws from."""
    params = OmegaConf.select(config, "hydra.sweeper.params") or {}
    # Both sweepers read their params first, then the command line's overrides.
    arguments = [f"{key}={value}" for key, value in params.items()] + list(config.hydra.overrides.task)
    exact = OmegaConf.select(config, "hydra.sweeper._target_") == BASIC_SWEEPER
    values: dict[str, list[str]] = {}  # by key: a later override of a key replaces an earlier one, as in Hydra
    for override in parse(arguments):
        key = override.get_key_element()
        values[key] = [f"{key}={value}" for value in _values(override, exact)]
    return [list(job) for job in itertools.product(*values.values())], exact


def _values(override: Override, exact: bool) -> Iterator[Any]:
    if not override.is_sweep_override():
        yield override.get_value_element_as_str()
    elif override.is_interval_sweep():
        yield from (override.value().start, override.value().end)  # the extremes a sampler can draw
    else:
        values = list(override.sweep_string_iterator())
        yield from values
        sweep = override.value()
        if override.is_range_sweep() and not exact and not sweep.shuffle:
            # Optuna samples a range up to its last step at or below the end, the end included; Hydra's
            # basic sweeper stops before the end.
            last = sweep.start + (sweep.stop - sweep.start) // sweep.step * sweep.step
            if str(last) not in values:
                yield last


def submits_to_slurm(config: DictConfig) -> bool:
    """The configured launcher hands each job to SLURM (Hydra's submitit launcher, ``cluster=slurm``)."""
    from hydra.utils import get_class

    target = OmegaConf.select(config, "hydra.launcher._target_")
    try:
        from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher

        return target is not None and issubclass(get_class(target), SlurmLauncher)
    except ImportError:  # no submitit launcher installed: nothing can submit
        return False


class CheckJobsFirst(Callback):
    """Before a multirun's sweeper starts: refuse the sweep in one line if any job it can run has a
    config that cannot work, or if its launcher submits to a SLURM that does not answer.

    A callback rather than a sweeper or launcher of ddlscale's own: Hydra calls ``on_multirun_start``
    whichever sweeper and launcher the user picks, before either is built, so choosing Optuna or joblib
    cannot drop the check. (Exiting is the one way a callback can stop Hydra: it turns a callback's
    exceptions into warnings and goes on.)"""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra.core.global_hydra import GlobalHydra

        from ddlscale.cluster import slurm

        submitted = submits_to_slurm(config)
        if submitted and OmegaConf.select(config, "cluster.kind") != "slurm":
            # A SLURM task of a cluster=local job would start workers of its own beside SLURM's tasks.
            launcher = OmegaConf.select(config, "hydra.runtime.choices", default={}).get("hydra/launcher")
            sys.exit(f"ddlscale: invalid config: hydra/launcher={launcher} runs jobs in SLURM: choose cluster=slurm "
                     "(it selects that launcher and gives each job a task per device)")
        why = slurm.cannot_submit() if submitted else None
        if why is not None:
            sys.exit(f"ddlscale: invalid config: {why}")  # nothing has run, no sweep directory was made
        loader = GlobalHydra.instance().config_loader()
        parser = OverridesParser.create(config_loader=loader)
        jobs, exact = sweep_jobs(config, parser.parse_overrides)
        try:
            check_jobs(jobs, lambda overrides: loader.load_sweep_config(config, overrides), numbered=exact,
                       submitted=submitted)
        except SweepRefused as exc:
            sys.exit(f"ddlscale: invalid config: {exc}")
