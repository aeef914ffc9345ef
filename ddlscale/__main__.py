"""``python -m ddlscale [group=option ...] [key=value ...]``: the training app, as ``ddlscale-train``
(:mod:`ddlscale.trainer.cli`). The emulated cluster's and torchrun's workers run it this way too."""

from ddlscale.trainer.cli import main

if __name__ == "__main__":
    main()
