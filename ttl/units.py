"""Sizes and durations as people write them, for every CLI flag and config value. Pure.

::

    parse_size_bytes("4MiB") -> 4194304      B; KiB MiB GiB TiB PiB (and K M G T P) are
    parse_size_bytes("500GB") -> 5 * 10**11   powers of 1024; kB/KB MB GB TB PB of 1000
    parse_duration_s("7d") -> 604800.0        s m h d w; a bare number is seconds; inf
    size_label(262144) -> "256KiB"            exact, for table rows and labels
    format_bytes(1.5 * 2**30) -> "1.5 GiB"    rounded, for people
    format_duration(259200) -> "3d"           exact, shortest unit
"""

from __future__ import annotations

import math
import re

DAY_S = 86_400.0
_SIZE_UNIT_TO_BYTES = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "kib": 2**10,
    "m": 2**20,
    "mib": 2**20,
    "g": 2**30,
    "gib": 2**30,
    "t": 2**40,
    "tib": 2**40,
    "p": 2**50,
    "pib": 2**50,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")
_DURATION_UNIT_TO_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": DAY_S, "w": 7 * DAY_S}
_DURATION_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([smhdw]?)\s*$")
_INFINITE = ("inf", "none", "never")


def parse_size_bytes(text: str | int) -> int:
    """A byte count from ``"4MiB"``, ``"500GB"``, ``"1.5TiB"`` or ``4096``; ValueError with
    the accepted forms otherwise."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"a size must be >= 0 bytes, got {text}")
        return text
    match = _SIZE_RE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNIT_TO_BYTES:
        raise ValueError(
            f"bad size {text!r}: use a number with B, KiB, MiB, GiB, TiB (powers of 1024) "
            "or kB, MB, GB, TB (powers of 1000), e.g. 4MiB or 500GB"
        )
    return int(float(match.group(1)) * _SIZE_UNIT_TO_BYTES[unit])


def parse_duration_s(text: str | float | int) -> float:
    """``"7d"`` -> 604800.0; ``"90m"``, ``"1.5h"``, ``"3600"`` (seconds); ``"inf"`` -> math.inf."""
    if isinstance(text, int | float):
        return float(text)
    if text.strip().lower() in _INFINITE:
        return math.inf
    match = _DURATION_RE.match(text)
    if not match:
        raise ValueError(
            f"bad duration {text!r}: expected a number with unit s, m, h, d or w "
            "(e.g. '7d', '90m') or 'inf'"
        )
    value, unit = match.groups()
    return float(value) * _DURATION_UNIT_TO_S[unit or "s"]


def size_label(num_bytes: int) -> str:
    """The exact size in the largest binary unit that divides it: 262144 -> "256KiB"."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale and num_bytes % scale == 0:
            return f"{num_bytes // scale}{unit}"
    return f"{num_bytes}B"


def format_bytes(num_bytes: float) -> str:
    """A size for people, in binary units with one decimal: 1610612736 -> "1.5 GiB"."""
    value, unit = float(num_bytes), "B"
    for larger in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024:
            break
        value, unit = value / 1024, larger
    return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"


def format_duration(seconds: float) -> str:
    """The shortest exact form of a duration: 604800 -> "1w", 259200 -> "3d", inf -> "inf"."""
    if math.isinf(seconds):
        return "inf"
    for unit, unit_s in (("w", 7 * DAY_S), ("d", DAY_S), ("h", 3600.0), ("m", 60.0)):
        if seconds >= unit_s and seconds % unit_s == 0:
            return f"{int(seconds // unit_s)}{unit}"
    return f"{seconds:g}s"
