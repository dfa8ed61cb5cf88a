"""Shared by the store tests: the start time, the traffic classes and the store factory type."""

from __future__ import annotations

from collections.abc import Callable

from kvstore.shard_store import ShardStore
from tests.kvstore.node_harness import DAY_S
from ttl.policy import TrafficClasses

T0 = 1_000 * DAY_S
CLASSES = TrafficClasses({"chat": 7 * DAY_S, "agent": 3 * DAY_S, "pinned": float("inf")})

MakeStore = Callable[..., ShardStore]  # make_store(**node_or_ttl_fields) -> an open store
