"""The sign compressors, one class configured three ways: signSGD, Signum and EF-signSGD.

- ``signsgd`` (Bernstein et al., 2018): every rank sends sign(g), one bit per element, and the
  ranks' signs are combined by a majority vote; the step is lr x the vote.
- ``signum`` (the same paper's momentum version): the sign, and the vote, of a momentum
  m_t = beta m_{t-1} + (1 - beta) g_t that each rank keeps of its own gradient.
- ``efsignsgd`` (Karimireddy et al., 2019): the scaled sign mean|p| sign(p) of p = g + e, summed
  over ranks, with error feedback e (the run's ``memory``; residual by default) — the scale is what
  makes the compressor a contraction, so that error feedback converges.
"""

from __future__ import annotations

from typing import Any

import torch

from ddlscale.compress import bits
from ddlscale.compress.compressor import (
    Compressor,
    Context,
    Segment,
    Shape,
    check_unit_interval,
    wide,
)


def mean_abs(flat: torch.Tensor, members: tuple[Segment, ...]) -> torch.Tensor:
    """mean |x| of each member (0 for an empty one), as a 1-D tensor."""
    parts = flat.split([m.numel for m in members]) if len(members) > 1 else [flat]
    return torch.stack([p.abs().mean() if p.numel() else p.new_zeros(()) for p in parts])


def rows_of(member: Segment) -> int:
    """How many rows of its member's matrix a piece touches (a vector member, or a piece of one: one
    row, the whole of it; an empty piece: none)."""
    if member.numel == 0:
        return 0
    if member.cols == 1:
        return 1
    return (member.start + member.numel - 1) // member.cols - member.start // member.cols + 1


def row_lengths(members: tuple[Segment, ...], device: torch.device) -> torch.Tensor:
    """The elements of each row the members touch, members in order (a piece's first and last rows
    may be partial), built on the host and moved in one copy."""
    out = []
    for member in members:
        rows = rows_of(member)
        if member.cols == 1 or rows == 0:
            out.append(torch.full((rows,), member.numel))
            continue
        lengths = torch.full((rows,), member.cols)
        head = member.cols - member.start % member.cols  # what is left of the row the piece starts in
        lengths[0] = min(head, member.numel)
        if rows > 1:
            lengths[-1] = member.numel - head - (rows - 2) * member.cols
        out.append(lengths)
    return torch.cat(out).to(device)


def live_rows(flat: torch.Tensor, members: tuple[Segment, ...]) -> torch.Tensor:
    """Per row of each member (:func:`rows_of`), whether it holds a non-zero: bool, members in order;
    one segmented pass over the whole buffer."""
    if len(members) == 1 and members[0].cols == 1:  # a vector: one row
        return (flat != 0).any().reshape(1) if flat.numel() else flat.new_zeros(0, dtype=torch.bool)
    nonzero = (flat != 0).to(torch.float32)
    return torch.segment_reduce(nonzero, "max", lengths=row_lengths(members, flat.device), unsafe=True) > 0


