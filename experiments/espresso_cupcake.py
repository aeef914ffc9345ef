"""Espresso and Cupcake against no compression and layer-wise compression on the emulated cluster.

    python -m experiments.espresso_cupcake [--nodes 4] [--bandwidths 1gbit,5gbit] [--workloads cnn,lstm,gpt]
        [--compressors dgc,efsignsgd,randomk] [--reps 4] [--steps 97] [--warmup-steps 6]

Per (bandwidth, workload) the methods alternate, rotating which goes first: dense allreduce
(``sync=dense``), and per compressor layer-wise compression of every tensor (``sync=compress``),
``sync=cupcake`` and ``sync=espresso``; allgather, or allreduce where the compressor is summable;
each compressor's default error feedback (residual for the three here). One worker per emulated
machine. Both planners run their model's plan, with no trial on the cluster (``sync.trial_steps=0``:
Espresso's search alone, Cupcake's fusion alone); every method skips as many steps as a trial would take,
so the measured window is the same for all. Measured: rank 0's median step
period (one optimizer step's end to the next: the batch and the loop's time between batches, which is
what the planners' profiles measure and their predictions mean; trials.csv also has the batch alone)
over the steps after that (the planned syncs profile dense for the first steps), the same steps for
every method. The planners are told
the NIC's TCP payload rate and measure the per-message latency themselves
(``sync.network_latency=measured``: small collectives timed on the sync group before planning, which
on emulated machines sharing 2 cores is mostly process scheduling); their predicted iteration time
is read from each run's ``plan.json``. From every saved ``plan_profile.json`` the same cost model
prices all four methods at --nodes workers (dense: DDP's buckets) and at 64 (there with the emulated
cluster's configured alpha: real machines do not share cores). Before training, every machine streams TCP to the next one at once (a ring, as
the allreduce does) to show whether this host sustains each rate. Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

from ddlscale.sync.compressed.schemes import SCHEMES, scheme
from ddlscale.units import parse_time
from experiments.harness import Results, alternating, finished_run, machine, spread, train

WORKLOADS = ("cnn", "lstm", "gpt")
COMPRESSORS = ("dgc", "efsignsgd", "randomk")
# Error feedback needs a contractive compressor: unbiased random-k (values scaled by numel / k) with a
# residual diverges (losses of 1e16-1e29 within 49 steps on cnn and lstm here, and the blown-up values
# then slow the arithmetic); experiments/compression_accuracy shows it too.
SETTINGS = {"randomk": ["compressor.unbiased=false"]}
PLANNED = ("cupcake", "espresso")
METHODS = ("dense", "layerwise", *PLANNED)
# Dense steps: warm-up ones (--warmup-steps: a run's first half second or so is slower here), then profiled
# ones (3, the default, is noisy on this shared host).
WARMUP_STEPS, PROFILE_STEPS = 6, 6
# DGC's sparsity warm-up scaled to these runs (its default, 100 steps, outlasts them; the paper's is 4 of
# about 90 epochs): as long as the planned syncs' dense steps, which stand in for it, so they calibrate
# DGC as it then runs, and every method's measured steps run DGC past its warm-up.
RUN_SETTINGS = {**SETTINGS, "dgc": [f"compressor.warmup_steps={WARMUP_STEPS + PROFILE_STEPS}"]}
SETTLE_STEPS, CALIBRATE_STEPS = 3, 3  # then layer-wise: 3 settling steps, 3 timing the compressor in training (median), then the plan
# Espresso also settles and calibrates every other scheme it may choose (sync.calibrate_families), at most
# all but the configured one, before it: so each option family is priced on its own CPU and lag. Both
# planners time each family layer-wise and then fused (sync.calibrate_fused: per group and per element
# apart), and Espresso a mixed step (sync.calibrate_mixed: what a dense group costs beside compression).
MAX_FAMILIES = len(SCHEMES) - 1
# Skip the first planned step too (it rebuilds the groups), and every method alike skips as many steps as
# the longest calibration takes.
AFTER_WARMUP = PROFILE_STEPS + (2 * (1 + MAX_FAMILIES) + 1) * (SETTLE_STEPS + CALIBRATE_STEPS) + 1
DEFAULT_STEPS = WARMUP_STEPS + AFTER_WARMUP + 18  # 18 measured steps
PROJECT_TO = 64
PROBE_PORT, PROBE_SECONDS = 29611, 1.5

# Each machine listens, streams zeros to the next machine for a while, prints what it received per second.
PROBE = r"""
import socket, sys, threading, time
me, peer, seconds, port = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
server = socket.create_server((me, port))
rate = []
def receive():
    conn, _ = server.accept()
    total, first = 0, None
    while chunk := conn.recv(1 << 20):
        first = first or time.perf_counter()
        total += len(chunk)
    rate.append(total * 8 / (time.perf_counter() - first))
