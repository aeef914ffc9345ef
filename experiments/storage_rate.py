"""The storage machine's link: the write rate every machine reaches through the real client, against its setting.

    python -m experiments.storage_rate [--cells 2:500mbit,2:2gbit,8:500mbit,8:2gbit,16:500mbit] [--reps 4]
        [--seconds 4]

The persistent tier of an emulated cluster writes to a storage machine behind one shaped link shared
by every machine (``cluster.storage.bandwidth``: nginx's WebDAV server, fsspec's WebDAV client; see
docs/emulation.md). A regime whose persistent checkpoint must take many iterations (Gemini's) is only
as faithful as that link's rate. Per cell (machines : storage bandwidth), every machine writes its
share of ``--seconds`` of the link's traffic at once through the client
(:func:`ddlscale.cluster.storage_probe.probe`), at the CPU share's k (one core per machine; their
NICs at 10 Gbit/s: the storage link is the bottleneck); the aggregate rate is every
byte written over the span from the first start to the last PUT answered, in emulated time. Cells
alternate, the first rotating. Target: within 10% of the setting (TCP over Ethernet caps the payload
at 1448/1514 of it, 0.956).

Needs root (network namespaces) and nginx with its WebDAV module.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from ddlscale.cluster import dilation
from ddlscale.cluster.emulated import TCP_PAYLOAD_FRACTION
from ddlscale.cluster.storage_probe import probe
from experiments.harness import Results, alternating, spread

NIC = "10gbit"  # every machine's NIC: faster than its share of the storage link


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", default="2:500mbit,2:2gbit,8:500mbit,8:2gbit,16:500mbit")
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--name", default="storage_rate")
    args = parser.parse_args(argv)
    cells = [(int(n), bw) for n, bw in (cell.split(":") for cell in args.cells.split(","))]
    # The CPU share's k: one core per machine. The storage link, not the machines' NICs, is what is
    # measured, so auto's byte and round probes at 10 Gbit/s NICs would only cost time.
    ks = {n: float(math.ceil(dilation.cpu_share(n, 1))) for n in {n for n, _ in cells}}
    results = Results(args.name)
    results.dilation = ", ".join(f"{ks[n]:g} ({n} machines)" for n in sorted(ks))
    rows: list[dict[str, Any]] = []
    plan = list(alternating([f"{n}:{bw}" for n, bw in cells], args.reps))
    for done, (rep, cell) in enumerate(plan, 1):
        nodes, bandwidth = int(cell.split(":")[0]), cell.split(":")[1]
        measured = probe(nodes, bandwidth, NIC, ks[nodes], args.seconds)
        rows.append({"nodes": nodes, "storage_bandwidth": bandwidth, "k": ks[nodes], "rep": rep,
                     "bytes": measured.bytes, "seconds": measured.seconds, "rate_bps": measured.rate_bps,
                     "of_setting": measured.rate_bps / measured.setting_bps})
        results.progress(done, len(plan), measured.describe())
    results.write_csv(rows)

    table = []
    for nodes, bandwidth in cells:
        ratios = [r["of_setting"] for r in rows if (r["nodes"], r["storage_bandwidth"]) == (nodes, bandwidth)]
        median, low, high = spread(ratios)
        table.append([nodes, bandwidth, f"{ks[nodes]:g}", median, low, high, "yes" if low >= 0.9 else "no"])
    answer = ", ".join(f"{row[0]} machines at {row[1]}: {row[3]:.3f}x" for row in table)
    results.write_markdown(
        "The storage machine's link: write rate against its setting",
        ["machines", "storage link", "k", "rate / setting (median)", "min", "max", "every rep within 10%"],
        table,
        notes=(f"Every machine writes at once through fsspec's WebDAV client (the persistent tier's path); each "
               f"machine's NIC {NIC}. The ceiling is TCP's payload, {TCP_PAYLOAD_FRACTION:.3f} of the setting. "
               f"{args.seconds:g} s of the link's traffic per repetition; every object read back and compared."),
        summary={
            "Compared": "the aggregate write rate to the storage machine against its configured link.",
            "Emulation": f"machines at {NIC}, the storage machine's NIC at the cell's rate, k the CPU share's "
                         "(one core per machine).",
            "Bound by": "the storage link (the machines' NICs are faster than their share of it).",
            "Repetitions": f"{args.reps}, alternating the cells.",
            "Answer": f"median rate over setting: {answer}.",
        },
        command=f"python -m experiments.storage_rate --cells {args.cells} --reps {args.reps} --seconds {args.seconds:g}",
    )
    print(f"wrote {results.dir}")


if __name__ == "__main__":
    main()
