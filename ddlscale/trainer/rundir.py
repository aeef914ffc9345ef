"""A run directory holds one run: a second run into it continues the first or is refused.

Without this, a second run into the same ``hydra.run.dir`` appended its steps to the first's
``metrics.csv`` (steps 0..4, then 0..4 again) while ``summary.json`` described the second alone.
Checked in the launching process before anything starts, beside the config.
"""

from __future__ import annotations

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
