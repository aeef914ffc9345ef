"""Compressed sync on the emulated cluster: the aggregation schemes side by side, and what Espresso's search is worth.

    python -m experiments.compression_schemes [--workloads lstm,gpt] [--compressor topk] [--ratio 0.01]
        [--bandwidth 1gbit] [--reps 4] [--measure 15] [--flat-methods dense,allgather,zen] [--workloads-4x2 lstm]

One compressor (top-k 1% by default, with its default error feedback: residual), one table, two clusters:

- ``8x1``: 8 emulated machines, one worker each: dense allreduce (``sync=dense``, DDP's buckets) and
  the compressor layer-wise through each scheme in ``--flat-methods`` (``sync=compress sync.comm=...``,
  ``zen``: Zen's push / sum / pull of the selections) — what a sparsifier's payloads cost to aggregate.
- ``4x2``: 4 machines, two workers each, so hierarchical layouts exist: dense; every uniform plan of
  Espresso's option space run layer-wise (the compressor under allgather, alltoall and gather, flat
  and hierarchical, and zen where the compressor is a sparsifier; dense allreduce hierarchical); Cupcake's groups of compressor/allgather; Espresso
  (every option family calibrated first, layer-wise and fused: ``sync.calibrate_families``,
  ``sync.calibrate_fused``) with its search alone (``sync.trial_steps=0``: the model's plan runs) and Espresso with its trial (its plan,
  Cupcake's and dense's take turns on the cluster, the fastest stays).

Per (cluster, workload) the methods alternate, the first rotating, ``--reps`` repetitions. Measured per
run: rank 0's medians over the last ``--measure`` steps (each method after its own warm-up and
planning steps) of the step period (one optimizer step's end to the next: what throughput sees) and
of the sync time (the training thread's time in synchronization). The planners are told the NIC's
TCP payload rate and measure the per-message latency themselves. Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from experiments.espresso_cupcake import per_step, planner_network, probe_rate
from experiments.harness import RESULTS, Results, alternating, machine, spread, train

CLUSTERS = {"8x1": (8, 1), "4x2": (4, 2)}
SCHEMES = ("allgather", "alltoall", "gather", "zen")
# The 4x2 cluster's methods: every uniform plan Espresso could choose, then the planners.
UNIFORM = ("dense", "dense/hier", *SCHEMES, *(f"{s}/hier" for s in SCHEMES))
PLANNED = ("cupcake", "espresso search", "espresso trial")
WARMUP = 5  # steps every run takes before its measured ones (plus the planners' own phases)
PLANNER = {"sync.warmup_steps": 4, "sync.profile_steps": 6, "sync.settle_steps": 3, "sync.calibrate_steps": 3}
TRIAL_STEPS = 3  # Espresso's trial: 3 candidates x 3 turns of a settling and a measured step
# Espresso calibrates every option family it may choose (each settled and timed layer-wise in turn, the
# configured allgather last), so each is priced on its own CPU and lag: with allgather's alone the first
# dilated run's search took alltoall/hier on figures measured for allgather and the dense lag.
FAMILIES = tuple(f"{s}{layout}" for s in SCHEMES for layout in ("", "/hier") if f"{s}{layout}" != "allgather")
# Both planners also time each family fused (sync.calibrate_fused): per group and per element apart.
# Espresso also times a mixed step (sync.calibrate_mixed: the largest tensor compressed, the rest dense
# alone): in the third dilated run its plans' small dense groups waited several ms each at the step's end.


def settle_steps(method: str) -> int:
    """Steps a method's run takes before its measured window: the planners profile, calibrate, plan
    (and the trial's turns), and the first planned step rebuilds the groups."""
    if method not in PLANNED:
        return WARMUP
    steps = sum(PLANNER.values()) + 1
    family = PLANNER["sync.settle_steps"] + PLANNER["sync.calibrate_steps"]
    steps += family  # the configured family fused
    if method.startswith("espresso"):  # each further family settles and calibrates before the configured one, and a mixed step
        steps += (2 * len(FAMILIES) + 1) * family
    return steps + (3 * TRIAL_STEPS * 2 if method == "espresso trial" else 0) + WARMUP


def overrides_of(method: str, cluster: str, args: argparse.Namespace) -> list[str]:
    nodes, workers = CLUSTERS[cluster]
    out = ["cluster=emulated", f"cluster.nodes={nodes}", f"cluster.bandwidth={args.bandwidth}",
           f"trainer.devices={workers}", f"trainer.max_steps={settle_steps(method) + args.measure}", "seed=0",
           *args.overrides.split()]
    if method == "dense":
        return [*out, "sync=dense"]
    compressor = ["compressor=none"] if method == "dense/hier" else [
        f"compressor={args.compressor}", f"compressor.ratio={args.ratio}"]
    if method not in PLANNED:
        scheme, _, layout = method.partition("/")
        return [*out, "sync=compress", *compressor, f"sync.comm={'allreduce' if scheme == 'dense' else scheme}",
                f"sync.hierarchical={str(layout == 'hier').lower()}"]
    bandwidth, latency = planner_network(args.bandwidth)
    out += [f"sync={method.split()[0]}", *compressor, "sync.comm=allgather", f"sync.network_bandwidth={bandwidth}",
            f"sync.network_latency={latency}", f"sync.gpus_per_machine={workers}",
            *(f"{k}={v}" for k, v in PLANNER.items())]
    # Cupcake and the search run their model's plan: sync.trial_steps=0 (both planners' default is a trial).
    out.append(f"sync.trial_steps={TRIAL_STEPS if method == 'espresso trial' else 0}")
    out.append("sync.calibrate_fused=true")
    if method.startswith("espresso"):
        out += [f"sync.calibrate_families=[{','.join(FAMILIES)}]", "sync.calibrate_mixed=true"]
    return out


def measured(run_dir: Path, steps: int) -> dict[str, float]:
    """Rank 0's medians over the last ``steps`` steps: step period, sync time (and its part blocked on
    the wire: sync minus encode and decode), bytes sent."""
    rows = per_step(run_dir)[-steps:]
    early = {r["sync_phase"] for r in rows if r.get("sync_phase", "plan") != "plan"}
    if early:
        raise RuntimeError(f"{run_dir}: the measured window holds steps of phase {sorted(early)}, not the plan's")

    def median(value) -> float:
        return statistics.median(value(r) for r in rows)

    return {"step_ms": median(lambda r: r["step_period_s"]) * 1e3, "sync_ms": median(lambda r: r["sync_time_s"]) * 1e3,
            "comm_ms": median(lambda r: r["sync_time_s"] - r["encode_time_s"] - r["decode_time_s"]) * 1e3,
            "bytes_sent": median(lambda r: r["bytes_sent"]), "steps": len(rows)}


def plan_of(run_dir: Path) -> dict[str, Any]:
    """What a planned run kept: its candidate, fusion and options used (label x units)."""
    plan = json.loads((run_dir / "plan.json").read_text())
    labels = [f"{o['compressor']}/{o['scheme']}" + ("/hier" if o["hierarchical"] else "") for o in plan["options"]]
    return {"plan_kept": plan["context"].get("candidate", plan["system"]), "plan_fusion": plan["fusion"],
            "plan_options": " ".join(f"{k}x{labels.count(k)}" for k in sorted(set(labels))),
            "predicted_ms": plan["iteration_s"] * 1e3}


def earlier_runs(name: str, clusters: list[str]) -> tuple[list[dict[str, Any]], dict]:
    """The rows and host probes of ``name``'s trials.csv for the clusters not in ``clusters``."""
    if not name:
        return [], {}
    folder = RESULTS / name
    rows = [r for r in csv.DictReader((folder / "trials.csv").open()) if r["cluster"] not in clusters]
    if not rows:
        raise SystemExit(f"--runs-from {name}: {folder / 'trials.csv'} has no runs of a cluster other than {clusters}")
    for row in rows:
        row["rep"] = int(row["rep"])
        for key in ("step_ms", "sync_ms", "comm_ms", "bytes_sent", "final_loss", "wall_s"):
            row[key] = float(row[key]) if row[key] != "" else float("nan")  # a null figure is written empty
    probes = json.loads((folder / "config.json").read_text())["probe"]
    return rows, probes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="lstm,gpt")
    parser.add_argument("--compressor", default="topk")
    parser.add_argument("--ratio", type=float, default=0.01)
    parser.add_argument("--bandwidth", default="1gbit")
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--measure", type=int, default=15, help="steps measured at the end of every run")
    parser.add_argument("--clusters", default=",".join(CLUSTERS))
    parser.add_argument("--flat-methods", default="dense,allgather,zen", help="the 8x1 cluster's methods")
    parser.add_argument("--overrides", default="", help="extra train.py overrides, space-separated")
    parser.add_argument("--name", default="compression_schemes", help="results folder under experiments/results")
    parser.add_argument("--workloads-4x2", default="", help="the 4x2 cluster's workloads, where they differ from "
                        "--workloads (its 13 methods take ~55 min per workload at --reps 4)")
    parser.add_argument("--runs-from", default="", help="a results folder whose trials.csv gives the clusters not "
                        "run now (same workloads and flags): one table from runs made in two sittings")
    args = parser.parse_args(argv)
    workloads, clusters = args.workloads.split(","), args.clusters.split(",")
    methods = {"8x1": tuple(args.flat_methods.split(",")), "4x2": (*UNIFORM, *PLANNED)}
    earlier_rows, earlier_probes = earlier_runs(args.runs_from, clusters)
    workloads_of = {c: args.workloads_4x2.split(",") if c == "4x2" and args.workloads_4x2 else workloads
                    for c in clusters}

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = Results(args.name)
    command = (f"python -m experiments.compression_schemes --workloads {args.workloads} --compressor {args.compressor} "
               f"--ratio {args.ratio} --bandwidth {args.bandwidth} --reps {args.reps} --measure {args.measure} "
               f"--clusters {args.clusters} --flat-methods {args.flat_methods}"
               + (f" --workloads-4x2 {args.workloads_4x2}" if args.workloads_4x2 else "")
               + (f" --overrides '{args.overrides}'" if args.overrides else "")
               + (f" --name {args.name}" if args.name != "compression_schemes" else "")
               + (f" --runs-from {args.runs_from}" if args.runs_from else ""))
    runs: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    probes = {}
    for cluster in clusters:  # can the host carry every machine's NIC at once?
        rates = probe_rate(CLUSTERS[cluster][0], args.bandwidth)
        probes[cluster] = {"achieved_gbps": [r / 1e9 for r in rates],
                           "fraction": statistics.median(rates) / float(planner_network(args.bandwidth)[0])}
        print(f"probe {cluster}: {probes[cluster]['fraction']:.0%} of the TCP payload rate", flush=True)
    for row in earlier_rows:
        runs[(row["cluster"], row["workload"], row["method"])].append(row)
    if earlier_rows:  # the earlier sitting's clusters come first in the table, as if run in one command
        earlier_clusters = list(dict.fromkeys(r["cluster"] for r in earlier_rows))
        for cluster in earlier_clusters:
            mine = [r for r in earlier_rows if r["cluster"] == cluster]
            methods[cluster] = tuple(dict.fromkeys(r["method"] for r in mine))
            workloads_of[cluster] = list(dict.fromkeys(r["workload"] for r in mine))
        probes = {**{c: earlier_probes[c] for c in earlier_clusters}, **probes}
        clusters = [*earlier_clusters, *clusters]
    (results.dir / "config.json").write_text(json.dumps(
        {"command": command, "args": vars(args), "machine": machine(), "probe": probes,
         "overrides_example": {f"{c} {m}": overrides_of(m, c, args) for c in clusters for m in methods[c]}}, indent=1))

    run_now = args.clusters.split(",")
    rows: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    total = sum(len(workloads_of[c]) * args.reps * len(methods[c]) for c in run_now)
    with tempfile.TemporaryDirectory(prefix="ddlscale-cs-") as scratch:
        for cluster in run_now:
            for workload in workloads_of[cluster]:
                for rep, method in alternating(methods[cluster], args.reps):
                    run_dir = Path(scratch) / f"{cluster}-{workload}-{method.replace(' ', '_').replace('/', '-')}-{rep}"
                    started = time.perf_counter()
                    try:
                        summary = train([f"model={workload}", *overrides_of(method, cluster, args)], timeout=1800,
                                        run_dir=run_dir)
                        row = {"cluster": cluster, "workload": workload, "method": method, "rep": rep,
                               **measured(run_dir, args.measure), "memory": summary.get("memory"),
                               "final_loss": summary["final_loss"], "wall_s": round(time.perf_counter() - started, 1),
                               "plan_kept": "", "plan_fusion": "", "plan_options": "", "predicted_ms": ""}
                        if method in PLANNED:
                            row.update(plan_of(run_dir))
                    except Exception as error:  # reported, not fatal: one broken method must not void the rest
                        failures.append({"cluster": cluster, "workload": workload, "method": method, "rep": rep,
                                         "error": f"{type(error).__name__}: {error}"[-800:]})
                        results.progress(len(rows) + len(failures), total, f"{cluster} {workload} {method} rep {rep}: "
                                                                           f"FAILED ({type(error).__name__})")
                        continue
                    rows.append(row)
                    results.write_csv([*earlier_rows, *rows], "trials.csv")  # so far: an interrupted run keeps its rows
                    runs[(cluster, workload, method)].append(row)
                    results.progress(len(rows) + len(failures), total, f"{cluster} {workload} {method} rep {rep}: step "
                                                       f"{row['step_ms']:.1f} ms, sync {row['sync_ms']:.1f} ms "
                                                       f"(run {row['wall_s']:.0f} s)")
    if failures:  # first: whatever follows, the failures are on disk
        results.write_csv(failures, "failures.csv")
    if not rows and not earlier_rows:
        raise SystemExit(f"every run failed: {results.dir / 'failures.csv'}")
    results.write_csv([*earlier_rows, *rows], "trials.csv")
    table, summary_rows, lines, zen_lines, answers = [], [], [], [], []
    for cluster in clusters:
        for workload in workloads_of[cluster]:
            present = [m for m in methods[cluster] if runs[(cluster, workload, m)]]  # a method may have failed
            stats = {m: {k: spread([r[k] for r in runs[(cluster, workload, m)]]) for k in ("step_ms", "sync_ms")}
                     for m in present}
            dense = stats.get("dense")  # a run of the 8x1 cluster may leave it out (zen vs allgather alone)
            records = {}
            for m in present:
                mine, kept = stats[m], runs[(cluster, workload, m)]
                plans = " / ".join(f"{r['plan_kept'].split(' of ')[0]}: {r['plan_options']}" for r in kept) \
                    if m in PLANNED else ""
                record = {"cluster": cluster, "workload": workload, "method": m,
                          **{f"{k}_{part}": v for k in ("step_ms", "sync_ms")
                             for part, v in zip(("median", "min", "max"), mine[k], strict=True)},
                          "step_speedup_vs_dense": dense["step_ms"][0] / mine["step_ms"][0] if dense else "",
                          **prediction(kept, m),
                          "per_rep_step_ms": " ".join(f"{r['step_ms']:.1f}" for r in kept), "plans": plans}
                summary_rows.append(record)
                records[m] = record
                table.append([cluster, workload, m, _cell(mine["step_ms"]), _cell(mine["sync_ms"]),
                              record["step_speedup_vs_dense"], record["per_rep_step_ms"], plans])
            if {"zen", "allgather"} <= set(present):
                ratio = stats["allgather"]["sync_ms"][0] / stats["zen"]["sync_ms"][0]
                answers.append(f"{cluster} {workload}: zen's sync {ratio:.2f}x as fast as allgather's"
                               + (" (target >= 1.5x)" if cluster == "8x1" else ""))
                zen_lines.append(f"| {cluster} | {workload} | {stats['allgather']['sync_ms'][0]:.1f} | "
                                 f"{stats['zen']['sync_ms'][0]:.1f} | {ratio:.2f}x | {('yes' if ratio >= 1.5 else 'no') if cluster == '8x1' else '(8x1 only)'} | "
                                 f"{stats['allgather']['step_ms'][0] / stats['zen']['step_ms'][0]:.2f}x |")
            if cluster == "4x2" and {"espresso search", "espresso trial", "cupcake", "allgather", "dense"} <= set(present):
                best = min((m for m in UNIFORM if m in stats), key=lambda m: stats[m]["step_ms"][0])
                search = stats["espresso search"]["step_ms"][0]
                answers.append(f"{cluster} {workload}: Espresso's search {search / stats[best]['step_ms'][0]:.3f}x the "
                               f"best uniform plan's step ({best}; target at most 1)")
                guess = records["espresso search"]
                answers.append(f"{cluster} {workload}: Espresso's search predicted {guess['predicted_over_measured']:.3f}x "
                               "its measured step (median over repetitions; target within 15%)")
                lines.append(f"| {workload} | {best} {stats[best]['step_ms'][0]:.1f} | {search:.1f} | "
                             f"{search / stats[best]['step_ms'][0]:.3f} | "
                             f"{'yes' if search <= stats[best]['step_ms'][0] else 'no'} | "
                             f"{guess['predicted_ms_median']:.1f} | {guess['predicted_over_measured_per_rep']} | "
                             f"{stats['espresso trial']['step_ms'][0]:.1f} | {stats['cupcake']['step_ms'][0]:.1f} | "
                             f"{stats['allgather']['step_ms'][0]:.1f} | {dense['step_ms'][0]:.1f} |")
    results.write_csv(summary_rows)
    cpu = "; ".join(f"{c} {w}: dense sync {statistics.median(r['sync_ms'] for r in runs[(c, w, 'dense')]):.1f} ms of "
                    f"a {statistics.median(r['step_ms'] for r in runs[(c, w, 'dense')]):.1f} ms step"
                    for c in clusters for w in workloads_of[c] if runs[(c, w, "dense")])
    bound = "; ".join(f"{c} {w}: {wait:.0f} ms against {rest:.0f} ms, {'network' if wait > rest else 'host CPU'}"
                      for c in clusters for w in workloads_of[c] if (dense_runs := runs[(c, w, "dense")])
                      for wait, rest in [(statistics.median(r["comm_ms"] for r in dense_runs),
                                          statistics.median(r["step_ms"] - r["comm_ms"] for r in dense_runs))])
    notes = f"""
{args.compressor} ratio {args.ratio} with its default error feedback ({[*earlier_rows, *rows][-1]['memory']}), {args.bandwidth} per
emulated machine; `8x1`: 8 machines x 1 worker, `4x2`: 4 machines x 2 workers (hierarchical: dense inside a machine,
compressed across). Per (cluster, workload) the methods alternate over {args.reps} repetitions; each run's
figures are rank 0's medians over its last {args.measure} steps (after {WARMUP} warm-up steps, and the planners'
profiling, calibration, planning and trial steps); the table gives the median (min-max) over repetitions and
every repetition's step period. Layer-wise methods are `sync=compress` (every tensor compressed alone) under the
scheme named; `/hier` adds sync.hierarchical. Planned runs: the planners are told {planner_network(args.bandwidth)[0]}
bit/s and measure the latency; Espresso first calibrates every option family it may choose, each settled and
timed layer-wise and then fused in turn (sync.calibrate_families: {', '.join(FAMILIES)}, then the configured allgather;
sync.calibrate_fused, Cupcake's configured family too), so each is priced on its own CPU, per group and per element, and lag,
and then a mixed step (sync.calibrate_mixed: the largest tensor under allgather, the rest dense alone), for what a dense group costs beside compression; `espresso search` runs the search's plan (sync.trial_steps=0), `espresso trial` the
fastest on the cluster of Espresso's, Cupcake's and dense's plans ({TRIAL_STEPS} turns each). Plans: the candidate
kept and the options its units use, per repetition.{failed_note(failures)}

CPU or network: all machines share this host's 2 cores ({cpu}). Host check (every machine streaming TCP to the next
at once): {"; ".join(f"{c} {p['fraction']:.0%} of the payload rate" for c, p in probes.items())}.

Zen against allgather (medians of the sync time, ms; target: zen's sync at least 1.5x faster):

| cluster | workload | allgather sync | zen sync | allgather / zen | >= 1.5x | step speed-up |
|---|---|---|---|---|---|---|
""" + "\n".join(zen_lines) + """

Espresso's search alone against the best uniform plan it could have chosen (4x2; medians of the step period, ms;
the target: the search's median at most the best uniform plan's), and its model's predicted step (the plan's, made
before the measured steps) over the measured one per repetition (target: within 15%):

| workload | best uniform plan | Espresso search | search / best | <= 1 | search predicted | predicted / measured per rep | Espresso trial | Cupcake | layer-wise allgather | dense |
|---|---|---|---|---|---|---|---|---|---|---|
""" + "\n".join(lines)
    results.write_markdown(
        f"Compressed sync on the emulated cluster: schemes, uniform plans, Cupcake and Espresso ({args.compressor} "
        f"{args.ratio}, {args.bandwidth})",
        ["cluster", "workload", "method", "step period ms (min-max)", "sync ms (min-max)", "step speed-up vs dense",
         "step period per rep", "plans kept (per rep)"], table, notes=notes, command=command,
        summary={"Compared": f"{args.compressor} {args.ratio} synchronized through each aggregation scheme, every "
                             "uniform plan, Cupcake and Espresso (search alone and with its trial), beside dense "
                             "allreduce, on " + "; ".join(f"{c}: {', '.join(workloads_of[c])}" for c in clusters) + ".",
                 "Emulation": "; ".join(f"{c}: {CLUSTERS[c][0]} emulated machines x {CLUSTERS[c][1]} worker(s)"
                                        for c in clusters) + f", {args.bandwidth} NICs, on this host's 2 shared "
                              "cores; no device time.",
                 "Bound by": "dense's communication wait against the rest of its step (medians): " + bound + ".",
                 "Repetitions": f"{args.reps}, alternating, the last {args.measure} steps of each run measured.",
                 "Answer": "; ".join(answers) + "."})
    plot(summary_rows, clusters, workloads_of, methods, results.figure_path(), plt)
    print(f"wrote {results.dir}")


