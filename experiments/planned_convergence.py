"""Does training under ``sync=cupcake`` and ``sync=espresso`` converge like its compressor does layer-wise?

    python -m experiments.planned_convergence [--workloads cnn,lstm] [--compressors dgc,efsignsgd,randomk]
        [--steps 150] [--bandwidth 100mbit]

Same workload, seed and data for every run, 2 workers on this host; only the synchronization differs:
``sync=dense``, and per compressor ``sync=compress`` (layer-wise: every tensor compressed alone),
``sync=cupcake`` (fused groups) and ``sync=espresso`` (per-tensor plan; ``trial_steps=0`` so the
model's plan runs even where dense would measure faster). The planners are told a ``--bandwidth``
network so that their plans compress: a plan that compresses nothing would converge like dense
trivially. Reported: the final loss (mean of the last 10% of steps), its gap to dense and to the
layer-wise run of the same compressor, and what the plan compressed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from experiments.compression_accuracy import _smooth, loss_curve
from experiments.espresso_cupcake import MEMORY, SETTINGS, scheme_of
from experiments.harness import Results, train

METHODS = ("layerwise", "cupcake", "espresso")


def overrides_of(method: str, compressor: str, bandwidth: str) -> list[str]:
    out = [f"sync={'compress' if method == 'layerwise' else method}", f"compressor={compressor}",
           f"memory={MEMORY.get(compressor, 'residual')}", f"sync.comm={scheme_of(compressor)}",
           *SETTINGS.get(compressor, [])]
    if method != "layerwise":
        out += [f"sync.network_bandwidth={bandwidth}", "sync.profile_steps=3"]
    if method == "espresso":
        out.append("sync.trial_steps=0")
    return out


def compressed_share(run_dir: Path) -> str:
    """Of the plan's units: how many compress, and the share of elements they hold."""
    plan = json.loads((run_dir / "plan.json").read_text())
    units = list(zip(plan["units"], plan["options"], strict=True))
    compressed = [u for u, o in units if o["compressor"] != "none"]
    total = sum(u["numel"] for u, _ in units)
    return f"{len(compressed)}/{len(units)} units, {sum(u['numel'] for u in compressed) / total:.0%} of elements"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="cnn,lstm")
    parser.add_argument("--compressors", default="dgc,efsignsgd,randomk")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--bandwidth", default="100mbit", help="the network the planners are told")
    args = parser.parse_args(argv)
    workloads, compressors = args.workloads.split(","), args.compressors.split(",")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = Results("planned_convergence")
    runs = [(w, "dense", None) for w in workloads] + [(w, m, c) for w in workloads for c in compressors for m in METHODS]
    curves, rows = {}, []
    with tempfile.TemporaryDirectory() as scratch:
        for k, (workload, method, compressor) in enumerate(runs):
            run_dir = Path(scratch) / f"{workload}-{method}-{compressor}"
            sync = ["sync=dense"] if method == "dense" else overrides_of(method, compressor, args.bandwidth)
            train([f"model={workload}", *sync, f"trainer.max_steps={args.steps}", "seed=0", "logger=csv",
                   "trainer.log_every_n_steps=1"], run_dir=run_dir)
            curve = curves[(workload, method, compressor)] = loss_curve(run_dir)
            rows.append({"workload": workload, "method": method, "compressor": compressor or "none",
                         "final_loss": statistics.fmean(curve[-max(1, len(curve) // 10):]), "steps": len(curve),
                         "plan": compressed_share(run_dir) if method in ("cupcake", "espresso") else ""})
            results.progress(k + 1, len(runs), f"{workload} {method} {compressor or ''}: final loss "
                                               f"{rows[-1]['final_loss']:.4f} {rows[-1]['plan']}")
    results.write_csv(rows)

    def final(workload: str, method: str, compressor: str) -> float:
        return next(r["final_loss"] for r in rows if (r["workload"], r["method"], r["compressor"]) ==
                    (workload, method, compressor))

    table = [[r["workload"], r["method"], r["compressor"], r["final_loss"],
              r["final_loss"] - final(r["workload"], "dense", "none"),
              "" if r["method"] == "dense" else r["final_loss"] - final(r["workload"], "layerwise", r["compressor"]),
              r["plan"]] for r in rows]
    results.write_markdown(
        "Convergence under Cupcake and Espresso plans vs the same compressor layer-wise",
        ["workload", "method", "compressor", "final loss (last 10%)", "gap to dense", "gap to layer-wise",
         "what the plan compressed"],
        table,
        notes=f"2 workers, {args.steps} steps, seed 0, same data for every run. Error feedback: "
              + ", ".join(f"{c} {MEMORY.get(c, 'residual')}" for c in compressors)
              + "; settings: " + "; ".join(f"{c}: {' '.join(v)}" for c, v in SETTINGS.items())
              + f". Planners told {args.bandwidth} (profile 3 dense steps first; Espresso without its "
                "trial, so the model's plan runs).",
        command=f"python -m experiments.planned_convergence --workloads {args.workloads} --compressors "
                f"{args.compressors} --steps {args.steps} --bandwidth {args.bandwidth}")
    fig, axes = plt.subplots(len(workloads), len(compressors), figsize=(4.2 * len(compressors), 3.4 * len(workloads)),
                             squeeze=False)
    for row_axes, workload in zip(axes, workloads, strict=True):
        for ax, compressor in zip(row_axes, compressors, strict=True):
            ax.plot(_smooth(curves[(workload, "dense", None)]), color="black", linewidth=2, label="dense")
            for method in METHODS:
                ax.plot(_smooth(curves[(workload, method, compressor)]), linewidth=1, label=method)
            ax.set(title=f"{workload}, {compressor}", xlabel="step", ylabel="training loss (smoothed)")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(results.figure_path(), dpi=120)
    print(f"wrote {results.dir}")


if __name__ == "__main__":
    main()
