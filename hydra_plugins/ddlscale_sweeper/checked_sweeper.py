"""Hydra's basic sweeper, except that every job's config is checked before the first job starts
(``hydra/sweeper=checked``, ddlscale's default): see :mod:`ddlscale.trainer.sweep`.

Hydra finds sweepers only in the ``hydra_plugins`` namespace package, hence this module here; the
checking itself lives in ddlscale.
"""

from __future__ import annotations

import sys
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser


class CheckedSweeper(BasicSweeper):
    def sweep(self, arguments: list[str]) -> Any:
        from ddlscale.trainer.sweep import SweepRefused, check_jobs

        assert self.config is not None and self.hydra_context is not None
        loader = self.hydra_context.config_loader
        parsed = OverridesParser.create(config_loader=loader).parse_overrides([*self._parse_config(), *arguments])
        jobs = [job for batch in self.split_arguments(parsed, None) for job in batch]
        try:
            check_jobs(jobs, lambda overrides: loader.load_sweep_config(self.config, overrides))
        except SweepRefused as exc:
            sys.exit(f"ddlscale: invalid config: {exc}")  # nothing ran and no sweep directory was made
        return super().sweep(arguments)
