"""What checkpointing every iteration costs the training: none vs blocking vs unpipelined vs Gemini.

    python -m experiments.gemini_overhead [--model gpt] [--nodes 4] [--bandwidth 1gbit] [--steps 60] [--reps 3]
                                          [--device-time 0] [--name gemini_overhead]

Every variant trains the same model on the same emulated cluster (one worker per machine, NICs
shaped to ``--bandwidth``), checkpointing every iteration to m = 2 machines' CPU memory:

- ``none``: no checkpoint;
- ``blocking``: the whole version sent at the end of each step, training waits;
- ``unpipelined``: interleaved into the profiled gaps, one staging sub-buffer (copy, then send);
- ``gemini``: interleaved, 4 staging sub-buffers (copy of chunk i+1 overlaps sending chunk i).

Measured: rank 0's *mean* step time over the steps after profiling (the last half of the run), every
checkpoint stall included; reported per variant and as a ratio to ``none`` per repetition (target:
Gemini's overhead <= 3% with device time), with the median step beside it, and the same for the time
the training thread spent in gradient synchronization — where checkpoint traffic competing for the NIC
shows, and what interleaving is there to protect. The paper measured +10.1% (blocking), +3.5%
(unpipelined) and about 0 (Gemini) on 16 GPU machines.

Here all emulated machines share the host's cores, which the workers' compute saturates, so the
checkpoint's host work (copies, hashes, TCP) competes with training in a way it does not next to
GPUs. ``--device-time T`` adds T seconds per step in which the CPU idles, as while an accelerator
computes (``strategy.device_time_s``). That is the setting the paper measured (GPU machines, host
cores idle during compute) and the one the 3% target is judged on; the committed results
(``experiments/results/gemini_overhead``) use ``--device-time 0.2``. A CPU-bound run (device time 0)
shows what the same work costs when nothing is idle; give it ``--name`` to keep it beside them.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

from experiments.harness import Results, alternating, spread, train

VARIANTS = ("none", "blocking", "unpipelined", "gemini")
PROFILE_STEPS = 10


def _overrides(variant: str, model: str, nodes: int, bandwidth: str, steps: int, device_time: float) -> list[str]:
    common = [f"model={model}", "cluster=emulated", f"cluster.nodes={nodes}", f"cluster.bandwidth={bandwidth}",
              "trainer.devices=1", f"trainer.max_steps={steps}", f"strategy.device_time_s={device_time}"]
    if variant == "none":
        return [*common, "ckpt=none"]
    return [*common, "ckpt=gemini", f"ckpt.mode={variant}", f"ckpt.profile_steps={PROFILE_STEPS}"]


def _late(run: Path, steps: int, column: str) -> list[float]:
    """Rank 0's per-step ``column`` over the last half of the run (after profiling settled)."""
    with open(run / "metrics.csv") as file:
        return [float(r[column]) for r in csv.DictReader(file) if r.get(column) and int(r["step"]) > steps // 2]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--bandwidth", default="1gbit")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--device-time", type=float, default=0.0,
                        help="seconds per step the CPU idles as if an accelerator computed (strategy.device_time_s)")
    parser.add_argument("--name", default="gemini_overhead", help="results folder under experiments/results")
    args = parser.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = Results(args.name)
    rows, times, medians, syncs, extra = [], defaultdict(list), defaultdict(list), defaultdict(list), defaultdict(list)
    total = args.reps * len(VARIANTS)
    for done, (rep, variant) in enumerate(alternating(VARIANTS, args.reps), start=1):
        with tempfile.TemporaryDirectory(prefix="ddlscale-gemini-") as scratch:
            run = Path(scratch) / "run"
            summary = train(_overrides(variant, args.model, args.nodes, args.bandwidth, args.steps, args.device_time), run_dir=run)
            steps = _late(run, args.steps, "step_time_s")
            step, median_step = statistics.fmean(steps), statistics.median(steps)
            sync = statistics.fmean(_late(run, args.steps, "sync_time_s"))
        times[variant].append(step)
        medians[variant].append(median_step)
        syncs[variant].append(sync)
        row = {"variant": variant, "rep": rep, "mean_step_time_s": step, "median_step_time_s": median_step,
               "max_step_time_s": max(steps), "sync_time_s": sync,
               "ckpt_bytes": summary.get("ckpt_bytes"), "ckpt_complete_s": summary.get("ckpt_complete_s"),
               "ckpt_stall_s": summary.get("ckpt_stall_s"), "committed": summary.get("ckpt_committed"),
               "planned_chunks": summary.get("ckpt_interleave_planned_chunks"),
               "idle_s": summary.get("ckpt_interleave_idle_s"), "chunk_s": summary.get("ckpt_interleave_chunk_s"),
               "starved": summary.get("starved")}
        rows.append(row)
        extra[variant].append(row)
        results.progress(done, total, f"rep {rep} {variant}: {step * 1e3:.1f} ms/step")
    results.write_csv(rows)

    table = []
    for variant in VARIANTS:
        ratios = [a / b for a, b in zip(times[variant], times["none"], strict=True)]
        ratio, lo, hi = spread(ratios)
        ckpt = extra[variant][0]
        complete = [r["ckpt_complete_s"] for r in extra[variant] if r["ckpt_complete_s"] is not None]
        sync_ratio = spread([a / b for a, b in zip(syncs[variant], syncs["none"], strict=True)])[0]
        median_ratio = spread([a / b for a, b in zip(medians[variant], medians["none"], strict=True)])[0]
        table.append([variant, spread(times[variant])[0] * 1e3, ratio, lo, hi, median_ratio,
                      spread(syncs[variant])[0] * 1e3, sync_ratio,
                      (ckpt["ckpt_bytes"] or 0) / 2**20, statistics.median(complete) * 1e3 if complete else "-",
                      ("yes" if ratio <= 1.03 else "no") if variant == "gemini" else "-"])
    # What bounds training without checkpoints: its wait for communication against its CPU work.
    sync_ms = spread(syncs["none"])[0] * 1e3
    cpu_ms = spread(times["none"])[0] * 1e3 - sync_ms - args.device_time * 1e3
    results.write_markdown(
        "Checkpointing every iteration: iteration time side by side",
        ["variant", "mean ms/step", "mean vs none (median of reps)", "min", "max", "median step vs none",
         "sync ms/step", "sync vs none", "checkpoint MiB per rank", "checkpoint complete ms", "Gemini overhead <= 3%"],
        table,
        notes=f"{args.nodes} emulated machines x 1 worker, {args.bandwidth} NICs, model={args.model}, "
              f"emulated device time {args.device_time:g} s per step (CPU idle, as while a GPU computes), "
              f"{args.steps} steps, step time = rank 0's mean over steps > {args.steps // 2}, stalls included "
              f"(each repetition's ratio to none's, then the median over repetitions, min and max); m = 2 replicas "
              f"(own machine + its group peer), every replica MACed (HMAC-SHA256) by its sender and by its "
              f"holder; {args.reps} alternating repetitions. Target: Gemini's overhead <= 3% with device time. "
              "All machines share this host's cores, so checkpoint copies and hashing compete with training "
              "compute here, unlike on separate machines.",
        summary={
            "Compared": "iteration time with no checkpoint, blocking, unpipelined and Gemini checkpoints every "
                        "iteration (m = 2 replicas, HMAC-SHA256).",
            "Emulation": f"{args.nodes} emulated machines, one worker each, {args.bandwidth} NICs, model {args.model}, "
                         f"{args.device_time:g} s device time per step (the CPU idles as next to a GPU), on this "
                         f"host's {os.cpu_count()} cores.",
            "Bound by": f"{'the host CPU' if cpu_ms > sync_ms else 'the network'}, measured: without checkpoints "
                        f"sync took {sync_ms:.0f} ms of the {spread(times['none'])[0] * 1e3:.0f} ms step against "
                        f"{cpu_ms:.0f} ms of CPU work (the rest, {args.device_time * 1e3:.0f} ms, device time); Gemini added {(spread(times['gemini'])[0] - spread(times['none'])[0]) * 1e3:.0f} ms "
                        f"per step, {(spread(syncs['gemini'])[0] - spread(syncs['none'])[0]) * 1e3:.0f} ms of it in "
                        "sync (medians).",
            "Repetitions": f"{args.reps}, alternating, {args.steps} steps each (mean over the last {args.steps // 2}).",
            "Answer": f"Gemini costs {(table[-1][2] - 1):.1%} ({table[-1][3]:.3f}-{table[-1][4]:.3f}x no checkpoint; "
                      f"target <= 3%); blocking costs "
                      f"{table[1][2] - 1:.0%}.",
        },
        command=f"python -m experiments.gemini_overhead --model {args.model} --nodes {args.nodes} "
                f"--bandwidth {args.bandwidth} --steps {args.steps} --reps {args.reps} --device-time {args.device_time:g}"
                + (f" --name {args.name}" if args.name != "gemini_overhead" else ""),
    )
    fig, ax = plt.subplots(figsize=(5, 3.2))
    medians = [spread(times[v])[0] * 1e3 for v in VARIANTS]
    ax.bar(VARIANTS, medians, color=["grey", "tab:red", "tab:orange", "tab:green"])
    for i, v in enumerate(VARIANTS):
        ax.plot([i] * len(times[v]), [t * 1e3 for t in times[v]], "k.", markersize=4)
    ax.set_ylabel("ms per iteration")
    ax.set_title(f"checkpoint every iteration ({args.model}, {args.nodes} machines, {args.bandwidth})")
    fig.tight_layout()
    fig.savefig(results.figure_path())
    print((results.dir / "results.md").read_text())


if __name__ == "__main__":
    main()
