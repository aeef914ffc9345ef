"""Compressed payloads as one byte message: a small header of dtypes and shapes, then the tensors.

A compressor's payload is a list of tensors of mixed dtypes (values, int32 indices, packed bits,
scales) whose sizes may vary by rank (threshold, DGC). One uint8 message per payload lets every
collective move it in a single call, and the header lets a receiver rebuild another rank's payload
without knowing its sizes in advance. The header is charged like any other byte.
"""

from __future__ import annotations

import torch

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8,
           torch.int16, torch.int32, torch.int64, torch.bool]
_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}


def pack(payload: list[torch.Tensor]) -> torch.Tensor:
    """[count, (dtype, ndim, *shape) per tensor] as int64, then every tensor's bytes, as uint8."""
    header = [len(payload)]
    for t in payload:
        header += [_CODE[t.dtype], t.dim(), *t.shape]
    device = payload[0].device if payload else None  # one message on the payload's device (NCCL sends no CPU tensors)
    parts = [torch.tensor(header, dtype=torch.int64, device=device).view(torch.uint8)]
    parts += [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in payload]
    return torch.cat(parts)


def unpack(message: torch.Tensor) -> list[torch.Tensor]:
    """The payload :func:`pack` wrote (fresh tensors, not views of ``message``)."""
    if message.storage_offset() % 8:  # a slice of a larger receive buffer: realign for int64 reads
        message = message.clone()
    words = message[: (message.numel() // 8) * 8].view(torch.int64)
    count, at = int(words[0]), 1
    specs = []
    for _ in range(count):
        dtype, ndim = _DTYPES[int(words[at])], int(words[at + 1])
        specs.append((dtype, [int(d) for d in words[at + 2: at + 2 + ndim]]))
        at += 2 + ndim
    offset, payload = at * 8, []
    for dtype, shape in specs:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        raw = message[offset: offset + nbytes].clone()
        payload.append(raw.view(dtype).reshape(shape))
        offset += nbytes
    if offset != message.numel():
        raise ValueError(f"payload message has {message.numel() - offset} trailing bytes")
    return payload
