"""The compressing syncs: ``sync=compress`` and the planned ``sync=espresso`` / ``sync=cupcake``.

The compressors and error-feedback memories themselves live in :mod:`ddlscale.compress`; this
package decides how their payloads travel (:mod:`.schemes`), runs a plan's choices inside the
GradSync seam (:mod:`.backend`), carries their state across regroupings (:mod:`.regroup`), and
profiles, plans and executes (:mod:`.planned`, with the plans of :mod:`ddlscale.plan`).
"""

from ddlscale.plan.choices import Choices, TensorChoice
from ddlscale.sync.compressed.backend import CompressSync
from ddlscale.sync.compressed.planned import CupcakeSync, EspressoSync, PlannedSync
from ddlscale.sync.compressed.schemes import SCHEMES

__all__ = ["SCHEMES", "CompressSync", "CupcakeSync", "EspressoSync", "Choices", "PlannedSync", "TensorChoice"]
