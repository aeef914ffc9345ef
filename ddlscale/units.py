"""Quantities with units, as configs and the command line write them: ``1gbit``, ``100us``.

tc's rate and time units, so a value reads the same in a config, on ``tc``'s command line and in a
paper. Every ``*bps`` here means bits per second, the way papers write link speeds ("25 Gbps"),
where tc itself reads "bps" as *bytes* per second. Scales are exact decimals, so "50us" parses to
the float nearest 5e-5 rather than to 50 * 1e-6.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal

_BANDWIDTH_UNITS = {
    "": "1", "bit": "1", "bps": "1",
    "kbit": "1e3", "mbit": "1e6", "gbit": "1e9", "tbit": "1e12",
    "kbps": "1e3", "mbps": "1e6", "gbps": "1e9", "tbps": "1e12",
    "kibit": "1024", "mibit": "1048576", "gibit": "1073741824", "tibit": "1099511627776",
}
_TIME_UNITS = {
    "": "1", "s": "1", "sec": "1", "secs": "1",
    "ms": "1e-3", "msec": "1e-3", "msecs": "1e-3",
    "us": "1e-6", "usec": "1e-6", "usecs": "1e-6",
    "ns": "1e-9", "nsec": "1e-9", "nsecs": "1e-9",
}
_QUANTITY = re.compile(r"\s*(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)\s*([a-zA-Z]*)\s*")


def _parse_quantity(text: str | float, units: dict[str, str], what: str) -> float:
    """A non-negative finite number, scaled by its (case-insensitive) unit suffix."""
    if isinstance(text, bool):
        raise ValueError(f"bad {what} {text!r}: expected a number with an optional unit")
    if isinstance(text, int | float):
        value = float(text)
    else:
        match = _QUANTITY.fullmatch(str(text))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in units:
            known = ", ".join(u for u in units if u)
            raise ValueError(f"bad {what} {text!r}: expected a number with an optional unit ({known})")
        value = float(Decimal(match.group(1)) * Decimal(units[unit]))
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"bad {what} {text!r}: must be a finite number >= 0")
    return value


def parse_bandwidth(text: str | float) -> float:
    """Bits per second from a tc-style rate: "1gbit", "100mbit", "500kbit", "25gbps", or a number.

    A plain number is bit/s. "kibit"/"mibit"/"gibit" are the binary (1024-based) units.
    """
    return _parse_quantity(text, _BANDWIDTH_UNITS, "bandwidth")


def parse_time(text: str | float) -> float:
    """Seconds from a tc-style duration: "50us", "2ms", "0.1s", or a number of seconds."""
    return _parse_quantity(text, _TIME_UNITS, "time")
