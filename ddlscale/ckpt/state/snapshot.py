"""A training-state payload as a byte stream: JSON for its structure, raw bytes for its tensors.

``torch.save`` of a whole state copies every tensor into one buffer before a byte leaves, and
``torch.load`` of it unpickles, which runs whatever code the bytes name. This stream does neither:

* a :class:`Snapshot` is a header, a JSON *skeleton* (the payload with every large tensor replaced by a
  reference to a segment, small ones written inline) and then the tensors' raw bytes, in order.
  Gemini sends parameters and optimizer state straight from where they live, chunk by chunk, while
  the next iteration computes (they change only at its optimizer step, which waits for the send);
  everything the next iteration mutates earlier (BatchNorm statistics, error feedback, RNG, loop
  counters) is copied at capture;
* :func:`rebuild` parses the JSON and cuts the tensors out of the stream. It creates only JSON values,
  tensors and numpy arrays of numeric dtypes, and containers (dict, OrderedDict, list, tuple): no
  code named by the bytes ever runs, whoever wrote them. Every length is checked against the
  stream before anything is allocated.

JSON has no tuples, non-string keys, tensors or bytes: those become tagged objects
``{"__ddl__": tag, ...}`` (a user dict that happens to hold the key ``"__ddl__"`` is tagged too, so
nothing is ambiguous). What the payload may hold is exactly what the encoder accepts; anything else
(a set, a user class) is refused at capture with its path named, as ``torch.load(weights_only=True)``
would refuse it at load. Other dict subclasses come back as plain dicts; tensors come back on the CPU.

The same stream is the persistent tier's shard format (:mod:`ddlscale.ckpt.state.shard`).
"""

from __future__ import annotations

import base64
import json
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

MAGIC = b"DDLSNAP3"
_HEADER = struct.Struct("<8sQ")  # magic, skeleton length
TAG = "__ddl__"
# Tensors smaller than this (scalars: optimizer step counters) are written inline in the skeleton;
# anything larger is a segment of the stream, sent without a copy when it is live.
INLINE_BYTES = 64

# The dtypes a stream may name: looked up in these tables, never by attribute name.
TORCH_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
              torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
              *(getattr(torch, n) for n in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2")
                if hasattr(torch, n)))
}
_NAME_OF = {d: name for name, d in TORCH_DTYPES.items()}
NUMPY_DTYPES: dict[str, np.dtype] = {
    np.dtype(n).name: np.dtype(n)
    for n in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16",
              "float32", "float64", "complex64", "complex128")
}


class Snapshot:
    """``header + skeleton + segments``; ``tensors`` are the segments (contiguous, possibly on a GPU)."""

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
        """The whole stream in one buffer."""
        out = bytearray(self.nbytes)
        view = memoryview(out)
        position = 0
        for piece in self.pieces(0, self.nbytes):
            n = piece.numel()
            view[position:position + n] = piece.cpu().numpy().tobytes()
            position += n
        return bytes(out)


