"""1-bit SGD's quantizer (Seide et al., 2014): one bit per element, two reconstruction values per column."""

from __future__ import annotations

import torch

from ddlscale.compress import bits
from ddlscale.compress.compressor import Compressor, Context, Segment, Shape, wide


class OneBit(Compressor):
    """Each column of the gradient matrix (a tensor seen as its first dimension by the rest; a vector
    is one column) is split at zero, and besides the bit each element decodes to the mean of its
    column's side: the non-negative mean or the negative one. So each column keeps its sum exactly
    (n+ mean+ + n- mean- = its sum) and its own scale — the paper's column-wise quantization, which
    one pair of means per tensor lacks. Biased per element: 1-bit SGD runs with error feedback.

    Members of a fused buffer (and the pieces of them an alltoall partition holds) keep their own
    columns: a fused group decodes bit for bit as its members compressed alone would.

    Zero: the bit cannot carry a third value (a second bit per element would double the payload). An
    all-zero column decodes to 0 (both its means are 0); a zero element of another column joins its
    non-negative side, whose mean keeps the column's sum exact, and error feedback (the default)
    carries the difference to the next step.

    Payload: ``[bits (uint8, ceil(numel / 8); 1 = negative), means (float32, 2 per column:
    [non-negative, negative], 0 for an empty side)]``; a member or piece has
    :attr:`Segment.columns` columns.
    """

    name = "onebit"
    per_member, member_bytes = True, 8

    def encode(self, tensor: torch.Tensor, name: str, segments: tuple[Segment, ...] | None = None
               ) -> tuple[list[torch.Tensor], None]:
        flat = wide(tensor.reshape(-1))
        negative = flat < 0
        members = segments or (Segment(flat.numel()),)
        sizes = [m.numel for m in members]
        means = torch.cat([_column_means(x, neg, m) for x, neg, m in
                           zip(flat.split(sizes), negative.split(sizes), members, strict=True)])
        return [bits.pack(negative, 1), means.reshape(-1).to(torch.float32)], None

    def decode(self, payload: list[torch.Tensor], ctx: Context) -> torch.Tensor:
        packed, means = payload
        members = ctx.members
        if all(m.columns == 1 for m in members):  # a pair per member: one byte-table lookup each
            if len(members) == 1:
                return bits.lookup(packed, 1, ctx.numel, means)
            return bits.lookup_segments(packed, 1, tuple(m.numel for m in members), means.reshape(-1, 2))
        negative = bits.unpack(packed, 1, ctx.numel).bool()
        out, at = [], 0
        for neg, member in zip(negative.split([m.numel for m in members]), members, strict=True):
            pairs = means[2 * at: 2 * (at + member.columns)].reshape(-1, 2)
            at += member.columns
            if _whole(member):
                out.append(torch.where(neg.view(member.rows, member.cols), pairs[:, 1], pairs[:, 0]).reshape(-1))
            else:
                per_element = pairs[_column_ids(member, neg.device)]
                out.append(torch.where(neg, per_element[:, 1], per_element[:, 0]))
        return torch.cat(out) if out else means.new_zeros(0)

    def payload_bytes(self, shape: Shape, dtype: torch.dtype, kept: int | None = None) -> int:
        member = Segment(shape) if isinstance(shape, int) else Segment.of(shape)
        return bits.packed_bytes(member.numel, 1) + 8 * member.columns


def _whole(member: Segment) -> bool:
    """A block of whole rows of several columns: columns are the matrix view's own (no index needed)."""
    return member.whole_rows and member.cols > 1 and member.numel > 0


def _column_ids(member: Segment, device: torch.device) -> torch.Tensor:
    """Each element's column among the ``member.columns`` columns the piece touches, in column order
    (a piece shorter than a row touches its own consecutive ones)."""
    offsets = torch.arange(member.numel, device=device)
    if member.numel < member.cols:
        return offsets
    return (member.start + offsets) % member.cols


def _column_means(flat: torch.Tensor, negative: torch.Tensor, member: Segment) -> torch.Tensor:
    """(columns, 2): per column, [mean of its non-negative elements, mean of its negative ones]."""
    if _whole(member):
        x, neg = flat.view(member.rows, member.cols), negative.view(member.rows, member.cols)
        sum_neg, n_neg = torch.where(neg, x, 0).sum(0), neg.sum(0)
        sum_all, n_all = x.sum(0), torch.full_like(n_neg, member.rows)
    else:
        ids, columns = _column_ids(member, flat.device), member.columns
        sum_neg = flat.new_zeros(columns).index_add_(0, ids, torch.where(negative, flat, 0))
        n_neg = torch.bincount(ids[negative], minlength=columns)
        sum_all, n_all = flat.new_zeros(columns).index_add_(0, ids, flat), torch.bincount(ids, minlength=columns)
    n_pos = n_all - n_neg
    return torch.stack([(sum_all - sum_neg) / n_pos.clamp(min=1), sum_neg / n_neg.clamp(min=1)], dim=1)
