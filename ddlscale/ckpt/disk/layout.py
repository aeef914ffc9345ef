"""How a version of the persistent tier is laid out in torch.distributed.checkpoint (DCP) format, and what
its items are called. Written by DCP (:mod:`~ddlscale.ckpt.disk.writer`), read without unpickling
(:mod:`~ddlscale.ckpt.disk.reader`).

A version is one DCP checkpoint directory, written by DCP's stock ``FileSystemWriter`` through
``dcp.async_save`` (or ``dcp.save``; a Gemini launch's last in-memory version, drained when the launch
ends, through :func:`~ddlscale.ckpt.disk.writer.save_ranks`), plus ddlscale's commit record beside it
(:mod:`~ddlscale.ckpt.version.manifest`, ``layout: dcp``)::

    step_000000012.manifest.json          the commit record: per-file sha256, the item index
    step_000000012.<token>/.metadata      DCP's own index (written by DCP, for DCP's tools)
    step_000000012.<token>/__<r>_0.distcp rank r's items

Items (DCP's fully qualified names): ``model.<name>`` (the LightningModule's state dict),
``optimizer.<i>.state.<id>.<key>`` (optimizer i), ``trainer.<path>`` (other tensors of Lightning's
checkpoint), ``rank<r>.<path>`` (rank r's own state: RNG, sync-backend state such as error feedback)
and ``ddlscale.rank<r>``: rank r's JSON skeleton as uint8 — everything that is not a tensor (loop
counters, hyper-parameters, param groups, the data position) and where each item goes back. Rank 0
writes the rank-shared state, every rank its own. So DCP's own tools load the model with nothing
from ddlscale::

    dcp.load({"model": module.state_dict()}, checkpoint_id="<ckpt dir>/step_000000012.<token>")
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from ddlscale.ckpt.state.snapshot import TAG, encode

SKELETON_FORMAT = "ddlscale-dcp-rank/1"
METADATA_FILE = ".metadata"  # DCP's name for its (pickled) index
DATA_FILE = re.compile(r"__(\d+)_\d+\.distcp")


def skeleton_item(rank: int) -> str:
    return f"ddlscale.rank{rank}"


# -- naming the items --------------------------------------------------------------------------------
def _segment_paths(node: Any, path: tuple[str, ...], out: dict[int, tuple[str, ...]]) -> None:
    """Walk a snapshot skeleton; record the path of every segment (tensor or array) by its index."""
    if isinstance(node, list):
        for i, value in enumerate(node):
            _segment_paths(value, (*path, str(i)), out)
        return
    if not isinstance(node, dict):
        return
    tag = node.get(TAG)
    if tag in ("tensor", "ndarray") and "segment" in node:
        out[node["segment"]] = path
    elif tag in ("dict", "odict"):
        for key, value in node["items"]:
            _segment_paths(value, (*path, key if isinstance(key, str) else json.dumps(key)), out)
    elif tag == "tuple":
        _segment_paths(node["items"], path, out)
    else:
        for key, value in node.items():
            if key != TAG:
                _segment_paths(value, (*path, key), out)


def _item_name(path: tuple[str, ...], rank: int) -> str:
    """DCP's name for a payload path: the model and optimizers under the names users load them by."""
    if path[:2] == ("shared", "state_dict"):
        return ".".join(("model", *path[2:]))
    if path[:2] == ("shared", "optimizer_states"):
        return ".".join(("optimizer", *path[2:]))
    if path[0] == "shared":
        return ".".join(("trainer", *path[1:]))
    return ".".join((f"rank{rank}", *path[1:]))


def _owning(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when it is its whole storage (what the reader expects of an item), else a copy."""
    whole = tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    return tensor if whole and tensor.is_contiguous() else tensor.clone(memory_format=torch.contiguous_format)


def state_items(payload: dict[str, Any], rank: int, live: set[int] | None) -> dict[str, torch.Tensor]:
    """The DCP state dict of one rank's payload (``{"local", "shared"}`` as :mod:`~ddlscale.ckpt.state.shard`
    builds it): its tensors by name, and its skeleton. ``live`` as :func:`~ddlscale.ckpt.state.snapshot.capture`:
    tensors unchanged until the optimizer step are referenced, the others copied now."""
    skeleton, tensors = encode(payload, live, inline_bytes=1)  # only empty tensors inline: DCP's tools see all
    paths: dict[int, tuple[str, ...]] = {}
    _segment_paths(skeleton, (), paths)
    names: list[str] = []
    seen: set[str] = set()
    for index in range(len(tensors)):
        name = _item_name(paths[index], rank)
        if name in seen:  # two payload paths that join to one dotted name: keep both, distinctly
            name = f"{name}#{index}"
        seen.add(name)
        names.append(name)
    items = {name: _owning(t) for name, t in zip(names, tensors, strict=True)}
    record = {"format": SKELETON_FORMAT, "rank": rank, "segments": names, "skeleton": skeleton}
    items[skeleton_item(rank)] = torch.frombuffer(bytearray(json.dumps(record, separators=(",", ":")).encode()),
                                                  dtype=torch.uint8)
    return items
