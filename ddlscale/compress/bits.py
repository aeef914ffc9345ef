"""Packing small integer codes (1, 2, 4 or 8 bits each) into bytes, so that a sign costs one bit on
the wire and ``payload_bytes`` is honest.

Layout: code i sits in byte i // (8 / width), at bit offset (i % (8 / width)) * width (little-endian
within the byte); the last byte is zero-padded.
"""

from __future__ import annotations

import torch

WIDTHS = (1, 2, 4, 8)


def packed_bytes(count: int, width: int) -> int:
    return (count * width + 7) // 8


def pack(codes: torch.Tensor, width: int) -> torch.Tensor:
    """uint8 codes (each < 2**width) -> ceil(count * width / 8) bytes."""
    if width not in WIDTHS:
        raise ValueError(f"bit width must be one of {WIDTHS}, got {width}")
    codes = codes.reshape(-1).to(torch.uint8)
    if width == 8:
        return codes.clone()
    per = 8 // width
    pad = (-codes.numel()) % per
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    if width == 1:
        # Eight 0/1 bytes read as one little-endian int64 hold bit j at position 8j; multiplying by
        # sum_j 2^(56 - 7j) moves it to 56 + j with no carries (all partial products are distinct
        # powers of two), so one multiply and shift gather a byte. 4x faster than shifted ORs.
        # The product wraps past 2^63 by design; only bits 56..63 are kept.
        return ((codes.view(torch.int64) * 0x0102040810204080) >> 56).to(torch.uint8)
    lanes = codes.view(-1, per)
    # One shifted OR per lane: faster than a reduction over a length-`per` inner dimension.
    out = lanes[:, 0].clone()
    for j in range(1, per):
        out |= lanes[:, j] << (j * width)
    return out


_TABLES: dict[tuple[int, torch.device], torch.Tensor] = {}


def code_table(width: int, device: torch.device) -> torch.Tensor:
    """(256, 8 / width) int64: the codes held by each possible byte."""
    key = (width, torch.device(device))
    if key not in _TABLES:
        shifts = torch.arange(0, 8, width, device=device)
        _TABLES[key] = (torch.arange(256, device=device).unsqueeze(1) >> shifts) & ((1 << width) - 1)
    return _TABLES[key]


def lookup(packed: torch.Tensor, width: int, count: int, values: torch.Tensor) -> torch.Tensor:
    """``values[code]`` for the first ``count`` packed codes, without materializing the codes: a
    256-row table of decoded bytes is built from ``values`` (2**width entries), and each packed
    byte selects its row — one gather instead of unpack, convert and arithmetic passes."""
    table = values[code_table(width, packed.device)]
    return table.index_select(0, packed.long()).reshape(-1)[:count]


def lookup_segments(packed: torch.Tensor, width: int, segments: tuple[int, ...], values: torch.Tensor) -> torch.Tensor:
    """:func:`lookup` with a table per segment: ``values[k, code]`` for the codes of segment k
    (``values`` has one row of 2**width entries per segment, ``segments`` their lengths). Each
    segment is looked up from the bytes holding it, skipping the codes of the one before."""
    per, start, out = 8 // width, 0, []
    for k, length in enumerate(segments):
        skip = start % per
        first, end = start // per, (start + length + per - 1) // per
        out.append(lookup(packed[first:end], width, skip + length, values[k])[skip:])
        start += length
    return torch.cat(out) if out else values.new_zeros(0)


def unpack(packed: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack`: the first ``count`` codes as uint8."""
    if width not in WIDTHS:
        raise ValueError(f"bit width must be one of {WIDTHS}, got {width}")
    if width == 8:
        return packed[:count].clone()
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(1) >> shifts) & ((1 << width) - 1)
    return codes.reshape(-1)[:count]
