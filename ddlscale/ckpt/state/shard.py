"""The whole training state of one rank: captured as bytes, restored bit-exactly.

A rank's state splits in two:

* **shared** — what every data-parallel rank holds identically: Lightning's own checkpoint dict
  (parameters and buffers, optimizer state with its step counters, LR schedulers, loop progress,
  callback states, precision-plugin state, hyper-parameters). One rank's copy is enough.
* **local** — what differs per rank: the RNG streams, the data position, and the sync backend's
  state (error feedback, Zen's profiled densities...).

:func:`capture_shard` serializes both (or only the local part) into a :class:`Shard`: immutable bytes
and their sha256 checksum, so the snapshot cannot change while it is being written or sent. The bytes
are a :mod:`~ddlscale.ckpt.state.snapshot` stream (JSON plus raw tensors), so reading a shard back never
unpickles: a crafted file can at worst hold wrong numbers, never run code. :func:`assemble`
turns a shared and a local payload back into one dict that Lightning restores on ``fit(ckpt_path=)``;
:func:`restore_local` then applies what Lightning does not know about at train start.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ddlscale.ckpt.state.data import DataPosition, position_loader, position_loader_at_sample
from ddlscale.ckpt.state.rng import capture_rng, restore_rng
from ddlscale.ckpt.state.snapshot import rebuild, to_bytes
from ddlscale.ckpt.version.checksum import checksum, matches

if TYPE_CHECKING:  # decoding shards (agents, drills, tools) needs no Lightning
    import pytorch_lightning as pl

PAYLOAD_FORMAT = "ddlscale-training-state/1"
# DDLStrategy.load_model_state_dict reads the backend's per-rank state under this key.
SYNC_STATE_KEY = "ddlscale_sync"
# This rank's local state inside an assembled checkpoint dict.
RANK_STATE_KEY = "ddlscale_rank"


@dataclass(frozen=True)
class Shard:
    """One rank's serialized state."""

    rank: int
    data: bytes
    checksum: str  # "sha256:<hex>"

    @classmethod
    def encode(cls, rank: int, payload: dict[str, Any]) -> Shard:
        data = to_bytes(payload)
        return cls(rank, data, checksum(data, "sha256"))

    def decode(self) -> dict[str, Any]:
        return decode(self.data, self.checksum, f"shard of rank {self.rank}")


def decode(data: bytes, expected_checksum: str | None = None, where: str = "shard") -> dict[str, Any]:
    """The payload inside shard bytes, after checking them against ``expected_checksum`` when given."""
    if expected_checksum is not None and not matches(data, expected_checksum):
        raise ValueError(f"{where}: checksum mismatch (corrupt shard)")
    try:
        payload = rebuild(data)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    if not isinstance(payload, dict) or payload.get("format") != PAYLOAD_FORMAT:
        raise ValueError(f"{where}: not a ddlscale training-state payload")
    return payload


def capture_shared(trainer: pl.Trainer) -> dict[str, Any]:
    """Lightning's full checkpoint dict, exactly what ``trainer.save_checkpoint`` would write."""
    # The connector's dump is what save_checkpoint serializes; it runs every callback's and the
    # module's on_save_checkpoint hook, and needs no collective under data parallelism.
    return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)


def train_loaders(trainer: pl.Trainer) -> list[Any]:
    loop = trainer.fit_loop
    return loop._combined_loader.flattened if loop._combined_loader is not None else []


def data_position(trainer: pl.Trainer, batch_idx: int) -> DataPosition:
    """Where the data stands once training batch ``batch_idx`` is done, samples consumed included."""
    loaders = train_loaders(trainer)
    return DataPosition.after_batch(trainer.current_epoch, batch_idx, trainer.num_training_batches,
                                    loaders[0] if len(loaders) == 1 else None, trainer.world_size)


def unchanged_until_step(trainer: pl.Trainer) -> set[int]:
    """Storage of tensors only the optimizer step changes: parameters and optimizer state (a
    checkpoint may reference them until then; everything else it copies at capture)."""
    live = {p.data_ptr() for p in trainer.lightning_module.parameters()}
    for optimizer in trainer.optimizers:
        for state in optimizer.state.values():
            live.update(v.data_ptr() for v in state.values() if isinstance(v, torch.Tensor))
    return live


