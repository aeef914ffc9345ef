"""``ckpt=disk``: the persistent tier — every K steps a torch.distributed.checkpoint (DCP) version.

One version, step s (:mod:`~ddlscale.ckpt.disk.layout`):

1. every rank captures its state (rank 0 adds the rank-shared part) and hands it to DCP's
   ``async_save`` (``async_save: false``: ``dcp.save`` on the training thread), which writes the
   DCP directory ``step_s.<token>/`` (one file per rank, at ``bandwidth`` if set) from its own thread;
2. rank 0, once DCP reports every rank's file written, hashes the files and writes the manifest
   atomically — the version now exists — and prunes all but the newest ``keep`` versions (and
   directories no manifest names: leftovers of crashed writes).

Resuming (``ckpt.resume=auto``) takes the newest version whose every file verifies; a version that
fails is reported by file name, set aside (its manifest renamed ``*.rejected``) and the previous one
is tried. Decided once, before workers start, so every rank loads the same version. A version saved
at another world size is resumed there too (:mod:`~ddlscale.ckpt.state.reshard`).
"""

from __future__ import annotations

import os
import re
import uuid
import warnings
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch.distributed as dist

from ddlscale import clock
from ddlscale.ckpt.checkpointer import PROGRESS_FILE, Checkpointer
from ddlscale.ckpt.disk.disk_config import DiskConfig, write_rate
from ddlscale.ckpt.disk.writer import DcpWriter
from ddlscale.ckpt.state.shard import (
    PAYLOAD_FORMAT,
    capture_local,
    capture_shared,
    data_position,
    unchanged_until_step,
)
from ddlscale.ckpt.version.io import load_version
from ddlscale.ckpt.version.manifest import (
    REJECTED_SUFFIX,
    SUFFIX,
    Manifest,
    ManifestError,
    manifest_names,
    read_manifest,
    step_of,
    verify,
)
from ddlscale.ckpt.version.store import SCHEME, Store, locate, open_store, storage_root
from ddlscale.cluster.context import Launch
from ddlscale.cluster.storage_client import StorageEndpoint

DEFAULT_SUBDIR = "checkpoints"
# A DCP collective waiting longer than this for a peer fails the save instead of holding the process
# (a peer that died mid-save) for gloo's default 30 minutes.
DCP_TIMEOUT_S = 300
# A save that first waits longer than this for the version before it says so, with that version's timings:
# the write outlasted the interval (or hung), and the stall would otherwise show only as one long step.
STALL_NOTE_S = 5.0


def checkpoint_dir(given: str | Path | None, run_dir: str | Path | None, on_storage: str = DEFAULT_SUBDIR,
                   storage: bool | None = None) -> Path | str | None:
    """Where a tier's versions go: ``given`` (a path; a ``storage://<path>`` stays a string, which a Path
    would fold to ``storage:/``); else ``storage://<on_storage>`` where a storage machine serves the run
    (``storage``; None: whether the launcher handed this process its endpoint — a launching process has
    none in its environment and says so through ``storage``), else ``<run dir>/checkpoints`` (None
    without a run directory)."""
    if given is not None:
        return str(given) if str(given).startswith(SCHEME) else Path(given)
    if storage is None:
        storage = StorageEndpoint.from_env() is not None
    if storage:
        return SCHEME + on_storage
    return Path(run_dir) / DEFAULT_SUBDIR if run_dir is not None else None


