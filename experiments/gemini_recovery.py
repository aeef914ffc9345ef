"""Time wasted per failure, measured whole: Gemini vs disk checkpoints every ceil(t_ckpt/T_iter) steps
(HighFreq) vs rarely (strawman), steady-state overhead included.

    python -m experiments.gemini_recovery [--model gpt] [--nodes 4] [--bandwidth 1gbit] [--device-time 0.2]
                                          [--storage-fraction 20] [--failures 3] [--reps 4] [--seed 0]
                                          [--dilation auto]

Every strategy trains the same model on the same emulated cluster, with ``strategy.device_time_s`` as
an accelerator would take (the host CPU idles that long per step), while the drill kills a random
machine's training process at a random moment, ``--failures`` times per run; torchrun restarts the
workers and the strategy's checkpoint brings them back. ``none`` trains with no checkpoint and no
failure: the iteration time the others are measured against. Storage is throttled to
1/``storage-fraction`` of the NIC bandwidth, both ways (the paper's setting: 20 Gbps storage next to
a 400 Gbps network). Strategies alternate within each repetition. The cluster runs time-dilated
(``--dilation``, as ``cluster.dilation``; ``auto``: the k the host's probe picks for this shape), so
that the emulated machines, not the 2-core host, decide an iteration or a restart; every time below
is in emulated seconds.

- ``gemini``: every iteration into CPU memory of 2 machines (own + group peer), persisted rarely;
- ``highfreq``: ``ckpt=disk`` (DCP ``async_save``) every K = ceil(t_ckpt / T_iter) steps, t_ckpt timed
  on a probe checkpoint that training does not wait for; any wait of a save for the version before it
  is part of its iterations;
- ``strawman``: ``ckpt=disk`` (DCP ``async_save``) every ``--strawman-every`` steps.

From rank 0's progress log (``ckpt_progress.log``):

* **iteration time** — the mean over every step that made new progress (replays after a failure are
  lost progress, counted there; the first step after each start is excluded as warm-up), checkpoint
  stalls included; **overhead** = that mean over ``none``'s in the same repetition, minus 1;
* per failure: **restart** (kill until the restarted workers hold their state, retrieval excluded),
  split into *torchrun* (kill until the new worker process launched: noticing the death, stopping the
  group, re-rendezvous, spawning), *start-up* (launch until the checkpointer's set-up: interpreter,
  imports, Hydra, trainer, process group) and *restore* (set-up until resumed, retrieval excluded:
  store and agents, Lightning's restore); **retrieval** (loading the checkpoint); **lost progress**
  (recomputing up to the step the failure hit);
* **total wasted time per failure** = restart + retrieval + lost progress + the overhead paid between
  two failures: MTBF x (1 - T_none / T_strategy), MTBF = 1 day / (machines x failure rate), at 1.5%
  failures per machine-day (SYSTEMS.md) on the paper's 16 machines and on 1000.

Then a simulation at 1000 machines and 1.5% failures per machine-day gives the effective training time
ratio (useful time / wall time) from each strategy's measured per-failure cost and measured overhead.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from ddlscale.ckpt.checkpointer import PROGRESS_FILE
from ddlscale.cluster.dilation import AUTO, choose
from ddlscale.cluster.dilation import parse as parse_dilation
from ddlscale.testing.drill import GeminiDrill
from ddlscale.trainer.loggers import metrics_rows
from ddlscale.units import parse_bandwidth
from experiments.harness import Results, alternating

STRATEGIES = ("none", "gemini", "highfreq", "strawman")
FAILURES_PER_MACHINE_DAY = 0.015
OVERHEAD_TARGET = 0.02  # Gemini's steady overhead over no checkpoint (issue 44)
RATIO_TARGET = 10.0  # HighFreq's total wasted time per failure over Gemini's
# A run with an iteration this many times its median keeps its workers' logs (results folder, stalls/):
# they say what the training thread waited for (ckpt=disk notes waits on a previous version's write).
STALL_FACTOR = 5.0
CLUSTERS = (16, 1000)  # the paper's testbed, and its simulation


def _overrides(strategy: str, args: argparse.Namespace, storage: str) -> list[str]:
    common = [f"model={args.model}", f"trainer.max_steps={args.steps}", "trainer.enable_progress_bar=false",
              f"strategy.device_time_s={args.device_time}"]
    if strategy == "none":
        # The progress log needs a checkpointer: a disk tier that never fires within the run.
        return [*common, "ckpt=disk", f"ckpt.every={10 * args.steps}"]
    if strategy == "gemini":
        return [*common, "ckpt=gemini", "ckpt.profile_steps=10", f"ckpt.persist_every={10 * args.steps}",
                f"ckpt.persist_bandwidth={storage}"]
    every = "highfreq" if strategy == "highfreq" else str(args.strawman_every)
    return [*common, "ckpt=disk", f"ckpt.every={every}", f"ckpt.bandwidth={storage}", "ckpt.resume=auto",
            "ckpt.keep=2"]


def read_progress(path: Path) -> list[tuple[str, int, float, float]]:
    """(kind, step, unix, retrieve_s) per line of a progress log."""
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split()
        rows.append((parts[0], int(parts[1]), float(parts[2]), float(parts[3]) if len(parts) > 3 else 0.0))
    return rows


def iteration_times(rows: list[tuple[str, int, float, float]]) -> list[float]:
    """Seconds of every step that made new progress, the first after each (re)start excluded."""
    out, best, previous = [], 0, None
    for kind, step, unix, _ in rows:
        if kind != "step":
            if kind in ("start", "resumed"):
                previous = None
            continue
        if previous is not None and step == previous[0] + 1 and step > best:
            out.append(unix - previous[1])
        best = max(best, step)
        previous = (step, unix)
    return out


def split_failure(rows: list[tuple[str, int, float, float]], t_kill: float) -> dict[str, float]:
    """Restart (and its parts), retrieval and lost progress of the failure injected at ``t_kill``."""
    before = [r for r in rows if r[0] == "step" and r[2] < t_kill]
    step_at_kill = before[-1][1] if before else 0
    after = [r for r in rows if r[2] > t_kill]
    resumed = next((r for r in after if r[0] in ("resumed", "start")), None)
    if resumed is None:
        raise RuntimeError(f"no restart after the failure at {t_kill}")
    _, resumed_step, t_resumed, retrieve_s = resumed
    launched = next((r[2] for r in after if r[0] == "launched" and r[2] < t_resumed), math.nan)
    setup = next((r[2] for r in after if r[0] == "setup" and r[2] < t_resumed), math.nan)
    back = [r for r in rows if r[0] == "step" and r[2] > t_resumed and r[1] >= step_at_kill]
    t_back = back[0][2] if back and step_at_kill > resumed_step else t_resumed
    return {"step_at_kill": step_at_kill, "resumed_step": resumed_step, "lost_steps": step_at_kill - resumed_step,
            "restart_s": t_resumed - t_kill - retrieve_s, "torchrun_s": launched - t_kill,
            "startup_s": setup - launched, "restore_s": t_resumed - setup - retrieve_s, "retrieve_s": retrieve_s,
            "lost_progress_s": t_back - t_resumed, "wasted_s": t_back - t_kill}


def ready_for_failure(rows: list[tuple[str, int, float, float]], failure: int, warmup_steps: int) -> bool:
    """Whether failure ``failure`` (0-based) may be injected: training (re)started after the previous one,
    ran ``warmup_steps`` steps since, and went past every step trained before, so that the previous
    failure's lost progress is measured whole, not cut short by this one (whose restart it would count)."""
    starts = [i for i, r in enumerate(rows) if r[0] in ("start", "resumed")]
    if len(starts) <= failure:
        return False
    since = [r[1] for r in rows[starts[-1]:] if r[0] == "step"]
    before = [r[1] for r in rows[:starts[-1]] if r[0] == "step"]
    return len(since) >= warmup_steps and max(since) > max(before, default=0)


