"""SLURM: whether a ``cluster=slurm`` run can go ahead here, asked of SLURM and Lightning themselves.

A ``cluster=slurm`` run trains in a SLURM job's tasks, one per device: Hydra's submitit launcher
(``python train.py -m cluster=slurm ...``) submits each sweep job and its tasks run the app, or the
user starts the tasks with ``srun`` inside an allocation. Anywhere else the run would train on this
machine while recording ``cluster: slurm``; it is refused in one line before anything starts, saying
whether a SLURM controller answers here at all (``scontrol ping``, SLURM's own check).
"""

from __future__ import annotations

import os
import shutil
import subprocess

from omegaconf import OmegaConf

PING_TIMEOUT_S = 15.0  # a live controller answers at once
GPU_ACCELERATORS = ("gpu", "cuda")


def in_task() -> bool:
    """This process is one of a SLURM job's tasks: Lightning's own test (``SLURM_NTASKS`` set, and the
    allocation not an interactive shell's), the one that makes it take its ranks from SLURM."""
    from lightning_fabric.plugins.environments import SLURMEnvironment

    return SLURMEnvironment.detect()


def controller_unreachable() -> str | None:
    """Why no job can be submitted from here (None: the SLURM controller answers ``scontrol ping``)."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return "no SLURM here (scontrol is not on PATH)"
    conf = os.environ.get("SLURM_CONF")
    if conf and not os.path.isfile(conf):  # scontrol would retry for a minute before saying so
        return f"SLURM_CONF={conf} is no file"
    try:
        ping = subprocess.run([scontrol, "ping"], capture_output=True, text=True, timeout=PING_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"scontrol ping had no answer in {PING_TIMEOUT_S:.0f} s"
    if ping.returncode == 0 and " is UP" in ping.stdout:
        return None
    said = [line.strip() for line in (ping.stderr + ping.stdout).splitlines()]
    # The line that says why: a fatal error ("Could not establish a configuration source"), or
    # "Slurmctld(primary) at HOST is DOWN" (followed by a banner of asterisks).
    why = next((line for line in reversed(said) if "fatal: " in line or " is DOWN" in line), None)
    why = why or next((line for line in reversed(said) if line and "*" not in line), f"exit code {ping.returncode}")
    return f"no SLURM controller answers here (scontrol ping: {why.rpartition('fatal: ')[2]})"


def cannot_submit() -> str | None:
    """Why a ``cluster=slurm`` sweep cannot submit its jobs from here (None: it can)."""
    unreachable = controller_unreachable()
    if unreachable is None:
        return None
    return f"cluster=slurm trains through SLURM, and {unreachable}; cluster=local trains on this machine"


def refusal() -> str:
    """Why a ``cluster=slurm`` run cannot train in this process, which is not a SLURM task."""
    # srun's tasks each compose their own Hydra run: one hydra.run.dir, or each would pick its own time.
    return cannot_submit() or (
        "cluster=slurm trains in a SLURM job's tasks, and this process is not one: submit it with -m "
        "(python train.py -m cluster=slurm ...: Hydra's submitit launcher), or start a task per device "
        "with srun --ntasks-per-node, giving them one hydra.run.dir")


def gpus_per_node(accelerator: str, devices: int) -> int | None:
    """``hydra.launcher.gpus_per_node`` of ddlscale/conf/cluster/slurm.yaml: a GPU per task when the trainer runs on
    GPUs, none asked otherwise (SLURM refuses a job that asks for GPUs its nodes do not have)."""
    return devices if str(accelerator).lower() in GPU_ACCELERATORS else None


OmegaConf.register_new_resolver("ddlscale_slurm_gpus", gpus_per_node, replace=True)