# -- encoding ---------------------------------------------------------------------------------------
class _Encoder:
    """Turns a payload into a JSON-able skeleton, collecting its large tensors as segments."""

    def __init__(self, live: set[int] | None, inline_bytes: int = INLINE_BYTES) -> None:
        self.live = live
        self.inline_bytes = inline_bytes
        self.tensors: list[torch.Tensor] = []

    def encode(self, obj: Any, path: str) -> Any:
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj, path)
        if isinstance(obj, OrderedDict):
            return {TAG: "odict", "items": self.pairs(obj, path)}
        if isinstance(obj, dict):
            if all(isinstance(k, str) for k in obj) and TAG not in obj:
                return {k: self.encode(v, f"{path}[{k!r}]") for k, v in obj.items()}
            return {TAG: "dict", "items": self.pairs(obj, path)}
        if isinstance(obj, list):
            return [self.encode(v, f"{path}[{i}]") for i, v in enumerate(obj)]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return {TAG: "tuple", "items": [self.encode(v, f"{path}[{i}]") for i, v in enumerate(obj)]}
        if isinstance(obj, np.ndarray):
            return self.ndarray(obj, path)
        if isinstance(obj, np.generic) and obj.dtype.name in NUMPY_DTYPES:
            value = obj.item()
            return {TAG: "np", "dtype": obj.dtype.name,
                    "value": [value.real, value.imag] if isinstance(value, complex) else value}
        if isinstance(obj, (bytes, bytearray)):
            return {TAG: "bytes", "b64": base64.b64encode(obj).decode()}
        if isinstance(obj, torch.dtype) and str(obj).removeprefix("torch.") in TORCH_DTYPES:
            return {TAG: "dtype", "name": str(obj).removeprefix("torch.")}
        raise TypeError(
            f"checkpoint state holds a {type(obj).__module__}.{type(obj).__qualname__} at {path}: checkpoints "
            "hold tensors, numpy arrays, numbers, strings, bytes and dicts, lists and tuples of them (nothing "
            "is pickled); return plain values from that state_dict()"
        )

    def pairs(self, obj: dict, path: str) -> list[list[Any]]:
        return [[self.encode(k, f"{path}.keys()"), self.encode(v, f"{path}[{k!r}]")] for k, v in obj.items()]

    def tensor(self, obj: torch.Tensor, path: str) -> dict[str, Any]:
        if obj.layout == torch.sparse_coo:
            sparse = obj.detach().coalesce() if not obj.is_coalesced() else obj.detach()
            return {TAG: "sparse_coo", "shape": list(sparse.shape),
                    "indices": self.tensor(sparse._indices(), path), "values": self.tensor(sparse._values(), path)}
        dtype = _NAME_OF.get(obj.dtype)  # per tensor of every capture: kept to table look-ups
        if obj.layout != torch.strided or dtype is None:
            raise TypeError(f"checkpoint state holds a {obj.layout} tensor of {obj.dtype} at {path}")
        data = obj.detach() if obj.requires_grad else obj
        head = {TAG: "tensor", "dtype": dtype, "shape": list(data.shape)}
        if data.numel() * data.element_size() < self.inline_bytes:
            flat = data.cpu().contiguous().reshape(-1).view(torch.uint8)
            return {**head, "b64": base64.b64encode(flat.numpy().tobytes()).decode()}
        if self.live is not None and data.data_ptr() not in self.live:
            data = data.clone(memory_format=torch.contiguous_format)
        elif not data.is_contiguous():
            data = data.contiguous()
        self.tensors.append(data)
        return {**head, "segment": len(self.tensors) - 1}

    def ndarray(self, obj: np.ndarray, path: str) -> dict[str, Any]:
        if obj.dtype.name not in NUMPY_DTYPES:
            raise TypeError(f"checkpoint state holds a numpy array of dtype {obj.dtype} at {path}")
        raw = np.ascontiguousarray(obj).reshape(-1).view(np.uint8).copy()  # copied: numpy state is not live
        self.tensors.append(torch.from_numpy(raw))
        return {TAG: "ndarray", "dtype": obj.dtype.name, "shape": list(obj.shape), "segment": len(self.tensors) - 1}


def capture(payload: Any, live: set[int] | None = None) -> Snapshot:
    """Snapshot ``payload``.

    ``live``: ``data_ptr()`` of tensors that stay unchanged until the stream is sent (parameters and
    optimizer state): they are referenced, every other tensor is copied now. ``None``: reference every
    tensor (the caller writes the stream out before anything changes).
    """
    skeleton, tensors = encode(payload, live)
    return Snapshot(json.dumps(skeleton, separators=(",", ":")).encode(), tensors)


def encode(payload: Any, live: set[int] | None, inline_bytes: int = INLINE_BYTES) -> tuple[Any, list[torch.Tensor]]:
    """``payload`` as a JSON-able skeleton and its segments (as :func:`capture`, before serializing)."""
    encoder = _Encoder(live, inline_bytes)
    return encoder.encode(payload, "state"), encoder.tensors


def to_bytes(payload: Any) -> bytes:
    """The stream of ``payload`` in one buffer, tensors read where they are."""
    return capture(payload, live=None).to_bytes()


