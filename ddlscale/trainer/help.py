"""``python train.py --help``: every config group, each option with what it selects and its keys.

Written from the config files themselves (each option's header comment, its keys and defaults), so
the screen says what the files hold. Hydra shows it through its help template
(``ddlscale/conf/hydra/default.yaml``), which calls the ``ddlscale_options`` resolver registered here.
"""

from __future__ import annotations

import importlib.resources
import json
import textwrap
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from ddlscale.paths import CONF_DIR

GROUPS = {  # in the order a user picks them, with what the group decides
    "sync": "how gradients are synchronized across workers",
    "compressor": "gradient compressor, for sync=compress, espresso, cupcake",
    "memory": "error feedback for a compressor",
    "model": "workload (a LightningModule with deterministic synthetic data)",
    "ckpt": "checkpointing",
    "strategy": "Lightning strategy",
    "cluster": "where the workers run",
    "logger": "where per-step metrics go too (metrics.csv and summary.json are always written)",
    "trainer": "Lightning Trainer arguments, under their own names (trainer.max_steps=500)",
    "experiment": "presets that override the rest",
}
WIDTH, INDENT = 100, 20


def header_comment(path: Path) -> str:
    """An option file's leading comment, as one paragraph (up to an indented example line)."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        text = line[1:].strip()
        if text.startswith("@package"):
            continue
        if line.startswith("#   ") or not text:  # an example command, or the paragraph's end
            break
        lines.append(text)
    return " ".join(lines).removesuffix(" e.g.").removesuffix(",")  # cut before an example


def option_keys(path: Path, group: str) -> str:
    """``group.key=default`` for an option file's own keys (``_target_`` and Hydra's aside)."""
    try:
        node = OmegaConf.to_container(OmegaConf.load(path), resolve=False)  # ${seed} stays as written
    except Exception:  # a file OmegaConf cannot read alone: show no keys rather than fail the help
        return ""
    if "hydra" in node or "defaults" in node and not _bases(node["defaults"]):  # a package-global preset (cluster=slurm)
        node = node.get(group, {})
    elif "defaults" in node:  # an option extending shared keys (a sparse sync): theirs, then its own
        shared: dict[str, Any] = {}
        for base in _bases(node.pop("defaults")):
            shared.update(OmegaConf.to_container(OmegaConf.load(path.parents[1] / f"{base}.yaml"), resolve=False))
        node = {**shared, **node}
    return ", ".join(f"{group}.{key}={_show(value)}" for key, value in node.items() if key != "_target_")


def _bases(defaults: list[Any]) -> list[str]:
    """The configs an option's defaults list merges into its own package (``/base/x@_here_``)."""
    return [d.removeprefix("/").removesuffix("@_here_") for d in defaults
            if isinstance(d, str) and d.endswith("@_here_")]


def _show(value: Any) -> str:
    """A value as one would type it on the command line."""
    return json.dumps(value) if value in (None, "") or isinstance(value, bool | dict | list) else str(value)


def _wrap(text: str, first: str) -> list[str]:
    """``first`` in the left column, ``text`` wrapped beside it (below it when ``first`` is wider)."""
    lines = [first] if len(first) >= INDENT else []
    lines += textwrap.wrap(text, WIDTH, initial_indent=(first if not lines else "").ljust(INDENT),
                           subsequent_indent=" " * INDENT)
    return lines or [first]


def options_text(conf_dirs: list[Path] | None = None, chosen: dict[str, Any] | None = None) -> str:
    """The options screen: per group, each option (``*``: selected now) with its comment and keys."""
    dirs = conf_dirs or [CONF_DIR]
    chosen = chosen or {}
    out: list[str] = []
    for group, purpose in GROUPS.items():
        files = {p.stem: p for d in dirs for p in sorted((d / group).glob("*.yaml"))}
        if not files:
            continue
        out.append(f"{group}=<{'|'.join(files)}>   {purpose}")
        for name, path in files.items():
            mark = "*" if chosen.get(group) == name else " "
            out += _wrap(header_comment(path), f"  {mark} {name}")
            keys = option_keys(path, group)
            if keys:
                out += _wrap(f"keys: {keys}", "")
        out.append("")
    top = CONF_DIR / "config.yaml"
    out.append("run-level keys:")
    for line in top.read_text().splitlines():
        if not line.startswith(("#", " ", "-", "defaults")) and ":" in line:
            key, _, rest = line.partition(":")
            value, _, comment = rest.partition("#")
            out += _wrap(comment.strip(), f"  {key}={value.strip()}")
    return "\n".join(out).replace("$", "$$")  # Hydra fills the template with string.Template


def _resolver() -> str:
    """The options of the config being composed (its search path, its current choices)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return options_text()
    runtime = HydraConfig.get().runtime
    dirs = [d for d in map(_folder, runtime.config_sources) if d is not None]
    return options_text(dirs or None, dict(runtime.choices))


def _folder(source: Any) -> Path | None:
    """A config source's folder, if it has one: a ``file://`` source's path, a ``pkg://`` source's
    package (ddlscale's own configs are ``pkg://ddlscale.conf``; a user's may be either)."""
    if source.schema == "file":
        path = Path(source.path)
    elif source.schema == "pkg":
        try:
            path = Path(str(importlib.resources.files(source.path)))
        except (ModuleNotFoundError, TypeError, ValueError):
            return None
    else:
        return None
    return path if path.is_dir() else None


OmegaConf.register_new_resolver("ddlscale_options", _resolver, replace=True)