def param_sha256(module: torch.nn.Module) -> str:
    """Hash of every parameter's bytes in registration order: equal iff the models are bit-identical."""
    digest = hashlib.sha256()
    for name, p in module.named_parameters():
        digest.update(name.encode())
        digest.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def capture_local(trainer: pl.Trainer, batch_idx: int) -> dict[str, Any]:
    """This rank's own state, taken right after training batch ``batch_idx`` (at on_train_batch_end)."""
    sync = getattr(trainer.strategy, "sync", None)
    position = data_position(trainer, batch_idx)
    return {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "rng": capture_rng(),
        "data": position.to_dict(),
        "sync": sync.state_dict() if callable(getattr(sync, "state_dict", None)) else None,
    }


def capture_shard(trainer: pl.Trainer, batch_idx: int, with_shared: bool) -> Shard:
    """Serialize this rank's state now; ``with_shared`` adds the rank-shared part (one rank suffices)."""
    payload = {
        "format": PAYLOAD_FORMAT,
        "local": capture_local(trainer, batch_idx),
        "shared": capture_shared(trainer) if with_shared else None,
    }
    return Shard.encode(trainer.global_rank, payload)


def assemble(shared_payload: dict[str, Any], own_payload: dict[str, Any]) -> dict[str, Any]:
    """One rank's restorable checkpoint dict from the shared part and that rank's local part."""
    if shared_payload.get("shared") is None:
        raise ValueError("the shared payload holds no rank-shared state")
    local = own_payload["local"]
    if local["global_step"] != shared_payload["local"]["global_step"]:
        raise ValueError(
            f"shards of different steps: {shared_payload['local']['global_step']} and {local['global_step']}"
        )
    checkpoint = dict(shared_payload["shared"])
    if local["sync"] is not None:
        ranks: list[Any] = [None] * local["world_size"]  # DDLStrategy reads only its own entry
        ranks[local["rank"]] = local["sync"]
        checkpoint[SYNC_STATE_KEY] = {"world_size": local["world_size"], "ranks": ranks}
    checkpoint[RANK_STATE_KEY] = local
    return checkpoint


def restore_local(trainer: pl.Trainer, local: dict[str, Any]) -> None:
    """Resume the data position and RNG streams; call at on_train_start, after Lightning's restore.

    By then Lightning has built the train iterator (and pre-fetched a batch) from the epoch's start.
    The loader is repositioned and the iterator rebuilt. Building an iterator draws a seed from the
    global RNG: an uninterrupted run draws it at an epoch's start, right after the checkpoint point,
    so there the RNG is restored first and the rebuild draws exactly that seed; mid-epoch the
    uninterrupted run draws nothing, so the RNG is restored after the rebuild.
    """
    if local["rank"] != trainer.global_rank or local["world_size"] != trainer.world_size:
        raise RuntimeError(
            f"state of rank {local['rank']} of {local['world_size']} loaded on rank {trainer.global_rank} "
            f"of {trainer.world_size}"
        )
    position = DataPosition.from_dict(local["data"])
    loop = trainer.fit_loop
    if local.get("resharded_from") is not None:  # saved at another world size: continue at its global sample
        _position_resharded(trainer, position)
    else:
        for loader in train_loaders(trainer):
            position_loader(loader, position)
    fetcher = loop._data_fetcher
    if position.at_epoch_start:
        restore_rng(local["rng"])
        if fetcher is not None:
            iter(fetcher)
    else:
        if fetcher is not None:
            iter(fetcher)
        restore_rng(local["rng"])


def _position_resharded(trainer: pl.Trainer, position: DataPosition) -> None:
    """Continue the epoch at ``position.samples`` over this run's ranks, and count as done the
    batches this rank would have trained to get there, so the epoch ends when its samples do."""
    if position.samples is None and not position.at_epoch_start:
        raise RuntimeError("this checkpoint does not record the samples consumed mid-epoch: it can resume "
                           "only at the world size it was saved with")
    loaders = train_loaders(trainer)
    if len(loaders) != 1:
        raise RuntimeError(f"resuming at another world size needs one train loader, this run has {len(loaders)}")
    done = position_loader_at_sample(loaders[0], position.epoch, position.samples or 0)
    progress = trainer.fit_loop.epoch_loop.batch_progress
    shift = done - progress.current.ready
    for tracker in (progress.current, progress.total):
        for counter in ("ready", "started", "processed", "completed"):
            setattr(tracker, counter, getattr(tracker, counter) + shift)
