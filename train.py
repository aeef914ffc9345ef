"""Train with ddlscale: `python train.py [group=option ...] [key=value ...]` (Hydra).

    python train.py                                  # lstm, 2 CPU workers, dense sync
    python train.py model=deepfm trainer.devices=3
    python train.py -m sync=dense seed=1,2           # a sweep: one run directory per job
"""

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from ddlscale.trainer import ConfigError, run

RUN_INFO_GROUPS = ("sync", "compressor", "memory", "ckpt", "model", "strategy", "cluster")


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    runtime = HydraConfig.get().runtime
    run_info = {group: runtime.choices.get(group) for group in RUN_INFO_GROUPS}
    try:
        summary = run(cfg, Path(runtime.output_dir), run_info, list(HydraConfig.get().overrides.task))
    except ConfigError as exc:
        sys.exit(f"ddlscale: invalid config: {exc}")
    return summary.get("final_loss")


if __name__ == "__main__":
    main()
