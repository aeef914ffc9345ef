"""Planning how gradients are compressed and fused: profile, pricing of an option, Espresso, Cupcake.

- :mod:`.profile`  what a plan is computed from (measured on the first steps, saved as JSON);
- :mod:`.fit`      constant-then-linear compression cost curves;
- :mod:`.aggregation` each aggregation scheme: the compressors it carries and its price;
- :mod:`.pricing`  an option (compressor x scheme x layout x device) as a simulator task;
- :mod:`.frontier` the suffix Pareto-front DP both planners run (exact, or a proven bound when capped);
- :mod:`.cupcake`  the exact dynamic program over fusion split points;
- :mod:`.espresso` the per-tensor option search (brute-force optimum by that DP; Algorithm 2);
- :mod:`.planner`  profile -> :class:`~.result.CompressionPlan`, used by the backends and the tool.

Every plan is scored by :mod:`ddlscale.comm.timeline` — one iteration model for both systems.
"""

from ddlscale.plan.planner import configured_option, cost_model, cupcake_plan, espresso_plan
from ddlscale.plan.pricing import DENSE, CostModel, Option, Unit
from ddlscale.plan.profile import Profile
from ddlscale.plan.result import CompressionPlan

__all__ = ["DENSE", "CompressionPlan", "CostModel", "Option", "Profile", "Unit", "configured_option",
           "cost_model", "cupcake_plan", "espresso_plan"]
