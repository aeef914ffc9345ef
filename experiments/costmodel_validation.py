"""Collective times on the emulated cluster vs the alpha-beta cost model, side by side.

    python -m experiments.costmodel_validation [--nodes 2,4,8] [--sizes-mb 1,4,16,64,256] [--reps 5]
        [--bandwidth 1gbit] [--dilation auto]

For each machine count an emulated cluster (one rank per machine, NICs of --bandwidth) runs
allreduce, allgather and all-to-all of every size through ddlscale's accounted collectives,
alternating the three, timing each from the moment its last rank enters it to the slowest rank's
completion (the namespaces share the host's monotonic clock). Ranks leave the barrier before a call
some milliseconds apart on this shared host; that skew is reported beside each point, not charged
to the collective, whose model assumes every rank has arrived. Sizes are per-rank results: the
allreduced tensor, the gathered output, the all-to-all input. The model's time for the same call is
printed beside each median; the target is within 15% from 4 MB up.

Every cluster runs time-dilated (``--dilation``, as ``cluster.dilation``: ``auto`` picks the k at which
the host stops limiting), so each emulated machine has its own CPU relative to its NIC, as a real
machine does; times are emulated seconds (wall / k). The model is the collective's algorithm on
rates and latencies each cluster measures before the runs, as the syncs do with
``sync.network_latency=measured`` and ``sync.network_bandwidth=measured``: allreduce at the NICs'
payload rate with the per-message latency of tiny allreduces (``ddlscale.comm.probe.probe_latency``);
the pairwise exchanges (allgather and all-to-all) at the rate and fixed cost two all-to-alls of 8 and
32 MB per rank show (``probe_exchange``, ``PROBE_TOTALS``). No point's size is probed and no point is fitted, so every
point is out of sample. Needs root.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys

from ddlscale.cluster import dilation
from ddlscale.cluster.emulated import ALPHA, TCP_PAYLOAD_FRACTION, EmulatedCluster
from ddlscale.comm.network import PROJECTION_WORKERS, NetworkModel
from ddlscale.comm.probe import PROBE_TOTALS
from ddlscale.units import parse_bandwidth

COLLECTIVES = ("allreduce", "allgather", "all_to_all")
PROBED = ("allreduce_alpha_s", "exchange_alpha_s", "exchange_bps", "exchange_fixed_s")
PORT = 29511


def model_time(model: NetworkModel, collective: str, nbytes: float, n: int, probe: dict | None = None) -> float:
    """The model's time for the call the workers make (allgather: direct, as on gloo). ``probe``: what
    the cluster measured before the runs (allreduce's alpha from tiny calls; the exchanges' rate and
    fixed cost from two all-to-alls of sizes not among the points), else the wire's own."""
    if probe is not None:
        if collective == "allreduce":
            model = dataclasses.replace(model, latency_s=probe["allreduce_alpha_s"])
        else:  # the pairwise exchange prices (n-1) alphas and its busiest NIC's bytes at its rate
            # each of its n-1 steps costs at least a tiny message's latency, whatever the line's intercept
            latency = max(probe["exchange_alpha_s"], probe["exchange_fixed_s"] / max(1, n - 1))
            model = dataclasses.replace(model, latency_s=latency, bandwidth_bps=probe["exchange_bps"])
    if collective == "allreduce":
        return model.allreduce(nbytes, n)
    if collective == "allgather":
        return model.allgather(nbytes / n, n, algorithm="direct")
    return model.all_to_all(nbytes / n, n)


def host_cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of the whole host: namespaces share /proc/stat with it."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:8]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


