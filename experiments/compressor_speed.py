"""Encode and decode cost of every compressor against tensor size (Espresso's compression-cost input).

    python -m experiments.compressor_speed [--min-exp 10] [--max-exp 24] [--step 2] [--reps 5] [--threads 1]

Each compressor is built from its ``ddlscale/conf/compressor/<name>.yaml`` (the defaults a user gets;
threshold is set to 2.576 so that ~1% of the N(0, 1) input passes, like topk's and dgc's ratio).
Input: a float32 N(0, 1) matrix of 2^e elements, as square as possible (PowerSGD compresses
matrices only; the rest flatten it). Each repetition visits every size, and per size every
compressor, alternating and rotating which goes first (BENCHMARKS.md), so a burst of load from other
jobs lands on one repetition rather than on one size. A measurement times a loop of ``compress``
calls, then a loop of ``decompress`` calls, long enough (``--budget`` seconds) to be measurable.
Reported: medians over repetitions, min-max of encode + decode; throughput = elements / (encode +
decode).

Threads: one intra-op thread by default. On the 2-core machine these results come from, shared with
other jobs, every parallel region torch entered cost ~6 ms whenever the other core was busy (65536-
element ``abs``: 6.5 ms with 2 threads, 7.5 us with 1), which buries the compressors' own cost;
``--threads 0`` keeps torch's default.

Expected shape (Espresso's model): a constant per-call cost (Python and kernel-launch overhead) up
to some size, then linear in the size. ``knee`` is the smallest size whose median cost exceeds
twice the smallest size's.

Not measured here: ddlscale's fp16 / PowerSGD paths against PyTorch's fp16_compress_hook and
powerSGD_hook on a model — that needs the ``sync=compress`` backend.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from ddlscale.compress import COMPRESSORS, Compressor, NoCompression
from ddlscale.paths import CONF_DIR
from experiments.harness import Results, alternating, spread

CONF = CONF_DIR / "compressor"
OVERRIDES = {"threshold": {"threshold": 2.576}}  # ~1% of N(0, 1) has |g| >= 2.576


def build(name: str) -> Compressor:
    cfg = OmegaConf.load(CONF / f"{name}.yaml")
    if cfg.get("_target_") is None:
        return NoCompression()
    return instantiate(cfg, **OVERRIDES.get(name, {}))


def matrix(exp: int, seed: int) -> torch.Tensor:
    rows = 2 ** ((exp + 1) // 2)
    return torch.randn(rows, 2**exp // rows, generator=torch.Generator().manual_seed(seed))


def per_call(fn, number: int) -> float:
    start = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - start) / number


def calls_for(fn, budget: float) -> int:
    """How many calls fill about ``budget`` seconds (one untimed warm-up call first)."""
    fn()
    single = per_call(fn, 1)
    return max(1, min(2000, math.ceil(budget / max(single, 1e-7))))


def measure(compressor: Compressor, g: torch.Tensor, budget: float) -> dict[str, float]:
    name = f"g{g.numel()}"  # one name per tensor: stateful compressors keep per-name state
    encode = lambda: compressor.compress(g, name)  # noqa: E731
    number = calls_for(encode, budget)
    encode_s = per_call(encode, number)
    compressed = compressor.compress(g, name)
    decode = lambda: compressor.decompress(compressed)  # noqa: E731
    decode_number = calls_for(decode, budget)
    decode_s = per_call(decode, decode_number)
    return {"encode_s": encode_s, "decode_s": decode_s, "bytes": compressed.nbytes, "calls": number}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--min-exp", type=int, default=10)
    parser.add_argument("--max-exp", type=int, default=24)
    parser.add_argument("--step", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--budget", type=float, default=0.05, help="seconds per timed loop")
    parser.add_argument("--only", default="", help="comma-separated compressor names")
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    names = [n for n in COMPRESSORS if not args.only or n in args.only.split(",")]
    exps = list(range(args.min_exp, args.max_exp + 1, args.step))
    results = Results("compressor_speed")
    compressors = {name: build(name) for name in names}
    samples: dict[tuple[str, int], list[dict[str, float]]] = {}
    total = len(exps) * args.reps * len(names)
    done = 0
    inputs = {exp: matrix(exp, seed=exp) for exp in exps}
    for rep in range(args.reps):
        for exp in exps:
            # alternating() rotates the starting compressor; offset it by the repetition.
            for _, name in list(alternating(names, rep + 1))[-len(names):]:
                samples.setdefault((name, exp), []).append(measure(compressors[name], inputs[exp], args.budget))
                done += 1
        results.progress(done, total, f"repetition {rep + 1}")

    rows = []
    for name in names:
        for exp in exps:
            runs = samples[(name, exp)]
            both = [r["encode_s"] + r["decode_s"] for r in runs]
            median, low, high = spread(both)
            numel = 2**exp
            rows.append({
                "compressor": name, "elements": numel,
                "encode_s": statistics.median(r["encode_s"] for r in runs),
                "decode_s": statistics.median(r["decode_s"] for r in runs),
                "total_s": median, "total_min_s": low, "total_max_s": high,
                "melem_per_s": numel / median / 1e6,
                "payload_bytes": runs[0]["bytes"], "ratio": runs[0]["bytes"] / (4 * numel),
                "calls": min(int(r["calls"]) for r in runs),
            })
    results.write_csv(rows)
    plot(rows, names, results.figure_path())
    write_table(rows, names, exps, results, args)
    print(f"wrote {results.dir}")


def knee(rows: list[dict], name: str) -> int | None:
    mine = sorted((r for r in rows if r["compressor"] == name), key=lambda r: r["elements"])
    base = mine[0]["total_s"]
    return next((r["elements"] for r in mine if r["total_s"] > 2 * base), None)


def write_table(rows: list[dict], names: list[str], exps: list[int], results: Results, args) -> None:
    shown = [e for e in (exps[0], 16, 20, exps[-1]) if e in exps]
    shown = list(dict.fromkeys(shown))
    by = {(r["compressor"], r["elements"]): r for r in rows}
    header = ["compressor", *[f"2^{e} (us)" for e in shown], f"Melem/s @2^{exps[-1]}",
              f"encode / decode @2^{exps[-1]} (ms)", f"bytes / fp32 @2^{exps[-1]}", "knee"]
    table = []
    for name in names:
        last = by[(name, 2 ** exps[-1])]
        k = knee(rows, name)
        table.append([
            name, *[round(by[(name, 2**e)]["total_s"] * 1e6, 1) for e in shown],
            round(last["melem_per_s"], 1),
            f"{last['encode_s'] * 1e3:.3g} / {last['decode_s'] * 1e3:.3g}",
            f"{last['ratio']:.4f}", f"2^{int(math.log2(k))}" if k else "-",
        ])
    none_note = ("`none` is a view of the input (no copy), so its cost is pure call overhead; it shows "
                 "the floor of the interface.")
    notes = f"""
