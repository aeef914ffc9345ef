"""A run directory holds one run: a second run into it continues the first or is refused.

Without this, a second run into the same ``hydra.run.dir`` appended its steps to the first's
``metrics.csv`` (steps 0..4, then 0..4 again) while ``summary.json`` described the second alone.
Checked in the launching process before anything starts, beside the config.

A run that stopped with checkpoints is continued by :func:`continuing_command`'s command line: the
same one with its directory named (the default directory is a new timestamp, a fresh run).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

RUN_FILES = ("summary.json", "metrics.csv")  # what a run that started leaves, whatever its end


class RunDirectoryTaken(ValueError):
    """The run directory holds a run this one would not continue; the message says what would."""


def earlier_run(output_dir: Path) -> list[str]:
    """The files of a run already in ``output_dir`` (empty: none)."""
    return [name for name in RUN_FILES if (output_dir / name).is_file()]


def check_continues_or_fresh(cfg: DictConfig, output_dir: Path, sweep: bool = False) -> None:
    """Refuse a run into a directory that holds one unless it resumes from a checkpoint
    (``ckpt.resume`` set on a checkpointer); a resumed run's rows continue the earlier ones."""
    found = earlier_run(output_dir)
    if not found:
        return
    resumes = OmegaConf.select(cfg, "ckpt._target_") is not None and OmegaConf.select(cfg, "ckpt.resume") is not None
    if resumes:
        return
    where = "hydra.sweep.dir" if sweep else "hydra.run.dir"
    raise RunDirectoryTaken(
        f"{where}: {output_dir} already holds a run ({', '.join(found)}); continue it from its checkpoints "
        f"with ckpt.resume=auto (and the ckpt= it ran with), or give this run another {where}")


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def continuing_command(run_dir: Path, overrides: list[str]) -> str | None:
    """The command line that continues the run in ``run_dir`` (None outside a Hydra app's run): this
    process's program and config flags, the job's own overrides (a sweep job's values, not the sweep's)
    with ``overrides`` in place of the same keys, and ``hydra.run.dir=<run_dir>``."""
    from hydra._internal.utils import get_args_parser
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    hydra = HydraConfig.get()
    program = sys.orig_argv[:len(sys.orig_argv) - (len(sys.argv) - 1)]  # as typed: python train.py, python -m x
    args, _ = get_args_parser().parse_known_args(sys.argv[1:])  # Hydra's own reading of its flags
    flags = [f"--{name.replace('_', '-')}={value}" for name in ("config_path", "config_name", "config_dir")
             if (value := getattr(args, name)) is not None]
    replaced = {_key(o) for o in overrides} | {"hydra.run.dir"}
    job = [o for o in hydra.overrides.task if _key(o) not in replaced]
    own = [o for o in hydra.overrides.hydra  # Hydra's of the command line, less a sweep's and the directory
           if not _key(o).startswith(("hydra.run.", "hydra.sweep.", "hydra.mode", "hydra.job.num", "hydra.job.id"))]
    return shlex.join([*program, *flags, *job, *own, *overrides, f"hydra.run.dir={run_dir}"])
