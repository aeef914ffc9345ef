"""What a message round costs between emulated machines, against what the configured network says.

    python -m experiments.rounds [--nodes 2,8,16] [--reps 4] [--rounds 200] [--cpus shares,quota]
        [--bandwidth 1gbit]

A round of small messages should cost the links' configured one-way delay plus serialization, within
max(25%, 50 us) (``ddlscale.cluster.dilation.round_target``): a datacenter's round costs 10-100 us,
and methods that exchange in several rounds (recursive doubling, push then pull) are judged by it.
On an emulated cluster a round can also pay the host: a CPU quota's refill period, scheduling, the
kernel's forwarding through veth, bridge and tc. Per machine count, at the k ``cluster.dilation=auto``
picks for it (one rank per machine), three patterns are timed by the dilation probe's workers
(``ddlscale.cluster.dilation._rounds``), each ``--rounds`` times back to back, in reported time:

- ``pingpong``: machine 0 and machine 1 bounce a 64-byte message (one way: half a round trip);
- ``exchange``: every machine sends 64 bytes to every other, then reads one from each (one concurrent
  n-way round over plain TCP sockets);
- ``gloo``: the same round as gloo's ``all_to_all_single`` of one float per peer (the collective
  library's round, which the syncs pay per collective).

Beside each, the CPU one round costs a machine (its process's CPU time per round: its syscalls and
the kernel's forwarding of what it sends): what the round costs a machine with one core of this host,
whatever the emulation does. Each machine's CPU comes from ``cluster.cpu``: ``shares`` (weights and a
reserve, the default) and ``quota`` (CFS bandwidth limits, the mechanism before it) alternate, each
repetition on a fresh cluster.

Needs root (network namespaces, cgroups).
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from typing import Any

from ddlscale.cluster import dilation
from ddlscale.cluster.emulated import resolve_latency
from ddlscale.units import parse_bandwidth
from experiments.harness import Results, alternating, spread

PATTERNS = ("pingpong", "exchange", "gloo")


def measure(nodes: int, k: float, cpu: str, bandwidth_bps: float, latency_s: float, rounds: int) -> dict[str, float]:
    """One fresh cluster's rounds: reported seconds per round and CPU seconds per round, per pattern."""
    with dilation.ProbeCluster(nodes, 1, bandwidth_bps, latency_s, k, cpu=cpu) as probes:
        walls = probes.rounds(rounds)
    starved = walls.pop("starved")
    return {**{name: (value if name.endswith("_cpu") else value / k) for name, value in walls.items()},
            "starved": starved}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="2,8,16")
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=dilation.ROUNDS)
    parser.add_argument("--cpus", default="shares,quota")
    parser.add_argument("--bandwidth", default="1gbit")
    parser.add_argument("--latency", default="auto")
    parser.add_argument("--name", default="rounds")
    args = parser.parse_args(argv)
    nodes_list = [int(n) for n in args.nodes.split(",")]
    cpus = args.cpus.split(",")
    bandwidth_bps, latency_s = parse_bandwidth(args.bandwidth), resolve_latency(args.latency)
    serialization_s = dilation.ROUND_BYTES * 8 / bandwidth_bps
    target_s = dilation.round_target(latency_s) + serialization_s
    results = Results(args.name)
    choices = {n: dilation.choose(dilation.AUTO, n, 1, bandwidth_bps, latency_s) for n in nodes_list}
    results.dilation = ", ".join(f"{choices[n].k:g} ({n} machines)" for n in nodes_list)
    rows: list[dict[str, Any]] = []
    total, done = len(nodes_list) * args.reps * len(cpus), 0
    for nodes in nodes_list:
        k = choices[nodes].k
        for rep, cpu in alternating(cpus, args.reps):
            measured = measure(nodes, k, cpu, bandwidth_bps, latency_s, args.rounds)
            done += 1
            for pattern in PATTERNS:
                round_s, cpu_s = measured[pattern], measured[f"{pattern}_cpu"]
                rows.append({"nodes": nodes, "k": k, "cpu": cpu, "rep": rep, "pattern": pattern,
                             "round_us": round(round_s * 1e6, 2), "cpu_us": round(cpu_s * 1e6, 2),
                             "target_us": round(target_s * 1e6, 2), "within": round(round_s / target_s, 4),
                             "starved": measured["starved"]})
            results.progress(done, total, f"{nodes} machines, k={k:g}, {cpu}, rep {rep}: " + ", ".join(
                f"{p} {measured[p] * 1e6:.0f} us (CPU {measured[p + '_cpu'] * 1e6:.0f})" for p in PATTERNS))
    results.write_csv(rows)

    cells: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        cells[(row["nodes"], row["cpu"], row["pattern"])].append(row)
    table = []
    for (nodes, cpu, pattern), got in cells.items():
        rounds_us, cpus_us = spread([r["round_us"] for r in got]), spread([r["cpu_us"] for r in got])
        table.append([nodes, got[0]["k"], cpu, pattern, *rounds_us, cpus_us[0], got[0]["target_us"],
                      "yes" if max(r["within"] for r in got) <= 1 else "no"])
    shares = {(n, p): statistics.median(r["round_us"] for r in cells[(n, "shares", p)])
              for n in nodes_list for p in PATTERNS if (n, "shares", p) in cells}
    answer = "; ".join(f"{n} machines (k={choices[n].k:g}): " + ", ".join(
        f"{p} {shares[(n, p)]:.0f} us" for p in PATTERNS if (n, p) in shares) for n in nodes_list)
    command = (f"python -m experiments.rounds --nodes {args.nodes} --reps {args.reps} --rounds {args.rounds} "
               f"--cpus {args.cpus} --bandwidth {args.bandwidth}")
    results.write_markdown(
        "A message round between emulated machines, against the configured network",
        ["machines", "k", "cluster.cpu", "pattern", "round us (median)", "min", "max", "its CPU us (median)",
         "target us", "every rep within"],
        table,
        notes=(f"Target: the configured one-way delay ({latency_s * 1e6:g} us here; this kernel "
               f"{'has' if latency_s else 'has no'} netem) plus a 64-byte message's serialization plus "
               f"max(25%, 50 us). {args.rounds} rounds per pattern back to back, per repetition on a fresh "
               "cluster; a round's time is the slowest machine's. 'Its CPU' is the CPU one round cost the "
               "busiest machine's process (not dilated: CPU seconds on one core of this host)."),
        summary={
            "Compared": "one message round (ping-pong one way, a concurrent n-way exchange over sockets, gloo's "
                        "all_to_all of one float per peer) against the configured delay, under cgroup weights "
                        "with a reserve (cluster.cpu=shares) and under CFS quotas (quota).",
            "Emulation": f"{args.bandwidth} NICs, one worker per machine, time-dilated at the k auto picks: "
                         + ", ".join(f"{n} machines k={choices[n].k:g}" for n in nodes_list) + ".",
            "Bound by": "the host's CPU: 64-byte messages move no bytes worth counting; a round costs the "
                        "machines' own CPU (syscalls and the kernel's forwarding) and the waits the emulation adds.",
            "Repetitions": f"{args.reps} per machine count, alternating cluster.cpu, each on a fresh cluster.",
            "Answer": f"median round under shares: {answer}.",
        },
        command=command,
    )
    _plot(rows, nodes_list, results)
    print(f"wrote {results.dir}")


def _plot(rows: list[dict[str, Any]], nodes_list: list[int], results: Results) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PATTERNS), figsize=(4 * len(PATTERNS), 3.4), sharey=False)
    for ax, pattern in zip(axes, PATTERNS, strict=True):
        for cpu, marker in (("shares", "o"), ("quota", "s")):
            xs, ys = [], []
            for n in nodes_list:
                got = [r["round_us"] for r in rows if (r["nodes"], r["cpu"], r["pattern"]) == (n, cpu, pattern)]
                xs += [n] * len(got)
                ys += got
            if xs:
                ax.scatter(xs, ys, marker=marker, label=cpu, alpha=0.7)
        target = rows[0]["target_us"]
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label="target")
        ax.set_xscale("log", base=2)
        ax.set_xticks(nodes_list, [str(n) for n in nodes_list])
        ax.set_yscale("log")
        ax.set_xlabel("machines")
        ax.set_title(pattern)
    axes[0].set_ylabel("round, reported us (every rep)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(results.figure_path(), dpi=120)


if __name__ == "__main__":
    main()
