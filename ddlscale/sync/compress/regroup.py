"""Carrying per-group state (error-feedback residuals, momenta) across a change of fusion groups.

That state is keyed by group and laid out like the group's flat buffer — for a hierarchical group,
like this rank's chunk of the buffer its machine reduce-scattered. A plan that regroups tensors
(calibration to plan, Espresso's trial plans, a re-plan) would otherwise orphan it: error feedback
would drop what compression had held back, and a flat group turned hierarchical under the same
name would meet a residual of the wrong size. :func:`regroup` splits each changed group's tensor
by member and joins the pieces again in the new groups.

Only the sum over ranks of such state matters (every rank's compensated gradient is summed), and
that sum is what is kept: a hierarchical chunk becomes a flat tensor holding the chunk at this
rank's position and zeros elsewhere, and a flat tensor becomes a chunk by reduce-scattering it over
the machine, as the gradients themselves are.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GroupLayout:
    """A group's members as (tensor name, numel) in buffer order, and for a hierarchical group this
    rank's position in its machine and the machine's size."""

    members: tuple[tuple[str, int], ...]
    machine: tuple[int, int] | None = None

    @property
    def numel(self) -> int:
        return sum(n for _, n in self.members)

    @property
    def chunk_numel(self) -> int:
        return math.ceil(self.numel / self.machine[1]) if self.machine else self.numel


ReduceScatter = Callable[[torch.Tensor, torch.Tensor], None]  # (chunk out, whole padded buffer in)


def regroup(states: list[dict[str, torch.Tensor]], before: dict[str, GroupLayout],
            after: dict[str, GroupLayout], reduce_scatter: ReduceScatter | None = None) -> None:
    """Re-lay out every dict in ``states`` in place from the groups ``before`` to those ``after``.

    Keys whose layout did not change are left alone, as are keys neither layout names (state a
    checkpoint restored for the groups it was saved with). A member no old group held state for
    starts at zero beside members that did. ``reduce_scatter`` (the machine's) is needed only when
    state moves into a hierarchical group; every rank calls it for the same groups in the same
    order, since every rank has run the same groups and so holds state under the same keys.
    """
    changed_before = {k: g for k, g in before.items() if after.get(k) != g}
    changed_after = {k: g for k, g in after.items() if before.get(k) != g}
    for state in states:
        pieces: dict[str, torch.Tensor] = {}
        for key, group in changed_before.items():
            tensor = state.get(key)
            if tensor is None or tensor.numel() != group.chunk_numel:
                continue  # not this layout's: leave it
            flat = _unchunk(state.pop(key).reshape(-1), group)
            pieces.update(zip((name for name, _ in group.members),
                              torch.split(flat, [n for _, n in group.members]), strict=True))
        for key, group in changed_after.items():
            held = [pieces.get(name) for name, _ in group.members]
            present = [p for p in held if p is not None]
            if not present:
                continue
            flat = torch.cat([p if p is not None else present[0].new_zeros(n)
                              for p, (_, n) in zip(held, group.members, strict=True)])
            state[key] = _chunk(flat, group, reduce_scatter)


def _unchunk(tensor: torch.Tensor, group: GroupLayout) -> torch.Tensor:
    """The flat tensor of a group's state: a hierarchical chunk placed at this rank's position."""
    if group.machine is None:
        return tensor
    position, _ = group.machine
    flat = tensor.new_zeros(group.numel)
    start = position * group.chunk_numel
    stop = min(start + group.chunk_numel, group.numel)
    if stop > start:  # the padding past the buffer's end stood for no gradient
        flat[start:stop] = tensor[: stop - start]
    return flat


def _chunk(flat: torch.Tensor, group: GroupLayout, reduce_scatter: ReduceScatter | None) -> torch.Tensor:
    """A flat group state as the group's layout holds it: for a hierarchical group, this rank's
    chunk of the machine's sum."""
    if group.machine is None:
        return flat
    if reduce_scatter is None:
        raise ValueError("regroup: moving state into a hierarchical group needs the machine's reduce_scatter")
    padded = flat.new_zeros(group.chunk_numel * group.machine[1])
    padded[: flat.numel()] = flat
    chunk = flat.new_empty(group.chunk_numel)
    reduce_scatter(chunk, padded)
    return chunk
