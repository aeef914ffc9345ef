"""``python -m ddlscale.testing.drill recover``: Gemini recovering a machine killed mid-run, in about two
minutes (root: the emulated cluster).

Two emulated machines train a small cnn with ``ckpt=gemini`` (each rank's state checkpointed into its
group peer's CPU memory every step). Once a few versions are committed, every process of machine 1 is
killed (its trainer, replica agent and torchrun agent: a lost machine); when the job's root agent has
noticed, a replacement starts at the same address, fetches its rank's last committed version from
machine 0's memory, and the job goes on. It prints where each rank recovered from, how many steps were
re-run, and the losses of those steps before the kill and after it: equal, since training resumed from
exactly the state that produced them.
"""

from __future__ import annotations

import argparse
import csv
import json
import tempfile
import time
from pathlib import Path
from typing import Any

MODEL = ["model=cnn", "model.width=16", "model.num_blocks=2", "model.image_size=8", "model.num_samples=1024",
         "trainer.enable_progress_bar=false"]


def step_losses(run_dir: Path) -> dict[int, list[str]]:
    """{step: its losses in the order written}: a run restarted in its own directory appends the steps
    it re-runs, so a step written before the failure and again after it has two."""
    seen: dict[int, list[str]] = {}
    with open(run_dir / "metrics.csv") as file:
        for row in csv.DictReader(file):
            if row.get("step", "").isdigit() and row.get("train_loss"):
                seen.setdefault(int(row["step"]), []).append(row["train_loss"])
    return seen


def report(run_dir: Path, killed_after: int, seconds_to_replace: float) -> list[str]:
    summary: dict[str, Any] = json.loads((run_dir / "summary.json").read_text())
    recovery = summary.get("ckpt_recovery") or {}
    losses = step_losses(run_dir)
    rerun = {step: values for step, values in losses.items() if len(values) > 1}
    resumed = summary.get("ckpt_resumed_step")
    lines = [f"ddlscale drill: machine 1 killed after version {killed_after} was committed (every process on it); "
             f"replaced {seconds_to_replace:.1f} s later",
             f"  every rank recovered from: {', '.join(map(str, summary.get('ckpt_recovery_sources') or []))} "
             f"(rank 0 read its version in {recovery.get('retrieve_s', float('nan')) * 1e3:.1f} ms)",
             f"  resumed at step {resumed}; {len(rerun)} steps re-run, "
             f"{summary.get('steps')} in all, final loss {summary.get('final_loss'):.4f}"]
    if resumed is not None:
        around = [f"{step}: {float(losses[step][-1]):.4f}" for step in range(resumed - 2, resumed + 2) if step in losses]
        lines.append(f"  loss by step around the resume: {', '.join(around)}")
    if rerun:
        same = all(len(set(values)) == 1 for values in rerun.values())
        shown = ", ".join(f"step {s}: {' / '.join(v)}" for s, v in sorted(rerun.items())[:4])
        lines.append(f"  losses of the re-run steps, before the kill / after: {shown}"
                     f"{' ...' if len(rerun) > 4 else ''} ({'identical' if same else 'DIFFERENT'})")
    lines.append(f"  run directory: {run_dir} (summary.json, metrics.csv, logs/)")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ddlscale.testing.drill recover", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40, help="training steps of the job")
    parser.add_argument("--kill-after", type=int, default=10, help="kill machine 1 once this version is committed")
    parser.add_argument("--run-dir", type=Path, default=None, help="where the job writes (default: a new temporary one)")
    args = parser.parse_args(argv)
    if not 0 < args.kill_after < args.steps:
        parser.error(f"--kill-after must be in (0, --steps={args.steps}); got {args.kill_after}")
    from ddlscale.cluster.emulated import unavailable_reason
    from ddlscale.testing.drill import GeminiDrill

    reason = unavailable_reason()
    if reason is not None:
        parser.exit(2, f"the drill needs the emulated cluster, unavailable here: {reason}\n")
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="ddlscale-recover-")) / "run"
    overrides = [*MODEL, f"trainer.max_steps={args.steps}", "ckpt=gemini"]
    with GeminiDrill(2, overrides, run_dir) as drill:
        killed_after = drill.wait_committed(args.kill_after)
        drill.kill_machine(1)
        killed = time.monotonic()
        drill.wait_failed([1])  # the root agent notices the silence; then the operator replaces the machine
        drill.replace(1)
        replaced = (time.monotonic() - killed) / drill.k
        drill.finish()
    print("\n".join(report(run_dir, killed_after, replaced)), flush=True)
