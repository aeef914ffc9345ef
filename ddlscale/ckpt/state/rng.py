"""Every global random stream a training step can draw from, captured and restored per rank.

Lightning's checkpoints leave them out; without them a model with dropout (or any code using
``random``/``numpy``) continues differently after a restore.
"""

from __future__ import annotations

import random
from typing import Any

import torch


def capture_rng() -> dict[str, Any]:
    """Python, numpy, torch CPU and (when in use) every CUDA device's generator state."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:  # numpy is optional: a run without it has no numpy stream to keep
        pass
    else:
        state["numpy"] = np.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state:
        if not torch.cuda.is_available() or torch.cuda.device_count() < len(state["cuda"]):
            raise RuntimeError(
                f"checkpoint holds the RNG state of {len(state['cuda'])} CUDA devices; this process sees "
                f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}"
            )
        torch.cuda.set_rng_state_all(state["cuda"])
