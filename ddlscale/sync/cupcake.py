"""``sync=cupcake``: the configured compressor on fusion groups chosen by Cupcake's exact DP.

Tensors are partitioned, in backward order, into contiguous groups; each group is one flat buffer
compressed once with the configured compressor and aggregated by ``sync.comm`` (flat, or
hierarchical with ``sync.hierarchical``). The partition minimizes the simulated iteration time
(:mod:`ddlscale.plan.cupcake`) on the profile of the first steps (:mod:`ddlscale.sync.planned`).
With ``compressor=none`` it plans the fusion of dense allreduce alone (optimal buckets).
"""

from __future__ import annotations

from ddlscale.plan.planner import configured_option, cupcake_plan
from ddlscale.plan.pricing import CostModel
from ddlscale.plan.profile import Profile
from ddlscale.plan.result import CompressionPlan
from ddlscale.sync.planned import PlannedSync


class CupcakeSync(PlannedSync):
    """``sync=cupcake``; every argument is :class:`~ddlscale.sync.planned.PlannedSync`'s."""

    system = "cupcake"

    def compute_plan(self, profile: Profile, model: CostModel) -> CompressionPlan:
        return cupcake_plan(profile, model, configured_option(model, self.comm_scheme, self.hierarchical))
