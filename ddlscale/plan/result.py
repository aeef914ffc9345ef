"""A computed plan: what each tensor (or fused group) does, what it is predicted to save, and the
CompressSync :class:`~ddlscale.plan.choices.Choices` that executes it.

It travels as a plain dict (rank 0 broadcasts it, checkpoints keep it, ``plan.json`` holds it) and
prints as a table (``plan.txt``, the log, ``python -m ddlscale.tools.plan``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ddlscale.comm.timeline import iteration_time
from ddlscale.plan.choices import Choices, TensorChoice
from ddlscale.plan.pricing import DENSE, CostModel, Option, Unit


@dataclass
class CompressionPlan:
    """``units[g]`` (a tensor or fused group, backward order) is synchronized with ``options[g]``.

    ``saved_s[g]``: predicted iteration time saved by unit g's option against dense allreduce of
    that unit, all other units as planned. ``baselines``: predicted iteration times of reference
    plans by name. ``notes``: how the plan was found and what the model assumes.
    """

    system: str
    units: list[Unit]
    options: list[Option]
    iteration_s: float
    fusion: str = "per tensor"
    saved_s: list[float] = field(default_factory=list)
    baselines: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    context: dict[str, Any] = field(default_factory=dict)  # cluster, compressor, measured step

    # -- execution ------------------------------------------------------------------------------
    def to_choices(self) -> Choices:
        """The CompressSync plan: a choice per parameter, and fusion groups when any unit fuses."""
        tensors = {name: o.tensor_choice() for u, o in zip(self.units, self.options, strict=True) for name in u.names}
        groups = [list(u.names) for u in self.units] if any(len(u.names) > 1 for u in self.units) else None
        return Choices(default=TensorChoice("none", "allreduce"), tensors=tensors, groups=groups)

    @property
    def offloaded(self) -> int:
        return sum(o.compressed and o.device == "side" for o in self.options)

    # -- serialization --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "system": self.system, "iteration_s": self.iteration_s, "fusion": self.fusion,
            "units": [{**asdict(u), "names": list(u.names), "shape": None if u.shape is None else list(u.shape)}
                      for u in self.units],
            "options": [asdict(o) for o in self.options], "saved_s": list(self.saved_s),
            "baselines": dict(self.baselines), "notes": list(self.notes), "context": dict(self.context),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CompressionPlan:
        units = [Unit(tuple(u["names"]), int(u["numel"]), u["dtype"], float(u["ready_s"]),
                      None if u["shape"] is None else tuple(u["shape"]), dict(u.get("kept", {})))
                 for u in data["units"]]
        options = [Option(o["compressor"], o["scheme"], bool(o["hierarchical"]), o["device"]) for o in data["options"]]
        return cls(data["system"], units, options, float(data["iteration_s"]), data.get("fusion", "per tensor"),
                   list(data.get("saved_s", [])), dict(data.get("baselines", {})), list(data.get("notes", [])),
                   dict(data.get("context", {})))

    # -- the human-readable form ------------------------------------------------------------------
    def describe(self, limit: int | None = 40) -> str:
        ctx = self.context
        names = {"default": ctx.get("compressor_name", "default")}
        head = f"{self.system} plan: {len(self.units)} units"
        if ctx:
            head += (f" | {ctx.get('world_size')} workers, {ctx.get('bandwidth')} / {ctx.get('latency')}, "
                     f"{ctx.get('gpus_per_machine', 1)} rank(s) per machine | compressor {ctx.get('compressor')}")
        lines = [head, f"fusion: {self.fusion}",
                 f"predicted iteration: {self.iteration_s * 1e3:.3f} ms"]
        for name, seconds in self.baselines.items():
            lines.append(f"  vs {name}: {seconds * 1e3:.3f} ms (speed-up {seconds / self.iteration_s:.2f}x)")
        if ctx.get("measured_dense_step_s"):
            lines.append(f"  measured step with dense sync while profiling: {ctx['measured_dense_step_s'] * 1e3:.3f} ms")
        lines.append(f"  {'#':>3}  {'tensor(s)':<44} {'elements':>11}  {'option':<28} {'saved (ms)':>10}")
        order = range(len(self.units))
        shown = list(order) if limit is None or len(self.units) <= limit else sorted(
            order, key=lambda g: -self.units[g].numel)[:limit]
        for g in sorted(shown):
            unit, option = self.units[g], self.options[g]
            saved = self.saved_s[g] * 1e3 if g < len(self.saved_s) else float("nan")
            lines.append(f"  {g:>3}  {unit.label[:44]:<44} {unit.numel:>11,}  {option.label(names):<28} {saved:>10.3f}")
        if len(shown) < len(self.units):
            lines.append(f"  ... {len(self.units) - len(shown)} smaller units not shown (plan.json has all)")
        counts: dict[str, int] = {}
        for option in self.options:
            counts[option.label(names)] = counts.get(option.label(names), 0) + 1
        lines.append("options used: " + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())))
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


def per_unit_savings(units: list[Unit], options: list[Option], model: CostModel, backward_end_s: float,
                     optimizer_s: float) -> list[float]:
    """For each unit: iteration time with it dense (others as planned) minus the plan's."""
    tasks = [model.task(u, o) for u, o in zip(units, options, strict=True)]
    planned = iteration_time(tasks, backward_end_s, optimizer_s + model.fixed_s(options))
    saved = []
    for g, (unit, option) in enumerate(zip(units, options, strict=True)):
        if not option.compressed:
            saved.append(0.0)
            continue
        swapped = [*options[:g], DENSE, *options[g + 1:]]
        if not any(o.compressed for o in swapped):  # nothing compressed now: priced as it runs alone
            plain = model.plainly()
            dense = [plain.task(u, o) for u, o in zip(units, swapped, strict=True)]
        else:
            dense = list(tasks)
            dense[g] = model.task(unit, DENSE)
        saved.append(iteration_time(dense, backward_end_s, optimizer_s + model.fixed_s(swapped)) - planned)
    return saved


def uniform_time(units: list[Unit], option: Option, model: CostModel, backward_end_s: float,
                 optimizer_s: float) -> float:
    """Predicted iteration time with every unit under ``option``."""
    return plan_time(units, [option] * len(units), model, backward_end_s, optimizer_s)


def plan_time(units: list[Unit], options: list[Option], model: CostModel, backward_end_s: float,
              optimizer_s: float) -> float:
    """Predicted iteration time of unit g under ``options[g]`` (with the plan's fixed cost per step:
    :meth:`CostModel.fixed_s`)."""
    tasks = [model.task(u, o) for u, o in zip(units, options, strict=True)]
    return iteration_time(tasks, backward_end_s, optimizer_s + model.fixed_s(options))

