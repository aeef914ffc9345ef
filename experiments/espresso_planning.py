"""How long Espresso and Cupcake take to plan, against the number of tensors (target: 300 in < 1 s).

    python -m experiments.espresso_planning [--counts 50,100,200,300] [--seeds 4] [--reps 4]

Instances: random profiles (:mod:`ddlscale.plan.synthetic`: log-uniform sizes, random compression
fits and clusters) at each tensor count, once with one rank per machine (4-5 options per tensor)
and once with 4 ranks per machine (hierarchical options too: 7-8 per tensor); plus a ResNet-101
(314 tensors: its real parameter shapes) on Espresso's cluster (8 machines x 8 GPUs, 25 Gbit/s,
alpha 150 us) with top-k 1%, its encode/decode fitted to experiments/compressor_speed's table
(this CPU).

Timed per instance, alternating the methods (BENCHMARKS.md): Cupcake's DP; Espresso's search
(the exact per-tensor DP over every option, then Algorithm 2: the paper's "search"); and the full Espresso
plan (the search, the fusion of its equal-option runs and the search over Cupcake's groups — two
more exact DPs). Reported: medians with min-max over repetitions and seeds, simulations run, and
the predicted iteration time against dense allreduce and layer-wise compression. trials.csv keeps every
timed repetition (one row per instance, method and ``rep``: the claims count repetitions there);
results.csv each case's median, min and max over them.
"""

from __future__ import annotations

import argparse
import csv
import random
import statistics
import time

from ddlscale.compress import NoCompression, ResidualMemory, TopK
from ddlscale.plan.cupcake import plan_fusion
from ddlscale.plan.espresso import espresso, search
from ddlscale.plan.fit import CostFit
from ddlscale.plan.planner import configured_option, cost_model
from ddlscale.plan.pricing import Option, units_of
from ddlscale.plan.profile import CompressorProfile, Profile, TensorProfile, profile_compressor
from ddlscale.plan.synthetic import random_profile
from experiments.harness import RESULTS, Results, alternating, spread

METHODS = ("cupcake", "espresso_search", "espresso_full")


def resnet101_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """ResNet-101's parameters in registration order (torchvision's layout: 314 tensors)."""
    shapes = [("conv1.weight", (64, 3, 7, 7)), ("bn1.weight", (64,)), ("bn1.bias", (64,))]
    inplanes = 64
    for layer, (planes, blocks) in enumerate(((64, 3), (128, 4), (256, 23), (512, 3)), start=1):
        for b in range(blocks):
            prefix = f"layer{layer}.{b}"
            for k, (cin, cout, size) in enumerate(((inplanes, planes, 1), (planes, planes, 3), (planes, planes * 4, 1)), 1):
                shapes += [(f"{prefix}.conv{k}.weight", (cout, cin, size, size)),
                           (f"{prefix}.bn{k}.weight", (cout,)), (f"{prefix}.bn{k}.bias", (cout,))]
            if b == 0:
                shapes += [(f"{prefix}.downsample.0.weight", (planes * 4, inplanes, 1, 1)),
                           (f"{prefix}.downsample.1.weight", (planes * 4,)), (f"{prefix}.downsample.1.bias", (planes * 4,))]
            inplanes = planes * 4
    return [*shapes, ("fc.weight", (1000, 2048)), ("fc.bias", (1000,))]


def resnet101_profile(compressor_costs: dict) -> Profile:
    """Backward order (reverse registration); each gradient ready after compute proportional to its
    size plus a fixed per-layer cost (a V100 runs ResNet-101's backward in about 100 ms at batch 64)."""
    shapes = list(reversed(resnet101_shapes()))
    total = sum(_numel(s) for _, s in shapes)
    ready, tensors = 0.0, []
    for name, shape in shapes:
        ready += 1e-4 + 0.09 * _numel(shape) / total
        tensors.append(TensorProfile(name, _numel(shape), shape, "torch.float32", ready))
    network = {"bandwidth": "25gbit", "latency": "150us", "gpus_per_machine": 8}
    return Profile(tensors, ready + 1e-3, 0.05, 64, network, compressor_costs, "cpu (fits measured here)")


