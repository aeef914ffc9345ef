"""A training-state payload as a byte stream that can be sent without first copying it.

``torch.save`` of a whole state copies every tensor into one buffer before a byte leaves. Gemini
instead sends parameters and optimizer state straight from where they live, chunk by chunk, while
the next iteration computes: they change only at that iteration's optimizer step, and the sender
finishes before it. Everything else that the next iteration mutates earlier (BatchNorm statistics in
forward, error feedback in backward, RNG, loop counters) is copied at capture.

A :class:`Snapshot` is therefore a small ``skeleton`` (the payload with each large tensor replaced by
a :class:`TensorSlot` and each small one by an :class:`InlineTensor`, pickled) followed by the
tensors' raw bytes in order. :func:`rebuild` turns the received stream back into the payload, bit
for bit.
"""

from __future__ import annotations

import copy
import pickle
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

MAGIC = b"DDLSNAP2"
_HEADER = struct.Struct("<8sQ")  # magic, skeleton length
# Tensors smaller than this (scalars: step counters) stay inside the pickled skeleton; anything larger is a
# segment, since pickling tensor data into the skeleton costs more on every capture than the segment.
INLINE_BYTES = 64


@dataclass(frozen=True)
class TensorSlot:
    """Where a tensor was: its index among the snapshot's segments, dtype and shape."""

    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class InlineTensor:
    """A small tensor inside the skeleton as plain bytes: pickling a torch tensor costs ~20 us, this ~1 us,
    and an optimizer holds one step counter per parameter."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    data: bytes

    @classmethod
    def of(cls, tensor: torch.Tensor) -> InlineTensor:
        flat = tensor.detach().cpu().reshape(-1)
        return cls(tensor.dtype, tuple(tensor.shape), flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")

    def tensor(self) -> torch.Tensor:
        if not self.data:
            return torch.empty(self.shape, dtype=self.dtype)
        return torch.frombuffer(bytearray(self.data), dtype=torch.uint8).view(self.dtype).reshape(self.shape)


class Snapshot:
    """``header + skeleton + tensor bytes``; ``segments`` are contiguous tensors (possibly on a GPU)."""

    def __init__(self, skeleton: bytes, tensors: list[torch.Tensor]) -> None:
        head = _HEADER.pack(MAGIC, len(skeleton)) + skeleton
        self.head = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        self.tensors = tensors
        self.sizes = [len(head)] + [t.numel() * t.element_size() for t in tensors]
        self.nbytes = sum(self.sizes)

    def pieces(self, offset: int, length: int) -> Iterator[torch.Tensor]:
        """uint8 views covering bytes ``[offset, offset + length)`` of the stream, in order."""
        position = 0
        end = offset + length
        for index, size in enumerate(self.sizes):
            lo, hi = max(offset, position), min(end, position + size)
            if lo < hi:
                yield self._bytes_of(index)[lo - position:hi - position]
            position += size
            if position >= end:
                return

    def _bytes_of(self, index: int) -> torch.Tensor:
        return self.head if index == 0 else self.tensors[index - 1].reshape(-1).view(torch.uint8)

    def to_bytes(self) -> bytes:
        """The whole stream in one buffer (tests, and the blocking path's checksum reference)."""
        out = bytearray(self.nbytes)
        view = memoryview(out)
        position = 0
        for piece in self.pieces(0, self.nbytes):
            n = piece.numel()
            view[position:position + n] = piece.cpu().numpy().tobytes()
            position += n
        return bytes(out)


def _map_leaves(obj: Any, fn: Any) -> Any:
    """``obj`` with ``fn`` applied to every leaf inside dicts, lists and plain tuples, keeping each
    container's type (OrderedDict, defaultdict...); named tuples and other objects are leaves."""
    if isinstance(obj, dict):
        out = copy.copy(obj)
        for key, value in obj.items():
            out[key] = _map_leaves(value, fn)
        return out
    if isinstance(obj, list):
        return [_map_leaves(v, fn) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_map_leaves(v, fn) for v in obj)
    return fn(obj)


def capture(payload: Any, live: set[int]) -> Snapshot:
    """Snapshot ``payload``; tensors whose storage pointer is in ``live`` are referenced, others copied.

    ``live``: ``data_ptr()`` of tensors that stay unchanged until the send completes (parameters and
    optimizer state). Small tensors and non-strided ones stay inside the pickled skeleton.
    """
    tensors: list[torch.Tensor] = []

    def strip(obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return obj
        if obj.layout != torch.strided:
            return obj.detach().clone()
        if obj.numel() * obj.element_size() < INLINE_BYTES:
            return InlineTensor.of(obj)
        data = obj.detach()
        if data.data_ptr() not in live:
            data = data.clone(memory_format=torch.contiguous_format)
        elif not data.is_contiguous():
            data = data.contiguous()
        tensors.append(data)
        return TensorSlot(len(tensors) - 1, data.dtype, tuple(data.shape))

    skeleton = _map_leaves(payload, strip)
    return Snapshot(pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL), tensors)


def rebuild(data: bytes | bytearray | memoryview) -> Any:
    """The payload of a received snapshot stream (tensors on CPU, owning their memory)."""
    view = memoryview(data)
    if len(view) < _HEADER.size:
        raise ValueError("snapshot stream too short")
    magic, skeleton_len = _HEADER.unpack(view[:_HEADER.size])
    if magic != MAGIC:
        raise ValueError("not a ddlscale snapshot stream")
    start = _HEADER.size + skeleton_len
    try:  # our own stream, checksum-verified before it gets here
        skeleton = pickle.loads(view[_HEADER.size:start])
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, TypeError, AttributeError) as exc:
        raise ValueError(f"snapshot skeleton unreadable: {exc}") from None
    position = [start]

    def fill(obj: Any) -> Any:
        if isinstance(obj, InlineTensor):
            return obj.tensor()
        if not isinstance(obj, TensorSlot):
            return obj
        n = torch.Size(obj.shape).numel() * obj.dtype.itemsize
        lo = position[0]
        position[0] += n
        if position[0] > len(view):
            raise ValueError(f"snapshot stream truncated: {len(view)} bytes, its skeleton needs more")
        raw = torch.frombuffer(bytearray(view[lo:lo + n]), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
        return raw.view(obj.dtype).reshape(obj.shape)

    payload = _map_leaves(skeleton, fill)
    if position[0] != len(view):
        raise ValueError(f"snapshot stream holds {len(view)} bytes, its skeleton describes {position[0]}")
    return payload
