"""Native C++ kernels (ddlscale/csrc/zen_cpu.cpp) vs their pure-PyTorch references, side by side.

    python -m experiments.native_kernels [--sizes 1,1e1,1e2,...,1e7] [--servers 8] [--reps 7]

Per operation and size (units; for owned_sets the tensor's units) both versions run on the
same inputs, alternating and rotating which goes first (BENCHMARKS.md); each repetition times a
loop long enough to be measurable and reports seconds per call. Before timing, the outputs are
checked bit-identical. Each repetition times both, so the speedup (reference / native) is the
median over repetitions of that paired ratio, with its min-max. ``native.NATIVE_FROM`` takes the
smallest size from which the native kernel measurably won — median paired speedup >= 1.1 — at that
size and every larger one. (The machine is shared: single pairs can be far off either way.)
Inputs: sorted distinct indices at density 0.1 (what a gradient's units yield), fp32 values (rows of
``--width`` for partition, split_by_server and merge_rows: an embedding's rows), a bitmap of density
0.5, ``--servers`` servers, torch's default intra-op threads.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from ddlscale.sync.sparse import native
from ddlscale.sync.sparse.kernels import (
    merge_rows_reference,
    owned_sets_reference,
    pack_bits_reference,
    partition_reference,
    server_of_reference,
    split_by_server_reference,
    unpack_bits_reference,
)

OPS = ("server_of", "split_by_server", "partition", "owned_sets", "merge_rows", "pack_bits", "unpack_bits")
SEED = 0x5EED
METHODS = ("reference", "native")
WIN = 1.1  # median paired speedup that counts as a measurable win


def calls(op: str, size: int, servers: int, ops, width: int = 64) -> tuple:
    """(reference, native) zero-argument callables for one op on one input; the native side includes
    the conversions kernels.py does (counts to a list)."""
    g = torch.Generator().manual_seed(size)
    n = servers
    if op == "owned_sets":
        def owned():
            flat, counts = ops.owned_sets(size, SEED, n)
            return flat, counts.tolist()
        return (lambda: owned_sets_reference(size, SEED, n)), owned
    idx = torch.randperm(10 * size, generator=g)[:size].sort().values
    val = torch.randn(size, width, generator=g)
    other = torch.randperm(10 * size, generator=g)[:size].sort().values
    other_val = torch.randn(size, width, generator=g)
    server = server_of_reference(idx, SEED, n)
    mask = torch.rand(size, generator=g) < 0.5
    bitmap = pack_bits_reference(mask)

    def with_list(result):
        return result[0], result[1], result[2].tolist()

    return {
        "server_of": (lambda: server_of_reference(idx, SEED, n), lambda: ops.server_of(idx, SEED, n)),
        "split_by_server": (lambda: split_by_server_reference(server, idx, val, n),
                            lambda: with_list(ops.group_by_server(server, idx, val, n))),
        "partition": (lambda: partition_reference(idx, val, SEED, n),
                      lambda: with_list(ops.partition(idx, val, SEED, n))),
        "merge_rows": (lambda: merge_rows_reference(idx, val, other, other_val),
                       lambda: ops.merge_rows(idx, val, other, other_val)),
        "pack_bits": (lambda: pack_bits_reference(mask), lambda: ops.pack_bits(mask)),
        "unpack_bits": (lambda: unpack_bits_reference(bitmap, size), lambda: ops.unpack_bits(bitmap, size)),
    }[op]


def identical(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(identical(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def per_call(fn, number: int) -> float:
    start = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - start) / number


def measure(op: str, size: int, servers: int, reps: int, ops, width: int) -> list[dict]:
    from experiments.harness import alternating

    reference, fast = calls(op, size, servers, ops, width)
    if not identical(reference(), fast()):
        raise AssertionError(f"{op} at {size}: native output differs from the reference")
    fns = {"reference": reference, "native": fast}
    # Calls per timed loop: enough for ~30 ms of the slower version (one call when that is longer).
    once = max(per_call(reference, 1), per_call(fast, 1), 1e-7)
    number = max(1, int(0.03 / once))
    return [{"op": op, "size": size, "servers": servers, "method": method, "rep": rep, "calls": number,
             "seconds_per_call": per_call(fns[method], number)}
            for rep, method in alternating(METHODS, reps)]


def summarize(rows: list[dict], op: str, size: int) -> dict:
    mine = [r for r in rows if r["op"] == op and r["size"] == size]
    times = {m: [r["seconds_per_call"] for r in sorted(mine, key=lambda r: r["rep"]) if r["method"] == m]
             for m in METHODS}
    ratios = [ref / nat for ref, nat in zip(times["reference"], times["native"], strict=True)]
    return {"reference": statistics.median(times["reference"]), "native": statistics.median(times["native"]),
            "speedup": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}


def native_from(summary: dict[tuple[str, int], dict], op: str, sizes: list[int]) -> int | None:
    """Smallest size from which the native kernel measurably won, there and at every larger size."""
    start = None
    for size in reversed(sizes):
        if summary[op, size]["speedup"] < WIN:
            break
        start = size
    return start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,1e1,1e2,1e3,1e4,1e5,1e6,1e7")
    parser.add_argument("--servers", type=int, default=8)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--width", type=int, default=64, help="values per row (partition, split, merge)")
    parser.add_argument("--ops", default=",".join(OPS))
    args = parser.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from experiments.harness import Results

    load_start = os.getloadavg()[0]
    ops = native.build("cpu")  # fails loudly: a benchmark of the fallback would mean nothing
    sizes = [int(float(x)) for x in args.sizes.split(",")]
    chosen = args.ops.split(",")
    results = Results("native_kernels")
    rows, total = [], len(sizes) * len(chosen)
    for k, (op, size) in enumerate((op, size) for op in chosen for size in sizes):
        rows += measure(op, size, args.servers, args.reps, ops, args.width)
        results.progress(k + 1, total, f"{op} {size}")
    results.write_csv(rows)

    summary = {(op, size): summarize(rows, op, size) for op in chosen for size in sizes}
    table = [[op, size, s["reference"] * 1e3, s["native"] * 1e3, f"{s['speedup']:.2f}x",
              f"{s['ratio_min']:.2f}-{s['ratio_max']:.2f}"] for (op, size), s in summary.items()]
    thresholds = {op: native_from(summary, op, sizes) for op in chosen}
    slowest = min(summary, key=lambda key: summary[key]["speedup"])
    fastest = max(summary, key=lambda key: summary[key]["speedup"])
    by_threshold: dict[int | None, list[str]] = {}
    for op, n in thresholds.items():
        by_threshold.setdefault(n, []).append(op)
    results.write_markdown(
        "The sparse syncs' kernels: native C++ vs pure-PyTorch reference",
        ["op", "size", "reference ms (median)", "native ms (median)", "speedup (median of paired reps)",
         "speedup min-max over reps"],
        table,
        notes=f"{args.servers} servers, rows of {args.width} fp32 values, {args.reps} alternating repetitions, "
              f"torch intra-op threads {torch.get_num_threads()}; outputs checked bit-identical before timing. "
              f"Size = units (owned_sets: the tensor's units; merge_rows: each side's). Smallest size from which native measurably won (median paired speedup "
              f">= {WIN}) there and above, used for native.NATIVE_FROM (None = never): {thresholds}. "
              f"1-minute load average at start / end: {load_start:.1f} / {os.getloadavg()[0]:.1f} on "
              f"{os.cpu_count()} cores (other jobs share this machine; single repetitions can be far off).",
        summary={"Compared": "Zen's C++ kernels (" + ", ".join(chosen) + ") against their pure-PyTorch references, "
                             "outputs checked bit-identical.",
                 "Emulation": f"none: one process, torch intra-op threads {torch.get_num_threads()}, "
                              f"{args.servers} servers, rows of {args.width} fp32 values.",
                 "Bound by": "not applicable: compute only, no communication.",
                 "Repetitions": f"{args.reps}, alternating, ratios paired per repetition.",
                 "Answer": f"native / reference speed-up, medians per op and size: {summary[slowest]['speedup']:.2f}x "
                           f"({slowest[0]} at {slowest[1]:g}) to {summary[fastest]['speedup']:.2f}x ({fastest[0]} at "
                           f"{fastest[1]:g}); native used " + "; ".join(
                               ("never" if n is None else f"from size {n}") + ": " + ", ".join(ops)
                               for n, ops in by_threshold.items()) + "."},
        command=f"python -m experiments.native_kernels --sizes {args.sizes} --servers {args.servers} "
                f"--reps {args.reps} --width {args.width}",
    )
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for op in chosen:
        s = [summary[op, size] for size in sizes]
        ax.errorbar(sizes, [x["speedup"] for x in s], fmt="o-", capsize=3, label=op,
                    yerr=[[x["speedup"] - x["ratio_min"] for x in s], [x["ratio_max"] - x["speedup"] for x in s]])
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel="size (units; the tensor's for owned_sets)",
           ylabel="speedup (reference / native)", title=f"native vs reference, {args.servers} servers")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(results.figure_path(), dpi=120)
    print("speedups:", {f"{op}@{size}": round(s["speedup"], 2) for (op, size), s in summary.items()})
    print("native from:", thresholds)
    print(f"wrote {results.dir}")


if __name__ == "__main__":
    main()