reader = threading.Thread(target=receive)
reader.start()
for _ in range(200):
    try:
        out = socket.create_connection((peer, port))
        break
    except OSError:
        time.sleep(0.05)
block, end = bytes(1 << 22), time.perf_counter() + seconds
while time.perf_counter() < end:
    out.sendall(block)
out.close()
reader.join()
print(rate[0], flush=True)
"""


def probe_rate(nodes: int, bandwidth: str) -> list[float]:
    """Received TCP payload bit/s of each machine while all stream to their ring successor at once."""
    from ddlscale.cluster.emulated import EmulatedCluster

    with EmulatedCluster(max(2, nodes), bandwidth) as cluster:
        n = cluster.nodes
        procs = [cluster.popen(i, [sys.executable, "-c", PROBE, cluster.address(i), cluster.address((i + 1) % n),
                                   str(PROBE_SECONDS), str(PROBE_PORT)], stdout=subprocess.PIPE, text=True)
                 for i in range(n)]
        outs = [p.communicate(timeout=60)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"the {bandwidth} probe failed: exit codes {[p.returncode for p in procs]}")
    return [float(o.strip().splitlines()[-1]) for o in outs]


def planner_network(bandwidth: str) -> tuple[str, str]:
    """(sync.network_bandwidth, sync.network_latency): the NIC's TCP payload rate; latency measured by the planner."""
    from ddlscale.cluster.emulated import TCP_PAYLOAD_FRACTION
    from ddlscale.units import parse_bandwidth

    return str(int(parse_bandwidth(bandwidth) * TCP_PAYLOAD_FRACTION)), "measured"


def scheme_of(compressor: str) -> str:
    """allreduce where payloads sum, else allgather (CompressSync's default)."""
    from ddlscale.compress import build_compressor

    comp = build_compressor(compressor)
    return "allreduce" if comp.summable or hasattr(comp, "reduce") else "allgather"


def other_families(compressor: str) -> list[str]:
    """The schemes besides :func:`scheme_of`'s that the compressor runs under: the option families
    Espresso may choose, each calibrated before planning (``sync.calibrate_families``)."""
    from ddlscale.compress import build_compressor

    comp, out = build_compressor(compressor), []
    for name in SCHEMES:
        try:
            scheme(name).check(comp, "sync.calibrate_families")
        except ValueError:
            continue
        if name != scheme_of(compressor):
            out.append(name)
    return out


def overrides_of(method: str, compressor: str | None, bandwidth: str, args: argparse.Namespace) -> list[str]:
    out = ["cluster=emulated", f"cluster.nodes={args.nodes}", f"cluster.bandwidth={bandwidth}",
           "trainer.devices=1", f"trainer.max_steps={args.steps}", "seed=0", *args.overrides.split()]
    if method == "dense":
        return [*out, "sync=dense"]
    out += [f"sync={'compress' if method == 'layerwise' else method}", f"compressor={compressor}",
            f"sync.comm={scheme_of(compressor)}",
            *RUN_SETTINGS.get(compressor, [])]
    if method in PLANNED:
        bw, latency = planner_network(bandwidth)
        out += [f"sync.network_bandwidth={bw}", f"sync.network_latency={latency}",
                f"sync.warmup_steps={args.warmup_steps}", f"sync.profile_steps={PROFILE_STEPS}",
                f"sync.settle_steps={SETTLE_STEPS}", f"sync.calibrate_steps={CALIBRATE_STEPS}",
                "sync.gpus_per_machine=1"]
    if method in PLANNED:  # each planner's own plan, from its model alone (their default adds a trial)
        out += ["sync.trial_steps=0", "sync.calibrate_fused=true"]
    if method == "espresso":
        out += [f"sync.calibrate_families=[{','.join(other_families(compressor))}]", "sync.calibrate_mixed=true"]
    return out


def per_step(run_dir: Path) -> list[dict[str, float | str]]:
    """Rank 0's logged figures, one dict per optimizer step, in order (numbers as floats; text such as
    a planned sync's ``sync_phase`` as it was logged)."""
    with (run_dir / "metrics.csv").open() as f:
        rows = [r for r in csv.DictReader(f) if r.get("step_time_s")]
    return [{k: _figure(v) for k, v in r.items() if v not in ("", None)} for r in rows]


