"""Writing versions of the persistent tier with DCP's stock writer, and committing them.

Asynchrony: the training thread captures the state (tensors the next iteration changes before its
optimizer step — RNG, error feedback, BatchNorm statistics — are copied; parameters and optimizer
state are referenced) and hands it to ``dcp.async_save``. DCP's stager copies the referenced tensors
to CPU buffers in a background thread while the next iteration computes; :meth:`DcpWriter.staged`,
called before that iteration's optimizer step, waits for the copy (the only wait, usually none). DCP
then writes from its own thread over a process group of its own (its plan collectives must not
interleave with training's), and rank 0 commits: hashes the files and publishes the manifest, last
and atomically. One version is in flight at a time; the next save first waits for it.
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from ddlscale import clock
from ddlscale.ckpt.disk.layout import DATA_FILE, METADATA_FILE, state_items
from ddlscale.ckpt.state.data import DataPosition
from ddlscale.ckpt.version.manifest import Manifest, ShardRecord, write_manifest
from ddlscale.ckpt.version.store import Store, open_store
from ddlscale.comm.groups import weak_group


class _PacedStream(io.RawIOBase):
    """A file whose writes take as long as ``bandwidth_bps`` allows (emulated remote storage)."""

    def __init__(self, raw: Any, bandwidth_bps: float) -> None:
        self.raw, self.bps = raw, bandwidth_bps
        self.start, self.written = clock.now(), 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        step = max(4096, int(self.bps / 8 / 20))
        for lo in range(0, len(view), step):
            self.written += self.raw.write(view[lo:lo + step])
            delay = self.start + self.written * 8 / self.bps - clock.now()
            if delay > 0:
                clock.sleep(delay)
        return len(view)

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        self.raw.flush()


class PrivateFileSystem(FileSystem):
    """DCP's file system with the version private to this user: its directory 0700, its files 0600
    (a checkpoint holds the model and the data position; nobody else on the machine reads it).
    ``bandwidth_bps``: every written file paced to that rate (emulated remote storage)."""

    def __init__(self, bandwidth_bps: float | None = None) -> None:
        self.bandwidth_bps = bandwidth_bps

    def mkdir(self, path: Any) -> None:
        Path(path).mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(path, 0o700)  # also when the directory was there (mkdir's mode is masked by the umask)

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        os.fchmod(fd, 0o600)  # a file that was there keeps its mode through O_CREAT
        with os.fdopen(fd, mode) as stream:
            yield _PacedStream(stream, self.bandwidth_bps) if self.bandwidth_bps else stream


def file_system_writer(path: Path, bandwidth_bps: float | None = None) -> dcp.FileSystemWriter:
    """DCP's stock writer as every version is written: one file per rank (the reader's shard records),
    fsynced, never over an existing version, private to this user; paced to ``bandwidth_bps`` when given."""
    writer = dcp.FileSystemWriter(path, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=False)
    writer.fs = PrivateFileSystem(bandwidth_bps)
    return writer


def storage_writer(store: Store, version_dir: str, bandwidth_bps: float | None = None) -> Any:
    """DCP's writer for one version in ``store``: :func:`file_system_writer` in a local directory, DCP's
    ``FsspecWriter`` on the storage machine (:meth:`~ddlscale.ckpt.version.remote.RemoteStore.dcp_writer`)."""
    if store.remote:
        return store.dcp_writer(version_dir)
    return file_system_writer(store.path / version_dir, bandwidth_bps)


def save_ranks(store: Store, version_dir: str, ranks: int, items_of: Callable[[int], dict[str, torch.Tensor]]) -> Any:
    """What ``dcp.save`` writes into ``version_dir`` of ``store`` when ``ranks`` processes each save their
    state dict (``items_of(r)``), written by one process holding one rank's state at a time, through the
    writer a rank of the tier would use (:func:`storage_writer`: on the storage machine, each file hashed
    as it is sent); DCP's ``Metadata``, as ``dcp.save`` returns it.

    For a launcher that holds every rank's state once the ranks are gone (:mod:`~ddlscale.ckpt.gemini.drain`).
    DCP's save is collective: each rank plans its items, the coordinator merges the plans, each rank
    writes its file, the coordinator writes ``.metadata``. ``dcp.save(no_dist=True)`` would write all
    ranks' items as one rank's file, which is not a version of ``ranks`` ranks (one data file per rank
    is what :func:`commit` records and the reader, resharding included, reads). So each step runs here
    for every rank in turn, through DCP's own planner and writer, in the order the collectives would
    run them. Plans need only each item's shape and type: they are made from meta tensors, and
    ``items_of(r)`` is asked again for rank r's bytes when its file is written, so that a model's worth
    per rank, not per job, is in memory at once.
    """
    planners = [DefaultSavePlanner() for _ in range(ranks)]
    writers = [storage_writer(store, version_dir) for _ in range(ranks)]
    plans = []
    for rank, (planner, writer) in enumerate(zip(planners, writers, strict=True)):
        shapes = {k: torch.empty_like(v, device="meta") for k, v in items_of(rank).items()}
        planner.set_up_planner(state_dict=shapes, storage_meta=writer.storage_meta(), is_coordinator=rank == 0)
        writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
        plans.append(writer.prepare_local_plan(planner.create_local_plan()))
    plans, metadata = planners[0].create_global_plan(plans)
    plans = writers[0].prepare_global_plan(plans)
    results = []
    for rank, (plan, planner, writer) in enumerate(zip(plans, planners, writers, strict=True)):
        planner.set_up_planner(state_dict=items_of(rank), storage_meta=writer.storage_meta(), is_coordinator=rank == 0)
        written = writer.write_data(planner.finish_plan(plan), planner)
        written.wait()
        results.append(written.value())
        planner.state_dict = {}  # this rank's bytes are on disk
    writers[0].finish(metadata=metadata, results=results)
    return metadata


def _file_rank(name: str) -> int:
    match = DATA_FILE.fullmatch(name)
    if match is None:
        raise RuntimeError(f"DCP wrote an unexpected file {name!r}")
    return int(match.group(1))


def commit(directory: Path | Store, version_dir: str, step: int, world_size: int, position: DataPosition,
           metadata: Any) -> Manifest:
    """Hash the version's files (on the storage machine: take the hashes their writers left), check DCP's
    index against them, publish the manifest (rank 0)."""
    store = open_store(directory)
    index: dict[str, list[Any]] = {}
    for key, info in metadata.storage_data.items():
        if getattr(info, "transform_descriptors", None):
            raise RuntimeError(f"DCP item {key.fqn} was written through stream transforms ddlscale cannot read")
        index[key.fqn] = [info.relative_path, int(info.offset), int(info.length)]
    sizes: dict[str, int] = {}
    records = []
    for name in sorted({entry[0] for entry in index.values()}):
        record = _record(store, f"{version_dir}/{name}", _file_rank(name))
        sizes[name] = record.bytes
        records.append(record)
    for item, (name, offset, length) in index.items():
        if offset < 0 or length < 0 or offset + length > sizes[name]:
            raise RuntimeError(f"DCP item {item} lies outside {name}")
    if sorted(r.rank for r in records) != list(range(world_size)):
        raise RuntimeError(f"DCP wrote files for ranks {[r.rank for r in records]}, expected one per rank")
    meta = _record(store, f"{version_dir}/{METADATA_FILE}", -1)
    store.sync(version_dir)  # the files' names are on disk before the manifest names them
    manifest = Manifest(step=step, world_size=world_size, shards=tuple(records), epoch=position.epoch,
                        batch=position.batch, layout="dcp",
                        dcp={"metadata": {"file": meta.file, "bytes": meta.bytes, "checksum": meta.checksum},
                             "index": index})
    write_manifest(store, manifest)
    return manifest


def write_version(directory: Path | str | Store, version_dir: str, step: int, ranks: int,
                  payload_of: Callable[[int], dict[str, Any]], position: DataPosition) -> Manifest:
    """Version ``step`` of ``ranks`` ranks (``payload_of(r)``: rank r's payload, the rank-shared state in
    rank 0's alone), written and committed by one process (:func:`save_ranks`, one rank at a time):
    the files the ranks' own :class:`DcpWriter` would have written, in a local directory or on the
    storage machine, and the manifest last."""
    store = open_store(directory)
    metadata = save_ranks(store, version_dir, ranks, lambda rank: state_items(payload_of(rank), rank, live=None))
    return commit(store, version_dir, step, ranks, position, metadata)


def _record(store: Store, file: str, rank: int) -> ShardRecord:
    size, checksum = store.digest(file)
    return ShardRecord(rank, file, size, checksum)


class DcpWriter:
    """Writes versions of one rank's state into ``directory`` with DCP; rank 0 commits them.

    Args:
        directory: the checkpoint directory (versions are subdirectories, manifests beside them): a path,
            or a :class:`~ddlscale.ckpt.version.store.Store` (the storage machine's).
        rank, world_size: this process's place in the job.
        asynchronous: ``dcp.async_save`` with staging in the background (True), or ``dcp.save`` on the
            calling thread (False: the synchronous baseline).
        bandwidth_bps: emulated write rate per rank (None: disk speed).
        process_group: DCP's collectives' group (a group of its own, so a save running in DCP's
            thread never interleaves with training's collectives); None without torch.distributed.
        on_commit: called on rank 0 with each committed manifest (in the committing thread).
    """

    def __init__(self, directory: Path | Store, rank: int, world_size: int, asynchronous: bool = True,
                 bandwidth_bps: float | None = None, process_group: Any = None, on_commit: Any = None) -> None:
        self.store = open_store(directory)
        self.rank, self.world_size = rank, world_size
        self.asynchronous = asynchronous
        self.bandwidth_bps = bandwidth_bps
        self._process_group = weak_group(process_group)  # c10d owns it (see ddlscale.comm.groups)
        self.on_commit = on_commit
        self.no_dist = not (dist.is_available() and dist.is_initialized())
        self._stager: DefaultStager | None = None
        self._committer: ThreadPoolExecutor | None = None
        self._staging: Future | None = None
        self._pending: Future | None = None
        self.item_bytes: list[int] = []  # this rank's bytes per version
        # Per version on this rank, seconds after its save began: "staged_s" (its tensors copied),
        # "written_s" (DCP's write done on every rank), "committed_s" (rank 0: manifest published), and
        # "waited_s", how long that save first waited for the version before it (a stall of the caller).
        self.timings: list[dict[str, float]] = []

    def save(self, step: int, version_dir: str, payload: dict[str, Any], live: set[int] | None,
             position: DataPosition) -> None:
        """Start writing version ``step`` (every rank, same step); returns once the state may change
        again — at once when asynchronous (then :meth:`staged` before the optimizer step)."""
        timing = {"step": step, "waited_s": self.wait()}
        self.timings.append(timing)
        start = clock.now()

        def done(key: str) -> Callable[[Any], None]:
            return lambda _: timing.__setitem__(key, clock.now() - start)
        items = state_items(payload, self.rank, live)
        self.item_bytes.append(sum(t.numel() * t.element_size() for t in items.values()))
        kwargs = {"storage_writer": storage_writer(self.store, version_dir, self.bandwidth_bps),
                  "process_group": self._process_group(),
                  "no_dist": self.no_dist}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*torch.distributed is disabled.*")
            if not self.asynchronous:
                metadata = dcp.save(items, **kwargs)
                done("written_s")(None)
                self._commit(step, version_dir, position, metadata)
                done("committed_s")(None)
                return
            if self._stager is None:
                cuda = any(t.is_cuda for t in items.values())
                self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                            use_async_staging=True, use_non_blocking_copy=cuda))
                self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddlscale-dcp-commit")
            response = dcp.async_save(items, async_stager=self._stager, **kwargs)
        response.staging_completion.add_done_callback(done("staged_s"))
        response.upload_completion.add_done_callback(done("written_s"))
        self._staging = response.staging_completion
        self._pending = self._committer.submit(self._finish, response.upload_completion, step, version_dir, position)
        self._pending.add_done_callback(done("committed_s"))

    def _finish(self, upload: Future, step: int, version_dir: str, position: DataPosition) -> None:
        self._commit(step, version_dir, position, upload.result())

    def _commit(self, step: int, version_dir: str, position: DataPosition, metadata: Any) -> None:
        if self.rank != 0:
            return
        manifest = commit(self.store, version_dir, step, self.world_size, position, metadata)
        if self.on_commit is not None:
            self.on_commit(manifest)

    def staged(self) -> float:
        """Wait until the last version's tensors are copied (call before the optimizer step); seconds waited."""
        if self._staging is None:
            return 0.0
        start = clock.now()
        staging, self._staging = self._staging, None
        staging.result()
        return clock.now() - start

    def wait(self) -> float:
        """Wait until the version in flight is written (and on rank 0 committed); seconds waited. Raises
        what writing it raised."""
        start = clock.now()
        self.staged()
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()
        return clock.now() - start

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            if self._committer is not None:
                self._committer.shutdown(wait=True)
                self._committer = None