Encode + decode per call, median of {args.reps} alternating repetitions (each a loop of at least
{args.budget} s); float32 N(0, 1) input, torch intra-op threads: {torch.get_num_threads()} (why:
module docstring), on a machine shared with other jobs (min-max in results.csv).
Defaults from ddlscale/conf/compressor/*.yaml (topk/randomk/dgc ratio 0.01, qsgd 127 levels in buckets of
512, powersgd rank 1); threshold 2.576 keeps ~1%. knee: first size costing more than twice the
smallest size — below it the per-call constant dominates, above it the cost grows linearly
(the log-log plot's elbow). {none_note}

Not measured: ddlscale's fp16 and PowerSGD paths against PyTorch's fp16_compress_hook and
powerSGD_hook on the same model — that comparison needs the sync=compress backend.
"""
    speed = sorted((row[-4], row[0]) for row in table if row[0] != "none")
    summary = {"Compared": f"encode + decode time of {len(table)} compressors at their defaults, tensor sizes "
                           f"2^{exps[0]} to 2^{exps[-1]}.",
               "Emulation": f"none: one process, torch intra-op threads {torch.get_num_threads()}.",
               "Bound by": "not applicable: compute only.",
               "Repetitions": f"{args.reps}, alternating, each a timed loop of at least {args.budget} s.",
               "Answer": f"at 2^{exps[-1]} elements, Melem/s: fastest " + ", ".join(f"{n} {v:g}" for v, n in speed[::-1][:3])
                         + "; slowest " + ", ".join(f"{n} {v:g}" for v, n in speed[:2]) + "."}
    results.write_markdown("Compressor encode + decode cost vs tensor size", header, table, notes=notes,
                           command="python -m experiments.compressor_speed", summary=summary)


def plot(rows: list[dict], names: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.5))
    colors = plt.get_cmap("tab20").colors
    markers = "osD^v<>phX*P8dH"
    for i, name in enumerate(names):
        mine = sorted((r for r in rows if r["compressor"] == name), key=lambda r: r["elements"])
        x = [r["elements"] for r in mine]
        style = {"color": colors[i % len(colors)], "marker": markers[i % len(markers)], "ms": 4, "label": name}
        left.plot(x, [r["total_s"] for r in mine], **style)
        if name != "none":  # a view: its "throughput" is call overhead only and would flatten the rest
            right.plot(x, [r["melem_per_s"] for r in mine], **style)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tensor elements (float32)")
        ax.grid(True, which="both", alpha=0.3)
    left.set_ylabel("encode + decode per call (s)")
    left.set_title("cost: constant, then linear")
    right.set_ylabel("throughput (million elements / s)")
    right.set_title("throughput (none omitted: it is a view)")
    right.legend(fontsize=7, ncol=2, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
