"""PyTorch's own sparse allreduce beside every sparse sync, on an embedding gradient, on the emulated cluster.

    python -m experiments.sparse_allreduce [--nodes 2,4,8] [--bandwidths 1gbit,100mbit]
        [--densities 0.01,0.04] [--rows 200000] [--width 64] [--reps 5] [--sweep 10] [--dilation auto]

The gradient a user has: ``nn.Embedding(rows, width, sparse=True)`` looked up with Zipf-distributed
tokens (exponent 1.1, hot ids first), so each worker's gradient is a hybrid sparse COO tensor whose
non-zero rows are a target fraction of the table (the token count per worker is solved for that
expected fraction). One worker per emulated machine; fresh tokens every repetition, the same for
every method within it. Methods:

- ``torch``: ``dist.all_reduce(grad)`` on the sparse gradient over gloo, the one-line call a user has;
- every ddlscale sync (``dense``, ``gloo_sparse``, ``agsparse``, ``sparse_ps``, ``omnireduce``,
  ``sparcml``, ``zen``), fed the gradient as the strategy's hook does, and finishing the step, under
  two routings: ``auto`` (each backend's cost model decides sparse or dense for the table, every
  backend given the same network: the configured bandwidth and one latency probed at the start) and
  ``sparse`` (``sync.route=sparse``: the table goes sparse for every method).

Time: from the last rank's barrier exit to the last rank's finish, no compute overlapping; methods
take turns step by step, the first rotating. Each sync runs its profiling steps first, untimed.
Wire limit: the busiest NIC's bytes (max over ranks of bytes sent or received) at the NIC's payload
rate (the configured rate x 1448/1514, TCP over Ethernet); a ratio near 1 means the method moved its
bytes as fast as the NIC allows. ``--sweep 10`` repeats the 8-machine, 1 Gbit/s cells for the sparse
methods with 10x the rows at the same non-zero rows: the same tokens, drawn over the original table,
land on every 10th row of the larger one (so they spread over all of it, as hashing sees them). COO
pulls must not grow with the table.

Each cluster runs time-dilated (``--dilation``, as ``cluster.dilation``: ``auto`` picks, per machine
count and bandwidth, the smallest k at which the host stops limiting; every time is reported in
emulated seconds, wall / k).

Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from typing import Any

from ddlscale.paths import CONF_DIR
from experiments.harness import ROOT, Results, spread

PORT = 29541
ZIPF = 1.1
SYNCS = ("dense", "gloo_sparse", "agsparse", "sparse_ps", "omnireduce", "sparcml", "zen")
SPARSE_SYNCS = tuple(s for s in SYNCS if s != "dense")
ALL_METHODS = ",".join(("torch", *SYNCS))  # --methods' default
WARMUP = 4  # untimed steps per method: backward-order learning and the sparse syncs' profiling
SWEEP_ZEN = "zen+sync.pull=coo"  # the table-size sweep's Zen: the pull whose cost must not grow with the table


def tokens_for(rows: int, density: float, exponent: float = ZIPF) -> int:
    """Tokens per worker whose expected distinct rows are ``density`` of the table (bisection on
    sum_i 1 - (1 - p_i)^T over the Zipf probabilities)."""
    import torch

    p = torch.arange(1, rows + 1, dtype=torch.float64).pow(-exponent)
    p /= p.sum()
    target = density * rows
    low, high = 1, 1
    while float((1 - (1 - p).pow(high)).sum()) < target:
        high *= 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if float((1 - (1 - p).pow(mid)).sum()) < target else (low, mid)
    return high


def worker(rank: int, world: int, cells: list[dict[str, Any]], reps: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from ddlscale import clock
    from ddlscale.comm.probe import probe_latency
    from ddlscale.units import parse_bandwidth
    from ddlscale.workloads.zipf import zipf_probabilities

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://10.213.0.1:{PORT}", rank=rank, world_size=world)
    # One latency for every method's routing: probed once here, on the same group every method uses.
    alpha = probe_latency(None, world, parse_bandwidth(cells[0]["bandwidth"]))["exchange_alpha_s"]
    latency = [alpha]
    dist.broadcast_object_list(latency, src=0)
    rows_out: list[dict[str, Any]] = []
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        for cell in cells:
            rows, width, spread_by = cell["rows"], cell["width"], cell.get("spread", 1)
            weight = torch.nn.Parameter(torch.zeros(1, width).expand(rows, width))  # no table in memory
            probabilities = zipf_probabilities(rows // spread_by, ZIPF)
            methods = cell["methods"]
            syncs = {}
            for m in methods:
                if m == "torch":
                    continue
                name, *tweaks = m.split("+")  # e.g. zen+sync.pull=coo
                overrides = [f"sync={name}", *tweaks]
                if name != "dense":
                    overrides += [f"sync.route={cell['route']}", f"sync.network_bandwidth={cell['bandwidth']}",
                                  f"sync.network_latency={latency[0]}s"]
                sync = instantiate(compose("config", overrides).sync)
                sync.setup([("embedding.weight", weight)], sparse_grads={"embedding.weight"})  # F.embedding(sparse=True)
                syncs[m] = sync

            def gradient(step: int, cell=cell, weight=weight, probabilities=probabilities,
                         spread_by=spread_by) -> torch.Tensor:
                generator = torch.Generator().manual_seed(1_000_003 * step + 7919 * rank + cell["seed"])
                tokens = torch.multinomial(probabilities, cell["tokens"], replacement=True, generator=generator)
                tokens *= spread_by
                upstream = torch.randn(cell["tokens"], cell["width"], generator=generator)
                weight.grad = None
                (F.embedding(tokens, weight, sparse=True) * upstream).sum().backward()
                return weight.grad

            for step in range(WARMUP + reps):
                order = methods[step % len(methods):] + methods[: step % len(methods)]
                for m in order:
                    grad = gradient(step)
                    local_rows = grad.coalesce()._nnz()
                    dist.barrier()
                    start = clock.now()  # emulated seconds (wall / k): one clock for every rank here
                    summed_rows = -1
                    if m == "torch":
                        dist.all_reduce(grad)
                        summed_rows = grad.coalesce()._nnz()  # the sum's rows: gamma_n = this / mean rows
                        encode = comm = decode = 0.0
                        sent = recv = -1.0  # filled below from every rank's row count
                    else:
                        sync = syncs[m]
                        sync.grad_ready(weight)
                        stats = sync.finish_step()
                        encode, comm, decode = stats.encode_s, stats.comm_s, stats.decode_s
                        sent, recv = float(stats.bytes_sent), float(stats.bytes_recv)
                    end = clock.now()
                    stamps = [torch.zeros(8, dtype=torch.float64) for _ in range(world)]
                    dist.all_gather(stamps, torch.tensor([start, end, sent, recv, encode, comm, decode, local_rows],
                                                         dtype=torch.float64))
                    if step < WARMUP:
                        continue
                    if m == "torch":  # gloo's ring allgathers of int64 row ids and rows, from every count
                        counts = [float(t[7]) * (8 + 4 * width) for t in stamps]
                        for r, t in enumerate(stamps):
                            t[2] = sum(counts) - counts[(r + 1) % world]
                            t[3] = sum(counts) - counts[r]
                    route = "dense"
                    if m != "torch" and not m.startswith("dense"):
                        route = syncs[m].routing()["embedding.weight"]
                        route = route.get("plan", route["path"]) if route["path"] == "sparse" else "dense"
                    rows_out.append({
                        **{k: cell[k] for k in ("nodes", "bandwidth", "density", "rows", "width", "route", "tokens")},
                        "dilation": clock.dilation(),
                        "method": m, "rep": step - WARMUP, "path": "sparse" if m == "torch" else route,
                        "sync_s": max(float(t[1]) for t in stamps) - max(float(t[0]) for t in stamps),
                        "busiest_nic_bytes": max(max(float(t[2]), float(t[3])) for t in stamps),
                        "comm_s": max(float(t[5]) for t in stamps),
                        "encode_decode_s": max(float(t[4]) + float(t[6]) for t in stamps),
                        "mean_rows_per_worker": statistics.mean(float(t[7]) for t in stamps),
                        "summed_rows": summed_rows,
                    })
            del syncs
    if rank == 0:
        print("RESULT " + json.dumps(rows_out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def measure(nodes: int, bandwidth: str, cells: list[dict[str, Any]], reps: int, k: float) -> list[dict[str, Any]]:
    from ddlscale.cluster.emulated import EmulatedCluster

    with EmulatedCluster(nodes, bandwidth, dilation=k) as cluster:
        argv = [sys.executable, "-m", "experiments.sparse_allreduce", "--world", str(nodes), "--reps", str(reps),
                "--cells", json.dumps(cells)]
        procs = [cluster.popen(i, [*argv, "--worker", str(i)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
                 for i in range(nodes)]
        outputs = [p.communicate(timeout=7200 * k)[0] for p in procs]
        if any(p.returncode for p in procs):
            raise RuntimeError(f"workers failed on {nodes} machines: codes {[p.returncode for p in procs]}")
    line = next(x for x in outputs[0].splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="2,4,8")
    parser.add_argument("--bandwidths", default="1gbit,100mbit")
    parser.add_argument("--densities", default="0.01,0.04")
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--sweep", type=int, default=10, help="rows multiplier of the table-size sweep (0: none)")
    parser.add_argument("--methods", default=ALL_METHODS)
    parser.add_argument("--name", default="sparse_allreduce")
    parser.add_argument("--dilation", default="auto", help="time dilation k of every cluster (auto, or a number >= 1)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the folder's measured (machines, bandwidth) pairs and measure the rest")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cells", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(args.worker, args.world, json.loads(args.cells), args.reps)
        return
    from ddlscale.cluster import dilation
    from ddlscale.units import parse_bandwidth

    setting = dilation.parse(args.dilation, "--dilation")
    methods = args.methods.split(",")
    densities = [float(d) for d in args.densities.split(",")]
    tokens = {(args.rows, d): tokens_for(args.rows, d) for d in densities}
    results = Results(args.name)
    rows: list[dict[str, Any]] = read_rows(results.dir / "results.csv") if args.resume else []
    done = {(r["nodes"], r["bandwidth"]) for r in rows}
    plan = [(int(n), bw) for n in args.nodes.split(",") for bw in args.bandwidths.split(",")]
    for k, (nodes, bandwidth) in enumerate(plan):
        if (nodes, bandwidth) in done:
            results.progress(k + 1, len(plan), f"{nodes} machines at {bandwidth}: kept from the folder's CSV")
            continue
        cells = []
        for d in densities:
            for route in ("auto", "sparse"):
                # Dense and the library call do not route: measured once, with the auto cells.
                here = [m for m in methods if route == "auto" or m not in ("torch", "dense")]
                cells.append({"nodes": nodes, "bandwidth": bandwidth, "density": d, "rows": args.rows,
                              "width": args.width, "route": route, "tokens": tokens[(args.rows, d)],
                              "seed": 0, "methods": here})
            if args.sweep and nodes == max(int(n) for n in args.nodes.split(",")) and bandwidth == "1gbit":
                # The same non-zero rows in a table of 10x the rows: Zen with the COO pull (whose work
                # must not grow with the table) and the sparse baselines, beside the original size.
                sweep = ["torch", SWEEP_ZEN, *(m for m in methods if m not in ("torch", "dense", "zen"))]
                cells[-1]["methods"] = [*cells[-1]["methods"], SWEEP_ZEN]
                cells.append({"nodes": nodes, "bandwidth": bandwidth, "density": d / args.sweep,
                              "rows": args.rows * args.sweep, "width": args.width, "route": "sparse",
                              "tokens": tokens[(args.rows, d)], "seed": 0, "methods": sweep, "spread": args.sweep})
        choice = dilation.choose(setting, nodes, 1, parse_bandwidth(bandwidth), 0.0)
        results.progress(k, len(plan), f"{nodes} machines at {bandwidth}: {choice.describe()}")
        rows += [{**r, "sweep": r["rows"] != args.rows}
                 for r in measure(nodes, bandwidth, cells, args.reps, choice.k)]
        results.progress(k + 1, len(plan), f"{nodes} machines at {bandwidth} done")
        results.write_csv(rows)
    report(results, rows, args)


def read_rows(path) -> list[dict[str, Any]]:
    """A previous run's rows, typed as :func:`worker` wrote them (for ``--resume``)."""
    import csv

    types = {"nodes": int, "rows": int, "width": int, "tokens": int, "rep": int, "density": float, "dilation": float,
             "sweep": lambda v: v == "True", "method": str, "bandwidth": str, "route": str, "path": str}
    with open(path, newline="") as f:
        return [{k: types.get(k, float)(v) for k, v in r.items()} for r in csv.DictReader(f)]


