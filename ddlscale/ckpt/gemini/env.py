"""What a launcher tells Gemini's ranks through the environment: the job's store and the machine layout.

The launchers of :mod:`~ddlscale.ckpt.gemini.services` set these (with ``$DDLSCALE_JOB``,
:data:`ddlscale.cluster.context.JOB_ENV`, and ``$DDLSCALE_SECRET_FILE``); on a real cluster the user
exports them.
"""

from __future__ import annotations

import os

STORE_ENV, MACHINE_ENV, MACHINES_ENV = "DDLSCALE_STORE", "DDLSCALE_MACHINE", "DDLSCALE_MACHINES"


def machine_count(default: int) -> int:
    """Machines the placement spans: the launcher's ``$DDLSCALE_MACHINES``, else ``default``."""
    return int(os.environ.get(MACHINES_ENV, default))


def machine_layout(rank: int, world: int, node_rank: int, nodes: int) -> tuple[int, int]:
    """(this rank's machine, machines) for placement.

    ``$DDLSCALE_MACHINE`` where the launcher set it; else with as many machines as ranks (cluster=local:
    an agent per rank) each rank is its own machine; else one machine per node (the launcher's node
    rank: torchrun's GROUP_RANK, SLURM's node id). Never one per rank by default: with several ranks
    per node, placement could make two ranks of one node each other's only copy.
    """
    machines = machine_count(nodes)
    if os.environ.get(MACHINE_ENV):
        return int(os.environ[MACHINE_ENV]), machines
    if machines == world:
        return rank, machines
    if machines == nodes:
        return node_rank, machines
    raise ValueError(f"ckpt=gemini: {MACHINES_ENV}={machines} machines but {nodes} nodes and {world} ranks: "
                     f"set {MACHINE_ENV} to each rank's machine")
