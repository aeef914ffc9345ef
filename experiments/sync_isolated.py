"""Synchronization time of the sparse backends on a workload's real gradients, every rank starting together.

    python -m experiments.sync_isolated [--nodes 8] [--bandwidth 1gbit]
        [--workloads lstm,lstm+model.vocab_size=100000,deepfm] [--syncs dense,agsparse,...,zen] [--reps 8]

In training on emulated machines that share 2 cores, a rank's time in a collective is mostly the
wait for the slowest rank's backward: every backend pays it, so step and sync times hide what the
backends themselves cost (experiments/zen_speed). Here one worker per emulated machine builds the
workload, runs forward and backward on its own batch (untimed), and then every rank leaves a
barrier and hands its gradients to the backend in backward order, as the hooks would, and finishes
the step: the time from the last rank's barrier exit to the last rank's finish is the backend's
synchronization time (encode, collectives and decode; no overlap with compute, for any backend).
Each backend first runs its profiling steps untimed (the sparse ones start dense), then ``--reps``
timed steps on fresh batches; the backends take turns step by step, the first rotating, so drift
hits all alike. A workload (and a sync) is a config name, optionally with ``+``-joined overrides
(``zen+sync.scheme=bp``; ``lstm+model.vocab_size=100000``: the paper's language models have vocabularies of 10^5-10^6
words; ours defaults to 20,000). Embedding gradients are sparse COO (``model.sparse_embedding=true``).
Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

from experiments.harness import ROOT, Results, spread

PORT = 29531
SYNCS = ("dense", "agsparse", "gloo_sparse", "sparse_ps", "omnireduce", "sparcml", "zen")
SPARSE = ["model.sparse_embedding=true"]  # embedding gradients as sparse COO, as zen_speed trains
# The sparse syncs route with the per-message cost this cluster shows, as zen_speed runs them.
ROUTING = ["sync.network_latency=measured", "sync.network_bandwidth=956000000"]
WARMUP_STEPS = 6  # untimed: order learning, the sparse backends' profiling (2 steps by default) and re-routing


def worker(rank: int, world: int, workload: str, syncs: list[str], reps: int) -> None:
    import torch
    import torch.distributed as dist
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://10.213.0.1:{PORT}", rank=rank, world_size=world)
    with initialize_config_dir(str(ROOT / "conf"), version_base=None):
        model_name, *overrides = workload.split("+")
        configs = {}
        for s in syncs:
            name, *tweaks = s.split("+")
            routed = [] if name == "dense" else ROUTING
            configs[s] = compose("config", [f"model={model_name}", f"sync={name}", "seed=0", *SPARSE, *routed,
                                            *overrides, *tweaks])
    torch.manual_seed(0)  # the same on every rank, as Lightning's seeding makes it
    model = instantiate(configs[syncs[0]].model)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    order: list[int] = []
    for i, (_, p) in enumerate(named):
        p.register_post_accumulate_grad_hook(lambda _p, i=i: order.append(i))
    batches = DataLoader(model.make_dataset(), batch_size=model.batch_size, shuffle=False, drop_last=True)
    mine = [b for k, b in enumerate(batches) if k % world == rank]  # DistributedSampler's shard, unshuffled
    backends = {}
    for s in syncs:
        backends[s] = instantiate(configs[s].sync)
        backends[s].setup(named)
    rows = []
    for step in range(WARMUP_STEPS + reps):
        for s in syncs[step % len(syncs):] + syncs[: step % len(syncs)]:
            sync = backends[s]
            model.zero_grad(set_to_none=True)
            order.clear()
            model.loss(mine[step % len(mine)]).backward()
            dist.barrier()
            start, cpu = time.monotonic(), time.process_time()
            for i in order:
                sync.grad_ready(named[i][1])
            stats = sync.finish_step()
            end, cpu = time.monotonic(), time.process_time() - cpu
            stamps = [torch.zeros(5, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(stamps, torch.tensor([start, end, stats.bytes_sent, stats.sync_s, cpu], dtype=torch.float64))
            if step < WARMUP_STEPS:
                continue
            starts, ends = [float(t[0]) for t in stamps], [float(t[1]) for t in stamps]
            rows.append({"workload": workload, "sync": s, "rep": step - WARMUP_STEPS,
                         "sync_s": max(ends) - max(starts), "start_skew_s": max(starts) - min(starts),
                         "encode_s": stats.encode_s, "comm_s": stats.comm_s, "decode_s": stats.decode_s,
                         "max_bytes_sent": max(float(t[2]) for t in stamps),
                         "slowest_rank_sync_s": max(float(t[3]) for t in stamps),
                         "cpu_s_per_rank": statistics.mean(float(t[4]) for t in stamps)})
    routes = {s: describe_routes(b) for s, b in backends.items()}
    for row in rows:
        row["routes"] = routes[row["sync"]]
    if rank == 0:
        print("RESULT " + json.dumps(rows), flush=True)
    dist.barrier()  # nobody tears gloo down while a peer's last message is in flight
    dist.destroy_process_group()


def describe_routes(sync: Any) -> str:
    """Where each gradient went: the sparse syncs' routing (Zen's scheme per tensor), else ``all dense``."""
    if not hasattr(sync, "routing"):
        return "all dense"
    table = sync.routing()
    return " ".join(f"{name}:{info.get('plan', 'sparse')}" for name, info in table.items() if info["path"] == "sparse")


def measure(nodes: int, bandwidth: str, workload: str, syncs: list[str], reps: int) -> list[dict[str, Any]]:
    """Rank 0's rows for one workload: one per (sync, timed step)."""
    from ddlscale.cluster.emulated import EmulatedCluster

    with EmulatedCluster(nodes, bandwidth) as cluster:
        argv = [sys.executable, "-m", "experiments.sync_isolated", "--world", str(nodes), "--workloads", workload,
                "--syncs", ",".join(syncs), "--reps", str(reps)]
        procs = [cluster.popen(i, [*argv, "--worker", str(i)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
                 for i in range(nodes)]
        outputs = [p.communicate(timeout=3600)[0] for p in procs]
        if any(p.returncode for p in procs):
            raise RuntimeError(f"workers failed on {nodes} machines: codes {[p.returncode for p in procs]}")
    line = next(x for x in outputs[0].splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def summarize(rows: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, float]]:
    """Per (workload, sync): median, min and max of the synchronization time, medians of the rest."""
    keys = ("start_skew_s", "encode_s", "comm_s", "decode_s", "max_bytes_sent", "slowest_rank_sync_s", "cpu_s_per_rank")
    out = {}
    for pair in dict.fromkeys((r["workload"], r["sync"]) for r in rows):
        mine = [r for r in rows if (r["workload"], r["sync"]) == pair]
        out[pair] = {"sync_s": spread([r["sync_s"] for r in mine]),
                     **{k: statistics.median(r[k] for r in mine) for k in keys}}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--bandwidth", default="1gbit")
    parser.add_argument("--workloads", default="lstm,lstm+model.vocab_size=100000,deepfm")
    parser.add_argument("--syncs", default=",".join(SYNCS))
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--name", default="zen_comm", help="results folder name")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    syncs = args.syncs.split(",")
    if args.worker is not None:
        worker(args.worker, args.world, args.workloads, syncs, args.reps)
        return
    if "dense" not in syncs:
        parser.error("--syncs must include dense: every ratio is against it")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = Results(args.name)
    workloads = args.workloads.split(",")
    rows: list[dict[str, Any]] = []
    for k, workload in enumerate(workloads):
        rows += measure(args.nodes, args.bandwidth, workload, syncs, args.reps)
        results.progress(k + 1, len(workloads), f"{workload} done")
    results.write_csv(rows)
    summary = summarize(rows)
    table = []
    for workload in workloads:
        dense = summary[(workload, "dense")]["sync_s"][0]
        baselines = [s for s in syncs if s.split("+")[0] not in ("dense", "zen")]
        best = min((summary[(workload, s)]["sync_s"][0], s) for s in baselines) if baselines else None
        for s in syncs:
            f = summary[(workload, s)]
            med, low, high = f["sync_s"]
            table.append([workload.replace("+", " "), s, f"{med * 1e3:.1f} ({low * 1e3:.1f}-{high * 1e3:.1f})",
                          f["comm_s"] * 1e3, (f["encode_s"] + f["decode_s"]) * 1e3, f["cpu_s_per_rank"] * 1e3,
                          f["max_bytes_sent"] / 2**20,
                          dense / med, f"{best[0] / med:.2f} vs {best[1]}" if best and s.startswith("zen") else ""])
    routes = {}
    for row in rows:
        routes.setdefault(row["workload"], {})[row["sync"]] = row["routes"]
    route_notes = "\n".join(f"- {w.replace('+', ' ')}, {s}: {r}" for w, by_sync in routes.items()
                            for s, r in by_sync.items() if s != "dense")
    results.write_markdown(
        f"Sparse sync in isolation: {args.nodes} emulated machines at {args.bandwidth}, every rank starting together",
        ["workload", "sync", "sync ms (min-max)", "comm ms (rank 0)", "encode+decode ms (rank 0)", "CPU ms per rank",
         "MiB sent (max rank)", "speed-up vs dense", "zen vs best baseline"],
        table,
        notes=f"{args.reps} timed steps per backend after {WARMUP_STEPS} untimed ones, the backends taking turns "
              "step by step; 'sync ms' runs from the last rank's barrier exit to the last rank's finish (median, "
              "min-max), comm and encode+decode are rank 0's split of its own time, CPU the process time a rank "
              "spent in it (its gloo threads included; mean over ranks). No compute overlaps "
              "any backend here. All emulated machines share this host's 2 cores, so every rank's "
              "encode/decode runs about n/2 times slower than on its own machine, and each message "
              "step costs milliseconds of process scheduling. The sparse syncs route with the per-message "
              "latency they measure (sync.network_latency=measured). Tensors on the sparse path (Zen: its "
              "scheme), others in dense buckets:\n" + route_notes,
        command=f"python -m experiments.sync_isolated --nodes {args.nodes} --bandwidth {args.bandwidth} "
                f"--workloads {args.workloads} --syncs {args.syncs} --reps {args.reps}"
                + (f" --name {args.name}" if args.name != "zen_comm" else ""),
    )
    fig, axes = plt.subplots(1, len(workloads), figsize=(4.6 * len(workloads), 3.6), squeeze=False)
    for ax, workload in zip(axes[0], workloads, strict=True):
        figures = [summary[(workload, s)] for s in syncs]
        ax.bar(syncs, [f["comm_s"] * 1e3 for f in figures], label="comm (rank 0)")
        ax.bar(syncs, [(f["encode_s"] + f["decode_s"]) * 1e3 for f in figures],
               bottom=[f["comm_s"] * 1e3 for f in figures], label="encode+decode (rank 0)")
        ax.plot(syncs, [f["sync_s"][0] * 1e3 for f in figures], "k_", markersize=18, label="sync (all ranks)")
        ax.set(title=workload.replace("+", "\n"), ylabel="ms per step (median)")
        ax.tick_params(axis="x", rotation=45)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(results.figure_path(), dpi=120)
    print(f"wrote {results.dir}")


if __name__ == "__main__":
    main()