def prediction(kept: list[dict[str, Any]], method: str) -> dict[str, Any]:
    """A planned method's predicted step against the measured one: the planner's model is fitted on the
    profiling and calibration steps before the plan, so the measured window is out of sample. Per run
    predicted / measured, and that ratio's median over the repetitions."""
    if method not in PLANNED:
        return {"predicted_ms_median": "", "predicted_over_measured": "", "predicted_over_measured_per_rep": ""}
    ratios = [float(r["predicted_ms"]) / r["step_ms"] for r in kept]
    return {"predicted_ms_median": statistics.median(float(r["predicted_ms"]) for r in kept),
            "predicted_over_measured": statistics.median(ratios),
            "predicted_over_measured_per_rep": " ".join(f"{x:.3f}" for x in ratios)}


def failed_note(failures: list[dict[str, Any]]) -> str:
    if not failures:
        return ""
    runs = ", ".join(f"{f['cluster']} {f['workload']} {f['method']} rep {f['rep']}" for f in failures)
    return f"\n\nFAILED runs, left out of the medians (errors in failures.csv): {runs}."


def _cell(spread_: tuple[float, float, float]) -> str:
    median, low, high = spread_
    return f"{median:.1f} ({low:.1f}-{high:.1f})"


def plot(rows: list[dict[str, Any]], clusters: list[str], workloads_of: dict[str, list[str]],
         methods: dict[str, tuple[str, ...]], path: Path, plt: Any) -> None:
    width = max(len(w) for w in workloads_of.values())
    fig, axes = plt.subplots(len(clusters), width, figsize=(6 * width, 3.8 * len(clusters)), squeeze=False)
    for i, cluster in enumerate(clusters):
        for j in range(width, len(workloads_of[cluster]), -1):
            axes[i][j - 1].axis("off")
        for j, workload in enumerate(workloads_of[cluster]):
            ax = axes[i][j]
            mine = [r for r in rows if (r["cluster"], r["workload"]) == (cluster, workload)]
            med = [r["step_ms_median"] for r in mine]
            err = [[m - r["step_ms_min"] for m, r in zip(med, mine, strict=True)],
                   [r["step_ms_max"] - m for m, r in zip(med, mine, strict=True)]]
            ax.bar(range(len(mine)), med, yerr=err, capsize=2)
            ax.set_xticks(range(len(mine)), [r["method"] for r in mine], rotation=45, ha="right", fontsize=7)
            ax.set(title=f"{workload}, {cluster}", ylabel="step period ms (median, min-max)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
