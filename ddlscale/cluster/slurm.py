"""SLURM: whether a ``cluster=slurm`` run can go ahead here, asked of SLURM and Lightning themselves.

A ``cluster=slurm`` run trains in a SLURM job's tasks, one per device: Hydra's submitit launcher
(``python train.py -m cluster=slurm ...``) submits each sweep job and its tasks run the app, or the
user starts the tasks with ``srun`` inside an allocation. Anywhere else the run would train on this
machine while recording ``cluster: slurm``; it is refused in one line before anything starts, saying
whether a SLURM controller answers here at all (``scontrol ping``, SLURM's own check).
"""

from __future__ import annotations

import shutil
import subprocess

from omegaconf import OmegaConf

# scontrol retries a missing slurm.conf for 60 s before it gives up; a live controller answers at once.
PING_TIMEOUT_S = 15.0
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
    try:
        ping = subprocess.run([scontrol, "ping"], capture_output=True, text=True, timeout=PING_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"scontrol ping had no answer in {PING_TIMEOUT_S:.0f} s"
    if ping.returncode == 0 and " is UP" in ping.stdout:
        return None
    said = [line for line in (ping.stderr + ping.stdout).splitlines() if line.strip()]
    # SLURM's last line says why (a fatal error, or "Slurmctld(primary) at HOST is DOWN").
    last = said[-1].split(": ", 1)[-1].removeprefix("fatal: ").strip() if said else f"exit code {ping.returncode}"
    return f"no SLURM controller answers here (scontrol ping: {last})"


def cannot_submit(what: str = "cluster=slurm") -> str | None:
    """Why ``what`` (the choice that sends jobs to SLURM) cannot submit from here (None: it can)."""
    unreachable = controller_unreachable()
    if unreachable is None:
        return None
    return f"{what} trains through SLURM, and {unreachable}; cluster=local trains on this machine"


def refusal() -> str:
    """Why a ``cluster=slurm`` run cannot train in this process, which is not a SLURM task."""
    return cannot_submit() or (
        "cluster=slurm trains in a SLURM job's tasks, and this process is not one: submit it with -m "
        "(python train.py -m cluster=slurm ...: Hydra's submitit launcher), or start it with srun")


def gpus_per_node(accelerator: str, devices: int) -> int | None:
    """``hydra.launcher.gpus_per_node`` of conf/cluster/slurm.yaml: a GPU per task when the trainer runs on
    GPUs, none asked otherwise (a CPU job that asked for GPUs would wait for nodes that have them)."""
    return devices if str(accelerator).lower() in GPU_ACCELERATORS else None


OmegaConf.register_new_resolver("ddlscale_slurm_gpus", gpus_per_node, replace=True)
