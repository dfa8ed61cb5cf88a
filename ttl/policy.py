"""Traffic classes, TTL math and eviction order: pure functions of ``now`` and metadata.

Semantics (the store and the simulator share them):

* Each block belongs to one traffic class; its TTL comes from the class (``chat`` 7 days and
  ``agent`` 3 days by default; more classes by configuration). An unknown class is an error.
* The TTL counts from the last access: a write or a read hit sets ``last_access_s``; an
  existence check (``contains``, ``match_prefix``) does not.
* ``expires_at_s = last_access_s + ttl_s``. A block is expired when ``now_s >= expires_at_s``:
  a block touched exactly at its expiry instant is already gone (a miss), and the touch
  re-inserts it as a new block.
* Under capacity pressure blocks are evicted least recently accessed first
  (``EvictionOrder.LRU``, ``DEFAULT_EVICTION_ORDER``), whatever their class.
  ``EvictionOrder.EXPIRY`` (earliest expiry first) is the other choice
  (``[ttl] eviction_order`` in cluster.toml, ``kvstore sim --policy``). Blocks of a class with
  an infinite TTL come after every expirable block in both orders (the store never evicts them).

Why LRU is the default: under earliest-expiry-first, a block an agent session (3-day TTL) wrote
a moment ago expires sooner than a chat block (7-day TTL) last touched 4 days ago, so under
pressure the agent blocks go first, including those the current request just wrote, and agent
traffic stops hitting at all. On a 14-day generated workload LRU costs chat about a point of
its hit ratio and wins by far overall (docs/design-measurements.md has the table and the
commands); the class TTLs still bound how long any block lives.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from ttl.errors import UnknownTrafficClass
from ttl.units import DAY_S

DEFAULT_CLASS_TO_TTL_S: dict[str, float] = {"chat": 7 * DAY_S, "agent": 3 * DAY_S}


class EvictionOrder(enum.Enum):
    EXPIRY = "expiry"  # earliest expiry first
    LRU = "lru"  # least recently accessed first: the default (module docstring)

    def priority(self, last_access_s: float, expires_at_s: float) -> float:
        """Smaller value = evicted sooner; a block that never expires comes last (``inf``)."""
        if self is EvictionOrder.EXPIRY or math.isinf(expires_at_s):
            return expires_at_s
        return last_access_s


DEFAULT_EVICTION_ORDER = EvictionOrder.LRU


@dataclass(frozen=True)
class TrafficClasses:
    """The configured traffic classes and their TTLs (``math.inf`` = never expires)."""

    class_to_ttl_s: Mapping[str, float] = field(
        default_factory=lambda: dict(DEFAULT_CLASS_TO_TTL_S)
    )

    def __post_init__(self) -> None:
        if not self.class_to_ttl_s:
            raise ValueError("at least one traffic class is needed, e.g. {'chat': 604800}")
        for name, ttl_s in self.class_to_ttl_s.items():
            if not re.fullmatch(r"[a-z][a-z0-9_-]{0,31}", name):
                raise ValueError(f"traffic class name {name!r}: use 1-32 chars of [a-z0-9_-]")
            if not ttl_s > 0:
                raise ValueError(f"TTL of class {name!r} must be > 0 seconds, got {ttl_s}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.class_to_ttl_s)

    def ttl_s(self, traffic_class: str) -> float:
        try:
            return self.class_to_ttl_s[traffic_class]
        except KeyError:
            raise UnknownTrafficClass(
                f"unknown traffic class {traffic_class[:64]!r}"  # a bounded echo of the input
                f"{'...' if len(traffic_class) > 64 else ''}; configured classes: "
                f"{', '.join(self.names)} (add it under [ttl.classes] in cluster.toml)"
            ) from None

    def check(self, traffic_class: str) -> str:
        """Return ``traffic_class`` if it is configured, else raise UnknownTrafficClass."""
        self.ttl_s(traffic_class)
        return traffic_class

    def expires_at_s(self, traffic_class: str, last_access_s: float) -> float:
        return last_access_s + self.ttl_s(traffic_class)


def is_expired(expires_at_s: float, now_s: float) -> bool:
    """Expired at and after the expiry instant (see the module docstring)."""
    return now_s >= expires_at_s


@dataclass(frozen=True)
class Retention:
    """Class TTLs with per-tenant caps: a tenant's TTL in a class is the smaller of the two.

    A cap (``max_ttl_s`` in the nodes' credentials file) lets an operator hold one tenant's
    data shorter than the class allows (a data rule, not a hit-rate choice). Like every TTL
    it counts from the last access.
    """

    classes: TrafficClasses = field(default_factory=TrafficClasses)
    tenant_to_max_ttl_s: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    def ttl_s(self, tenant: str, traffic_class: str) -> float:
        ttl_s = self.classes.ttl_s(traffic_class)
        cap_s = self.tenant_to_max_ttl_s.get(tenant, {}).get(traffic_class, math.inf)
        return min(ttl_s, cap_s)

    def expires_at_s(self, tenant: str, traffic_class: str, last_access_s: float) -> float:
        return last_access_s + self.ttl_s(tenant, traffic_class)
