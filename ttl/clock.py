"""Clocks: real time, or time scaled for experiments and tests.

Every process of a cluster derives the same virtual time from the same two numbers kept in
``cluster.toml``: the real Unix time the cluster was created (``origin_unix_s``) and the
``time_scale`` (virtual seconds per real second). With a scale of 86400 a virtual day passes
in one real second, and nodes and clients agree on "now" without talking to each other.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Current time in (virtual) Unix seconds."""
        ...


class RealClock:
    def now(self) -> float:
        return time.time()


class ScaledClock:
    """``now = origin + (real_now - origin) * time_scale``: virtual time runs X times faster."""

    def __init__(self, time_scale: float, origin_unix_s: float) -> None:
        if time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        self.time_scale = time_scale
        self.origin_unix_s = origin_unix_s

    def now(self) -> float:
        return self.origin_unix_s + (time.time() - self.origin_unix_s) * self.time_scale

    def real_seconds(self, virtual_s: float) -> float:
        """How long a virtual duration takes in real seconds (for sleeps in tests)."""
        return virtual_s / self.time_scale


class ManualClock:
    """A clock that moves only when told to: for unit tests of time-dependent code."""

    def __init__(self, start_s: float = 0.0) -> None:
        self._now_s = start_s

    def now(self) -> float:
        return self._now_s

    def advance(self, seconds: float) -> None:
        self._now_s += seconds


def make_clock(time_scale: float, origin_unix_s: float) -> Clock:
    """The clock a cluster configuration asks for: real when the scale is 1."""
    if time_scale == 1.0:
        return RealClock()
    return ScaledClock(time_scale, origin_unix_s)
