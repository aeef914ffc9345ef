"""``sync=espresso``: per tensor, whether and how to compress, chosen on the simulated iteration.

After profiling (:mod:`ddlscale.sync.planned`), Espresso (:mod:`ddlscale.plan.espresso`) picks
for every tensor one option — dense allreduce, or the configured compressor under allreduce
(summable payloads), allgather, alltoall, gather or zen (sparsifiers), flat or hierarchical — and may fuse tensors
(runs of equal options, or Cupcake's groups of the configured option) where the model says it is
faster. The plan, with each tensor's predicted saving, is printed and saved as ``plan.txt``.

With ``trial_steps`` > 0 (the config's default: 3) the plan is checked on the cluster before it is
kept: Espresso's plan, Cupcake's and dense allreduce take turns for a few steps each and the fastest
measured stays (:class:`~ddlscale.sync.planned.PlannedSync`), so a cost-model error costs those steps only.

``offload`` runs Algorithm 2 (move some compressions to the CPU side device). CompressSync
compresses on the training thread only, so offloaded choices are predictions of what a side stream
would give, not what runs: off by default, and the plan says so when on.
"""

from __future__ import annotations

from ddlscale.plan.planner import configured_option, cupcake_plan, dense_plan, espresso_plan, option_label
from ddlscale.plan.pricing import CostModel
from ddlscale.plan.profile import Profile
from ddlscale.plan.result import CompressionPlan
from ddlscale.sync.planned import PlannedSync


class EspressoSync(PlannedSync):
    """``sync=espresso``. Args (besides :class:`~ddlscale.sync.planned.PlannedSync`'s):

    offload: run Algorithm 2 (side-device compression; modeled, see the module doc).
    fuse: consider fused plans (equal-option runs, Cupcake groups of ``comm``); off: one tensor each.
    """

    system = "espresso"

    def __init__(self, *args, offload: bool = False, fuse: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        for key, value in (("sync.offload", offload), ("sync.fuse", fuse)):
            if not isinstance(value, bool):
                raise ValueError(f"{key} must be true or false, got {value!r}")
        self.offload, self.fuse = offload, fuse

    def compute_plan(self, profile: Profile, model: CostModel) -> CompressionPlan:
        option = configured_option(model, self.comm_scheme, self.hierarchical)
        return espresso_plan(profile, model, cupcake_option=option, offload=self.offload, fuse=self.fuse)

    def candidate_plans(self, profile: Profile, model: CostModel) -> list[CompressionPlan]:
        """Espresso's plan, then the others it must never lose to: Cupcake's groups of the configured
        option and dense allreduce in DDP's buckets."""
        option = configured_option(model, self.comm_scheme, self.hierarchical)
        plans = {"espresso search": self.compute_plan(profile, model),
                 f"cupcake groups of {option_label(model, option)}":
                     cupcake_plan(profile, model, option),
                 "dense, DDP buckets": dense_plan(profile, model, self.first_bucket_bytes, self.bucket_bytes)}
        for label, plan in plans.items():
            plan.context["candidate"] = label
        return list(plans.values())
