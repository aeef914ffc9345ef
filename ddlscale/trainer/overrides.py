"""Command-line overrides Hydra cannot apply, refused the way ddlscale refuses any bad config: one line
naming the key, with the closest known key or option (``sync.bukcet_mb=1``: did you mean
``sync.bucket_mb``?), instead of Hydra's message and its advice to add the key with ``+``.

Hydra composes the config before the app runs and prints its own errors; it lets them through to the
caller only under ``HYDRA_FULL_ERROR=1`` (its documented switch). :func:`refusing_bad_overrides` sets it
around the app, and :func:`composed`, called first thing in the app, puts it back: an error of the run
itself is then reported as Hydra reports it, and no worker inherits the switch.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

from hydra.errors import CompactHydraException, MissingConfigException, OverrideParseException

from ddlscale.schema import did_you_mean
from ddlscale.trainer import schemas

FULL_ERROR = "HYDRA_FULL_ERROR"
_set_here = False  # this process set FULL_ERROR (the user had not)


@contextlib.contextmanager
def refusing_bad_overrides() -> Iterator[None]:
    """Around a Hydra app's main: a config Hydra cannot compose exits with ddlscale's refusal."""
    global _set_here
    _set_here = FULL_ERROR not in os.environ
    if _set_here:
        os.environ[FULL_ERROR] = "1"
    try:
        yield
    except CompactHydraException as exc:
        if not _set_here:
            raise  # the user asked for Hydra's whole error
        sys.exit(f"ddlscale: invalid config: {describe(exc)}")
    finally:
        composed()


def composed() -> None:
    """The config is composed: errors from here on are reported as Hydra reports them."""
    global _set_here
    if _set_here:
        os.environ.pop(FULL_ERROR, None)
        _set_here = False


def describe(exc: CompactHydraException) -> str:
    """Hydra's composition error as one refusal naming what the user typed."""
    if isinstance(exc, MissingConfigException) and exc.options and exc.missing_cfg_file:
        group, _, option = exc.missing_cfg_file.rpartition("/")
        return (f"{group}={option}: no such option{did_you_mean(option, exc.options, f'{group}=')}; "
                f"{group} takes {', '.join(exc.options)}")
    key = getattr(exc.__cause__, "full_key", None)
    if not str(exc).startswith("Could not override") or not key:
        line = " ".join(str(exc).split())  # Hydra's message, on one line
        return f"{exc.override}: {line}" if isinstance(exc, OverrideParseException) else line
    group, _, name = key.partition(".")
    if not name:
        group, name, known = "", group, schemas.run_level_keys()
    elif group in schemas.run_level_keys() - {"trainer", "cluster", *schemas.GROUPS}:
        known = set()  # a run-level value has no keys
    else:
        name = name.split(".")[0]  # the group's own key (cluster.storage.bandwidth: storage)
        known = schemas.group_keys(group) if group in ("trainer", "cluster", *schemas.GROUPS) else set()
    if name in known:  # a key the selected option's file leaves out: Hydra's advice holds
        return f"{key}: not in the composed config; add it with {str(exc).rpartition(' use ')[2]}"
    return f"{key}: no such key{did_you_mean(name, known, f'{group}.' if group else '')}"