def _figure(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


def window_median(steps: list[dict[str, float]], key: str, first: int) -> float:
    values = [s[key] for s in steps[first:] if key in s]
    return statistics.median(values) if values else float("nan")


def _after_drift(planned: list[dict[str, Any]], dense_ms: list[float]) -> float:
    """The median prediction of ``planned`` runs, each divided by its profile's drift: its profiled dense
    step over the dense runs' measured median. A profile taken while the host ran slow (or fast)
    scales every time in it, so this separates the model's error from the profile window's."""
    return statistics.median(r["predicted_ms"] * statistics.median(dense_ms) / r["profile_dense_step_ms"]
                             for r in planned)


# -- the cost model's view of the four methods -------------------------------------------------------
def modeled(profile_path: Path, comm: str, workers: int | None = None) -> dict[str, float]:
    """Predicted iteration time of each method from a saved profile (optionally at another size)."""
    from ddlscale.cluster.emulated import ALPHA
    from ddlscale.plan.planner import configured_option, cost_model, cupcake_plan, dense_plan, espresso_plan
    from ddlscale.plan.pricing import units_of
    from ddlscale.plan.profile import Profile
    from ddlscale.plan.result import uniform_time

    profile = Profile.load(profile_path)
    if workers is not None:  # real machines: their own cores, the configured alpha, no shared-host slowdown
        network = {k: v for k, v in profile.network.items() if k != "efficiency"}
        profile = replace(profile, world_size=workers, step_s=None, lag_s=0.0,
                          network={**network, "latency": ALPHA, "exchange_latency": ALPHA})
    model = cost_model(profile)
    option = configured_option(model, comm)
    units, end, rest = units_of(profile), profile.backward_end_s, profile.rest_s
    return {"dense": dense_plan(profile, model).iteration_s,
            "layerwise": uniform_time(units, option, model, end, rest),
            "cupcake": cupcake_plan(profile, model, option).iteration_s,
            "espresso": espresso_plan(profile, model, cupcake_option=option).iteration_s}


WORK_KEYS = ("work_encode_ms", "model_encode_ms", "work_decode_ms", "model_decode_ms", "work_finish_ms",
             "model_tail_ms")


def work_against_model(run_dir: Path) -> dict[str, float]:
    """The kept plan's groups as they ran beside the model's prices for the same groups, each summed
    over the groups (empty without ``plan_work.json``: runs kept before it was written).

    ``work_*``: rank 0's medians over the last steps (:data:`ddlscale.sync.compressed.planned.WORK_FILE`):
    compressor encode (error feedback included), decode, and finish (the training thread's time
    completing a group after backward: waiting for its collectives, plus the decode where the scheme
    decodes there). ``model_*``: encode without the per-group overhead the model is fitted with (a
    blocking size exchange stays in it), decode, and the tail from backward end to the last decode.
    """
    from ddlscale.plan.planner import cost_model
    from ddlscale.plan.profile import Profile
    from ddlscale.plan.result import CompressionPlan
    from ddlscale.sync.compressed.planned import PLAN_FILE, PROFILE_FILE, WORK_FILE

    if not (run_dir / WORK_FILE).exists():
        return {}
    groups = json.loads((run_dir / WORK_FILE).read_text())["groups"]
    plan = CompressionPlan.from_dict(json.loads((run_dir / PLAN_FILE).read_text()))
    profile = Profile.load(run_dir / PROFILE_FILE)
    model = cost_model(profile)
    overhead = profile.compressors["default"].calibration.get("group_s", 0.0)
    encode = decode = 0.0
    for unit, option in zip(plan.units, plan.options, strict=True):
        if option.compressed:
            e, _, d = model.costs(unit, option)
            encode, decode = encode + e - overhead, decode + d
    tail = plan.iteration_s - profile.rest_s - profile.backward_end_s
    work = {kind: sum(g[f"{kind}_s"] for g in groups) for kind in ("encode", "decode", "finish")}
    return dict(zip(WORK_KEYS, (1e3 * t for t in (work["encode"], encode, work["decode"], decode, work["finish"],
                                                  tail)), strict=True))


def work_table(runs: dict[tuple, list[dict[str, Any]]], cases: list[tuple[str, str, str]]) -> list[str]:
    """Markdown lines: per case and planned method, the groups' measured work against the model's
    (none when no run wrote ``plan_work.json``)."""
    from ddlscale.sync.compressed.planned import WORK_STEPS

    lines = []
    for case, method in itertools.product(cases, PLANNED):
        timed = [r for r in runs[(*case, method)] if r["work_encode_ms"] != ""]
        if timed:
            med = {k: statistics.median(r[k] for r in timed) for k in WORK_KEYS}
            pairs = [f"{med[a]:.1f} / {med[b]:.1f}" for a, b in zip(WORK_KEYS[::2], WORK_KEYS[1::2], strict=True)]
            lines.append(f"| {' '.join(case)} | {method} | " + " | ".join(pairs) + " |")
    if not lines:
        return []
    return ["", f"Where the kept plans' time went, rank 0, summed over groups, medians over the last {WORK_STEPS} "
                "steps and then over repetitions, ms measured / model (`work_*` and `model_*` in trials.csv): "
                "compressor encode (the model's without its fitted per-group overhead), decode, and the time the "
                "training thread spent completing groups after backward beside the model's tail from backward "
                "end to the last decode:", "",
            "| case | method | encode | decode | after backward |", "|---|---|---|---|---|", *lines]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--bandwidths", default="1gbit,5gbit")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--compressors", default=",".join(COMPRESSORS))
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--warmup-steps", type=int, default=WARMUP_STEPS,
                        help="the planned syncs' dense steps before the profiled ones")
    parser.add_argument("--overrides", default="", help="extra train.py overrides, space-separated")
    parser.add_argument("--name", default="espresso_cupcake", help="results folder under experiments/results")
    parser.add_argument("--keep", default="", help="keep every run's folder (profile, plan, metrics) under this path")
    parser.add_argument("--reuse", action="store_true",
                        help="with --keep: read the runs already finished there instead of training them again "
                             "(resume an interrupted experiment, or redo the report)")
    args = parser.parse_args(argv)
    if args.reuse and not args.keep:
        parser.error("--reuse needs --keep: the folder whose runs to read")
    first = args.warmup_steps + AFTER_WARMUP  # the first measured step
    if args.warmup_steps < 1 or args.steps < first + 3:
        parser.error(f"--warmup-steps must be >= 1 and --steps >= {first + 3}: the first {first} are not measured")
    bandwidths, workloads = args.bandwidths.split(","), args.workloads.split(",")
    compressors = args.compressors.split(",")
    schemes = {c: scheme_of(c) for c in compressors}
    keys = [("dense", None)] + [(m, c) for c in compressors for m in METHODS[1:]]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = Results(args.name)
    command = (f"python -m experiments.espresso_cupcake --nodes {args.nodes} --bandwidths {args.bandwidths} "
               f"--workloads {args.workloads} --compressors {args.compressors} --reps {args.reps} "
               f"--steps {args.steps} --warmup-steps {args.warmup_steps}"
               + (f" --overrides '{args.overrides}'" if args.overrides else "")
               + (f" --name {args.name}" if args.name != "espresso_cupcake" else ""))
    # What the host can carry: the ring of TCP streams at each rate.
    config = results.dir / "config.json"
    earlier = json.loads(config.read_text()).get("probe", {}) if args.reuse and config.exists() else {}
    probes = {bw: earlier[bw] for bw in bandwidths if bw in earlier}  # a resumed run keeps its host check
    for bw in bandwidths:
        if bw in probes:
            continue
        rates = probe_rate(args.nodes, bw)
        payload = float(planner_network(bw)[0])
        probes[bw] = {"achieved_gbps": [r / 1e9 for r in rates], "payload_gbps": payload / 1e9,
                      "fraction": statistics.median(rates) / payload}
        print(f"probe {bw}: {args.nodes} machines streaming at once receive "
              f"{', '.join(f'{r / 1e9:.2f}' for r in rates)} Gbit/s (TCP payload rate {payload / 1e9:.2f}: "
              f"{probes[bw]['fraction']:.0%})", flush=True)
    (results.dir / "config.json").write_text(json.dumps(
        {"command": command, "args": vars(args), "machine": machine(), "probe": probes, "schemes": schemes,
         "memory": "each compressor's default (memory=default)",
         "planner_network": {bw: planner_network(bw) for bw in bandwidths},
         "overrides_example": {f"{m}/{c}": overrides_of(m, c, bandwidths[0], args) for m, c in keys}}, indent=1))

    rows: list[dict[str, Any]] = []
    runs: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    model_at: dict[tuple, list[dict[str, float]]] = defaultdict(list)  # (bw, workload, compressor, workers)
    total, done = len(bandwidths) * len(workloads) * args.reps * len(keys), 0
    with tempfile.TemporaryDirectory(prefix="ddlscale-ec-") as temporary:
        scratch = args.keep or temporary
        for bw in bandwidths:
            for workload in workloads:
                for rep, (method, comp) in alternating(keys, args.reps):
                    run_dir = Path(scratch) / f"{bw}-{workload}-{method}-{comp}-{rep}"
                    started = time.perf_counter()
                    kept = finished_run(run_dir, args.reuse)  # a run stopped when its part ended runs again
                    if kept is not None:
                        summary = kept
                        timed = run_dir / "wall.json"  # absent in runs kept before it was written
                        wall = json.loads(timed.read_text())["wall_s"] if timed.exists() else float("nan")
                    else:
                        summary = train([f"model={workload}", *overrides_of(method, comp, bw, args)], timeout=1800,
                                        run_dir=run_dir)
                        wall = time.perf_counter() - started
                        (run_dir / "wall.json").write_text(json.dumps({"wall_s": wall}))
                    steps = per_step(run_dir)
                    row = {"bandwidth": bw, "workload": workload, "compressor": comp or "none", "method": method,
                           "scheme": schemes.get(comp, "allreduce"), "rep": rep,
                           "step_ms": window_median(steps, "step_period_s", first) * 1e3,
                           "batch_ms": window_median(steps, "step_time_s", first) * 1e3,
                           "sync_ms": window_median(steps, "sync_time_s", first) * 1e3,
                           "bytes_sent_per_step": window_median(steps, "bytes_sent", first),
                           "summary_step_ms": summary["step_time_s"] * 1e3, "final_loss": summary["final_loss"],
                           "starved": summary.get("starved"),
                           "measured_steps": len(steps) - first, "wall_s": round(wall, 1),
                           "predicted_ms": "", "plan_kept": "", "plan_fusion": "", "plan_units": "", "plan_options": "",
                           "profile_dense_step_ms": "", "planner_alpha_us": "",
                           "planner_exchange_alpha_us": "", "calibration_encode": "", "calibration_decode": "",
                           "allreduce_efficiency": "", "group_overhead_ms": "", "calibration_layerwise_step_ms": "",
                           "slowest_rank_lag_ms": "", "member_encode_us": "", "member_decode_us": "",
                           **dict.fromkeys(WORK_KEYS, "")}
                    if method in PLANNED:
                        plan = json.loads((run_dir / "plan.json").read_text())
                        labels = [f"{o['compressor']}/{o['scheme']}" + ("/hier" if o["hierarchical"] else "")
                                  for o in plan["options"]]
                        row.update(predicted_ms=plan["iteration_s"] * 1e3, plan_fusion=plan["fusion"],
                                   plan_kept=plan["context"].get("candidate", method),
                                   plan_units=len(plan["units"]),
                                   plan_options=" ".join(f"{k}x{labels.count(k)}" for k in sorted(set(labels))),
                                   profile_dense_step_ms=(plan["context"].get("measured_dense_step_s") or 0) * 1e3)
                        profile = run_dir / "plan_profile.json"
                        saved = json.loads(profile.read_text())
                        network, calibration = saved["network"], saved["compressors"]["default"]["calibration"]
                        row["planner_alpha_us"] = parse_time(network["latency"]) * 1e6
                        row["planner_exchange_alpha_us"] = parse_time(network["exchange_latency"]) * 1e6
                        row["calibration_encode"] = calibration.get("encode", "")
                        row["calibration_decode"] = calibration.get("decode", "")
                        row["allreduce_efficiency"] = network.get("efficiency", {}).get("allreduce", "")
                        row["slowest_rank_lag_ms"] = saved.get("lag_s", 0.0) * 1e3  # 0: planned before it was measured
                        for kind in ("encode", "decode"):
                            row[f"member_{kind}_us"] = saved["compressors"]["default"].get(f"member_{kind}_s", 0.0) * 1e6
                        if "group_s" in calibration:
                            row["group_overhead_ms"] = calibration["group_s"] * 1e3
                            row["calibration_layerwise_step_ms"] = calibration["layerwise_step_s"] * 1e3
                        row.update(work_against_model(run_dir))
                        model_at[(bw, workload, comp, args.nodes)].append(modeled(profile, schemes[comp]))
                        model_at[(bw, workload, comp, PROJECT_TO)].append(modeled(profile, schemes[comp], PROJECT_TO))
                    rows.append(row)
                    runs[(bw, workload, comp, method)].append(row)
                    done += 1
                    pred = f", predicted {row['predicted_ms']:.1f} ms" if row["predicted_ms"] != "" else ""
                    eta = (time.perf_counter() - results.started) / done * (total - done) / 60
                    results.progress(done, total, f"{bw} {workload} {method}{'/' + comp if comp else ''} rep {rep}: "
                                                  f"step {row['step_ms']:.1f} ms{pred} (run {wall:.0f} s, "
                                                  f"~{eta:.0f} min left)")
    results.write_csv(rows, "trials.csv")

    # Per (bandwidth, workload, compressor, method): measured spread, model at --nodes and at 64.
    table, summary_rows, targets = [], [], []
    for bw in bandwidths:
        for workload in workloads:
            dense = [r["step_ms"] for r in runs[(bw, workload, None, "dense")]]
            for comp in compressors:
                stats, models = {}, {}
                for method in METHODS:
                    mine = runs[(bw, workload, None if method == "dense" else comp, method)]
                    stats[method] = spread([r["step_ms"] for r in mine])
                    here = [m[method] * 1e3 for m in model_at[(bw, workload, comp, args.nodes)]]
                    far = [m[method] * 1e3 for m in model_at[(bw, workload, comp, PROJECT_TO)]]
                    # The planned methods' prediction is the plan each run executed.
                    planned = [r["predicted_ms"] for r in mine if r["predicted_ms"] != ""]
                    models[method] = (statistics.median(planned or here or [float("nan")]),
                                      statistics.median(far or [float("nan")]))
                for method in METHODS:
                    (med, low, high), (pred, proj) = stats[method], models[method]
                    record = {"bandwidth": bw, "workload": workload, "compressor": comp, "method": method,
                              "measured_ms": med, "min_ms": low, "max_ms": high,
                              "speedup_vs_dense": statistics.median(dense) / med, "predicted_ms": pred,
                              "measured_over_predicted": med / pred, f"projected_{PROJECT_TO}_ms": proj,
                              f"projected_{PROJECT_TO}_speedup_vs_dense": models["dense"][1] / proj}
                    summary_rows.append(record)
                    table.append([bw, workload, comp, method, f"{med:.1f} ({low:.1f}-{high:.1f})",
                                  record["speedup_vs_dense"], pred, record["measured_over_predicted"], proj,
                                  record[f"projected_{PROJECT_TO}_speedup_vs_dense"]])
                best = min(("dense", "layerwise", "cupcake"), key=lambda m: stats[m][0])
                esp, other = stats["espresso"], stats[best]
                kept = [r["plan_kept"] for r in runs[(bw, workload, comp, "espresso")]]
                targets.append({
                    "case": f"{bw} {workload} {comp}", "best other": best,
                    "espresso kept": " / ".join(k.split(",")[0].split(" ")[0] for k in kept),
                    "espresso / best": esp[0] / other[0],
                    "espresso ok": esp[0] <= other[0] or esp[1] <= other[2],  # faster, or the ranges overlap
                    "cupcake / layer-wise": stats["cupcake"][0] / stats["layerwise"][0],
                    "pred err cupcake": models["cupcake"][0] / stats["cupcake"][0] - 1,
                    "pred err espresso": models["espresso"][0] / stats["espresso"][0] - 1,
                    **{f"drift err {m}": _after_drift(runs[(bw, workload, comp, m)], dense) / stats[m][0] - 1
                       for m in PLANNED}})
    results.write_csv(summary_rows, "results.csv")

    target_lines = ["| case | best other | Espresso kept (per rep) | Espresso / best | Espresso target | Cupcake / layer-wise | "
                    "predicted vs measured: Cupcake | Espresso | after the profile's drift: Cupcake | Espresso |",
                    "|---|---|---|---|---|---|---|---|---|---|"]
    for t in targets:
        cupcake = f"{t['cupcake / layer-wise']:.2f}" + (
            (" (faster)" if t["cupcake / layer-wise"] < 1 else " (slower)") if " cnn " in f" {t['case']} " else "")
        errs = [f"{t[k]:+.0%}" + ("" if abs(t[k]) <= 0.15 else " (beyond 15%)") for k in ("pred err cupcake",
                                                                                    "pred err espresso")]
        drifted = " | ".join(f"{t[f'drift err {m}']:+.0%}" for m in PLANNED)
        target_lines.append(f"| {t['case']} | {t['best other']} | {t['espresso kept']} | {t['espresso / best']:.2f} | "
                            f"{'yes' if t['espresso ok'] else 'no'} | {cupcake} | {errs[0]} | {errs[1]} | {drifted} |")
    probe_text = "; ".join(f"{bw}: {p['fraction']:.0%} of the {p['payload_gbps']:.2f} Gbit/s TCP payload rate "
                           f"({', '.join(f'{a:.2f}' for a in p['achieved_gbps'])} Gbit/s per machine)"
                           + (" - this host cannot sustain it" if p["fraction"] < 0.9 else "")
                           for bw, p in probes.items())
    def measured(bw: str, key: str) -> str:
        a = [r[key] for r in rows if r["bandwidth"] == bw and r[key] != ""]
        return f"{statistics.median(a):.0f} us (runs {min(a):.0f}-{max(a):.0f})" if a else "-"

    def drift(bw: str, workload: str) -> str:
        dense = statistics.median(r["step_ms"] for r in runs[(bw, workload, None, "dense")])
        a = [r["profile_dense_step_ms"] / dense for r in rows if (r["bandwidth"], r["workload"]) == (bw, workload)
             and r["method"] in PLANNED]
        return f"{bw} {workload} x{statistics.median(a):.2f} ({min(a):.2f}-{max(a):.2f})"

    def ratio(key: str) -> str:
        a = [r[key] for r in rows if r[key] != ""]
        return f"{statistics.median(a):.2f} (runs {min(a):.2f}-{max(a):.2f})" if a else "-"

    planner = ", ".join(f"{bw}: {int(planner_network(bw)[0]) / 1e9:.3f} Gbit/s, measured alpha of allreduce "
                        f"{measured(bw, 'planner_alpha_us')}, of allgather and other exchanges "
                        f"{measured(bw, 'planner_exchange_alpha_us')}" for bw in bandwidths)
    notes = f"""
{args.nodes} emulated machines, one worker each, {args.steps} steps per run; "measured" is rank 0's median
step period (a step's end to the next one's: its batch and the loop's time between batches) over steps {first}..{args.steps - 1} (the planned syncs run dense for {args.warmup_steps} warm-up + {PROFILE_STEPS}
profiled steps, then layer-wise for {SETTLE_STEPS} settling + {CALIBRATE_STEPS} calibration steps and fused for as many (sync.calibrate_fused), then plan, with no trial (sync.trial_steps=0: the model's plan runs); Espresso first settles and
calibrates each other scheme it may choose, layer-wise and fused ({"; ".join(f"{c}: {', '.join(other_families(c))}" for c in compressors)}), and a mixed step (sync.calibrate_mixed: the largest tensor compressed, the rest dense alone), and every
method's window skips as many steps as that takes; the first planned step rebuilds the groups), median (min-max) over {args.reps}
alternating repetitions. Schemes: {", ".join(f"{c} {s}" for c, s in schemes.items())}; error feedback:
each compressor's default; settings: {"; ".join(f"{c}: {' '.join(v)}" for c, v in RUN_SETTINGS.items() if c in compressors) or "none"}. Layer-wise = sync=compress (every tensor
compressed alone). Speed-ups are against the dense median of the same bandwidth and workload.

*predicted*: for cupcake/espresso the kept plan's own predicted iteration time (plan.json), for dense and
layer-wise the same cost model on the planned runs' profiles (dense priced with DDP's 1/25 MB buckets).
The planners assumed: {planner}. Every rank's profiled dense steps say how far behind rank 0 the
slowest rank ends backward, which every collective waits for ({ratio('slowest_rank_lag_ms')} ms; the
model grows it through the step from the previous step's final collective). Calibrated in each planned run, in three steps: compression costs
are benchmarked on every rank at once over a grid of sizes, then scaled by what the same work cost in the
calibration steps (weighted median over groups of measured / benchmarked; encode x{ratio('calibration_encode')},
decode x{ratio('calibration_decode')}: the benchmark loop sees neither the other ranks' backward nor cold data;
a compressor that scales per member, efsignsgd here, is also timed on buffers of 64K and 4M elements as 64 members
and pays the difference per member and per element of a fused group);
the model's allreduce times are scaled so that its dense step in DDP's buckets takes what the profiled dense
steps took (x{ratio('allreduce_efficiency')}: on this host every machine's reductions, copies and TCP stack
share 2 cores with backward); and every compressed group is charged a fixed overhead on the training thread so
that the layer-wise step takes what the calibration steps took ({ratio('group_overhead_ms')} ms per group).
So the dense and layer-wise predictions here are fitted to the planned run's own steps: they check that
the fit carries over to separate runs, not the model; Cupcake's and Espresso's predictions are the test.
The model still leaves out that communication takes CPU from backward rather than overlapping with it
(the allreduce factor charges it to the link instead); a profile comes from a few steps. *projected {PROJECT_TO}*: the cost model on the
same profiles at {PROJECT_TO} workers, same NICs, without the allreduce factor and the lag (this host's compute and
compression speed, so it says what the plans do with more workers, not what a GPU cluster would run at).

How far the profiles' own dense steps (a planned run's {PROFILE_STEPS} after {args.warmup_steps} warm-up, median) were
from the dense runs' measured median, median (min-max) over the planned runs — every time a profile
holds moves with it, so a prediction cannot be closer than this: {"; ".join(drift(bw, w) for bw in bandwidths
for w in workloads)}. "After the profile's drift" divides each run's prediction by its profile's ratio
before the median: what is left is the model's error.

Host check (every machine streaming TCP to the next one at once, {PROBE_SECONDS} s): {probe_text}.

Targets per case (Espresso: yes when its median is at most the best other's, or their min-max ranges overlap;
Cupcake faster than layer-wise: judged on cnn; predicted within 15% of measured):

""" + "\n".join(target_lines + work_table(runs, list(itertools.product(bandwidths, workloads, compressors))))
    results.write_markdown(
        f"Espresso and Cupcake vs dense and layer-wise compression, {args.nodes} emulated machines",
        ["bandwidth", "workload", "compressor", "method", "measured ms (min-max)", "speed-up vs dense",
         "predicted ms", "measured / predicted", f"projected {PROJECT_TO} workers ms",
         f"projected speed-up vs dense at {PROJECT_TO}"],
        table, notes=notes, command=command, summary=header(args, runs, targets, probes, bandwidths, workloads))
    plot(summary_rows, bandwidths, workloads, compressors, results.figure_path(), plt)
    print(f"wrote {results.dir}")


