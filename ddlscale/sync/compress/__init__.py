"""``sync=compress``: compressed gradient synchronization through aggregation schemes and plans.

The compressors and error-feedback memories themselves live in :mod:`ddlscale.compress`; this
package decides how their payloads travel (:mod:`.schemes`), which tensor gets what (:mod:`ddlscale.plan.choices`)
and runs it inside the GradSync seam (:mod:`.backend`).
"""

from ddlscale.plan.choices import Plan, TensorPlan
from ddlscale.sync.compress.backend import CompressSync
from ddlscale.sync.compress.schemes import SCHEMES

__all__ = ["SCHEMES", "CompressSync", "Plan", "TensorPlan"]
