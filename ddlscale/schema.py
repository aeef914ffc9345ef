"""Typed configs: a component's keys as a dataclass whose checks run when it is built.

A component (a sync backend, a checkpointer, the run itself) declares its keys once, as a
:class:`Schema` subclass: fields with their types and defaults, and ``check`` with every range and
choice. The component's constructor builds its schema, so a bad value is refused the same way from
Python and from a config; :mod:`ddlscale.trainer.schemas` registers every schema in Hydra's
ConfigStore and checks a composed config against them before any worker starts. A refusal is a
ValueError naming the full key and the values it takes (``sync.route must be one of auto, sparse;
got 'x'``).

The helpers below write those messages, so every component words a refusal alike.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable, Iterable
from typing import Any, ClassVar


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def integer(key: str, value: Any, least: int = 1, most: int | None = None, allow: Iterable[Any] = ()) -> Any:
    """``value`` if an integer in [least, most] (or one of ``allow``), else the refusal naming ``key``."""
    allow = tuple(allow)
    if any(value == a and type(value) is type(a) for a in allow):
        return value
    if not is_int(value) or value < least or (most is not None and value > most):
        wanted = f"an integer in [{least}, {most}]" if most is not None else f"an integer >= {least}"
        also = "".join(f" or {'null' if a is None else a}" for a in allow)
        raise ValueError(f"{key} must be {wanted}{also}, got {value!r}")
    return value


def number(key: str, value: Any, above: float | None = None, least: float | None = None,
           below: float | None = None, what: str = "a number") -> Any:
    """``value`` if a finite number in the bounds given (``above``/``below``: strict), else the refusal."""
    ok = is_number(value) and math.isfinite(value)
    ok = ok and (above is None or value > above) and (least is None or value >= least)
    ok = ok and (below is None or value < below)
    if not ok:
        bounds = [f"> {above}" if above is not None else "", f">= {least}" if least is not None else "",
                  f"< {below}" if below is not None else ""]
        wanted = " and ".join(b for b in bounds if b)
        raise ValueError(f"{key} must be {what}{' ' + wanted if wanted else ''}, got {value!r}")
    return value


def choice(key: str, value: Any, options: Iterable[Any]) -> Any:
    """``value`` if one of ``options``, else the refusal listing them."""
    options = tuple(options)
    if value not in options or isinstance(value, bool) != any(isinstance(o, bool) and o == value for o in options):
        listed = ", ".join("null" if o is None else str(o) for o in options)
        raise ValueError(f"{key} must be one of {listed}; got {value!r}")
    return value


def boolean(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {value!r}")
    return value


def did_you_mean(word: str, known: Iterable[str], prefix: str = "") -> str:
    """``" (did you mean <prefix>X?)"`` for the known word X closest to a misspelled one; "" when none
    is close."""
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def quantity(key: str, value: Any, parse: Callable[[Any], float]) -> float:
    """``parse(value)``; its complaint, prefixed with ``key``, if it cannot."""
    try:
        return parse(value)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{key}: {exc}") from None


@dataclasses.dataclass
class Schema:
    """Base of the typed configs. ``group`` prefixes every key a refusal names (``sync.``)."""

    group: ClassVar[str] = ""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Refuse any value no run can use; subclasses call ``super().check()`` first."""

    def key(self, name: str) -> str:
        return f"{self.group}.{name}" if self.group else name

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def of(cls, values: dict[str, Any]):
        """The schema of the keys among ``values`` it declares (a subclass's own keys are its own)."""
        names = set(cls.keys())
        return cls(**{k: v for k, v in values.items() if k in names})
