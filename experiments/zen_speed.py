"""Zen vs dense allreduce and the sparse baselines on the emulated cluster, side by side.

    python -m experiments.zen_speed [--nodes 8] [--bandwidth 1gbit] [--models lstm,deepfm] [--reps 2] [--steps 20]

Each (model, sync) pair trains with one worker per emulated machine (NICs shaped to --bandwidth);
reps alternate the syncs. Reported per pair: median step time, median sync time (the training
thread's time in synchronization: what Zen saves), bytes per step and per-rank imbalance, and the
ratios to dense. The host shares 2 cores among all emulated machines, so compute is slow here and
throughput ratios understate the communication ratios. Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from experiments.harness import Results, alternating, spread, train
from experiments.sync_isolated import ROUTING

SYNCS = ("dense", "agsparse", "gloo_sparse", "sparse_ps", "omnireduce", "sparcml", "zen")
# Embedding gradients as sparse COO tensors (what a user of sparse sync runs): O(non-zeros) packing.
DEFAULT_OVERRIDES = "model.sparse_embedding=true"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--bandwidth", default="1gbit")
    parser.add_argument("--models", default="lstm,deepfm")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--syncs", default=",".join(SYNCS))
    parser.add_argument("--overrides", default=DEFAULT_OVERRIDES, help="extra train.py overrides, "
                        "space-separated (e.g. 'model.vocab_size=100000')")
    parser.add_argument("--name", default="zen_speed", help="results folder name")
    args = parser.parse_args(argv)
    syncs = tuple(args.syncs.split(","))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = Results(args.name)
    models = args.models.split(",")
    rows, by_pair = [], defaultdict(list)
    total, done = len(models) * args.reps * len(syncs), 0
    for model in models:
        for rep, sync in alternating(syncs, args.reps):
            summary = train([f"model={model}", f"sync={sync}", "cluster=emulated", f"cluster.nodes={args.nodes}",
                             f"cluster.bandwidth={args.bandwidth}", "trainer.devices=1",
                             f"trainer.max_steps={args.steps}", "seed=0", *([] if sync == "dense" else ROUTING),
                             *args.overrides.split()], timeout=1800)
            done += 1
            row = {"model": model, "sync": sync, "rep": rep,
                   **{k: summary[k] for k in ("step_time_s", "sync_time_s", "samples_per_s", "bytes_sent_per_step",
                                              "bytes_recv_per_step", "imbalance", "final_loss", "param_sha256",
                                              "encode_time_s", "comm_time_s", "decode_time_s")}}
            rows.append(row)
            by_pair[(model, sync)].append(row)
            results.progress(done, total, f"{model} {sync} rep {rep}: step {row['step_time_s'] * 1e3:.0f} ms, "
                                          f"sync {row['sync_time_s'] * 1e3:.0f} ms")
    results.write_csv(rows)

    def median(model: str, sync: str, key: str) -> float:
        return spread([r[key] for r in by_pair[(model, sync)]])[0]

    table = []
    for model in models:
        dense = {k: median(model, "dense", k) for k in ("sync_time_s", "step_time_s", "comm_time_s")}
        for sync in syncs:
            runs = by_pair[(model, sync)]
            m = {k: median(model, sync, k) for k in ("step_time_s", "sync_time_s", "comm_time_s", "encode_time_s",
                                                       "decode_time_s")}
            table.append([model, sync, m["step_time_s"] * 1e3, m["sync_time_s"] * 1e3, m["comm_time_s"] * 1e3,
                          (m["encode_time_s"] + m["decode_time_s"]) * 1e3, runs[0]["bytes_sent_per_step"] / 2**20,
                          runs[0]["imbalance"], dense["comm_time_s"] / m["comm_time_s"],
                          dense["sync_time_s"] / m["sync_time_s"], dense["step_time_s"] / m["step_time_s"]])
    results.write_markdown(
        f"Sparse sync on {args.nodes} emulated machines at {args.bandwidth}",
        ["model", "sync", "step ms", "sync ms", "comm ms", "encode+decode ms", "MiB sent/step (max rank)",
         "imbalance", "comm speedup vs dense", "sync speedup vs dense", "step speedup vs dense"],
        table,
        notes=f"One worker per emulated machine, {args.steps} steps per run (first excluded), {args.reps} "
              "alternating repetitions, medians. 'sync ms' is the training thread's time in synchronization "
              "after backward; 'comm ms' the part of it blocked on collectives; 'encode+decode ms' packing, "
              "hashing, partitioning, summing and unpacking (Zen's hashing overhead, reported apart). All "
              "emulated machines share this host's 2 cores, so compute and encode/decode run ~4x slower than "
              "on 8 real machines and step speedups understate sync speedups. The sparse syncs route with "
              "the per-message latency they measure (sync.network_latency=measured). "
              "experiments/results/zen_comm times each sync alone, every rank starting together, "
              "with each rank's CPU time: on 8 emulated machines sharing 2 cores the syncs are CPU-bound.",
        command=f"python -m experiments.zen_speed --nodes {args.nodes} --bandwidth {args.bandwidth} "
                f"--models {args.models} --reps {args.reps} --steps {args.steps} --syncs {args.syncs}"
                + (f" --overrides '{args.overrides}'" if args.overrides != DEFAULT_OVERRIDES else "")
                + (f" --name {args.name}" if args.name != "zen_speed" else ""),
    )
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.6))
    for ax, model in zip(list(axes) if len(models) > 1 else [axes], models, strict=True):
        rows_m = [r for r in table if r[0] == model]
        names = [r[1] for r in rows_m]
        ax.bar(names, [r[4] for r in rows_m], label="comm")
        ax.bar(names, [r[3] - r[4] for r in rows_m], bottom=[r[4] for r in rows_m], label="rest of sync")
        ax.set(title=f"{model}: sync time per step", ylabel="ms (median)")
        ax.tick_params(axis="x", rotation=45)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(results.figure_path(), dpi=120)
    print(f"wrote {results.dir}")


if __name__ == "__main__":
    main()
