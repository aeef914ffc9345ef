"""Show an Espresso or Cupcake plan without training.

    python -m ddlscale.tools.plan --profile RUN_DIR/plan_profile.json [--workers 64 --bandwidth 25gbit]
    python -m ddlscale.tools.plan --model cnn --compressor topk [--memory residual] [--steps 6] [--save profile.json]

From a saved profile (every ``sync=espresso`` / ``sync=cupcake`` run writes ``plan_profile.json``)
the plan is recomputed offline, optionally for another cluster (workers, bandwidth, latency, ranks
per machine). With ``--model`` a workload from ``ddlscale/conf/model`` is profiled here for a few
steps in this one process (ready times, backward end, the rest of the step) and the compressor from
``ddlscale/conf/compressor`` is measured on this device, with the error feedback from
``ddlscale/conf/memory``; the cluster is then the one given.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from ddlscale.compress import MEMORIES, Compressor, NoCompression, build_compressor
from ddlscale.compress.memory import Memory
from ddlscale.paths import CONF_DIR
from ddlscale.plan.planner import configured_option, cost_model, cupcake_plan, espresso_plan
from ddlscale.plan.profile import Profile, StepRecorder, TensorProfile, matrix_kept, profile_compressor
from ddlscale.units import parse_bandwidth, parse_time


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ddlscale.tools.plan", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--profile", type=Path, help="a saved plan_profile.json")
    source.add_argument("--model", help="profile this workload (ddlscale/conf/model/<name>.yaml) here")
    parser.add_argument("--compressor", default="topk", help="with --model: ddlscale/conf/compressor/<name>.yaml, or a compressor class's module.Class path")
    parser.add_argument("--memory", default="default",
                        help="with --model: the error feedback the compressor is timed with, ddlscale/conf/memory/<name>.yaml "
                             "(default: the compressor's own default, as train.py's)")
    parser.add_argument("--steps", type=int, default=6, help="with --model: steps to run (the first is warm-up)")
    parser.add_argument("--save", type=Path, help="with --model: write the profile here")
    parser.add_argument("--system", choices=("espresso", "cupcake", "both"), default="both")
    parser.add_argument("--workers", type=int, help="cluster size (default: the profile's; 2 with --model)")
    parser.add_argument("--bandwidth", help="NIC bandwidth, tc units (default: the profile's; 1gbit)")
    parser.add_argument("--latency", help="per-message latency, tc units (default: the profile's; 100us)")
    parser.add_argument("--gpus-per-machine", type=int, help="ranks per machine (default: the profile's; 1)")
    parser.add_argument("--comm", default="allgather", help="Cupcake's scheme (and Espresso's uniform baseline)")
    parser.add_argument("--hierarchical", action="store_true", help="Cupcake: hierarchical groups")
    parser.add_argument("--offload", action="store_true", help="Espresso: run Algorithm 2 (side-device compression)")
    parser.add_argument("--no-fuse", action="store_true", help="Espresso: per-tensor plans only")
    parser.add_argument("--all", action="store_true", help="list every unit, not only the 40 largest")
    parser.add_argument("--json", type=Path, help="also write the plan(s) as JSON here")
    return parser


def _load_config(group: str, name: str):
    from omegaconf import OmegaConf

    path = CONF_DIR / group / f"{name}.yaml"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml")))
        raise ValueError(f"--{group} {name!r}: no {path} (one of {known})")
    return OmegaConf.load(path)


def build_memory(name: str, compressor: Compressor) -> Memory:
    from hydra.utils import instantiate

    cfg = _load_config("memory", name)
    if cfg.get("_target_") is None:  # memory=default: what the compressor runs with unless told
        return MEMORIES[compressor.default_memory]()
    return instantiate(cfg)


def profile_model(module: torch.nn.Module, compressor: Compressor, memory: Memory, steps: int, world_size: int,
                  network: dict, budget_s: float = 0.02) -> Profile:
    """Train ``module`` (a ddlscale Workload) for ``steps`` steps in this process and profile it."""
    if steps < 2:
        raise ValueError(f"--steps must be >= 2 (one warm-up step, then measured ones), got {steps}")
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    index = {id(p): i for i, (_, p) in enumerate(named)}
    recorder = StepRecorder()
    seen: list[int] = []

    def hook(param: torch.Tensor) -> None:
        recorder.ready(index[id(param)])
        seen.append(index[id(param)])

    handles = [p.register_post_accumulate_grad_hook(hook) for _, p in named]
    optimizer = module.configure_optimizers()
    optimizer = optimizer[0] if isinstance(optimizer, list | tuple) else optimizer
    batches = iter(module.train_dataloader())
    try:
        for _ in range(steps):
            loss = module.loss(next(batches))
            loss.backward()
            recorder.backward_end()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            recorder.step_end()
    finally:
        for handle in handles:
            handle.remove()
    order = list(dict.fromkeys(seen)) + [i for i in reversed(range(len(named))) if i not in set(seen)]
    summary = recorder.summary(order, warmup=1)
    tensors = []
    for k, i in enumerate(order):
        name, param = named[i]
        kept = matrix_kept(compressor, param.shape, param.dtype)  # PowerSGD: its factors, from the shape
        tensors.append(TensorProfile(name, param.numel(), tuple(param.shape), str(param.dtype), summary["ready_s"][k],
                                     {} if kept is None else {"default": kept}))
    total = sum(t.numel for t in tensors)
    planning = {"none": NoCompression()} if compressor.name == "none" else {"none": NoCompression(), "default": compressor}
    compressors = {key: profile_compressor(comp, total, "cpu", budget_s, memory) for key, comp in planning.items()}
    return Profile(tensors, summary["backward_end_s"], summary["rest_s"], world_size, network, compressors,
                   "cpu", None, summary["steps"], widens=memory.widens)


def _network(args: argparse.Namespace, base: dict) -> dict:
    out = dict(base)
    for key, value, parse in (("bandwidth", args.bandwidth, parse_bandwidth), ("latency", args.latency, parse_time)):
        if value is not None:
            try:
                parse(value)
            except ValueError as exc:
                raise ValueError(f"--{key}: {exc}") from None
            out[key] = value
            if key == "latency":
                out.pop("exchange_latency", None)  # a measured exchange alpha belongs to the profiled cluster
    if args.gpus_per_machine is not None:
        if args.gpus_per_machine < 1:
            raise ValueError(f"--gpus-per-machine must be >= 1, got {args.gpus_per_machine}")
        out["gpus_per_machine"] = args.gpus_per_machine
    return out


def report(argv: Sequence[str]) -> str:
    """The tool's output as text (raises ValueError on bad input, naming the argument)."""
    args = _parser().parse_args(argv)
    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    lines = []
    if args.profile is not None:
        profile = Profile.load(args.profile)
        profile = replace(profile, network=_network(args, profile.network))
        if args.workers is not None and args.workers != profile.world_size:
            lines.append(f"(profiled at {profile.world_size} workers; planned for {args.workers})")
            profile = replace(profile, world_size=args.workers, step_s=None)
    else:
        from hydra.utils import instantiate

        cfg = _load_config("model", args.model)
        cfg.data_seed = 0
        module = instantiate(cfg)
        network = _network(args, {"bandwidth": "1gbit", "latency": "100us", "gpus_per_machine": 1})
        try:
            compressor = build_compressor(args.compressor)
        except ValueError as exc:
            raise ValueError(f"--compressor {args.compressor!r}: {exc}") from None
        memory = build_memory(args.memory, compressor)
        profile = profile_model(module, compressor, memory, args.steps, args.workers or 2, network)
        if args.save is not None:
            lines.append(f"profile saved to {profile.save(args.save)}")
    model = cost_model(profile)
    option = configured_option(model, args.comm, args.hierarchical)
    plans = []
    if args.system in ("cupcake", "both"):
        plans.append(cupcake_plan(profile, model, option))
    if args.system in ("espresso", "both"):
        plans.append(espresso_plan(profile, model, cupcake_option=option, offload=args.offload, fuse=not args.no_fuse))
    for plan in plans:
        lines += ["", plan.describe(limit=None if args.all else 40)]
    if args.json is not None:
        args.json.write_text(json.dumps({p.system: p.to_dict() for p in plans}, indent=1))
        lines.append(f"plans written to {args.json}")
    return "\n".join(lines).lstrip("\n")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        print(report(sys.argv[1:] if argv is None else argv))
    except (ValueError, FileNotFoundError) as exc:
        print(f"plan: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
