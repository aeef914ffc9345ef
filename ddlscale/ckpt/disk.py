"""``ckpt=disk``: the persistent baseline — every K steps, every rank writes its shard, rank 0 commits.

One version, step s:

1. every rank serializes its state (:func:`~ddlscale.ckpt.state.capture_shard`; rank 0 adds the
   rank-shared part) and writes ``step_s.<token>/rank_r.ckpt`` atomically, at ``bandwidth`` if set;
2. the ranks exchange (file, size, checksum);
3. rank 0 writes the manifest atomically — the version now exists — and prunes all but the newest
   ``keep`` versions (and files no manifest names: leftovers of crashed writes).

Resuming (``ckpt.resume=auto``) takes the newest version whose every shard verifies; a version that
fails is reported by file name, set aside (its manifest renamed ``*.rejected``) and the previous one
is tried. Decided once, before workers start, so every rank loads the same version.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch.distributed as dist

from ddlscale.ckpt.base import PROGRESS_FILE, Checkpointer
from ddlscale.ckpt.data import DataPosition
from ddlscale.ckpt.io import load_version
from ddlscale.ckpt.manifest import (
    REJECTED_SUFFIX,
    SUFFIX,
    Manifest,
    ManifestError,
    ShardRecord,
    list_manifests,
    read_manifest,
    step_of,
    verify,
    write_manifest,
)
from ddlscale.ckpt.state import capture_shard
from ddlscale.ckpt.storage import write_atomic
from ddlscale.comm.cost import parse_bandwidth

DEFAULT_SUBDIR = "checkpoints"


def find_resumable(directory: Path, world_size: int, set_aside: bool = True) -> Path | None:
    """The newest manifest in ``directory`` whose version verifies, or None.

    Versions that fail (unreadable manifest, missing or corrupt shard) are warned about by file name
    and, with ``set_aside``, their manifests renamed so no later run considers them again.
    """
    for path in list_manifests(directory):
        try:
            manifest = read_manifest(path)
            if manifest.world_size != world_size:
                raise ValueError(
                    f"ckpt.resume: {path} holds {manifest.world_size} ranks, this run has {world_size}; "
                    "resume with the same trainer.devices x trainer.num_nodes"
                )
            verify(directory, manifest)
            return path
        except ManifestError as exc:
            warnings.warn(f"ckpt: skipping checkpoint step {step_of(path)}: {exc}", stacklevel=2)
            if set_aside:
                path.replace(path.with_name(path.name + REJECTED_SUFFIX))
    return None


def write_rate(bandwidth: str | float | None, key: str = "ckpt.bandwidth") -> float | None:
    """Bits per second of an emulated write rate (None: full speed); a bad value names ``key``."""
    if bandwidth is None:
        return None
    try:
        bps = parse_bandwidth(bandwidth)
    except ValueError as exc:
        raise ValueError(f"{key}: {exc}") from None
    if bps == 0:
        raise ValueError(f"{key} must be > 0 (or null for no limit)")
    return bps


class DiskCheckpointer(Checkpointer):
    """Atomic, checksummed, sharded checkpoints to a directory (local disk or a mounted store).

    Args:
        every: optimizer steps between checkpoints, or ``"highfreq"`` (K = ceil(t_ckpt / T_iter)).
        dir: checkpoint directory; None means ``<run dir>/checkpoints``.
        keep: complete versions to keep (older ones are deleted after each commit).
        bandwidth: write rate per rank to emulate remote storage, e.g. ``"200mbit"``; None: full speed.
        resume: None (fresh; refused if ``dir`` already holds checkpoints), ``"auto"`` (newest verified
            version; fresh if none) or the path of a ``*.manifest.json``.
        run_dir: the run's directory (set by the app).

    In Python, outside ``train.py``: ``trainer.fit(model, ckpt_path=checkpointer.resume_path(trainer.world_size))``.
    """

    def __init__(self, every: int | str = 10, dir: str | None = None, keep: int = 3, bandwidth: str | float | None = None,
                 resume: str | None = None, run_dir: str | None = None) -> None:
        super().__init__(every=every, resume=resume)
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"ckpt.keep must be an integer >= 1, got {keep!r}")
        self.keep = keep
        self.bandwidth_bps = write_rate(bandwidth)
        if dir is None and run_dir is None:
            self.dir: Path | None = None  # only validating a config: no run yet
        else:
            self.dir = Path(dir) if dir is not None else Path(run_dir) / DEFAULT_SUBDIR
        if run_dir is not None:
            self.progress_path = Path(run_dir) / PROGRESS_FILE
        self.bytes_written: list[int] = []
        self._token: str | None = None
        self._rank = 0

    # -- before workers start ------------------------------------------------------------------
    def resume_path(self, world_size: int) -> str | None:
        directory = self._directory()
        if self.resume is None:
            existing = list_manifests(directory)
            if existing:
                raise ValueError(
                    f"ckpt.dir {directory} already holds checkpoints (newest: {existing[0].name}); set "
                    "ckpt.resume=auto to continue from them, or choose another ckpt.dir or run directory"
                )
            return None
        if self.resume == "auto":
            # Under torchrun every rank resolves; only rank 0 renames rejected versions.
            found = find_resumable(directory, world_size, set_aside=os.environ.get("RANK", "0") == "0")
            if found is None:
                print(f"ckpt: no complete checkpoint in {directory}; starting from scratch", flush=True)
            return str(found) if found is not None else None
        return str(self._check_explicit(Path(self.resume), world_size))

    def _check_explicit(self, path: Path, world_size: int) -> Path:
        try:
            manifest = read_manifest(path)
            verify(path.parent, manifest)
        except ManifestError as exc:
            raise ValueError(f"ckpt.resume: {exc}") from None
        if manifest.world_size != world_size:
            raise ValueError(f"ckpt.resume: {path} holds {manifest.world_size} ranks, this run has {world_size}")
        if path.parent.resolve() == self._directory().resolve():
            newer = [p for p in list_manifests(path.parent) if (step_of(p) or 0) > manifest.step]
            if newer:
                raise ValueError(
                    f"ckpt.resume: {path.name} is older than {newer[0].name} in the same ckpt.dir; continuing "
                    "from it would overwrite that history: set ckpt.dir to another directory"
                )
        return path

    def _directory(self) -> Path:
        if self.dir is None:
            raise ValueError("ckpt.dir: no directory (set ckpt.dir, or pass run_dir)")
        return self.dir

    # -- in the workers ------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._directory().mkdir(parents=True, exist_ok=True)
        # One token per run, the same on every rank: this run's shard files never collide with
        # files an existing manifest names.
        self._token = trainer.strategy.broadcast(uuid.uuid4().hex[:8], src=0)
        self._rank = trainer.global_rank

    def save(self, trainer: pl.Trainer, batch_idx: int) -> None:
        directory = self._directory()
        step, rank = trainer.global_step, trainer.global_rank
        shard = capture_shard(trainer, batch_idx, with_shared=rank == 0)
        shard_dir = f"step_{step:09d}.{self._token}"
        (directory / shard_dir).mkdir(exist_ok=True)
        record = ShardRecord(rank, f"{shard_dir}/rank_{rank:05d}.ckpt", len(shard.data), shard.checksum)
        write_atomic(directory / record.file, shard.data, self.bandwidth_bps)
        records = [record]
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            gathered: list[Any] = [None] * trainer.world_size
            dist.all_gather_object(gathered, record)
            records = gathered
        self.bytes_written.append(sum(r.bytes for r in records))
        if rank != 0:
            return
        position = DataPosition.after_batch(trainer.current_epoch, batch_idx, trainer.num_training_batches)
        manifest = Manifest(step=step, world_size=trainer.world_size, shards=tuple(sorted(records, key=lambda r: r.rank)),
                            epoch=position.epoch, batch=position.batch)
        write_manifest(directory, manifest)
        self.prune()

    def load_path(self, path: str) -> dict[str, Any] | None:
        """Manifests read back at ``bandwidth`` (remote storage is slow both ways); timed for the summary."""
        if not path.endswith(SUFFIX):
            return None
        start = time.perf_counter()
        loaded = load_version(Path(path), self._rank, self.bandwidth_bps)
        self.recovery = {"source": "persistent", "retrieve_s": time.perf_counter() - start, "tier": "disk"}
        return loaded

    def prune(self) -> None:
        """Keep the newest ``keep`` versions; delete older ones and files no manifest names."""
        directory = self._directory()
        manifests = list_manifests(directory)
        for old in manifests[self.keep:]:
            old.unlink(missing_ok=True)  # the version ceases to exist before its files go
        named: set[str] = set()
        for path in manifests[: self.keep]:
            try:
                named.update(r.file.split("/")[0] for r in read_manifest(path).shards)
            except ManifestError:
                continue
        for entry in directory.iterdir():
            ours = entry.name.startswith("step_") or entry.name.startswith(".step_")
            if not ours or entry.name.endswith(REJECTED_SUFFIX) or step_of(entry) is not None or entry.name in named:
                continue
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)

    def figures(self, trainer: pl.Trainer) -> dict[str, Any]:
        return {
            "ckpt_bytes": self.bytes_written[-1] if self.bytes_written else None,
            "ckpt_dir": str(self.dir),
            "ckpt_bandwidth_bps": self.bandwidth_bps,
        }