# -- decoding ---------------------------------------------------------------------------------------
def _shape(raw: Any) -> tuple[int, ...]:
    if not isinstance(raw, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in raw):
        raise ValueError(f"bad tensor shape {raw!r}")
    return tuple(raw)


def _lookup(table: dict[str, Any], name: Any) -> Any:
    if not isinstance(name, str) or name not in table:
        raise ValueError(f"dtype {name!r} is not one a checkpoint may hold")
    return table[name]


class _Decoder:
    """Rebuilds a payload from its skeleton; segments are cut from ``view`` in order."""

    def __init__(self, view: memoryview, start: int) -> None:
        self.view, self.position = view, start
        self.expected = 0  # the next segment's index

    def segment(self, index: Any, nbytes: int) -> bytearray:
        """The bytes of segment ``index``; segments appear in the skeleton in stream order."""
        if index != self.expected:
            raise ValueError(f"segment {index!r} out of order (expected {self.expected})")
        self.expected += 1
        lo, hi = self.position, self.position + nbytes
        if hi > len(self.view):
            raise ValueError(f"snapshot stream truncated: {len(self.view)} bytes, its skeleton needs {hi}")
        self.position = hi
        return bytearray(self.view[lo:hi])  # allocated only once the stream is known to hold it

    def decode(self, obj: Any) -> Any:
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        if isinstance(obj, list):
            return [self.decode(v) for v in obj]
        if not isinstance(obj, dict):
            raise ValueError(f"unexpected JSON value {type(obj).__name__}")
        if TAG not in obj:
            return {k: self.decode(v) for k, v in obj.items()}
        tag = obj[TAG]
        handler: Callable[[dict[str, Any]], Any] | None = getattr(self, f"_tag_{tag}", None) if isinstance(
            tag, str) and tag.isidentifier() else None
        if handler is None:
            raise ValueError(f"unknown tag {tag!r} in snapshot skeleton")
        return handler(obj)

    def _items(self, obj: dict[str, Any]) -> list[Any]:
        items = obj.get("items")
        if not isinstance(items, list):
            raise ValueError(f"{obj.get(TAG)} without items")
        return items

    def _pairs(self, obj: dict[str, Any]) -> Iterator[tuple[Any, Any]]:
        for pair in self._items(obj):
            if not isinstance(pair, list) or len(pair) != 2:
                raise ValueError("a mapping item is not a [key, value] pair")
            key = self.decode(pair[0])
            if isinstance(key, (dict, list)):
                raise ValueError("an unhashable mapping key")
            yield key, self.decode(pair[1])

    def _tag_tuple(self, obj: dict[str, Any]) -> tuple:
        return tuple(self.decode(v) for v in self._items(obj))

    def _tag_dict(self, obj: dict[str, Any]) -> dict:
        return dict(self._pairs(obj))

    def _tag_odict(self, obj: dict[str, Any]) -> OrderedDict:
        return OrderedDict(self._pairs(obj))

    def _tag_bytes(self, obj: dict[str, Any]) -> bytes:
        return base64.b64decode(str(obj.get("b64", "")), validate=True)

    def _tag_dtype(self, obj: dict[str, Any]) -> torch.dtype:
        return _lookup(TORCH_DTYPES, obj.get("name"))

    def _tag_np(self, obj: dict[str, Any]) -> np.generic:
        dtype, value = _lookup(NUMPY_DTYPES, obj.get("dtype")), obj.get("value")
        if isinstance(value, list) and len(value) == 2:
            value = complex(*value)
        if not isinstance(value, (bool, int, float, complex)):
            raise ValueError(f"numpy scalar of {dtype} holds {value!r}")
        return dtype.type(value)

    def _raw(self, obj: dict[str, Any], nbytes: int) -> bytearray:
        if "b64" in obj:
            raw = bytearray(base64.b64decode(str(obj["b64"]), validate=True))
            if len(raw) != nbytes:
                raise ValueError(f"inline tensor of {len(raw)} bytes, its shape needs {nbytes}")
            return raw
        return self.segment(obj.get("segment"), nbytes)

    def _tag_tensor(self, obj: dict[str, Any]) -> torch.Tensor:
        dtype, shape = _lookup(TORCH_DTYPES, obj.get("dtype")), _shape(obj.get("shape"))
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        raw = self._raw(obj, nbytes)
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape)

    def _tag_ndarray(self, obj: dict[str, Any]) -> np.ndarray:
        dtype, shape = _lookup(NUMPY_DTYPES, obj.get("dtype")), _shape(obj.get("shape"))
        raw = self._raw(obj, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
        return np.frombuffer(raw, dtype=dtype).reshape(shape)

    def _tag_sparse_coo(self, obj: dict[str, Any]) -> torch.Tensor:
        indices, values = self._tag_tensor(obj.get("indices") or {}), self._tag_tensor(obj.get("values") or {})
        shape = _shape(obj.get("shape"))
        if indices.dtype != torch.int64 or indices.dim() != 2 or indices.shape[1] != values.shape[0]:
            raise ValueError("sparse tensor with inconsistent indices and values")
        return torch.sparse_coo_tensor(indices, values, shape, check_invariants=True).coalesce()


def rebuild(data: bytes | bytearray | memoryview) -> Any:
    """The payload of a snapshot stream (tensors on the CPU, owning their memory).

    ValueError for anything that is not a well-formed stream: a foreign magic, a skeleton or segment
    running past the end, unknown tags or dtypes, bytes left over.
    """
    view = memoryview(data)
    if len(view) < _HEADER.size:
        raise ValueError("snapshot stream too short")
    magic, skeleton_len = _HEADER.unpack(view[:_HEADER.size])
    if magic != MAGIC:
        raise ValueError("not a ddlscale snapshot stream")
    start = _HEADER.size + skeleton_len
    if start > len(view):
        raise ValueError(f"snapshot skeleton of {skeleton_len} bytes runs past the stream's {len(view)}")
    try:
        skeleton = json.loads(bytes(view[_HEADER.size:start]))
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"snapshot skeleton unreadable: {exc}") from None
    decoder = _Decoder(view, start)
    try:
        payload = decoder.decode(skeleton)
    except RecursionError:
        raise ValueError("snapshot skeleton nested too deeply") from None
    except (TypeError, RuntimeError, OverflowError) as exc:
        raise ValueError(f"snapshot skeleton inconsistent: {exc}") from None
    if decoder.position != len(view):
        raise ValueError(f"snapshot stream holds {len(view)} bytes, its skeleton describes {decoder.position}")
    return payload