# -- the worker, run once per emulated machine ---------------------------------------------------
def worker(rank: int, world: int, sizes_mb: list[float], reps: int, bandwidth: str) -> None:
    import torch
    import torch.distributed as dist

    from ddlscale import clock
    from ddlscale.comm import Communicator
    from ddlscale.comm.probe import probe_exchange, probe_latency
    from ddlscale.units import parse_bandwidth

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://10.213.0.1:{PORT}", rank=rank, world_size=world)
    comm = Communicator()

    def prepare(collective: str, nbytes: int):
        """The call with its inputs already built: filling hundreds of MB is not the collective's time."""
        numel = max(world, nbytes // 4 // world * world)
        if collective == "allreduce":
            data = torch.ones(numel)
            return lambda: comm.allreduce(data)
        if collective == "allgather":
            piece = torch.ones(numel // world)
            return lambda: comm.allgather(piece)
        source, target = torch.ones(numel), torch.zeros(numel)
        return lambda: comm.all_to_all(target, source)

    prepare("allreduce", 4096)().wait()  # warm the connections
    # The per-message latency of this cluster, as the planners measure it: tiny collectives timed.
    probe = probe_latency(None, world, parse_bandwidth(bandwidth) * TCP_PAYLOAD_FRACTION)
    exchange = probe_exchange(None, world)  # the exchanges' rate and fixed cost, at sizes no point uses
    probe.update(exchange_bps=exchange["bandwidth_bps"], exchange_fixed_s=exchange["fixed_s"])
    rows = []
    for size_mb in sizes_mb:
        nbytes = int(size_mb * 2**20)
        for rep in range(reps):
            for collective in COLLECTIVES[rep % 3:] + COLLECTIVES[: rep % 3]:
                call = prepare(collective, nbytes)
                dist.barrier()
                busy0, total0 = host_cpu_ticks()
                start = clock.now()  # emulated seconds, on a clock every rank here shares
                pending = call()
                pending.wait()
                end = clock.now()
                busy1, total1 = host_cpu_ticks()
                stamps = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
                dist.all_gather(stamps, torch.tensor([start, end], dtype=torch.float64))
                starts, ends = [float(s[0]) for s in stamps], [float(s[1]) for s in stamps]
                rows.append({"collective": collective, "size_mb": size_mb, "rep": rep,
                             "measured_s": max(ends) - max(starts), "start_skew_s": max(starts) - min(starts),
                             "from_own_start_s": max(e - s for s, e in zip(starts, ends, strict=True)),
                             "bytes_sent": pending.record.bytes_sent,
                             "host_cpu_busy": (busy1 - busy0) / max(1, total1 - total0)})
                del pending, call
    if rank == 0:
        measured = {key: probe[key] for key in PROBED}
        print("RESULT " + json.dumps([{**row, **measured} for row in rows]), flush=True)
    dist.destroy_process_group()


# -- the driver ------------------------------------------------------------------------------------
def measure(nodes: int, bandwidth: str, sizes_mb: list[float], reps: int, k: float) -> list[dict]:
    with EmulatedCluster(nodes, bandwidth, dilation=k) as cluster:
        procs = [
            cluster.popen(i, [sys.executable, "-m", "experiments.costmodel_validation", "--worker", str(i),
                              "--world", str(nodes), "--sizes-mb", ",".join(map(str, sizes_mb)),
                              "--reps", str(reps), "--bandwidth", bandwidth], stdout=subprocess.PIPE, text=True)
            for i in range(nodes)
        ]
        outputs = [p.communicate(timeout=3600 * k)[0] for p in procs]
        if any(p.returncode for p in procs):
            raise RuntimeError(f"workers failed on {nodes} machines: codes {[p.returncode for p in procs]}")
    line = next(x for x in outputs[0].splitlines() if x.startswith("RESULT "))
    return [{"nodes": nodes, "dilation": k, **row} for row in json.loads(line[len("RESULT "):])]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="2,4,8")
    parser.add_argument("--sizes-mb", default="1,4,16,64,256")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--bandwidth", default="1gbit")
    parser.add_argument("--dilation", default="auto", help="time dilation k of every cluster (auto, or a number >= 1)")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = [float(s) for s in args.sizes_mb.split(",")]
    if args.worker is not None:
        worker(args.worker, args.world, sizes, args.reps, args.bandwidth)
        return

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from experiments.harness import Results

    results = Results("costmodel_validation")
    # The cluster's own model: TCP payload rate of the NICs and the measured per-message latency.
    wire_model = EmulatedCluster(2, args.bandwidth).network_model()
    node_counts = [int(n) for n in args.nodes.split(",")]
    setting = dilation.parse(args.dilation, "--dilation")
    rows, ks = [], {}
    for i, nodes in enumerate(node_counts):
        choice = dilation.choose(setting, nodes, 1, parse_bandwidth(args.bandwidth), 0.0)
        ks[nodes] = choice.k
        results.progress(i, len(node_counts), f"{nodes} machines: {choice.describe()}")
        rows += measure(nodes, args.bandwidth, sizes, args.reps, choice.k)
        results.progress(i + 1, len(node_counts), f"{nodes} machines measured")
    results.dilation = ", ".join(f"{k:g} ({n} machines)" for n, k in ks.items())
    alphas = {n: next({k: r[k] for k in PROBED} for r in rows if r["nodes"] == n) for n in node_counts}
    for row in rows:
        row["model_s"] = model_time(wire_model, row["collective"], row["size_mb"] * 2**20, row["nodes"],
                                    alphas[row["nodes"]])
        row["wire_model_s"] = model_time(wire_model, row["collective"], row["size_mb"] * 2**20, row["nodes"])
    results.write_csv(rows)

    table, misses = [], 0
    for nodes in node_counts:
        for collective in COLLECTIVES:
            for size in sizes:
                same = [r for r in rows if (r["nodes"], r["collective"], r["size_mb"]) == (nodes, collective, size)]
                times = [r["measured_s"] for r in same]
                cpu = statistics.median(r["host_cpu_busy"] for r in same)
                skew = statistics.median(r["start_skew_s"] for r in same)
                med = statistics.median(times)
                predicted = model_time(wire_model, collective, size * 2**20, nodes, alphas[nodes])
                wire = model_time(wire_model, collective, size * 2**20, nodes)
                error = predicted / med - 1
                judged = size >= 4
                misses += judged and abs(error) > 0.15
                verdict = ("yes" if abs(error) <= 0.15 else "no") if judged else "-"
                table.append([nodes, f"{ks[nodes]:g}", collective, size, med, min(times), max(times), wire, predicted,
                              f"{error:+.1%}", f"{cpu:.0%}", skew * 1e3, verdict])
                print(f"n={nodes} {collective:10s} {size:6g} MB: measured {med:.4f}s model {predicted:.4f}s "
                      f"({error:+.1%})")
    projections = {c: [(n, model_time(wire_model, c, 64 * 2**20, n)) for n in PROJECTION_WORKERS]
                   for c in COLLECTIVES}
    projection_text = "\n".join(
        f"- {c}, 64 MB: " + ", ".join(f"{n} workers {t:.2f}s" for n, t in pts) for c, pts in projections.items()
    )
    print("Projection (model):\n" + projection_text)
    results.write_markdown(
        f"Cost model vs emulated cluster ({args.bandwidth} NICs, one rank per machine)",
        ["machines", "k", "collective", "MB", "measured s (median)", "min", "max", "wire s",
         "model s (measured alpha, beta)", "model error", "host CPU busy", "start skew ms", "within 15% (>= 4 MB)"],
        table,
        notes=f"Model: NIC payload rate {wire_model.bandwidth_bps / 1e9:.3f} Gbit/s (TCP framing), "
              "ring allreduce (gloo's), allgather and all-to-all as ddlscale runs them on gloo (every pair at "
              f"once in 256 KiB segments), per-NIC bottleneck ('wire s', with the configured alpha {ALPHA}). The "
              "model takes what each cluster measured before the runs: allreduce's per-message latency from 20 "
              "tiny allreduces (ddlscale.comm.probe.probe_latency, as sync.network_latency=measured does), and the "
              f"pairwise exchange's rate and fixed cost from all-to-alls of {' and '.join(f'{t / 2**20:g}' for t in PROBE_TOTALS)} "
              "MB per rank (probe_exchange, "
              "as sync.network_bandwidth=measured does), the line through their medians: "
              + ", ".join(f"{n} machines: allreduce {a['allreduce_alpha_s'] * 1e6:.0f} us; exchanges "
                          f"{a['exchange_bps'] / 1e9:.3f} Gbit/s and {a['exchange_fixed_s'] * 1e3:.1f} ms each"
                          for n, a in alphas.items())
              + ": calls of sizes none of the points has, timed apart from them, so every point is out of sample. Times are "
              "emulated seconds (wall / k, k per cluster in the table). "
              f"{misses} of the points >= 4 MB miss 15%. 'host CPU busy' is the share of this host's cores in use "
              "during the collective (wall time: under dilation the machines' CPU caps leave the rest to the "
              "kernel's networking); 'start skew' how far apart the ranks entered it (timed from the last one)."
              "\n\nProjection to larger clusters (wire model):\n" + projection_text,
        summary={"Compared": "measured allreduce, allgather and all-to-all of " + args.sizes_mb.replace(",", ", ")
                             + " MB against the alpha-beta cost model (the wire, and the alpha and beta each cluster "
                             "measured on other calls).",
                 "Emulation": f"{args.nodes} emulated machines, one rank each, {args.bandwidth} NICs, on this host's "
                              f"{os.cpu_count()} cores, time-dilated (k per cluster: {results.dilation}); no device time.",
                 "Bound by": "measured per point as the share of the host's cores in use during the collective "
                             f"(medians {min(float(r[10].rstrip('%')) for r in table):.0f}-"
                             f"{max(float(r[10].rstrip('%')) for r in table):.0f}%, column 'host CPU busy'), and "
                             "as measured / wire time (columns 'measured s' and 'wire s').",
                 "Repetitions": f"{args.reps} per point.",
                 "Answer": f"{misses} of the points >= 4 MB miss 15%; worst error there "
                           + max((r[9] for r in table if r[12] in ("yes", "no")), key=lambda e: abs(float(e[:-1])),
                                 default="none")
                           + "."},
        command=f"python -m experiments.costmodel_validation --nodes {args.nodes} --sizes-mb {args.sizes_mb} "
                f"--reps {args.reps} --bandwidth {args.bandwidth}"
                + (f" --dilation {args.dilation}" if args.dilation != "auto" else ""),
    )
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), sharey=True)
    for ax, collective in zip(axes, COLLECTIVES, strict=True):
        for nodes in node_counts:
            meds = [statistics.median(r["measured_s"] for r in rows
                                      if (r["nodes"], r["collective"], r["size_mb"]) == (nodes, collective, s))
                    for s in sizes]
            line = ax.plot(sizes, meds, "o", label=f"{nodes} machines, measured")[0]
            ax.plot(sizes, [model_time(wire_model, collective, s * 2**20, nodes, alphas[nodes]) for s in sizes], "-",
                    color=line.get_color(), label=f"{nodes} machines, model")
            ax.plot(sizes, [model_time(wire_model, collective, s * 2**20, nodes) for s in sizes], ":",
                    color=line.get_color(), label=f"{nodes} machines, wire only")
        ax.set(xscale="log", yscale="log", title=collective, xlabel="MB per rank")
    axes[0].set_ylabel("seconds")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(results.figure_path(), dpi=120)
    print(f"wrote {results.dir}")


if __name__ == "__main__":
    main()
