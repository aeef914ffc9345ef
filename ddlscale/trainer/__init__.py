"""The Hydra-configured training application behind ``train.py``."""

from ddlscale.trainer.app import ConfigError, build_trainer, check_config, run
from ddlscale.trainer.metrics import StepMetrics, param_sha256

__all__ = ["ConfigError", "StepMetrics", "build_trainer", "check_config", "param_sha256", "run"]
