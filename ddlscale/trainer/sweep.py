"""A sweep is checked whole before its first job starts: every job's config, composed as Hydra will
compose it for that job, goes through the same validation as a single run (:func:`check_config`).

Hydra's basic sweeper only composes each job (a typo in a key fails early, a bad value does not);
the jobs then run one after the other, so a bad value in the tenth job stopped the sweep after nine
jobs' time. The sweeper in ``hydra_plugins/ddlscale_sweeper`` calls :func:`check_jobs` first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from omegaconf import DictConfig


class SweepRefused(ValueError):
    """A job of the sweep has a config that cannot work; the message names the job and the key."""


def check_jobs(jobs: Sequence[Sequence[str]], compose: Callable[[list[str]], DictConfig]) -> None:
    """Compose and check every job (its overrides, in order); raise :class:`SweepRefused` for the first
    job that fails, naming its number and its overrides (a swept key Hydra cannot compose too)."""
    from hydra.errors import CompactHydraException

    from ddlscale.trainer.app import ConfigError, check_config
    from ddlscale.trainer.overrides import describe

    for number, overrides in enumerate(jobs):
        try:
            check_config(compose(list(overrides)))
        except (ConfigError, CompactHydraException) as exc:
            why = describe(exc) if isinstance(exc, CompactHydraException) else exc
            raise SweepRefused(f"{why} (in sweep job {number}: {' '.join(overrides)}; no job ran)") from None
