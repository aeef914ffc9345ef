"""The per-message cost a sparse sync measures, and the routes it takes from it, across identical runs.

    python -m experiments.alpha_stability [--nodes 8] [--bandwidth 1gbit] [--models lstm,deepfm]
        [--reps 4] [--steps 8]

A sparse sync prices its choices (sparse or dense per tensor; Zen's balanced push/pull or recursive
doubling per tensor) on the network's per-message cost, measured on the sync group at start-up
(``sync.network_latency=measured``: :func:`ddlscale.comm.probe.probe_latency`, a concurrent n-way
exchange round of one float per peer, the median of 30). If that figure moves between identical
jobs, so can the routes, and a figure that moved cannot be traced. Per model, the same Zen job
(one worker per emulated machine, auto k, the same seed) runs ``--reps`` times, alternating the
models; each run's summary.json gives the alpha it measured (``latency_s``), the rounds behind it
(``measured_rounds``) and its routes (``routing``: path per tensor, and Zen's plan per sparse tensor).

Reported: the alpha's spread ((max - min) / median) over the runs of a model, and how many distinct
route sets its runs took. Target: spread <= 20%, one route set.
Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from experiments.harness import Results, alternating, train


def routes_of(summary: dict[str, Any]) -> str:
    """A run's routes as one comparable string: per tensor, its path and (Zen) its plan (bp-coo, bp-bitmap, hc)."""
    table = {name: [route["path"], route.get("plan")] for name, route in (summary.get("routing") or {}).items()}
    return json.dumps(table, sort_keys=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--bandwidth", default="1gbit")
    parser.add_argument("--models", default="lstm,deepfm")
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--name", default="alpha_stability")
    args = parser.parse_args(argv)
    models = args.models.split(",")
    results = Results(args.name)
    rows: list[dict[str, Any]] = []
    plan = list(alternating(models, args.reps))
    for done, (rep, model) in enumerate(plan, 1):
        summary = train([f"model={model}", "sync=zen", "model.sparse_embedding=true", "cluster=emulated",
                         f"cluster.nodes={args.nodes}", f"cluster.bandwidth={args.bandwidth}", "trainer.devices=1",
                         f"trainer.max_steps={args.steps}", "seed=0"], timeout=3600)
        rounds = summary.get("measured_rounds") or {}
        row = {"model": model, "rep": rep, "k": summary.get("dilation"), "alpha_us": summary["latency_s"] * 1e6,
               "exchange_round_us": rounds.get("exchange_round_s", float("nan")) * 1e6,
               "swap_us": rounds.get("swap_s", float("nan")) * 1e6, "routes": routes_of(summary),
               "step_time_s": summary["step_time_s"], "starved": summary.get("starved")}
        rows.append(row)
        results.progress(done, len(plan), f"{model} rep {rep}: alpha {row['alpha_us']:.0f} us (round "
                                          f"{row['exchange_round_us']:.0f} us, swap {row['swap_us']:.0f} us)")
    route_ids = {routes: i for i, routes in enumerate(dict.fromkeys(r["routes"] for r in rows))}
    for row in rows:
        row["route_set"] = route_ids[row["routes"]]
    results.write_csv(rows)

    table, answers = [], []
    for model in models:
        mine = [r for r in rows if r["model"] == model and not r["starved"]]
        alphas = [r["alpha_us"] for r in mine]
        spread = (max(alphas) - min(alphas)) / statistics.median(alphas)
        sets = sorted({r["route_set"] for r in mine})
        table.append([model, len(mine), statistics.median(alphas), min(alphas), max(alphas), f"{spread:.1%}",
                      statistics.median(r["exchange_round_us"] for r in mine),
                      statistics.median(r["swap_us"] for r in mine), len(sets)])
        answers.append(f"{model}: alpha {statistics.median(alphas):.0f} us, spread {spread:.1%}, "
                       f"{len(sets)} route set{'s' if len(sets) > 1 else ''}")
    k = ", ".join(sorted({f"{r['k']:g}" for r in rows}))
    results.write_markdown(
        "Measured alpha and routes across identical Zen runs",
        ["model", "runs counted", "alpha us (median)", "min", "max", "spread", "n-way round us", "swap us",
         "route sets"],
        table,
        notes=("alpha: the per-message-step cost routing used, the concurrent n-way exchange round of one float "
               "per peer over its n - 1 steps (median of 30 calls, rank 0's on every rank). Route sets: distinct "
               "(tensor -> path, Zen's scheme and pull) tables among the runs (results.csv's routes column)."),
        summary={
            "Compared": f"the same Zen job run {args.reps} times per model: its measured per-message cost and routes.",
            "Emulation": f"{args.nodes} machines, {args.bandwidth} NICs, one worker each, k = {k} (auto).",
            "Bound by": "not a timing comparison: the figure is the measured alpha's spread.",
            "Repetitions": f"{args.reps} per model, alternating the models.",
            "Answer": "; ".join(answers) + ".",
        },
        command=(f"python -m experiments.alpha_stability --nodes {args.nodes} --bandwidth {args.bandwidth} "
                 f"--models {args.models} --reps {args.reps} --steps {args.steps}"),
    )
    print(f"wrote {results.dir}")


if __name__ == "__main__":
    main()
