"""Does training under ``sync=cupcake`` and ``sync=espresso`` converge like its compressor does layer-wise?

    python -m experiments.planned_convergence [--workloads cnn,lstm] [--compressors dgc,efsignsgd,randomk]
        [--steps 150] [--bandwidth 100mbit] [--seeds 0,1,2] [--dilation k] [--keep DIR [--reuse]]

Per seed, the same workload, initialization and data for every run, 2 workers on this host; only
the synchronization differs:
``sync=dense``, and per compressor ``sync=compress`` (layer-wise: every tensor compressed alone),
``sync=cupcake`` (fused groups) and ``sync=espresso`` (per-tensor plan; ``trial_steps=0`` so the
model's plan runs even where dense would measure faster). The planners are told a ``--bandwidth``
network so that their plans compress: a plan that compresses nothing would converge like dense
trivially. Reported: the final loss (mean of the last 10% of steps), its gap to dense and to the
layer-wise run of the same compressor, and what the plan compressed. Gaps are paired: taken within a
seed, then summarized (mean and min-max) over seeds, so they can be told apart from the spread that
a different initialization and data order alone produce.

The plans depend on measured times: the planners profile dense steps, time the compressor and the
compressed steps, measure the per-message latency on their sync group, and Cupcake's trial keeps the
fastest of its plan, the same option layer-wise and dense, measured on the wire. On this host the 2
workers share its cores with everything else, over loopback, while the planners are told
``--bandwidth``: the trial then compares the methods on a wire the plan was not made for.
``--dilation k`` runs every job on the emulated cluster instead: 2 machines of one worker each (a world
of 2 workers, as on this host), their NICs at ``--bandwidth``, at time dilation k
(``cluster=emulated cluster.dilation=k``: each worker one emulated core, every time in emulated
seconds). Then every measured input of the plans is of the network they are told (the NIC's TCP
payload rate, as experiments/espresso_cupcake tells its planners), dense and layer-wise cross the same
links, and each run records whether its machines got their CPU share (``starved``: such a run stays in
results.csv and is left out of the claim's check). ``--dilation 1`` is that cluster without dilation;
without the option the runs are 2 workers on this host, as before. Needs root (network namespaces).

Dilated, the grid takes hours (about 1.5 minutes a cnn run and 6 an lstm run at 100 Mbit/s, 60 runs for
3 seeds): ``--keep DIR`` keeps every run's folder, and ``--keep DIR --reuse`` reads the runs finished
there instead of training them again, so it can run in parts and report once all are done.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from ddlscale.clock import parse_factor
from experiments.compression_accuracy import _smooth, loss_curve
from experiments.espresso_cupcake import SETTINGS, planner_network, scheme_of
from experiments.harness import Results, finished_run, train

METHODS = ("layerwise", "cupcake", "espresso")


def overrides_of(method: str, compressor: str, bandwidth: str, emulated: bool = False) -> list[str]:
    out = [f"sync={'compress' if method == 'layerwise' else method}", f"compressor={compressor}",
           f"sync.comm={scheme_of(compressor)}",
           *SETTINGS.get(compressor, [])]
    if method != "layerwise":
        told = planner_network(bandwidth)[0] if emulated else bandwidth  # on the cluster: what its NICs carry
        out += [f"sync.network_bandwidth={told}", "sync.profile_steps=3"]
    if method == "espresso":
        out.append("sync.trial_steps=0")
    return out


def cluster_of(dilation: float | None, bandwidth: str) -> list[str]:
    """Where the runs go: 2 workers on this host (None), or 2 emulated machines of one worker each, NICs at
    ``bandwidth``, at time dilation ``dilation`` (never loopback in their stead: that would be another
    experiment)."""
    if dilation is None:
        return []
    return ["cluster=emulated", "cluster.nodes=2", "trainer.devices=1", f"cluster.bandwidth={bandwidth}",
            f"cluster.dilation={dilation:g}", "cluster.fallback=error"]


def row_of(seed: int, workload: str, method: str, compressor: str | None, curve: list[float], summary: dict,
           plan: str) -> dict:
    """One run's row: its final loss, and the dilation and CPU share its summary.json recorded (``starved``:
    written by emulated-cluster runs, empty elsewhere)."""
    return {"seed": seed, "workload": workload, "method": method, "compressor": compressor or "none",
            "final_loss": statistics.fmean(curve[-max(1, len(curve) // 10):]), "steps": len(curve), "plan": plan,
            "dilation": summary.get("dilation", 1), "starved": summary.get("starved")}


def emulation_of(args: argparse.Namespace, told: str) -> str:
    if args.dilation is None:
        return f"2 workers on this host; the planners are told {told}. Losses only, no timing."
    return (f"the emulated cluster: 2 machines of one worker each, NICs at {args.bandwidth}, time dilation "
            f"k = {args.dilation:g} (each worker one emulated core; the plans' measured inputs in emulated seconds); "
            f"the planners are told {told}. Losses only, no timing.")


def starved_note(rows: list[dict], emulated: bool) -> str:
    """The runs whose machines got less CPU than their share: kept in the table and results.csv, left out of
    the claim's check (experiments/claims.py)."""
    if not emulated:
        return ""
    starved = [f"seed {r['seed']} {r['workload']} {r['method']} {r['compressor']}" for r in rows if r["starved"]]
    return (" Runs whose machines got less CPU than their share (starved; in the table, not in the claim): "
            + ("; ".join(starved) if starved else "none") + ".")


