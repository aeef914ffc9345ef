"""Lightning reads a committed version through its CheckpointIO plugin point.

``trainer.fit(ckpt_path=<manifest>)`` makes every rank call ``strategy.load_checkpoint(path)``; this
plugin answers with that rank's assembled state (the shared part from the shared shard, the local
part from its own shard, both checksum-verified). A tier that keeps no files (Gemini's peer memory)
answers its own paths through ``loader``. Any other path goes to the wrapped plugin, so ordinary
``.ckpt`` files keep working.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_fabric.plugins import CheckpointIO

from ddlscale.ckpt.manifest import SUFFIX, read_manifest, read_shard
from ddlscale.ckpt.state import assemble, decode
from ddlscale.ckpt.storage import pace


def load_version(manifest_path: Path, rank: int, bandwidth_bps: float | None = None) -> dict[str, Any]:
    """Rank ``rank``'s restorable checkpoint dict from the version ``manifest_path`` commits, read at
    most at ``bandwidth_bps`` when given (emulated remote storage)."""
    start = time.perf_counter()
    manifest_path = Path(manifest_path)
    manifest = read_manifest(manifest_path)
    if not 0 <= rank < manifest.world_size:
        raise RuntimeError(
            f"{manifest_path}: checkpoint of {manifest.world_size} ranks cannot restore rank {rank}; "
            "resume with the same number of workers"
        )
    directory = manifest_path.parent
    records = {r: manifest.shard(r) for r in {rank, manifest.shared_rank}}
    payloads = {r: decode(read_shard(directory, rec), where=str(directory / rec.file))  # read_shard verified it
                for r, rec in records.items()}
    pace(sum(rec.bytes for rec in records.values()), bandwidth_bps, start)
    return assemble(payloads[manifest.shared_rank], payloads[rank])


class ManifestCheckpointIO(CheckpointIO):
    """Loads ``*.manifest.json`` versions for ``rank``; delegates everything else to ``inner``.

    ``loader(path)``: a tier's own loader, asked first; it returns None for paths that are not its.
    """

    def __init__(self, inner: CheckpointIO, rank: int, loader: Callable[[str], dict[str, Any] | None] | None = None) -> None:
        self.inner = inner
        self.rank = rank
        self.loader = loader

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        if self.loader is not None and (loaded := self.loader(str(path))) is not None:
            return loaded
        if str(path).endswith(SUFFIX):
            return load_version(Path(path), self.rank)
        kwargs = {} if map_location is None else {"map_location": map_location}
        return self.inner.load_checkpoint(path, weights_only=weights_only, **kwargs)

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()
