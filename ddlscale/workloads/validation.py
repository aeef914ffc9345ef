"""Argument checks that name the offending Hydra key, so a bad config fails fast and readably."""

from __future__ import annotations

from collections.abc import Collection


def config_key(name: str) -> str:
    """Workload arguments live under ``model.`` in the Hydra config."""
    return f"model.{name}"


def require_int_at_least(name: str, value: object, minimum: int) -> int:
    # bool is an int subclass; ``batch_size=True`` is always a config mistake.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{config_key(name)} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{config_key(name)} must be >= {minimum}, got {value}")
    return value


def require_float_positive(name: str, value: object) -> float:
    if not _is_real(value) or not float(value) > 0.0:  # type: ignore[arg-type]
        raise ValueError(f"{config_key(name)} must be > 0, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def require_float_at_least(name: str, value: object, minimum: float) -> float:
    if not _is_real(value) or not float(value) >= minimum:  # type: ignore[arg-type]
        raise ValueError(f"{config_key(name)} must be >= {minimum}, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def require_choice(name: str, value: object, choices: Collection[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{config_key(name)} must be one of {sorted(choices)}, got {value!r}")
    return value


def require_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{config_key(name)} must be true or false, got {value!r}")
    return value


def _is_real(value: object) -> bool:
    # NaN fails every comparison above, so it is rejected by the callers' checks.
    return isinstance(value, (int, float)) and not isinstance(value, bool)