def compressed_share(run_dir: Path) -> str:
    """Of the plan's units: how many compress, and the share of elements they hold."""
    plan = json.loads((run_dir / "plan.json").read_text())
    units = list(zip(plan["units"], plan["options"], strict=True))
    compressed = [u for u, o in units if o["compressor"] != "none"]
    total = sum(u["numel"] for u, _ in units)
    return f"{len(compressed)}/{len(units)} units, {sum(u['numel'] for u in compressed) / total:.0%} of elements"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="cnn,lstm")
    parser.add_argument("--compressors", default="dgc,efsignsgd,randomk")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--bandwidth", default="100mbit",
                        help="the network the planners are told (with --dilation, the emulated NICs' rate too)")
    parser.add_argument("--seeds", default="0,1,2", help="one run per seed of every case; gaps are paired by seed")
    parser.add_argument("--dilation", type=lambda v: parse_factor(v, "--dilation"), default=None,
                        help="run on the emulated cluster (2 machines, NICs at --bandwidth) at this time dilation")
    parser.add_argument("--keep", default="", help="keep every run's folder (metrics, plan, summary) under this path")
    parser.add_argument("--reuse", action="store_true",
                        help="with --keep: read the runs already finished there instead of training them again "
                             "(the dilated grid takes hours: run it in parts, then once more to report)")
    return parser


