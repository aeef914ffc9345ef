"""A version saved on N ranks, restored on M != N (the persistent tier; machines lost and not replaced).

What each part of the state becomes:

* **rank-shared** (parameters, optimizer state, schedulers, loop counters): the same on every rank
  under data parallelism, so restored unchanged on all M ranks — parameters and optimizer state
  exactly as saved.
* **data position**: every saved rank stood at the same global sample of the epoch's order; the M
  ranks continue at that sample (:func:`~ddlscale.ckpt.state.data.position_loader_at_sample`).
* **RNG streams**: rank r < N continues rank r's saved streams; a rank the saved run did not have
  gets fresh streams seeded from (step, rank) — distinct per rank and the same on every restart.
* **sync-backend state**: all N ranks' states go to the backend, which merges and re-splits them
  (``GradSync.load_resharded``: error-feedback residuals summed and shared out so their total is
  kept; profiles, which depend on the world size, measured again).
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import torch

from ddlscale.ckpt.state.data import DataPosition
from ddlscale.ckpt.state.shard import RANK_STATE_KEY, SYNC_STATE_KEY


def fresh_rng(step: int, rank: int) -> dict[str, Any]:
    """RNG streams for a rank the saved run did not have, as :func:`~ddlscale.ckpt.state.rng.capture_rng` lays
    them out (CUDA generators keep the process's own seeding)."""
    seed = int.from_bytes(hashlib.sha256(f"ddlscale-reshard:{step}:{rank}".encode()).digest()[:4], "little")
    return {"python": random.Random(seed).getstate(), "torch": torch.Generator().manual_seed(seed).get_state(),
            "numpy": np.random.RandomState(seed).get_state()}


def reshard_local(saved: list[dict[str, Any]], rank: int, world_size: int) -> dict[str, Any]:
    """Rank ``rank`` of ``world_size``'s local state from the N saved ranks' local states (sync state
    excluded: the backend merges it, see :func:`assemble_resharded`)."""
    steps = {int(s["global_step"]) for s in saved}
    positions = {DataPosition.from_dict(s["data"]) for s in saved}
    if len(steps) != 1 or len({(p.epoch, p.samples) for p in positions}) != 1:
        raise ValueError(f"saved ranks disagree on the step or data position: steps {sorted(steps)}, "
                         f"positions {sorted((p.epoch, p.batch, p.samples or 0) for p in positions)}")
    step = steps.pop()
    return {
        "rank": rank,
        "world_size": world_size,
        "global_step": step,
        "rng": saved[rank]["rng"] if rank < len(saved) else fresh_rng(step, rank),
        "data": saved[0]["data"],
        "sync": None,
        "resharded_from": len(saved),
    }


def assemble_resharded(shared_payload: dict[str, Any], saved_locals: list[dict[str, Any]], rank: int,
                       world_size: int) -> dict[str, Any]:
    """Rank ``rank``'s restorable checkpoint dict at ``world_size`` from a version of ``len(saved_locals)``
    ranks: the shared part as saved, the sync states of all saved ranks for the backend to merge."""
    if shared_payload.get("shared") is None:
        raise ValueError("the shared payload holds no rank-shared state")
    checkpoint = dict(shared_payload["shared"])
    syncs = [s["sync"] for s in saved_locals]
    if any(s is not None for s in syncs):
        checkpoint[SYNC_STATE_KEY] = {"world_size": len(saved_locals), "ranks": syncs}
    checkpoint[RANK_STATE_KEY] = reshard_local(saved_locals, rank, world_size)
    return checkpoint
