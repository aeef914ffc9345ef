"""Carrying per-group state (error-feedback residuals, momenta) across a change of fusion groups.

That state is keyed by group and laid out like the group's flat buffer — for a hierarchical group,
like this rank's chunk of the buffer its machine reduce-scattered (the padding past the buffer's end
left out), or, where a machine's leader runs the group whole (a compressor of matrices), like the
whole buffer at the leader and empty at its other ranks. A plan that regroups tensors
(calibration to plan, Espresso's trial plans, a re-plan) would otherwise orphan it: error feedback
would drop what compression had held back, and a flat group turned hierarchical under the same
name would meet a residual of the wrong size. :func:`regroup` splits each changed group's tensor
by member and joins the pieces again in the new groups.

Only the sum over ranks of such state matters (every rank's compensated gradient is summed), and
that sum is what is kept: a hierarchical chunk becomes a flat tensor holding the chunk at this
rank's position and zeros elsewhere, and a flat tensor becomes a chunk by summing it over the machine
and keeping this rank's part, as the gradients themselves are reduced.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class GroupLayout:
    """A group's members as (tensor name, numel) in buffer order, and for a hierarchical group this
    rank's position in its machine and the machine's size; ``leader``: the machine's first rank
    holds the whole group's state, the others none."""

    members: tuple[tuple[str, int], ...]
    machine: tuple[int, int] | None = None
    leader: bool = False

    @property
    def numel(self) -> int:
        return sum(n for _, n in self.members)

    @property
    def chunk_start(self) -> int:
        """Where this rank's part of the group's state starts in its flat buffer."""
        if self.machine is None or self.leader:
            return 0
        position, k = self.machine
        return min(self.numel, position * math.ceil(self.numel / k))

    @property
    def chunk_numel(self) -> int:
        """How many elements of the group's state this rank holds."""
        if self.machine is None:
            return self.numel
        position, k = self.machine
        if self.leader:
            return self.numel if position == 0 else 0
        return min(math.ceil(self.numel / k), self.numel - self.chunk_start)


def layouts_state(layouts: dict[str, GroupLayout]) -> dict[str, Any]:
    """``layouts`` as plain lists and numbers, for a checkpoint."""
    return {key: {"members": [[name, n] for name, n in g.members],
                  "machine": None if g.machine is None else list(g.machine), "leader": g.leader}
            for key, g in layouts.items()}


def layouts_of(state: dict[str, Any]) -> dict[str, GroupLayout]:
    """:func:`layouts_state` back."""
    return {key: GroupLayout(tuple((str(name), int(n)) for name, n in g["members"]),
                             None if g["machine"] is None else (int(g["machine"][0]), int(g["machine"][1])),
                             bool(g["leader"]))
            for key, g in state.items()}


MachineSum = Callable[[torch.Tensor], None]  # sums a tensor over the machine's ranks, in place


def regroup(states: list[dict[str, torch.Tensor]], before: dict[str, GroupLayout],
            after: dict[str, GroupLayout], machine_sum: MachineSum | None = None) -> None:
    """Re-lay out every dict in ``states`` in place from the groups ``before`` to those ``after``.

    Keys whose layout did not change are left alone, as are keys neither layout names (state a
    checkpoint restored for the groups it was saved with). A member no old group held state for
    starts at zero beside members that did. ``machine_sum`` is needed only when state moves into a
    hierarchical group; every rank calls it for the same groups in the same order, since every rank
    has run the same groups and so holds state under the same keys.
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
            state[key] = _chunk(flat, group, machine_sum)


def _unchunk(tensor: torch.Tensor, group: GroupLayout) -> torch.Tensor:
    """The flat tensor of a group's state: this rank's part placed where it lies in the buffer."""
    if group.machine is None:
        return tensor
    flat = tensor.new_zeros(group.numel)
    flat[group.chunk_start: group.chunk_start + group.chunk_numel] = tensor
    return flat


def _chunk(flat: torch.Tensor, group: GroupLayout, machine_sum: MachineSum | None) -> torch.Tensor:
    """A flat group state as the group's layout holds it: for a hierarchical group, this rank's part
    of the machine's sum."""
    if group.machine is None:
        return flat
    if machine_sum is None:
        raise ValueError("regroup: moving state into a hierarchical group needs the machine's sum")
    total = flat.clone()
    machine_sum(total)
    return total[group.chunk_start: group.chunk_start + group.chunk_numel].clone()


def load_summed_share(holder: Any, states: list[dict[str, Any]], world_size: int) -> None:
    """Load into ``holder`` (an error-feedback memory or a compressor) one rank's share of state saved
    by ``len(states)`` ranks, for a run of ``world_size`` ranks: its per-name tensors (``group_states``,
    of which only the sum over ranks matters) summed over the saved ranks and split evenly, so their
    total is kept (to one rounding); everything else as the first saved rank had it."""
    totals: list[dict[str, torch.Tensor]] = []
    dtypes: dict[str, torch.dtype] = {}
    for state in states:
        holder.load_state_dict(state)
        for i, group in enumerate(holder.group_states()):
            if i == len(totals):
                totals.append({})
            for name, tensor in group.items():
                total = totals[i].get(name)
                if total is not None and total.shape != tensor.shape:
                    raise ValueError(f"state {name!r} is laid out differently on the saved ranks ({tuple(total.shape)} "
                                     f"vs {tuple(tensor.shape)}): a hierarchical group's chunks cannot be resharded")
                dtypes[name] = tensor.dtype
                wide = tensor.to(torch.float64)
                totals[i][name] = wide if total is None else total + wide
    holder.load_state_dict(states[0])
    for group, total in zip(holder.group_states(), totals, strict=False):
        group.clear()
        group.update({name: (value / world_size).to(dtypes[name]) for name, value in total.items()})