def header(args: argparse.Namespace, runs: dict, targets: list[dict], probes: dict, bandwidths: list[str],
           workloads: list[str]) -> dict[str, str]:
    """results.md's opening lines; 'bound by' from the dense runs: the wait for communication after backward
    (sync_ms) against the rest of the step."""
    bound = []
    for bw, workload in itertools.product(bandwidths, workloads):
        dense = runs[(bw, workload, None, "dense")]
        step, sync = (statistics.median(float(r[k]) for r in dense) for k in ("step_ms", "sync_ms"))
        bound.append(f"{bw} {workload} {sync:.0f} of {step:.0f} ms ({'network' if sync > step - sync else 'host CPU'})")
    n = len(targets)
    return {
        "Compared": "step period of dense (DDP's buckets), layer-wise compression, Cupcake's fused groups and "
                    f"Espresso's plans with {args.compressors} on {args.workloads}; each planner's predicted step "
                    "beside the measured one.",
        "Emulation": f"{args.nodes} emulated machines, one worker each, {args.bandwidths} NICs (the host sustained "
                     + ", ".join(f"{p['fraction']:.0%} of {bw}" for bw, p in probes.items())
                     + f"), on this host's {os.cpu_count()} cores; no device time.",
        "Bound by": "measured on the dense runs, the wait for communication after backward against the rest of the "
                    "step (trials.csv `sync_ms`, `step_ms`): " + "; ".join(bound) + ".",
        "Repetitions": f"{args.reps}, alternating, {args.steps} steps each.",
        "Answer": f"Espresso's median at most the best method's, or their ranges overlapping, in "
                  f"{sum(t['espresso ok'] for t in targets)} of {n} cases; Cupcake faster than layer-wise in {sum(t['cupcake / layer-wise'] < 1 for t in targets)} "
                  f"of {n}; predictions within 15%: Espresso "
                  f"{sum(abs(t['pred err espresso']) <= 0.15 for t in targets)} of {n}, Cupcake "
                  f"{sum(abs(t['pred err cupcake']) <= 0.15 for t in targets)} of {n}.",
    }