def topk_costs() -> dict[str, CompressorProfile]:
    """none and top-k 1% fits from experiments/compressor_speed's table (reproducible; the
    compressor calls alone), or measured here when that table is missing."""
    table = RESULTS / "compressor_speed" / "results.csv"
    if not table.exists():
        return {"none": profile_compressor(NoCompression(), 1 << 22, memory=ResidualMemory()),
                "default": profile_compressor(TopK(ratio=0.01), 1 << 22, memory=ResidualMemory())}
    with table.open() as f:
        rows = list(csv.DictReader(f))
    out = {}
    for key, name, params in (("none", "none", {}), ("default", "topk", {"ratio": 0.01})):
        mine = [r for r in rows if r["compressor"] == name]
        sizes = [int(r["elements"]) for r in mine]
        encode = CostFit.fit(sizes, [float(r["encode_s"]) for r in mine])
        decode = CostFit.fit(sizes, [float(r["decode_s"]) for r in mine])
        out[key] = CompressorProfile(name, params, encode, decode, encode, decode, 0 if name == "none" else 40)
    return out


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def run_method(method: str, profile: Profile) -> dict:
    model = cost_model(profile)
    units = units_of(profile)
    option = configured_option(model, "allgather")
    started = time.perf_counter()
    if method == "cupcake":
        plan = plan_fusion(units, model, option, profile.backward_end_s, profile.rest_s)
        predicted, sims = plan.iteration_s, None
    elif method == "espresso_search":
        result = search(units, model, profile.backward_end_s, profile.rest_s, offload=True)
        predicted, sims = result.iteration_s, result.simulations
    else:
        result = espresso(units, model, profile.backward_end_s, profile.rest_s, offload=True, cupcake_option=option)
        predicted, sims = result.iteration_s, None
    elapsed = time.perf_counter() - started
    dense = plan_dense = None
    if method == "espresso_full":
        from ddlscale.plan.result import uniform_time

        dense = uniform_time(units, Option("none", "allreduce"), model, profile.backward_end_s, profile.rest_s)
        plan_dense = uniform_time(units, option, model, profile.backward_end_s, profile.rest_s)
    return {"seconds": elapsed, "predicted_s": predicted, "simulations": sims, "options": len(model.options()),
            "dense_s": dense, "layer_wise_s": plan_dense}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", default="50,100,200,300")
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--reps", type=int, default=4)  # the claims count 4 or more
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    counts = [int(c) for c in args.counts.split(",")]
    results = Results("espresso_planning")

    instances = [("resnet101 (64 GPUs, 25 Gbit/s)", 314, 0, resnet101_profile(topk_costs()))]
    for count in counts:
        for layout, gpus in (("1 rank/machine", 1), ("4 ranks/machine", 4)):
            for seed in range(args.seeds):
                profile = random_profile(random.Random(1000 * count + seed), count, world_size=16)
                profile.network = {**profile.network, "gpus_per_machine": gpus}
                instances.append((f"random, {layout}", count, seed, profile))

    samples: dict[tuple[str, int, int, str], list[dict]] = {}
    total, done = len(instances) * args.reps * len(METHODS), 0
    for index, (kind, count, seed, profile) in enumerate(instances):
        for rep, method in alternating(METHODS, args.reps):
            samples.setdefault((kind, count, seed, method), []).append({"rep": rep, **run_method(method, profile)})
            done += 1
        results.progress(done, total, f"{kind} x{count} ({index + 1}/{len(instances)})")

    results.write_csv(trial_rows(samples), "trials.csv")
    rows = []
    for (kind, count, seed, method), runs in samples.items():
        median, low, high = spread([r["seconds"] for r in runs])
        rows.append({"instance": kind, "tensors": count, "seed": seed, "method": method, "median_s": median,
                     "min_s": low,
                     "max_s": high, "runs": len(runs),
                     "options_per_tensor": runs[0]["options"],
                     "simulations": statistics.median(r["simulations"] for r in runs) if runs[0]["simulations"] else "",
                     "predicted_ms": statistics.median(r["predicted_s"] for r in runs) * 1e3,
                     "dense_ms": runs[0]["dense_s"] * 1e3 if runs[0]["dense_s"] else "",
                     "layer_wise_ms": runs[0]["layer_wise_s"] * 1e3 if runs[0]["layer_wise_s"] else ""})
    results.write_csv(rows)
    plot(rows, results.figure_path())
    write_table(rows, results, args)
    print(f"wrote {results.dir}")


def trial_rows(samples: dict[tuple[str, int, int, str], list[dict]]) -> list[dict]:
    """One row per timed repetition (its ``rep``: the methods of one repetition ran back to back on the
    instance), what the claims read: every run, not only each case's median."""
    return [{"instance": kind, "tensors": count, "seed": seed, "method": method, "rep": run["rep"],
             "seconds": run["seconds"], "options_per_tensor": run["options"],
             "simulations": "" if run["simulations"] is None else run["simulations"],
             "predicted_ms": run["predicted_s"] * 1e3,
             "dense_ms": run["dense_s"] * 1e3 if run["dense_s"] else "",
             "layer_wise_ms": run["layer_wise_s"] * 1e3 if run["layer_wise_s"] else ""}
            for (kind, count, seed, method), runs in samples.items() for run in runs]


def command_of(args: argparse.Namespace) -> str:
    """The command results.md and the claims table give: every flag, so that it reproduces the run."""
    return f"python -m experiments.espresso_planning --counts {args.counts} --seeds {args.seeds} --reps {args.reps}"