def sync_seconds(run: Path, steps: int) -> list[float]:
    """Rank 0's communication wait per step (``sync_time_s``) over the run's second half."""
    return [float(r["sync_time_s"]) for r in metrics_rows(run)
            if r.get("sync_time_s") and r.get("step") and int(r["step"]) > steps // 2]


def run_strategy(strategy: str, args: argparse.Namespace, rng: random.Random,
                 keep: Path | None = None) -> tuple[list[dict], list[float], list[float]]:
    """The failures of one run (none for ``none``), its iteration times and its per-step sync times; a
    run that stalled keeps its logs and progress log in ``keep``."""
    storage = f"{parse_bandwidth(args.bandwidth) / args.storage_fraction:.0f}bit"
    failures = 0 if strategy == "none" else args.failures
    with tempfile.TemporaryDirectory(prefix="ddlscale-recovery-") as scratch:
        run = Path(scratch) / "run"
        progress = run / PROGRESS_FILE
        kills = []
        with GeminiDrill(args.nodes, _overrides(strategy, args, storage), run, bandwidth=args.bandwidth,
                         max_restarts=failures + 2, dilation=args.k) as drill:
            for failure in range(failures):
                # A random moment once training has run a while since its latest (re)start.
                while not (progress.exists() and ready_for_failure(read_progress(progress), failure, args.warmup_steps)):
                    time.sleep(0.05)
                time.sleep(rng.uniform(0, args.window_s) * args.k)
                kills.append(drill.kill_trainer(rng.randrange(args.nodes)))
            drill.finish(timeout_s=1800)
        rows = read_progress(progress)
        syncs = sync_seconds(run, args.steps)
        iterations = iteration_times(rows)
        if keep is not None and iterations and max(iterations) > STALL_FACTOR * statistics.median(iterations):
            shutil.copytree(run / "logs", keep, dirs_exist_ok=True)
            shutil.copy(progress, keep / PROGRESS_FILE)
    return [split_failure(rows, t) for t in kills], iterations, syncs


# -- the 1000-machine simulation -------------------------------------------------------------------
def simulate(machines: int, failures_per_machine_day: float, wasted_s: float, overhead: float, days: float = 30,
             seed: int = 0) -> float:
    """Effective training-time ratio: Poisson failures over the cluster, each wasting ``wasted_s`` of
    wall time (a failure during the recovery of another restarts it), and ``overhead`` the fraction
    by which checkpointing slows steady training (useful time = running time / (1 + overhead))."""
    rng = random.Random(seed)
    rate = machines * failures_per_machine_day / 86400.0
    horizon, t, useful = days * 86400.0, 0.0, 0.0
    while t < horizon:
        gap = rng.expovariate(rate)
        run_time = min(gap, horizon - t)
        useful += run_time / (1 + overhead)
        t += run_time
        if t >= horizon:
            break
        recovery_end = t + wasted_s  # lost progress is recomputed, restart and retrieval are idle
        while t < horizon:  # failures during recovery extend it
            nxt = t + rng.expovariate(rate)
            if nxt >= recovery_end:
                break
            t, recovery_end = nxt, nxt + wasted_s
        t = min(recovery_end, horizon)
    return useful / horizon


def import_seconds(processes: int, reps: int = 3) -> list[float]:
    """Wall time of ``processes`` fresh interpreters importing train.py's modules at once, as a restart's
    workers do on this shared host: the part of start-up that is torch's, Lightning's and ours to import."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, "-c", "import ddlscale.trainer"]) for _ in range(processes)]
        for proc in procs:
            proc.wait()
        times.append(time.perf_counter() - start)
    return times


def mtbf_s(machines: int) -> float:
    return 86400.0 / (machines * FAILURES_PER_MACHINE_DAY)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--bandwidth", default="1gbit")
    parser.add_argument("--device-time", type=float, default=0.2)
    parser.add_argument("--storage-fraction", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--failures", type=int, default=3)
    parser.add_argument("--warmup-steps", type=int, default=15)
    parser.add_argument("--window-s", type=float, default=4.0)
    parser.add_argument("--strawman-every", type=int, default=60)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dilation", default=AUTO, help="the cluster's time dilation k, or auto (cluster.dilation)")
    parser.add_argument("--name", default="gemini_recovery")
    args = parser.parse_args(argv)
    choice = choose(parse_dilation(args.dilation, "--dilation"), args.nodes, 1, parse_bandwidth(args.bandwidth), 0.0)
    args.k = choice.k

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = Results(args.name)
    results.dilation = args.k
    results.progress(0, 0, choice.describe())
    # Emulated seconds: capped at 1/k core each under dilation, the workers import k times slower in wall time.
    imports = [t / args.k for t in import_seconds(args.nodes)]
    results.progress(0, 0, f"{args.nodes} interpreters importing train.py's modules at once: "
                     + ", ".join(f"{t:.1f}s" for t in imports))
    rows, runs, per, t_iter, t_sync = [], [], defaultdict(list), defaultdict(dict), defaultdict(dict)
    total = args.reps * len(STRATEGIES)
    for done, (rep, strategy) in enumerate(alternating(STRATEGIES, args.reps), start=1):
        rng = random.Random(args.seed * 1000 + rep)  # the same failure schedule for every strategy
        failures, iterations, syncs = run_strategy(strategy, args, rng, results.dir / "stalls" / f"{strategy}-rep{rep}")
        t_iter[strategy][rep] = statistics.fmean(iterations)
        t_sync[strategy][rep] = statistics.fmean(syncs) if syncs else math.nan
        runs.append({"strategy": strategy, "rep": rep, "mean_iteration_s": t_iter[strategy][rep],
                     "median_iteration_s": statistics.median(iterations), "max_iteration_s": max(iterations),
                     "iterations": len(iterations), "mean_sync_s": t_sync[strategy][rep]})
        for i, failure in enumerate(failures):
            rows.append({"strategy": strategy, "rep": rep, "failure": i, **failure})
            per[strategy].append(failure)
        results.progress(done, total, f"rep {rep} {strategy}: {t_iter[strategy][rep] * 1e3:.1f} ms/iteration; wasted "
                         + ", ".join(f"{f['wasted_s']:.1f}s" for f in failures))
    results.write_csv(rows)  # one row per failure
    results.write_csv(runs, "iterations.csv")  # one row per run
    reps = range(args.reps)

    def median(strategy: str, key: str) -> float:
        return statistics.median(f[key] for f in per[strategy])

    overhead = {s: statistics.median(t_iter[s][r] / t_iter["none"][r] - 1 for r in reps) for s in STRATEGIES}
    # What bounds the step without checkpoints: its communication wait against its CPU work (the step less
    # that wait and the emulated device time).
    none_step, none_sync = statistics.median(t_iter["none"].values()), statistics.median(t_sync["none"].values())
    none_cpu = none_step - none_sync - args.device_time
    bound = "the network" if none_sync > none_cpu else "the host's CPU"
    table, totals = [], defaultdict(dict)
    for s in STRATEGIES[1:]:
        waste = median(s, "wasted_s")
        row = [s, len(per[s]), statistics.median(t_iter[s].values()) * 1e3, 100 * overhead[s],
               median(s, "lost_steps"), median(s, "restart_s"), median(s, "torchrun_s"), median(s, "startup_s"),
               median(s, "restore_s"), median(s, "retrieve_s"), median(s, "lost_progress_s"), waste]
        for n in CLUSTERS:
            # Overhead paid between two failures; a measured overhead below zero is noise and costs nothing.
            totals[n][s] = waste + mtbf_s(n) * max(0.0, 1 - 1 / (1 + overhead[s]))
            row.append(totals[n][s])
        table.append(row)
    ratios = {n: totals[n]["highfreq"] / totals[n]["gemini"] for n in CLUSTERS}
    sim_rows = []
    for s in STRATEGIES[1:]:
        measured = simulate(1000, FAILURES_PER_MACHINE_DAY, median(s, "wasted_s"), max(0.0, overhead[s]), seed=args.seed)
        sim_rows.append([s, median(s, "wasted_s"), 100 * overhead[s], measured])
    lines = ["", f"## 1000 machines, {100 * FAILURES_PER_MACHINE_DAY:g}% failures per machine-day (30 simulated days)",
             "", "Each strategy's measured per-failure waste (restart + retrieval + lost progress) and its measured "
             "steady-state overhead.", "",
             "| strategy | wasted s/failure | overhead % | effective training time ratio |", "|---|---|---|---|"]
    lines += ["| " + " | ".join(f"{c:.4g}" if isinstance(c, float) else str(c) for c in r) + " |" for r in sim_rows]
    results.write_markdown(
        "Time wasted per failure, overhead included: Gemini vs HighFreq vs a rare checkpoint",
        ["strategy", "failures", "mean T_iter ms", "overhead %", "lost steps", "restart s", "torchrun s",
         "start-up s", "restore s", "retrieval s", "lost progress s", "wasted s (excl. overhead)",
         *[f"total s/failure, {n} machines" for n in CLUSTERS]],
        table,
        notes=f"{args.nodes} emulated machines x 1 worker, {args.bandwidth} NICs, emulated device time "
              f"{args.device_time:g} s per step, storage at 1/{args.storage_fraction:g} of the NIC rate both ways, "
              f"model={args.model}, {args.steps} steps, {args.failures} software failures (a random machine's trainer "
              f"killed at a random moment) per run, {args.reps} alternating repetitions; none's mean iteration "
              f"{statistics.median(t_iter['none'].values()) * 1e3:.1f} ms (median over repetitions). Start-up "
              f"includes importing torch, Lightning and ddlscale: {args.nodes} fresh interpreters doing only that, "
              f"at once, took {statistics.median(imports):.1f} s (median of {', '.join(f'{t:.1f}' for t in imports)}) "
              f"here (host seconds / k, k = {args.k:g}). Medians over "
              "all failures and repetitions; overhead = median over repetitions of mean T_iter / none's - 1. "
              f"Totals add MTBF x (1 - T_none/T_iter) at {100 * FAILURES_PER_MACHINE_DAY:g}% failures per "
              f"machine-day (MTBF {mtbf_s(16) / 3600:.0f} h on 16 machines, {mtbf_s(1000) / 60:.0f} min on 1000). "
              f"Targets: Gemini overhead <= {100 * OVERHEAD_TARGET:g}%: {100 * overhead['gemini']:.2f}%; "
              f"total wasted per failure >= {RATIO_TARGET:g}x lower than HighFreq's: " + "; ".join(
                  f"{n} machines {ratios[n]:.1f}x" for n in CLUSTERS)
              + ".\n" + "\n".join(lines),
        summary={
            "Compared": "time wasted per failure by Gemini, HighFreq (a disk checkpoint every K iterations, K from a "
                        "probe checkpoint's time) and a rare disk checkpoint under real kills, with each one's steady "
                        "overhead; a 1000-machine projection.",
            "Emulation": f"{args.nodes} emulated machines, one worker each, {args.bandwidth} NICs, storage at "
                         f"1/{args.storage_fraction:g} of that rate, model {args.model}, {args.device_time:g} s device "
                         f"time per step, on this host's {os.cpu_count()} cores.",
            "Bound by": f"training without checkpoints: {bound}, measured: its step of {none_step * 1e3:.0f} ms waited "
                        f"{none_sync * 1e3:.0f} ms for communication against {none_cpu * 1e3:.0f} ms of CPU work "
                        f"({args.device_time * 1e3:.0f} ms device time; medians, iterations.csv). Each failure is "
                        f"bound by restart (Gemini: {median('gemini', 'restart_s'):.1f} s, "
                        f"{median('gemini', 'startup_s'):.1f} s of it worker start-up).",
            "Repetitions": f"{args.reps}, alternating, {args.failures} failures each "
                           f"({args.reps * args.failures} per strategy).",
            "Answer": f"Gemini's overhead is {100 * overhead['gemini']:.2f}% (target <= {100 * OVERHEAD_TARGET:g}%) and "
                      "it wastes " + " and ".join(f"{ratios[n]:.1f}x ({n} machines)" for n in CLUSTERS)
                      + f" less time per failure than HighFreq, overhead included (target {RATIO_TARGET:g}x).",
        },
        command=f"python -m experiments.gemini_recovery --model {args.model} --nodes {args.nodes} --bandwidth "
                f"{args.bandwidth} --device-time {args.device_time:g} --storage-fraction {args.storage_fraction:g} "
                f"--steps {args.steps} --failures {args.failures} --reps {args.reps} --seed {args.seed} --dilation {args.dilation}",
    )
    fig, ax = plt.subplots(figsize=(6, 3.4))
    names = list(STRATEGIES[1:])
    bottoms = [0.0] * len(names)
    for key, color in (("torchrun_s", "lightgrey"), ("startup_s", "darkgrey"), ("restore_s", "tab:purple"),
                       ("retrieve_s", "tab:blue"), ("lost_progress_s", "tab:red")):
        values = [median(s, key) for s in names]
        ax.bar(names, values, bottom=bottoms, label=key.removesuffix("_s"), color=color)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    ax.set_ylabel("seconds per failure (median), excl. overhead")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(results.figure_path())
    print((results.dir / "results.md").read_text())


if __name__ == "__main__":
    main()
