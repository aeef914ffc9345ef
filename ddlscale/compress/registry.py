"""The one registry of compressors: a name is its config file, ``ddlscale/conf/compressor/<name>.yaml``.

The file is where a name's class and settings are written, once: ``signum`` is SignSGD with
``momentum: 0.9`` there and nowhere else. :func:`build_compressor` builds a name from its file (the
same object ``compressor=<name>`` gives a run) or, given a dotted class path instead of a name, a
compressor defined outside this package; planners rebuild what they profiled with
:func:`class_path` and :func:`build_compressor`.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Any

from omegaconf import OmegaConf

from ddlscale.compress.compressor import Compressor
from ddlscale.paths import CONF_DIR

COMPRESSOR_CONF = CONF_DIR / "compressor"
NONE_TARGET = "ddlscale.compress.none.NoCompression"  # what ``_target_: null`` (compressor=none) runs


def class_path(compressor: Compressor | type[Compressor]) -> str:
    """``module.Class`` of a compressor: what :func:`build_compressor` takes to rebuild it."""
    cls = compressor if isinstance(compressor, type) else type(compressor)
    return f"{cls.__module__}.{cls.__qualname__}"


def _import(path: str) -> type[Compressor]:
    module, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"compressor: cannot import {path!r} ({exc})") from None
    if not (isinstance(cls, type) and issubclass(cls, Compressor)):
        raise ValueError(f"compressor: {path!r} is not a Compressor subclass")
    return cls


def preset(name: str) -> dict[str, Any]:
    """A name's file as plain values: ``_target_`` and the settings the name stands for."""
    path = COMPRESSOR_CONF / f"{name}.yaml"
    if "/" in name or not path.is_file():
        raise ValueError(f"compressor must be one of {', '.join(COMPRESSORS)}; got {name!r}")
    node = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    return {**node, "_target_": node.get("_target_") or NONE_TARGET}


class _Names(Mapping[str, type[Compressor]]):
    """Registered names and their classes, read from the config files on first use (the classes
    import this module: resolving them at import would be circular)."""

    def __init__(self) -> None:
        self._classes: dict[str, type[Compressor]] | None = None

    def _load(self) -> dict[str, type[Compressor]]:
        if self._classes is None:
            names = sorted(p.stem for p in COMPRESSOR_CONF.glob("*.yaml"))
            self._classes = {"none": _import(NONE_TARGET)}
            self._classes.update((n, _import(preset(n)["_target_"])) for n in names if n != "none")
        return self._classes

    def __getitem__(self, name: str) -> type[Compressor]:
        return self._load()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._load())

    def __len__(self) -> int:
        return len(self._load())


COMPRESSORS: Mapping[str, type[Compressor]] = _Names()


def build_compressor(name: str, **params: Any) -> Compressor:
    """The compressor ``name`` stands for, ``params`` over its file's settings; or, for a dotted
    ``module.Class`` path, that class built from ``params`` alone."""
    if "." in name:
        return _import(name)(**params)
    settings = preset(name)
    cls = _import(settings.pop("_target_"))
    return cls(**{**settings, **params})
