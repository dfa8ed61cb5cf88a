"""Traffic classes, TTL and eviction policies, clocks, and the hit-rate simulator.

The policy objects here are pure: they take ``now`` and an entry's metadata as arguments and
never read a clock. The storage node and the simulator call the same objects.
"""

from ttl.clock import Clock, ManualClock, RealClock, ScaledClock
from ttl.policy import DEFAULT_CLASS_TO_TTL_S, EvictionOrder, TrafficClasses, is_expired
from ttl.units import parse_duration_s, parse_size_bytes

__all__ = [
    "DEFAULT_CLASS_TO_TTL_S",
    "Clock",
    "EvictionOrder",
    "ManualClock",
    "RealClock",
    "ScaledClock",
    "TrafficClasses",
    "is_expired",
    "parse_duration_s",
    "parse_size_bytes",
]