def command_of(args: argparse.Namespace, seeds: list[int]) -> str:
    """The command results.md and the claims table give: it reproduces the run, its cluster included."""
    return (f"python -m experiments.planned_convergence --workloads {args.workloads} --compressors "
            f"{args.compressors} --steps {args.steps} --bandwidth {args.bandwidth} --seeds {','.join(map(str, seeds))}"
            + (f" --dilation {args.dilation:g}" if args.dilation is not None else ""))


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.reuse and not args.keep:
        parser.error("--reuse needs --keep: the folder whose runs to read")
    workloads, compressors = args.workloads.split(","), args.compressors.split(",")
    seeds = list(dict.fromkeys(int(s) for s in args.seeds.split(",")))  # a repeated seed would repeat a run

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = Results("planned_convergence")
    cases = [(w, "dense", None) for w in workloads] + [(w, m, c) for w in workloads for c in compressors for m in METHODS]
    runs = [(seed, *case) for seed in seeds for case in cases]
    curves, rows = {}, []
    cluster, emulated = cluster_of(args.dilation, args.bandwidth), args.dilation is not None
    told = f"{planner_network(args.bandwidth)[0]} bit/s (the NICs' TCP payload rate)" if emulated else args.bandwidth
    with tempfile.TemporaryDirectory() as temporary:
        scratch = args.keep or temporary
        for k, (seed, workload, method, compressor) in enumerate(runs):
            run_dir = Path(scratch) / f"{workload}-{method}-{compressor}-{seed}"
            sync = ["sync=dense"] if method == "dense" else overrides_of(method, compressor, args.bandwidth, emulated)
            kept = finished_run(run_dir, args.reuse)  # finished in an earlier part (a stopped one runs again)
            if kept is not None:
                ran = kept
            else:
                ran = train([f"model={workload}", *sync, *cluster, f"trainer.max_steps={args.steps}", f"seed={seed}",
                             "logger=csv", "trainer.log_every_n_steps=1"], run_dir=run_dir,
                            timeout=3600 if emulated else 900)  # dense lstm at 100 Mbit/s, dilated: many minutes
            curve = curves[(seed, workload, method, compressor)] = loss_curve(run_dir)
            rows.append(row_of(seed, workload, method, compressor, curve, ran,
                               compressed_share(run_dir) if method in ("cupcake", "espresso") else ""))
            results.progress(k + 1, len(runs), f"seed {seed} {workload} {method} {compressor or ''}: final loss "
                                               f"{rows[-1]['final_loss']:.4f} {rows[-1]['plan']}"
                                               + (" (starved: its machines got less than their CPU share)"
                                                  if rows[-1]["starved"] else ""))
    results.write_csv(rows)

    def final(seed: int, workload: str, method: str, compressor: str) -> float:
        return next(r["final_loss"] for r in rows if (r["seed"], r["workload"], r["method"], r["compressor"]) ==
                    (seed, workload, method, compressor))

    def summary(values: list[float]) -> str:
        mean = statistics.fmean(values)
        return f"{mean:.4g}" if len(values) == 1 else f"{mean:.4g} ({min(values):.4g} to {max(values):.4g})"

    table, in_spread = [], []
    for workload, method, compressor in cases:
        name = compressor or "none"
        losses = [final(s, workload, method, name) for s in seeds]
        to_dense = [final(s, workload, method, name) - final(s, workload, "dense", "none") for s in seeds]
        row = [workload, method, name, summary(losses), summary(to_dense), "", "", ""]
        if method in ("cupcake", "espresso"):
            to_layerwise = [final(s, workload, method, name) - final(s, workload, "layerwise", name) for s in seeds]
            plans = [r["plan"] for r in rows if (r["workload"], r["method"], r["compressor"]) == (workload, method, name)]
            row[5:] = [summary(to_layerwise), f"{sum(g < 0 for g in to_layerwise)}/{len(seeds)}", " / ".join(plans)]
            layerwise = [final(s, workload, "layerwise", name) for s in seeds]
            if max(layerwise) > min(layerwise):  # the mean gap as a share of layer-wise's own spread over seeds
                in_spread.append(statistics.fmean(to_layerwise) / (max(layerwise) - min(layerwise)))
        table.append(row)
    results.write_markdown(
        "Convergence under Cupcake and Espresso plans vs the same compressor layer-wise",
        ["workload", "method", "compressor", "final loss (last 10%), mean (min to max) over seeds",
         "gap to dense, paired by seed", "gap to layer-wise, paired by seed", "seeds below layer-wise",
         "what the plan compressed (per seed)"],
        table,
        notes=f"2 workers, {args.steps} steps, seeds {','.join(map(str, seeds))} (each seeds initialization and data; every "
              "method of a seed sees the same). Error feedback: each compressor's default; settings: "
              + "; ".join(f"{c}: {' '.join(v)}" for c, v in SETTINGS.items())
              + f". Planners told {told} (profile 3 dense steps first; Espresso without its "
                "trial, so the model's plan runs). The dense and layer-wise rows' own spread over seeds says how "
                "far apart two runs land without any change of method." + starved_note(rows, emulated),
        summary={"Compared": "final loss under Cupcake and Espresso plans against the same compressor layer-wise "
                             f"and dense: {args.compressors} on {args.workloads}.",
                 "Emulation": emulation_of(args, told),
                 "Bound by": "not measured: losses, not time.",
                 "Repetitions": f"{len(seeds)} seed(s) per case, gaps paired by seed.",
                 "Answer": ("mean gap to layer-wise over layer-wise's own spread over seeds: "
                            f"{statistics.median(in_spread):+.2f} ({min(in_spread):+.2f} to {max(in_spread):+.2f}); "
                            + ("every plan within that spread." if max(in_spread) < 1 else "NOT every plan within it.")
                            if in_spread else "one seed: no spread over seeds to compare the gaps with.")},
        command=command_of(args, seeds))

    def mean_curve(workload: str, method: str, compressor: str | None) -> list[float]:
        per_seed = [curves[(s, workload, method, compressor)] for s in seeds]
        return [statistics.fmean(step) for step in zip(*per_seed, strict=True)]

    fig, axes = plt.subplots(len(workloads), len(compressors), figsize=(4.2 * len(compressors), 3.4 * len(workloads)),
                             squeeze=False)
    for row_axes, workload in zip(axes, workloads, strict=True):
        for ax, compressor in zip(row_axes, compressors, strict=True):
            ax.plot(_smooth(mean_curve(workload, "dense", None)), color="black", linewidth=2, label="dense")
            for method in METHODS:
                ax.plot(_smooth(mean_curve(workload, method, compressor)), linewidth=1, label=method)
            ax.set(title=f"{workload}, {compressor}", xlabel="step",
                   ylabel=f"training loss (smoothed, mean of {len(seeds)} seeds)")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(results.figure_path(), dpi=120)
    print(f"wrote {results.dir}")


if __name__ == "__main__":
    main()
