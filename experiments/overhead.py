"""Step time of ddlscale's dense sync vs stock Lightning DDP, side by side.

    python -m experiments.overhead [--reps 5] [--steps 40] [--workloads lstm,cnn] [--devices 2] [--dilation 2]

Both run the same train.py job (same model, seed, data, worker count); only the strategy differs:
``strategy=ddlscale sync=dense`` (Python hooks + accounted gloo collectives) against
``strategy=ddp`` (DDP's C++ reducer). Reps alternate; the ratio per rep is ours / DDP, reported as
median [min, max]. Target: within 5%.

``--dilation k`` runs every job as one time-dilated machine (:func:`ddlscale.cluster.dilation.dilated_here`):
the workers and their launcher capped at devices / k cores, every time reported in emulated seconds
(wall / k). Each worker then has one emulated core of its own and the host's other core takes the
kernel, the launcher and everything else, which at k = 1 share the workers' cores.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ddlscale.cluster.dilation import dilated_here  # noqa: E402
from experiments.harness import Results, alternating, spread, train  # noqa: E402

STRATEGIES = ("ddlscale", "ddp")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--workloads", default="lstm,cnn")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--dilation", type=float, default=1.0, help="time dilation k of the one machine (1: none)")
    args = parser.parse_args(argv)
    workloads = args.workloads.split(",")

    results = Results("overhead")
    rows = []
    times: dict[tuple[str, str], list[float]] = defaultdict(list)
    total = len(workloads) * args.reps * len(STRATEGIES)
    done = 0
    with dilated_here(args.dilation, args.devices) as cap:
        results.dilation = args.dilation
        for workload in workloads:
            for rep, strategy in alternating(STRATEGIES, args.reps):
                summary = train([f"model={workload}", f"strategy={strategy}", "sync=dense",
                                 f"trainer.max_steps={args.steps}", f"trainer.devices={args.devices}", "seed=0"])
                done += 1
                step = summary["step_time_s"]
                times[(workload, strategy)].append(step)
                rows.append({"workload": workload, "strategy": strategy, "rep": rep, "step_time_s": step,
                             "sync_time_s": summary["sync_time_s"], "param_sha256": summary["param_sha256"],
                             "dilation": summary.get("dilation", 1)})
                results.progress(done, total, f"{workload} {strategy} rep {rep}: step {step * 1e3:.1f} ms")
    results.write_csv(rows)

    table = []
    for workload in workloads:
        ours, ddp = times[(workload, "ddlscale")], times[(workload, "ddp")]
        ratio, lo, hi = spread([a / b for a, b in zip(ours, ddp, strict=True)])
        table.append([workload, spread(ours)[0] * 1e3, spread(ddp)[0] * 1e3, ratio, lo, hi,
                      "yes" if ratio <= 1.05 else "no"])
        print(f"{workload}: ddlscale/ddp step time = {ratio:.3f} [{lo:.3f}, {hi:.3f}]")
    sync_ms = {w: spread([r["sync_time_s"] for r in rows if (r["workload"], r["strategy"]) == (w, "ddlscale")])[0] * 1e3
               for w in workloads}
    identical = all(len({r["param_sha256"] for r in rows if r["workload"] == w}) == 1 for w in workloads)
    results.write_markdown(
        "Dense sync overhead vs stock Lightning DDP",
        ["workload", "ddlscale step (ms, median)", "DDP step (ms, median)", "ratio (median)", "ratio min",
         "ratio max", "within 5%"],
        table,
        notes=f"{args.devices} CPU workers (gloo), {args.steps} steps per run, first step excluded, "
              f"{args.reps} alternating repetitions; a rep's ratio pairs runs made back to back.",
        summary={
            "Compared": "ddlscale's dense sync (`sync=dense`) against stock Lightning DDP (`strategy=ddp`), "
                        + ", ".join(workloads) + ".",
            "Emulation": f"one machine: {args.devices} gloo workers over loopback, no NIC limit, no device time; "
                         + (f"time dilation k={args.dilation:g}, the workers and their launcher capped at {cap} "
                            "(each worker one emulated core)" if args.dilation > 1 else "no dilation: the workers "
                            "share this host's cores with the launcher and the kernel") + ".",
            "Bound by": "CPU: unshaped loopback sets no network limit, so each step is compute and copies; "
                        + "; ".join(f"{w}: ddlscale's sync {sync_ms[w]:.1f} ms of a "
                                    f"{spread(times[(w, 'ddlscale')])[0] * 1e3:.1f} ms step" for w in workloads)
                        + " (medians).",
            "Repetitions": f"{args.reps}, alternating, {args.steps} steps each (first excluded).",
            "Answer": "ddlscale / DDP step, median of paired reps: "
                      + ", ".join(f"{row[0]} {row[3]:.3f}x" for row in table)
                      + "; " + ("bit-identical final parameters" if identical else "final parameters differ") + ".",
        },
        command=f"python -m experiments.overhead --reps {args.reps} --steps {args.steps} "
                f"--workloads {args.workloads} --devices {args.devices}"
                + (f" --dilation {args.dilation:g}" if args.dilation != 1 else ""),
    )
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.38
    for k, strategy in enumerate(STRATEGIES):
        meds = [spread(times[(w, strategy)]) for w in workloads]
        xs = [i + (k - 0.5) * width for i in range(len(workloads))]
        ax.bar(xs, [m[0] * 1e3 for m in meds], width, label=strategy,
               yerr=[[(m[0] - m[1]) * 1e3 for m in meds], [(m[2] - m[0]) * 1e3 for m in meds]], capsize=3)
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_ylabel("step time (ms), median, min-max")
    ax.set_title("ddlscale dense sync vs stock DDP")
    ax.legend()
    fig.tight_layout()
    fig.savefig(results.figure_path(), dpi=120)
    print(f"wrote {results.dir}")


if __name__ == "__main__":
    main()
