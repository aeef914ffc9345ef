"""Train with ddlscale from a checkout: `python train.py [group=option ...] [key=value ...]` (Hydra).

    python train.py                                  # lstm, 2 CPU workers, dense sync
    python train.py model=deepfm trainer.devices=3
    python train.py -m sync=dense seed=1,2           # a sweep: one run directory per job
    python train.py --help                           # every option and its values

The same app as an installed package's `ddlscale-train` and `python -m ddlscale`
(ddlscale/trainer/cli.py); the configs are the package's, ddlscale/conf.
"""

from ddlscale.trainer.cli import main

if __name__ == "__main__":
    main()