def check_storage(given: str | Path | None, bandwidth_bps: float | None, launch: Launch, dir_key: str = "ckpt.dir",
                  bandwidth_key: str = "ckpt.bandwidth") -> None:
    """Before any worker starts: a ``storage://`` directory (``given``, or the default where the launch has
    a storage machine) needs the emulated cluster's storage machine, a path under its root, and no
    emulated write rate: the storage link sets the rate there. Errors name ``dir_key`` / ``bandwidth_key``."""
    directory = checkpoint_dir(given, None, storage=launch.storage)
    if not isinstance(directory, str):
        return
    if not launch.storage:
        raise ValueError(f"{dir_key}={given}: a directory on the emulated cluster's storage machine, "
                         "which this launch has none of (cluster=emulated cluster.storage.bandwidth=<rate>)")
    storage_root(directory, dir_key)
    if bandwidth_bps:
        raise ValueError(f"{bandwidth_key} paces writes to a local directory; the storage machine's own link "
                         f"(cluster.storage.bandwidth) paces the persistent tier there: set {bandwidth_key}=null")


def find_resumable(directory: Path | str | Store, world_size: int, set_aside: bool = True) -> Path | str | None:
    """The newest manifest in ``directory`` whose version verifies (its path, or ``storage://`` name), or None.

    Versions that fail (unreadable manifest, missing or corrupt file) are warned about by file name
    and, with ``set_aside``, their manifests renamed so no later run considers them again. A version
    of another world size than ``world_size`` counts (it is resharded on loading), said once.
    """
    store = open_store(directory)
    for name in manifest_names(store):
        path = store.locator(name)
        try:
            manifest = read_manifest(path)
            verify(store, manifest)
        except ManifestError as exc:
            warnings.warn(f"ckpt: skipping checkpoint step {step_of(name)}: {exc}", stacklevel=2)
            if set_aside:
                store.rename(name, name + REJECTED_SUFFIX)
            continue
        if manifest.world_size != world_size and os.environ.get("RANK", "0") == "0":
            print(f"ckpt: {name} was saved by {manifest.world_size} workers; resuming on {world_size} "
                  "(parameters and optimizer state as saved, data from the same global sample, sync state merged)",
                  flush=True)
        return path
    return None


