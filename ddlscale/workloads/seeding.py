"""Derived RNG seeds for auxiliary random streams.

torch's CPU generator (mt19937) keeps only the low 32 bits of ``manual_seed``, so packing several
numbers into one seed with shifts silently aliases them. Hash them into 32 bits instead.
"""

from __future__ import annotations

_MASK64 = (1 << 64) - 1


def derive_seed(*parts: int) -> int:
    """A well-mixed 32-bit seed from integers, stable across processes and Python versions."""
    state = 0x9E3779B97F4A7C15
    for part in parts:
        state = _splitmix64((state ^ (part & _MASK64)) & _MASK64)
    return state & 0xFFFFFFFF


def _splitmix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)