class _FetchingDecoder(_Decoder):
    """Rebuilds a payload whose segments live elsewhere: ``fetch(index, nbytes)`` returns each one."""

    def __init__(self, fetch: Callable[[int, int], bytearray]) -> None:
        super().__init__(memoryview(b""), 0)
        self.fetch = fetch

    def segment(self, index: Any, nbytes: int) -> bytearray:
        if isinstance(index, bool) or not isinstance(index, int):
            raise ValueError(f"bad segment reference {index!r}")
        raw = self.fetch(index, nbytes)
        if len(raw) != nbytes:
            raise ValueError(f"segment {index} holds {len(raw)} bytes, its skeleton needs {nbytes}")
        return raw


def rebuild_skeleton(skeleton: Any, fetch: Callable[[int, int], bytearray]) -> Any:
    """The payload of a parsed skeleton whose segment ``i`` of ``n`` bytes is ``fetch(i, n)`` (the
    persistent tier keeps segments as separate items of a DCP checkpoint). Same guarantees as
    :func:`rebuild`: JSON, containers, tensors and numeric arrays only; ValueError when inconsistent."""
    try:
        return _FetchingDecoder(fetch).decode(skeleton)
    except RecursionError:
        raise ValueError("snapshot skeleton nested too deeply") from None
    except (TypeError, RuntimeError, OverflowError) as exc:
        raise ValueError(f"snapshot skeleton inconsistent: {exc}") from None