class DiskCheckpointer(Checkpointer):
    """Atomic, checksummed, sharded checkpoints to a directory: of this machine, or on the emulated
    cluster's storage machine (:mod:`ddlscale.cluster.storage`), written there over the network.

    Args:
        every: optimizer steps between checkpoints, or ``"highfreq"`` (K = ceil(t_ckpt / T_iter)).
        dir: checkpoint directory: a path, or ``storage://<path>`` on the storage machine. None means
            ``<run dir>/checkpoints``, or ``storage://checkpoints`` where a storage machine serves the
            run (``cluster=emulated cluster.storage.bandwidth=<rate>``).
        keep: complete versions to keep (older ones are deleted after each commit).
        bandwidth: write rate per rank to emulate remote storage on a local directory, e.g. ``"200mbit"``;
            None: full speed. Refused with the storage machine, whose own link sets the rate.
        async_save: write with DCP's ``async_save`` off the training thread (True), or with ``dcp.save``
            on it (False).
        resume: None (fresh; refused if ``dir`` already holds checkpoints), ``"auto"`` (newest verified
            version; fresh if none) or the path of a ``*.manifest.json``.
        run_dir: the run's directory (set by the app).

    In Python, outside ``train.py``: ``trainer.fit(model, ckpt_path=checkpointer.resume_path(trainer.world_size))``.
    """

    schema = DiskConfig  # its keys and their checks

    def __init__(self, every: int | str = 10, dir: str | None = None, keep: int = 3, bandwidth: str | float | None = None,
                 resume: str | None = None, run_dir: str | None = None, async_save: bool = True) -> None:
        DiskConfig(every=every, dir=dir, keep=keep, bandwidth=bandwidth, resume=resume,
                   async_save=async_save)  # refuses what no run can use
        super().__init__(every=every, resume=resume)
        self.keep = keep
        self.async_save = async_save
        self.bandwidth_bps = write_rate(bandwidth)
        self.dir = checkpoint_dir(dir, run_dir)  # None: no run yet
        self._store: Store | None = None
        self._dir_given = dir
        if run_dir is not None:
            self.progress_path = Path(run_dir) / PROGRESS_FILE
        self.bytes_written: list[int] = []  # rank 0: each committed version's bytes
        self.writer: DcpWriter | None = None
        self.write_timings: list[dict[str, float]] = []  # the writer's, kept past its teardown for the summary
        self._token: str | None = None
        self._rank = 0
        self._world_size = 1

    # -- before workers start ------------------------------------------------------------------
    def resume_path(self, world_size: int) -> str | None:
        directory = self._directory()
        if self.resume is None:
            existing = manifest_names(directory)
            if existing:
                raise ValueError(
                    f"ckpt.dir {directory} already holds checkpoints (newest: {existing[0]}); set "
                    "ckpt.resume=auto to continue from them, or choose another ckpt.dir or run directory"
                )
            return None
        if self.resume == "auto":
            # Under torchrun every rank resolves; only rank 0 renames rejected versions.
            found = find_resumable(directory, world_size, set_aside=os.environ.get("RANK", "0") == "0")
            if found is None:
                print(f"ckpt: no complete checkpoint in {directory}; starting from scratch", flush=True)
            return str(found) if found is not None else None
        return str(self._check_explicit(self.resume, world_size))

    def _check_explicit(self, path: str, world_size: int) -> Path | str:
        try:
            store, name = locate(path)
        except ValueError as exc:
            raise ValueError(f"ckpt.resume: {exc}") from None
        try:
            manifest = read_manifest(store.locator(name))
            verify(store, manifest)
        except ManifestError as exc:
            raise ValueError(f"ckpt.resume: {exc}") from None
        if store.same(self._directory()):
            newer = [n for n in manifest_names(store) if (step_of(n) or 0) > manifest.step]
            if newer:
                raise ValueError(
                    f"ckpt.resume: {name} is older than {newer[0]} in the same ckpt.dir; continuing "
                    "from it would overwrite that history: set ckpt.dir to another directory"
                )
        return store.locator(name)

    def _directory(self) -> Store:
        """The checkpoint directory's store (opened once: on the storage machine, a client)."""
        if self._store is None:
            if self.dir is None:
                raise ValueError("ckpt.dir: no directory (set ckpt.dir, or pass run_dir)")
            self._store = open_store(self.dir)
            if self._store.remote and self.bandwidth_bps:
                raise ValueError(f"ckpt.bandwidth paces writes to a local directory; ckpt.dir={self.dir} is written "
                                 "over the storage machine's own link (cluster.storage.bandwidth): set ckpt.bandwidth=null")
        return self._store

    def validate_launch(self, launch: Launch) -> None:
        """``storage://`` needs the emulated cluster's storage machine; its link, not ckpt.bandwidth, paces it."""
        check_storage(self._dir_given, self.bandwidth_bps, launch)

    # -- in the workers ------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._directory().make()
        # One token per run, the same on every rank: this run's version directories never collide with
        # ones an existing manifest names.
        self._token = trainer.strategy.broadcast(uuid.uuid4().hex[:8], src=0)
        self._rank, self._world_size = trainer.global_rank, trainer.world_size
        group = None
        if dist.is_available() and dist.is_initialized():
            # DCP's own group: its plan collectives run in DCP's thread, beside training's.
            group = dist.new_group(backend="gloo", timeout=clock.wall_timeout(DCP_TIMEOUT_S))
        self.writer = DcpWriter(self._directory(), self._rank, trainer.world_size, self.async_save, self.bandwidth_bps,
                                group, on_commit=self._committed)
        self.write_timings = self.writer.timings

    def save(self, trainer: pl.Trainer, batch_idx: int) -> None:
        step, rank = trainer.global_step, trainer.global_rank
        payload = {"format": PAYLOAD_FORMAT, "local": capture_local(trainer, batch_idx),
                   "shared": capture_shared(trainer) if rank == 0 else None}
        live = unchanged_until_step(trainer) if self.async_save else None
        self.writer.save(step, f"step_{step:09d}.{self._token}", payload, live, data_position(trainer, batch_idx))
        self._note_stall(rank)

    def written_seconds(self) -> float | None:
        """The newest version's save until its manifest was published (rank 0) or its files were written."""
        return self.write_timings[-1].get("committed_s") if self.write_timings else None

    def _note_stall(self, rank: int) -> None:
        timings = self.write_timings
        if len(timings) < 2 or timings[-1]["waited_s"] <= STALL_NOTE_S:
            return
        previous = timings[-2]
        phases = ", ".join(f"{name} after {previous[key]:.1f} s" for name, key in
                           (("staged", "staged_s"), ("written", "written_s"), ("committed", "committed_s"))
                           if key in previous)
        print(f"ckpt: rank {rank} step {timings[-1]['step']}: training waited {timings[-1]['waited_s']:.1f} s for "
              f"step {previous['step']}'s version to be written ({phases}; every {self.interval} steps)", flush=True)

    def _committed(self, manifest: Manifest) -> None:
        """Rank 0, in the committing thread: a version exists; keep only the newest ``keep``."""
        self.bytes_written.append(sum(r.bytes for r in manifest.files))
        self.prune()

    def before_optimizer_step(self) -> float:
        """The optimizer is about to change what the last version references: wait for its copy;
        the seconds waited (a stall on the training thread, counted with the save)."""
        waited = self.writer.staged() if self.writer is not None and self.async_save else 0.0
        if self.times and waited:
            self.times[-1] += waited
        return waited

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.before_optimizer_step()

    def finish(self) -> None:
        """Wait for the version in flight to be written and committed (at train end, before the summary)."""
        if self.writer is not None:
            self.writer.wait()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.finish()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.writer is not None:
            writer, self.writer = self.writer, None
            writer.close()

    def load_path(self, path: str) -> dict[str, Any] | None:
        """Manifests read back at ``bandwidth`` (remote storage is slow both ways); timed for the summary."""
        if not path.endswith(SUFFIX):
            return None
        start = clock.now()
        loaded = load_version(path, self._rank, self.bandwidth_bps, self._world_size)
        self.recovery = {"source": "persistent", "retrieve_s": clock.now() - start, "tier": "disk"}
        return loaded

    def prune(self) -> None:
        """Keep the newest ``keep`` versions; delete older ones and files no manifest names, except this
        run's version past the newest manifest: another rank may already be writing it (rank 0 prunes
        after committing step N, when a rank that finished its part of N can be saving the next)."""
        store = self._directory()
        manifests = manifest_names(store)
        newest = step_of(manifests[0]) if manifests else -1
        in_flight = re.compile(rf"step_(\d{{9}})\.{re.escape(self._token)}\b") if self._token else None
        for old in manifests[self.keep:]:
            store.remove(old)  # the version ceases to exist before its files go
        named: set[str] = set()
        for name in manifests[: self.keep]:
            try:
                named.update(r.file.split("/")[0] for r in read_manifest(store.locator(name)).shards)
            except ManifestError:
                continue
        for entry in store.names():
            ours = entry.startswith("step_") or entry.startswith(".step_")
            if not ours or entry.endswith(REJECTED_SUFFIX) or step_of(entry) is not None or entry in named:
                continue
            if in_flight and (match := in_flight.match(entry.lstrip("."))) and int(match.group(1)) > newest:
                continue
            store.remove(entry)

    def persisted_dir(self) -> Path | None:
        return self.dir if isinstance(self.dir, Path) else None  # a storage machine's went with it

    def local_figures(self, trainer: pl.Trainer) -> dict[str, Any]:
        written = sorted(t["written_s"] for t in self.write_timings if "written_s" in t)
        return {
            "ckpt_bytes": self.bytes_written[-1] if self.bytes_written else None,
            "ckpt_write_s_median": written[len(written) // 2] if written else None,
            "ckpt_write_s_max": written[-1] if written else None,
            "ckpt_dir": str(self.dir),
            "ckpt_bandwidth_bps": self.bandwidth_bps,
        }
