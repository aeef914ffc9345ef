"""The Hydra-configured training application behind ``train.py``."""

import warnings

# Deprecations raised inside Lightning's own use of torch, which a user cannot act on; they would
# print once per worker per run. (Imported in spawned workers too, through the metrics callback.)
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
warnings.filterwarnings("ignore", message=r".*torch.distributed.nn.functional.all_gather is deprecated.*")
# Lightning's advice to prepend srun wherever SLURM is installed: a cluster=local run needs none, and a
# cluster=slurm run outside SLURM's tasks is refused with ddlscale's own advice (ddlscale/cluster/slurm.py).
warnings.filterwarnings("ignore", message=r"The `srun` command is available on your system but is not used.*")

from ddlscale.trainer import help, runinfo  # noqa: E402  (their config resolvers: --help, run_name)
from ddlscale.trainer.app import ConfigError, build_trainer, check_config, run  # noqa: E402
from ddlscale.trainer.metrics import StepMetrics, param_sha256  # noqa: E402
from ddlscale.trainer.report import RunFailed, discard_refused_run  # noqa: E402

__all__ = ["ConfigError", "RunFailed", "StepMetrics", "build_trainer", "check_config", "discard_refused_run", "help",
           "param_sha256", "run", "runinfo"]