def _group(rows: list[dict]) -> dict[tuple[str, int, str], list[dict]]:
    groups: dict[tuple[str, int, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["instance"], r["tensors"], r["method"]), []).append(r)
    return groups


def write_table(rows: list[dict], results: Results, args) -> None:
    header = ["instance", "tensors", "options/tensor", "cupcake DP (s)", "espresso search (s)",
              "espresso full (s)", "search simulations", "predicted speed-up vs dense / layer-wise"]
    groups = _group(rows)
    table = []
    for kind, count in dict.fromkeys((r["instance"], r["tensors"]) for r in rows):
        cells = {}
        for method in METHODS:
            mine = groups[(kind, count, method)]
            values = [r["median_s"] for r in mine]
            lows, highs = [r["min_s"] for r in mine], [r["max_s"] for r in mine]
            cells[method] = f"{statistics.median(values):.3f} ({min(lows):.3f}-{max(highs):.3f})"
        full = groups[(kind, count, "espresso_full")]
        search_rows = groups[(kind, count, "espresso_search")]
        speedups = [(r["dense_ms"] / r["predicted_ms"], r["layer_wise_ms"] / r["predicted_ms"]) for r in full]
        table.append([kind, count, "/".join(str(o) for o in sorted({r["options_per_tensor"] for r in full})),
                      cells["cupcake"], cells["espresso_search"], cells["espresso_full"],
                      int(statistics.median(r["simulations"] for r in search_rows)),
                      f"{statistics.median(s[0] for s in speedups):.2f}x / {statistics.median(s[1] for s in speedups):.2f}x"])
    notes = f"""
Seconds of planning, median over {args.reps} alternating repetitions and {args.seeds} random profiles
per row (min-max in parentheses: single runs), pure Python on one core of a shared 2-core machine; every
repetition is in trials.csv.
*espresso search* is the per-tensor search the paper times (start from the best uniform plans,
Algorithm 1 with Properties 1-2, pair moves, Algorithm 2 offload); *espresso full* adds the two
exact fusion DPs (runs of equal options, and the search over Cupcake's groups) and is the plan
sync=espresso executes; *cupcake DP* is sync=cupcake's planning. The DPs price O(N^2) groups
(about 45,000 at 300 tensors), a row of them per numpy call; the search scores O(passes x N x
options) candidate plans, each in O(1) from the current plan's prefix states and suffix constants
(comm.timeline.Swaps) and rebuilds those in O(N) per accepted change, so the hierarchical rows (more
options) cost more.
The search runs from the 3 best uniform plans while it stays within 1,500 simulations, so at 300
tensors usually one descent runs (hence the dip: fewer simulations than at 200).
The paper reports 1-179 ms for its search (ResNet101: 314 tensors, compiled code). Predicted
speed-ups are the simulator's, for the full Espresso plan, on the instance's cluster. The ResNet-101
row prices top-k with this CPU's costs (experiments/compressor_speed: 11 ms per million elements)
against a GPU-like backward (90 ms), so its speed-ups say little about a GPU cluster.
"""
    largest = max(row[1] for row in table if row[0].startswith("random"))
    summary = {"Compared": "planning time of Cupcake's DP, Espresso's search alone and Espresso's full plan, "
                           f"{args.counts.replace(',', ', ')} tensors of random profiles and a ResNet-101 instance.",
               "Emulation": "none: pure Python on one core of the shared host; no cluster.",
               "Bound by": "not applicable: planning compute only.",
               "Repetitions": f"{args.reps}, alternating, over {args.seeds} random profiles per row.",
               "Answer": "Espresso's full plan (what sync=espresso runs), s: " + "; ".join(
                   f"{row[0]}, {row[1]} tensors: {row[5]}" for row in table
                   if row[1] == largest or not row[0].startswith("random")) + " (target at 300 tensors: 1 s)."}
    results.write_markdown("Espresso and Cupcake planning time", header, table, notes=notes,
                           command=command_of(args), summary=summary)


def plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    groups = _group([r for r in rows if r["instance"].startswith("random")])
    styles = {"cupcake": "o-", "espresso_search": "s-", "espresso_full": "^-"}
    for layout, dash in (("1 rank/machine", "-"), ("4 ranks/machine", "--")):
        for method in METHODS:
            points = sorted((count, statistics.median(r["median_s"] for r in runs))
                            for (kind, count, m), runs in groups.items() if m == method and layout in kind)
            ax.plot([p[0] for p in points], [p[1] for p in points], styles[method][0] + dash,
                    label=f"{method} ({layout})")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("tensors")
    ax.set_ylabel("planning time (s)")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("Planning time vs model size (random profiles, 16 workers)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
