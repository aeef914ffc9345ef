"""The training app's command line: ``ddlscale-train``, ``python -m ddlscale`` and a checkout's
``python train.py`` all run :func:`main`, so they compose the same configs (the package's own, through
Hydra's ``pkg://`` search path: from any working directory) and refuse a bad override alike.

    ddlscale-train                                   # lstm, 2 CPU workers, dense sync
    ddlscale-train model=deepfm trainer.devices=3
    ddlscale-train -m sync=dense seed=1,2            # a sweep: one run directory per job
    ddlscale-train --help                            # every option and its values
"""

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from ddlscale.cluster.stop import StopRequested
from ddlscale.paths import CONF_SEARCH_PATH
from ddlscale.trainer import ConfigError, RunFailed, discard_refused_run, run, runinfo
from ddlscale.trainer.overrides import composed, refusing_bad_overrides
from ddlscale.trainer.shutdown import skip_final_collection

# At import, not in main: every process that loads the app does, the launcher and the workers that
# re-run its script (Lightning's spawn imports it as __mp_main__, torchrun runs it); each would spend a
# second of CPU, or ten on a busy host, on its way out.
skip_final_collection()


@hydra.main(version_base="1.3", config_path=CONF_SEARCH_PATH, config_name="config")
def app(cfg: DictConfig) -> float | None:
    composed()
    hydra_cfg = HydraConfig.get()
    output_dir = Path(hydra_cfg.runtime.output_dir)
    try:
        info = {**runinfo.labels(cfg, hydra_cfg.runtime.choices), "seed": cfg.seed, "run_name": cfg.run_name,
                "overrides": runinfo.task_overrides(), **runinfo.version()}
        summary = run(cfg, output_dir, info, list(hydra_cfg.overrides.task), runinfo.logged_config(cfg))
    except ConfigError as exc:
        sweep_dir = hydra_cfg.sweep.dir if hydra_cfg.mode == RunMode.MULTIRUN else None
        discard_refused_run(output_dir, sweep_dir)
        sys.exit(f"ddlscale: invalid config: {exc}")
    except RunFailed as failed:  # its summary, printed above, names the run directory and train.log
        sys.exit(f"ddlscale: the run failed: {failed} (the traceback is in train.log)")
    except StopRequested as stop:
        sys.exit(128 + stop.signum)  # the shell's convention for "ended by signal N"
    return summary.get("final_loss")


def main() -> None:
    """Run the app on this process's command line (Hydra reads ``sys.argv``)."""
    with refusing_bad_overrides():  # a key Hydra cannot compose: refused like any bad value
        app()