class SignSGD(Compressor):
    """One bit per element (1 = negative), plus, when ``scaled``, one float32 scale per member of a
    fused buffer: mean |x| over the member, so ||D(C(x))||_1 = ||x||_1 member by member.

    Zero. One bit per element cannot carry a third value (a second bit would double the payload), so
    a zero element of a non-zero row is sent as +1. What the encodings can carry, they do:
    - unscaled (``signsgd``, ``signum``): one more bit per row of each tensor's matrix (its first
      dimension; a vector is one row) says whether the row holds any non-zero, and an all-zero row
      is sent as 0 — this rank abstains from its vote instead of voting +1. An embedding row absent
      from every rank's batch, or an unused tensor, then stays where it is instead of moving by lr
      every step. The bits cost 1/cols of the signs (a vector: one bit).
    - scaled (``efsignsgd``): an all-zero member has scale 0 and decodes to 0; a zero element of a
      non-zero member decodes to +scale, which error feedback (its default) takes back next step.

    Unchanged by fusion: a fused buffer given its members keeps each member's scale and each row's
    bit, so it decodes bit for bit as its members compressed alone would.

    ``vote``: the ranks' decoded tensors are combined by a majority vote — the sign of their sum:
    +1, -1, or 0 where the votes tie (Bernstein et al.'s sign, as the server applies it) — instead of
    summed. A vote is final where every rank decodes every payload (allgather); the schemes whose
    owners re-encode the result in 1 bit (alltoall, gather) could not send a tie, so they refuse it. Each element of the
    result is then +-1 whatever the gradient's scale, so the learning rate alone sets the step: sign
    methods need their own (much smaller) one. Error feedback does not apply to an unscaled sign (its
    error is of the order of 1, not of the gradient, so a residual would grow instead of shrinking):
    its default memory is none. ``momentum``: beta of Signum's momentum (0: none), kept per group on
    each rank, checkpointed; use the optimizer without its own momentum.

    Payload: ``[signs (uint8, ceil(numel / 8), bit-packed)]``, then when scaled ``[scales (float32,
    one per member)]``, else ``[live rows (uint8, one bit per row of each member, bit-packed)]``.
    """

    def __init__(self, scaled: bool = False, vote: bool = True, momentum: float = 0.0) -> None:
        super().__init__()
        for key, value in (("compressor.scaled", scaled), ("compressor.vote", vote)):
            if not isinstance(value, bool):
                raise ValueError(f"{key} must be true or false, got {value!r}")
        self.scaled, self.vote = scaled, vote
        self.momentum = check_unit_interval(momentum, "compressor.momentum")
        # The name says which published algorithm the configuration is (labels, profiles).
        self.name = "signum" if self.momentum else "efsignsgd" if scaled and not vote else "signsgd"
        self.per_member = True  # one scale, or one bit per row, per member of a fused buffer
        self.member_bytes = 4 if scaled else 1  # unscaled: a bit per row, at most a byte per vector member
        self._momenta: dict[str, torch.Tensor] = {}

    @property
    def votes(self) -> bool:
        return self.vote

    @property
    def default_memory(self) -> str:
        return "none" if self.vote or not self.scaled else "residual"

    def precondition(self, tensor: torch.Tensor, name: str, segments=None, ranks: int = 1) -> torch.Tensor:
        if not self.momentum:
            return tensor
        flat = wide(tensor.reshape(-1))
        previous = self._momenta.get(name)
        if previous is None:
            m = (1 - self.momentum) * flat
        elif previous.shape != flat.shape:
            raise ValueError(f"{self.name}: tensor {name!r} changed size from {previous.numel()} to "
                             f"{flat.numel()}; names must identify tensors")
        else:
            m = self.momentum * previous.to(flat.device) + (1 - self.momentum) * flat
        self._momenta[name] = m
        return m.reshape(tensor.shape)

    def combine(self, total: torch.Tensor, count: int) -> torch.Tensor:
        if not self.vote:
            return total
        return torch.sign(total)

    def encode(self, tensor: torch.Tensor, name: str, segments: tuple[Segment, ...] | None = None
               ) -> tuple[list[torch.Tensor], None]:
        flat = tensor.reshape(-1)
        members = segments or (Segment(flat.numel()),)
        signs = bits.pack(flat < 0, 1)
        if not self.scaled:
            return [signs, bits.pack(live_rows(flat, members), 1)], None
        return [signs, mean_abs(wide(flat), members).to(torch.float32)], None

    def decode(self, payload: list[torch.Tensor], ctx: Context) -> torch.Tensor:
        packed = payload[0]
        if not self.scaled:
            out = bits.lookup(packed, 1, ctx.numel, torch.tensor([1.0, -1.0], device=packed.device))
            members = ctx.members
            live = bits.unpack(payload[1], 1, sum(rows_of(m) for m in members)).bool()
            if not bool(live.all()):  # all-zero rows decode to 0
                dead = torch.repeat_interleave(~live, row_lengths(members, live.device), output_size=ctx.numel)
                out.masked_fill_(dead, 0.0)
            return out
        scale = payload[1]
        if ctx.segments is None:
            return bits.lookup(packed, 1, ctx.numel, torch.cat([scale, -scale]))
        # +-1 over the whole buffer, then each member's scale in place (exact: a product by +-1): one
        # lookup pass instead of one per member and a join, which made a fused decode ~2x a whole one.
        out = bits.lookup(packed, 1, ctx.numel, scale.new_tensor([1.0, -1.0]))
        for member, member_scale in zip(out.split([m.numel for m in ctx.segments]), scale, strict=True):
            member.mul_(member_scale)
        return out

    def payload_bytes(self, shape: Shape, dtype: torch.dtype, kept: int | None = None) -> int:
        member = Segment(shape) if isinstance(shape, int) else Segment.of(shape)
        return bits.packed_bytes(member.numel, 1) + (4 if self.scaled else bits.packed_bytes(rows_of(member), 1))

    # -- checkpointed state --------------------------------------------------------------------
    def group_states(self) -> list[dict[str, torch.Tensor]]:
        return [self._momenta]

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "momenta": {k: v.clone() for k, v in self._momenta.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._momenta = {k: v.clone() for k, v in state.get("momenta", {}).items()}
