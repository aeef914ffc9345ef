"""What CompressSync executes: per tensor, which compressor, which aggregation scheme, flat or
hierarchical, and which tensors are fused into one buffer compressed once (Cupcake's groups).

``sync=compress`` builds uniform choices from its config; a computed plan
(:class:`~ddlscale.plan.result.CompressionPlan`, Espresso's and Cupcake's) hands the backend
non-uniform ones. Tensors are named by parameter name; a group's members share one choice.

These are the plan's data types, so they live in the planning layer: the planners produce them and
the executing backend (:mod:`ddlscale.sync.compressed`) imports them from here, never the reverse.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TensorChoice:
    """How one tensor (or fused group) is synchronized.

    ``compressor``: a key of the backend's compressors (``"none"`` always exists, ``"default"`` is
    the configured one); ``scheme``: an aggregation scheme's name (allreduce, allgather, alltoall, zen,
    gather: executed by :mod:`ddlscale.sync.compressed.schemes`, priced by :mod:`ddlscale.plan.pricing`); ``hierarchical``:
    dense reduction inside each machine first, the scheme only across machines.
    """

    compressor: str = "default"
    scheme: str = "allgather"
    hierarchical: bool = False


@dataclass
class Choices:
    """Per-tensor choices (``tensors``; others get ``default``) and optional fusion ``groups``."""

    default: TensorChoice = field(default_factory=TensorChoice)
    tensors: dict[str, TensorChoice] = field(default_factory=dict)
    groups: list[list[str]] | None = None  # None: the backend's own grouping (per tensor or buckets)

    def for_tensor(self, name: str) -> TensorChoice:
        return self.tensors.get(name, self.default)

    def for_group(self, names: list[str]) -> TensorChoice:
        """The members' common choice; a fused group is compressed once, so they must agree."""
        choices = {self.for_tensor(name) for name in names}
        if len(choices) != 1:
            raise ValueError(f"plan: tensors fused into one group need one choice, got {sorted(map(str, choices))} "
                             f"for {names}")
        return choices.pop()
