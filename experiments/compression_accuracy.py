"""Loss curves of compressed training vs dense, with and without error feedback.

    python -m experiments.compression_accuracy [--workloads cnn,lstm] [--compressors topk,...] [--steps 150]

Every run trains the same workload from the same seed on the same data with 2 workers; only the
synchronization differs: ``sync=dense``, then ``sync=compress compressor=X`` with ``memory=none``
and with ``memory=residual`` (true error feedback). The per-step training loss comes from each
run's metrics.csv. Reported: the final loss (mean of the last 10% of steps) and its gap to dense;
biased compressors (top-k, sign-based) should close most of the gap with error feedback.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import tempfile
from pathlib import Path

from experiments.harness import Results, train

COMPRESSORS = ("topk", "dgc", "randomk", "signsgd", "onebit", "qsgd", "terngrad", "powersgd", "fp16")
MEMORIES = ("none", "residual")
SETTINGS = {  # per compressor: overrides that make it a fair, commonly used configuration
    "topk": ["compressor.ratio=0.01"],
    "dgc": ["compressor.ratio=0.01"],
    "randomk": ["compressor.ratio=0.05"],
    "powersgd": ["sync.comm=allreduce", "compressor.rank=2"],
    "fp16": ["sync.comm=allreduce"],
}


def loss_curve(run_dir: Path) -> list[float]:
    """Per-step training loss from the CSV logger's metrics.csv (one row per logged step)."""
    rows = list(csv.DictReader(next(run_dir.rglob("metrics.csv")).open()))
    key = next(k for k in ("train_loss_step", "train_loss", "loss") if rows and k in rows[0])
    return [float(r[key]) for r in rows if r.get(key)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="cnn,lstm")
    parser.add_argument("--compressors", default=",".join(COMPRESSORS))
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--name", default="compression_accuracy", help="results folder name")
    args = parser.parse_args(argv)
    workloads, compressors = args.workloads.split(","), args.compressors.split(",")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = Results(args.name)
    runs = [(w, "dense", "none") for w in workloads]
    runs += [(w, c, m) for w in workloads for c in compressors for m in MEMORIES]
    curves: dict[tuple[str, str, str], list[float]] = {}
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for k, (workload, compressor, memory) in enumerate(runs):
            run_dir = Path(scratch) / f"{workload}-{compressor}-{memory}"
            sync = ["sync=dense"] if compressor == "dense" else [
                "sync=compress", f"compressor={compressor}", f"memory={memory}", *SETTINGS.get(compressor, [])]
            summary = train([f"model={workload}", *sync, f"trainer.max_steps={args.steps}", "seed=0",
                             "logger=csv", "trainer.log_every_n_steps=1"], run_dir=run_dir)
            curve = loss_curve(run_dir)
            curves[(workload, compressor, memory)] = curve
            tail = curve[-max(1, len(curve) // 10):]
            rows.append({"workload": workload, "compressor": compressor, "memory": memory,
                         "final_loss": statistics.fmean(tail), "bytes_sent_per_step": summary["bytes_sent_per_step"],
                         "steps": len(curve)})
            results.progress(k + 1, len(runs), f"{workload} {compressor} memory={memory}: "
                                               f"final loss {rows[-1]['final_loss']:.4f}")
    results.write_csv(rows)

    table = []
    for workload in workloads:
        dense = next(r for r in rows if (r["workload"], r["compressor"]) == (workload, "dense"))
        for r in rows:
            if r["workload"] != workload:
                continue
            table.append([workload, r["compressor"], r["memory"], r["final_loss"], r["final_loss"] - dense["final_loss"],
                          r["bytes_sent_per_step"] / max(1.0, dense["bytes_sent_per_step"])])
    results.write_markdown(
        "Compressed training vs dense: final loss with and without error feedback",
        ["workload", "compressor", "memory", "final loss (last 10%)", "gap to dense", "bytes vs dense"],
        table,
        notes=f"2 workers, {args.steps} steps, seed 0, same data for every run; compressor settings: "
              + "; ".join(f"{c}: {' '.join(s)}" for c, s in SETTINGS.items())
              + ". Others at their config defaults. 'memory=residual' is true error feedback.",
        command=f"python -m experiments.compression_accuracy --workloads {args.workloads} "
                f"--compressors {args.compressors} --steps {args.steps}"
                + (f" --name {args.name}" if args.name != "compression_accuracy" else ""),
    )
    fig, axes = plt.subplots(len(workloads), 2, figsize=(11, 3.6 * len(workloads)), squeeze=False)
    for row_axes, workload in zip(axes, workloads, strict=True):
        for ax, memory in zip(row_axes, MEMORIES, strict=True):
            dense = curves[(workload, "dense", "none")]
            ax.plot(_smooth(dense), color="black", linewidth=2, label="dense")
            for compressor in compressors:
                ax.plot(_smooth(curves[(workload, compressor, memory)]), linewidth=1, label=compressor)
            ax.set(title=f"{workload}, memory={memory}", xlabel="step", ylabel="training loss (smoothed)")
            ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(results.figure_path(), dpi=120)
    print(f"wrote {results.dir}")


def _smooth(values: list[float], window: int = 10) -> list[float]:
    return [statistics.fmean(values[max(0, i - window + 1): i + 1]) for i in range(len(values))]


if __name__ == "__main__":
    main()