def plot(rows: list[dict[str, Any]], bandwidths: list[str], workloads: list[str], compressors: list[str],
         path: Path, plt: Any) -> None:
    fig, axes = plt.subplots(len(bandwidths), len(workloads), figsize=(4.5 * len(workloads), 3.4 * len(bandwidths)),
                             squeeze=False)
    width = 0.8 / len(METHODS)
    for i, bw in enumerate(bandwidths):
        for j, workload in enumerate(workloads):
            ax = axes[i][j]
            for k, method in enumerate(METHODS):
                mine = [next(r for r in rows if (r["bandwidth"], r["workload"], r["compressor"], r["method"])
                             == (bw, workload, c, method)) for c in compressors]
                xs = [x + (k - (len(METHODS) - 1) / 2) * width for x in range(len(compressors))]
                med = [r["measured_ms"] for r in mine]
                err = [[m - r["min_ms"] for m, r in zip(med, mine, strict=True)],
                       [r["max_ms"] - m for m, r in zip(med, mine, strict=True)]]
                ax.bar(xs, med, width, yerr=err, capsize=2, label=method)
                ax.plot(xs, [r["predicted_ms"] for r in mine], "kD", markersize=4,
                        label="predicted" if k == 0 else None)
            ax.set_xticks(range(len(compressors)), compressors)
            ax.set(title=f"{workload}, {bw}", ylabel="step ms (median)")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
