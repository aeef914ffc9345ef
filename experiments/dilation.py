"""Time dilation changes nothing it should not, and removes the host where the host was the limit.

    python -m experiments.dilation [--ks 1,2,4] [--syncs dense,zen,compress] [--reps 4] [--steps 16]
        [--big-nodes 8] [--big-syncs dense,zen] [--big-reps 4] [--name dilation]

``--nodes 0`` leaves out the invariance part, ``--big-nodes 0`` the 8-machine one; each part can be
run on its own into its own folder (``--name``), as the claims table does.

**Invariance.** On 2 emulated machines, one worker each (2 ranks on this host's 2 cores: not
oversubscribed), the same lstm job runs at k = 1, 2 and 4 (``cluster.dilation``) under three syncs:
dense allreduce, Zen, and top-k 1% through ``sync=compress``. Repetitions alternate the k's, the
first rotating. Dilation is right if the reported step and sync times (medians) agree across k:
at k the NICs run k times slower, each machine's CPU is capped at 1/k core, device time lasts k
times longer and every figure is divided by k, so nothing the job sees should move.

**What bound the run, and is auto enough.** On 8 machines the same job runs at k = 1 (8 ranks on
2 cores, uncapped), at the k ``cluster.dilation=auto`` picks, and at twice that k: if auto's k leaves
the host no part in the figures, doubling it changes nothing. Per run: the share of its CPU a rank used in a
step (its process CPU seconds / step time / the core it may use: at k = 1 a quarter of one of the
host's cores when all ranks compute, under caps one emulated core), and dense's communication time
against its wire time (the bytes it sent through its NIC at the configured bandwidth). A run whose
ranks use their whole CPU share is bound by the host; one whose communication runs at its wire time
is bound by the network.

Needs root (network namespaces, cgroups).
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections import defaultdict
from typing import Any

from ddlscale import clock
from ddlscale.cluster import dilation
from ddlscale.units import parse_bandwidth
from experiments.harness import Results, alternating, spread, train

SYNCS = {
    "dense": ["sync=dense"],
    "zen": ["sync=zen", "model.sparse_embedding=true"],
    "compress": ["sync=compress", "compressor=topk", "compressor.ratio=0.01"],
}
DEVICE_TIME_S = 0.05  # an accelerator's share of each step, dilated like the rest


def run(nodes: int, k: str, sync: str, steps: int, bandwidth: str, model: str) -> dict[str, Any]:
    overrides = ["cluster=emulated", f"cluster.nodes={nodes}", f"cluster.bandwidth={bandwidth}",
                 f"cluster.dilation={k}", "trainer.devices=1", f"model={model}", f"trainer.max_steps={steps}",
                 f"strategy.device_time_s={DEVICE_TIME_S}", "seed=0", *SYNCS[sync]]
    started = clock.now()  # the driver is not dilated: host seconds
    summary = train(overrides, timeout=3600)
    summary["wall_s"] = clock.now() - started
    return summary


def cpu_use(row: dict[str, Any], world: int) -> float:
    """The share of its CPU a rank used in a step: capped (k > 1), one emulated core; uncapped (k = 1),
    its fair share of the host's cores when every rank computes."""
    core = 1.0 if row["k"] > 1 else min(1.0, (os.cpu_count() or 1) / world)
    return row["cpu_s_per_step"] / row["step_time_s"] / core


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ks", default="1,2,4")
    parser.add_argument("--syncs", default="dense,zen,compress")
    parser.add_argument("--model", default="lstm")
    parser.add_argument("--bandwidth", default="1gbit")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--big-nodes", type=int, default=8)
    parser.add_argument("--big-syncs", default="dense,zen")
    parser.add_argument("--big-reps", type=int, default=4)
    parser.add_argument("--name", default="dilation", help="the results folder under experiments/results")
    args = parser.parse_args(argv)
    ks, syncs, big_syncs = args.ks.split(","), args.syncs.split(","), args.big_syncs.split(",")
    for name in [*syncs, *big_syncs]:
        if name not in SYNCS:
            parser.error(f"unknown sync {name!r}; choose from {', '.join(SYNCS)}")
    big_cells: list[tuple[str, str]] = []
    settings = {k: k for k in (*ks, "1", "auto")}  # a cell's label -> the cluster.dilation it runs at
    if args.big_nodes:  # auto's probe, if not cached yet, before the runs: no run's time holds it
        auto = dilation.choose(dilation.AUTO, args.big_nodes, 1, parse_bandwidth(args.bandwidth), 0.0)
        print(f"{args.big_nodes} machines: {auto.describe()}", flush=True)
        settings["2x auto"] = f"{2 * auto.k:g}"
        big_cells = [(sync, k) for sync in big_syncs for k in ("1", "auto", "2x auto")]
    if not (args.nodes or args.big_nodes):
        parser.error("--nodes 0 and --big-nodes 0 leave nothing to run")
    results = Results(args.name)
    rows: list[dict[str, Any]] = []
    cells = [(sync, k) for sync in syncs for k in ks] if args.nodes else []
    total, done = len(cells) * args.reps + len(big_cells) * args.big_reps, 0
    for part, nodes, plan, reps in (("invariance", args.nodes, cells, args.reps),
                                    ("bound", args.big_nodes, big_cells, args.big_reps)):
        for rep, (sync, k) in alternating(plan, reps) if plan else ():
            summary = run(nodes, settings[k], sync, args.steps, args.bandwidth, args.model)
            row = {"part": part, "nodes": nodes, "setting": k, "k": summary["dilation"], "sync": sync, "rep": rep,
                   **{key: summary.get(key) for key in ("step_time_s", "sync_time_s", "comm_time_s", "cpu_s_per_step",
                                                        "wire_time_per_step_s", "bytes_sent_per_step", "wall_s",
                                                        "starved")},
                   "cpu_received_min": (summary.get("cpu_load") or {}).get("received_min")}
            row["cpu_use"] = cpu_use(row, nodes)
            row["comm_over_wire"] = (row["comm_time_s"] / row["wire_time_per_step_s"]
                                     if row["wire_time_per_step_s"] else None)
            rows.append(row)
            done += 1
            results.progress(done, total, f"{part} {nodes} machines {sync} k={summary['dilation']:g} rep {rep}: step "
                             f"{row['step_time_s'] * 1e3:.1f} ms, sync {row['sync_time_s'] * 1e3:.1f} ms, "
                             f"CPU use {row['cpu_use']:.2f}, {row['wall_s']:.0f} s wall")
    results.write_csv(rows)
    results.dilation = ", ".join(sorted({f"{r['k']:g}" for r in rows}, key=float))

    def med(column: str, **eq: Any) -> float:
        values = [r[column] for r in rows if all(r[key] == want for key, want in eq.items())
                  and r[column] is not None]
        return statistics.median(values) if values else float("nan")

    table = []
    for sync in syncs if args.nodes else ():
        base_step, base_sync = med("step_time_s", part="invariance", sync=sync, setting=ks[0]), \
            med("sync_time_s", part="invariance", sync=sync, setting=ks[0])
        for k in ks:
            steps = [r["step_time_s"] for r in rows if (r["part"], r["sync"], r["setting"]) == ("invariance", sync, k)]
            step, lo, hi = spread(steps)
            sync_s = med("sync_time_s", part="invariance", sync=sync, setting=k)
            table.append([f"{args.nodes} machines", sync, k, step * 1e3, lo * 1e3, hi * 1e3,
                          f"{step / base_step - 1:+.1%}", sync_s * 1e3, f"{sync_s / base_sync - 1:+.1%}",
                          med("cpu_use", part="invariance", sync=sync, setting=k),
                          med("comm_over_wire", part="invariance", sync=sync, setting=k),
                          med("wall_s", part="invariance", sync=sync, setting=k)])
    for sync in big_syncs:
        auto_step = med("step_time_s", part="bound", sync=sync, setting="auto")
        for k in dict.fromkeys(c[1] for c in big_cells):
            steps = [r["step_time_s"] for r in rows if (r["part"], r["sync"], r["setting"]) == ("bound", sync, k)]
            if not steps:
                continue
            step, lo, hi = spread(steps)
            actual = med("k", part="bound", sync=sync, setting=k)
            table.append([f"{args.big_nodes} machines", sync, f"{k} (k={actual:g})", step * 1e3, lo * 1e3, hi * 1e3,
                          f"{step / auto_step - 1:+.1%} vs auto",
                          med("sync_time_s", part="bound", sync=sync, setting=k) * 1e3, "",
                          med("cpu_use", part="bound", sync=sync, setting=k),
                          med("comm_over_wire", part="bound", sync=sync, setting=k),
                          med("wall_s", part="bound", sync=sync, setting=k)])

    worst = max((abs(float(cell.rstrip("%"))) / 100 for r in table if r[8] for cell in (r[6], r[8])), default=None)
    bound_lines = []
    for k in dict.fromkeys(c[1] for c in big_cells):
        dense = [r for r in rows if (r["part"], r["sync"], r["setting"]) == ("bound", "dense", k)]
        if dense:
            bound_lines.append(
                f"k={statistics.median(r['k'] for r in dense):g}: ranks used "
                f"{statistics.median(r['cpu_use'] for r in dense):.2f} of their CPU, dense's communication ran "
                f"{statistics.median(r['comm_over_wire'] for r in dense):.2f}x its wire time")
    answers = []
    if worst is not None:
        answers.append(f"at {args.nodes} machines the medians at k = {', '.join(ks[1:])} differ from k = {ks[0]}'s by at "
                       f"most {worst:.1%} (step and sync, every sync)")
    for sync in big_syncs:
        moved = [abs(r["step_time_s"] / a["step_time_s"] - 1) for a in rows for r in rows
                 if (a["part"], a["sync"], a["setting"]) == ("bound", sync, "auto")
                 and (r["part"], r["sync"], r["setting"], r["rep"]) == ("bound", sync, "2x auto", a["rep"])]
        if moved:
            answers.append(f"at {args.big_nodes} machines {sync}'s step at twice auto's k differs from auto's by "
                           f"{statistics.median(moved):.1%} (median of paired repetitions)")
    results.write_markdown(
        "Time dilation: invariant where the host is not the limit; what bounds 8 machines at k = 1 and auto",
        ["cluster", "sync", "k", "step ms (median)", "min", "max", "step vs k=1", "sync ms (median)",
         "sync vs k=1", "CPU use (median)", "comm / wire (median)", "wall s per run"],
        table,
        notes=f"lstm, one worker per machine, {args.bandwidth} NICs, {args.steps} steps a run (the first "
              f"excluded), device time {DEVICE_TIME_S * 1e3:.0f} ms a step; zen with sparse embedding gradients, "
              "compress = top-k 1% allgather with error feedback. 'CPU use': a rank's process CPU seconds in a step "
              "over its step time and the core it may use (capped: one emulated core; at k = 1, its fair share of "
              f"the host's {os.cpu_count()} cores when every rank computes). 'comm / wire': the sync's time blocked "
              "on communication over the bytes it sent at the NIC's payload rate. 'wall s per run': the host's "
              "seconds for the whole run, start-up included: what dilation costs.",
        summary={"Compared": "; ".join(
                     ([f"reported step and sync times at k = {', '.join(ks)} on {args.nodes} machines "
                       f"({', '.join(syncs)})"] if args.nodes else [])
                     + ([f"at {args.big_nodes} machines k = 1 and twice auto's k against auto's "
                         f"({', '.join(big_syncs)})"] if args.big_nodes else [])) + ".",
                 "Emulation": f"{' and '.join(str(n) for n in (args.nodes, args.big_nodes) if n)} emulated machines, "
                              f"one worker each, {args.bandwidth} NICs, device time {DEVICE_TIME_S * 1e3:.0f} ms a "
                              f"step, on this host's {os.cpu_count()} cores; k as in the table.",
                 "Bound by": "measured per run (CPU use, comm / wire)" + (
                     f"; at {args.big_nodes} machines: " + "; ".join(bound_lines) if bound_lines else "") + ".",
                 "Repetitions": ", ".join(f"{reps} alternating at {n} machines" for n, reps in
                                          ((args.nodes, args.reps), (args.big_nodes, args.big_reps)) if n)
                                + "; every run in results.csv.",
                 "Answer": "; ".join(answers) + "."},
        command=f"python -m experiments.dilation --ks {args.ks} --syncs {args.syncs} --reps {args.reps} "
                f"--steps {args.steps} --big-nodes {args.big_nodes} --big-syncs {args.big_syncs} "
                f"--big-reps {args.big_reps}" + (f" --nodes {args.nodes}" if args.nodes != 2 else "")
                + (f" --name {args.name}" if args.name != "dilation" else ""),
    )
    if args.nodes:
        _plot(results, rows, "invariance", args.nodes, syncs)
    else:
        _plot(results, rows, "bound", args.big_nodes, big_syncs)
    print(f"wrote {results.dir}")


def _plot(results: Results, rows: list[dict[str, Any]], part: str, nodes: int, syncs: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, column, label in ((axes[0], "step_time_s", "step"), (axes[1], "sync_time_s", "sync")):
        for sync in syncs:
            by_k: dict[float, list[float]] = defaultdict(list)
            for r in rows:
                if (r["part"], r["sync"]) == (part, sync):
                    by_k[r["k"]].append(r[column] * 1e3)
            xs = sorted(by_k)
            meds = [statistics.median(by_k[x]) for x in xs]
            line = ax.plot(xs, meds, "o-", label=sync)[0]
            for x in xs:
                ax.plot([x] * len(by_k[x]), by_k[x], ".", color=line.get_color(), alpha=0.4)
        ks = sorted({r["k"] for r in rows if r["part"] == part})
        ax.set(xscale="log", xticks=ks, xticklabels=[f"{k:g}" for k in ks], xlabel="dilation k",
               ylabel=f"{label} time (ms, reported)", title=f"{label} time vs k, {nodes} machines")
        ax.set_ylim(bottom=0)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(results.figure_path(), dpi=120)


if __name__ == "__main__":
    main()