def report(results: Results, rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ddlscale.cluster.emulated import TCP_PAYLOAD_FRACTION
    from ddlscale.units import parse_bandwidth

    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["nodes"], r["bandwidth"], r["rows"], r["tokens"], r["route"], r["method"]), []).append(r)

    def med(key: tuple, field: str = "sync_s") -> float:
        return statistics.median(r[field] for r in groups[key])

    def torch_key(key: tuple) -> tuple:
        return (*key[:4], "auto" if (*key[:4], "auto", "torch") in groups else key[4], "torch")

    table, wire_of = [], {}
    for key, runs in groups.items():
        nodes, bandwidth, table_rows, _, route, method = key
        middle, low, high = spread([r["sync_s"] for r in runs])
        wire = med(key, "busiest_nic_bytes") * 8 / (parse_bandwidth(bandwidth) * TCP_PAYLOAD_FRACTION)
        wire_of[key] = wire
        comm = med(key, "comm_s")
        base = med(torch_key(key)) if torch_key(key) in groups else math.nan
        summed = med(torch_key(key), "summed_rows") if torch_key(key) in groups else math.nan
        gamma = summed / runs[0]["mean_rows_per_worker"]
        table.append([nodes, bandwidth, table_rows, f"{runs[0]['mean_rows_per_worker'] / table_rows:.4f}",
                      f"{gamma:.2f}", route, method, runs[0]["path"],
                      f"{middle * 1e3:.1f} ({low * 1e3:.1f}-{high * 1e3:.1f})",
                      "" if method == "torch" else f"{comm * 1e3:.1f}", f"{wire * 1e3:.1f}",
                      f"{middle / wire:.2f}", "" if method == "torch" else f"{comm / wire:.2f}",
                      f"{base / middle:.2f}"])

    targets = []
    big = max(int(n) for n in args.nodes.split(","))
    for key in groups:
        nodes, bandwidth, table_rows, tokens, route, method = key
        if method == "zen" and route == "auto" and nodes == big and bandwidth == "1gbit" and table_rows == args.rows:
            density = groups[key][0]["density"]
            goal = 2.0 if density >= 0.03 else 1.5
            got = med(torch_key(key)) / med(key)
            targets.append([f"Zen vs the torch call, {nodes} x {bandwidth}, rows/worker ~{density:.0%}",
                            f">= {goal}x", f"{got:.2f}x", "yes" if got >= goal else "no"])
        if method == "zen" and route == "auto" and nodes == big and bandwidth == "1gbit" and table_rows == args.rows:
            ratio = med(key) / wire_of[key]
            targets.append([f"Zen's sync / its wire limit, {nodes} x {bandwidth}, ~{groups[key][0]['density']:.0%}",
                            "<= 1.3", f"{ratio:.2f}", "yes" if ratio <= 1.3 else "no"])
        if method == "zen" and route == "auto" and nodes == big and bandwidth == "100mbit":
            ratio = med(key) / wire_of[key]
            targets.append([f"Zen's sync / its wire limit, {nodes} x {bandwidth}, ~{groups[key][0]['density']:.0%}",
                            "<= 1.2", f"{ratio:.2f}", "yes" if ratio <= 1.2 else "no"])
            ratio = med(key, "comm_s") / wire_of[key]
            targets.append([f"Zen's comm / its wire limit, {nodes} x {bandwidth}, ~{groups[key][0]['density']:.0%}",
                            "<= 1.3", f"{ratio:.2f}", "yes" if ratio <= 1.3 else "no"])
        if method == "gloo_sparse" and route == "auto":
            ratio = med(key) / med(torch_key(key))
            targets.append([f"gloo_sparse / the torch call, {nodes} x {bandwidth}, ~{groups[key][0]['density']:.0%}",
                            "<= 1.2", f"{ratio:.2f}", "yes" if ratio <= 1.2 else "no"])
        if method == SWEEP_ZEN and table_rows != args.rows:
            small = (nodes, bandwidth, args.rows, tokens, "sparse", SWEEP_ZEN)
            ratio = med(key) / med(small)
            targets.append([f"Zen (COO pull) at {table_rows} rows / at {args.rows}, same non-zero rows, "
                            f"~{groups[small][0]['density']:.0%}", "<= 1.2", f"{ratio:.2f}",
                            "yes" if ratio <= 1.2 else "no"])
    dilations = {(r["nodes"], r["bandwidth"]): r.get("dilation", 1.0) for r in rows}
    results.dilation = ", ".join(f"{k:g} ({n} x {bw})" for (n, bw), k in sorted(dilations.items()))
    by_bandwidth: dict[str, list[float]] = {}
    for key, runs in groups.items():
        if key[2] == args.rows:
            by_bandwidth.setdefault(key[1], []).append(statistics.median(r["sync_s"] for r in runs) / wire_of[key])
    results.write_markdown(
        f"Sparse allreduce of an embedding gradient ({args.rows} x {args.width}, Zipf {ZIPF}): "
        "PyTorch's call beside every sync, emulated machines",
        ["machines", "NIC", "table rows", "rows/worker (density)", "gamma_n", "routing", "method", "table went",
         "sync ms (min-max)", "comm ms", "wire limit ms", "sync / wire", "comm / wire", "speed-up vs torch call"],
        table,
        notes=f"{args.reps} timed repetitions per cell after {WARMUP} untimed ones, methods taking turns step by "
              "step, medians (min-max for sync). 'sync ms': from the last rank's barrier exit to the last rank's "
              "finish. 'comm ms': the slowest rank's time blocked on communication (the library call has no "
              "split). 'wire limit': the busiest NIC's bytes (max over ranks of bytes sent or received) at the "
              "NIC's payload rate (x 1448/1514). gamma_n: the sum's rows over a worker's (mean). 'speed-up vs "
              "torch call': the call's median over the method's, same table; in a routing=sparse cell, over the "
              "call of the same table (it does not route). Every cluster ran time-dilated: "
              + ", ".join(f"{n} machines at {bw}: k={k:g}" for (n, bw), k in sorted(dilations.items()))
              + " (NICs at bandwidth / k, each machine's CPU capped at 1/k core, every time wall / k).\n\n"
              "## Targets\n\n| claim | target | measured (medians) | within target |\n|---|---|---|---|\n"
              + "\n".join("| " + " | ".join(t) + " |" for t in targets),
        summary={"Compared": f"`torch.distributed.all_reduce` on a {args.rows} x {args.width} embedding's sparse "
                             "gradient beside " + ", ".join(m for m in args.methods.split(",") if m != "torch")
                             + ", both routings" + (f"; and a table {args.sweep}x larger at the same non-zero rows"
                                                    if args.sweep else "") + ".",
                 "Emulation": f"{args.nodes} emulated machines, one rank each, {args.bandwidths} NICs, on this "
                              f"host's {os.cpu_count()} cores, time-dilated (k per cluster in the notes); no device "
                              "time.",
                 "Bound by": "measured as sync time over the busiest NIC's wire time, medians per cell and method: "
                             + "; ".join(f"at {bw} {statistics.median(ws):.2f} ({min(ws):.2f}-{max(ws):.2f})"
                                         for bw, ws in by_bandwidth.items())
                             + " (1 is the network's limit; above it the host, the collective library and TCP add).",
                 "Repetitions": f"{args.reps} timed after {WARMUP} untimed, the methods taking turns step by step.",
                 "Answer": f"{sum(t[3] == 'yes' for t in targets)} of {len(targets)} target figures within their "
                           "target; outside: "
                           + ("; ".join(f"{t[0]} ({t[2]}, target {t[1]})" for t in targets if t[3] != "yes") or "none")
                           + "."},
        command=f"python -m experiments.sparse_allreduce --nodes {args.nodes} --bandwidths {args.bandwidths} "
                f"--densities {args.densities} --rows {args.rows} --width {args.width} --reps {args.reps} "
                f"--sweep {args.sweep}" + (f" --dilation {args.dilation}" if args.dilation != "auto" else "")
                + (f" --methods {args.methods}" if args.methods != ALL_METHODS else "")
                + (f" --name {args.name}" if args.name != "sparse_allreduce" else ""),
    )
    cells = sorted({(k[0], k[1], k[3]) for k in groups if k[2] == args.rows})
    fig, axes = plt.subplots(1, len(cells), figsize=(3.2 * len(cells), 3.6), squeeze=False)
    for ax, (nodes, bandwidth, tokens) in zip(axes[0], cells, strict=True):
        mine = [k for k in groups if (k[0], k[1], k[2], k[3]) == (nodes, bandwidth, args.rows, tokens)]
        labels = [k[5] + ("" if k[5] in ("torch", "dense") else f"/{k[4]}") for k in mine]
        ax.bar(labels, [med(k) * 1e3 for k in mine], label="sync")
        ax.plot(labels, [wire_of[k] * 1e3 for k in mine], "k_", markersize=10, label="wire limit")
        density = groups[mine[0]][0]["density"]
        ax.set(title=f"{nodes} x {bandwidth}, ~{density:.0%}", ylabel="ms (median)")
        ax.tick_params(axis="x", rotation=90, labelsize=5)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(results.figure_path(), dpi=110)
    print(f"wrote {results.dir}")


if __name__ == "__main__":
    main()
