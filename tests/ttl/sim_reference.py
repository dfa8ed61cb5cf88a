"""A deliberately naive simulator (dict scans, no queues) to check ``ttl.simulator`` against.

It follows the module docstring of ``ttl.simulator`` literally; speed is not a goal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ttl.partition import partition_capacity
from ttl.policy import EvictionOrder, is_expired
from ttl.traces import Trace


@dataclass
class _Block:
    class_index: int
    last_s: float
    last_request: int
    position: int  # first position in its last request
    born_s: float


_KEYS = (
    "requests",
    "blocks",
    "hit_blocks",
    "tokens",
    "tokens_saved",
    "input_tokens",
    "inserted_blocks",
    "written_blocks",
    "expired_blocks",
    "evicted_blocks",
    "peak_blocks",
    "block_seconds",
)


def reference_simulate(
    trace: Trace,
    ttl_by_class: dict[str, float],
    capacity_blocks: int | None,
    eviction: EvictionOrder,
    warmup_fraction: float = 0.0,
    group_of: Callable[[int], int] | None = None,
    num_groups: int = 1,
) -> dict[str, dict[str, float]]:
    """Per class and "all": the counters of ``ClassStats`` as a dict.

    With ``group_of`` the blocks live in ``num_groups`` placement groups, each with its share of
    the capacity (``ttl.partition.partition_capacity``) and evicting on its own; the prefix
    rule still spans the whole request."""
    sim = _Reference(trace, ttl_by_class, eviction, warmup_fraction)
    group_of = group_of or (lambda b: 0)
    for r, now in enumerate(sim.times):
        counted = now >= sim.window_s
        sim.expire(now, counted)
        blocks = trace.blocks(r).tolist()
        num_hit = next((i for i, b in enumerate(blocks) if b not in sim.state), len(blocks))
        num_new = sim.touch(r, blocks, now)
        for g in range(num_groups):
            limit = partition_capacity(capacity_blocks, num_groups, g)
            while limit is not None and sum(group_of(b) == g for b in sim.state) > limit:
                victim = min((b for b in sim.state if group_of(b) == g), key=sim.eviction_key)
                sim.die(victim, now, counted, "evicted")
        if counted:
            sim.count(r, blocks, num_hit, num_new)
    return sim.finish()


class _Reference:
    """The state of the naive simulation: every resident block in a dict, scanned in full."""

    def __init__(
        self,
        trace: Trace,
        ttl_by_class: dict[str, float],
        eviction: EvictionOrder,
        warmup_fraction: float,
    ) -> None:
        self.trace, self.eviction = trace, eviction
        self.names = trace.class_names
        self.ttls = [ttl_by_class[n] for n in self.names]
        self.times = trace.time_s.tolist()
        self.window_s = self.times[0] + warmup_fraction * (self.times[-1] - self.times[0])
        self.stats = {n: dict.fromkeys(_KEYS, 0) for n in (*self.names, "all")}
        self.state: dict[int, _Block] = {}

    def die(self, b: int, death_s: float, counted: bool, kind: str) -> None:
        blk = self.state.pop(b)
        if counted:
            name = self.names[blk.class_index]
            seconds = max(0.0, death_s - max(blk.born_s, self.window_s))
            self.stats[name]["block_seconds"] += seconds
            if kind == "evicted" or death_s >= self.window_s:
                self.stats[name][kind + "_blocks"] += 1

    def expire(self, now: float, counted: bool) -> None:
        """Every block whose expiry instant is <= now goes, dying at that instant."""
        for b in [b for b, blk in self.state.items() if is_expired(self.expires_s(blk), now)]:
            self.die(b, self.expires_s(self.state[b]), counted, "expired")

    def expires_s(self, blk: _Block) -> float:
        return blk.last_s + self.ttls[blk.class_index]

    def touch(self, r: int, blocks: list[int], now: float) -> int:
        """Insert request ``r``'s missing blocks, touch the rest; how many were inserted."""
        c, num_new = int(self.trace.class_ids[r]), 0
        for position, b in enumerate(blocks):
            blk = self.state.get(b)
            if blk is None:
                self.state[b] = _Block(c, now, r, position, now)
                num_new += 1
            elif blk.last_request != r:
                blk.last_s, blk.last_request, blk.position = now, r, position
        return num_new

    def eviction_key(self, b: int) -> tuple:
        blk = self.state[b]
        priority = self.eviction.priority(blk.last_s, self.expires_s(blk))
        return (priority, blk.class_index, blk.last_request, blk.position)

    def count(self, r: int, blocks: list[int], num_hit: int, num_new: int) -> None:
        trace, stats = self.trace, self.stats
        s = stats[self.names[int(trace.class_ids[r])]]
        bt, length = trace.block_tokens, int(trace.input_tokens[r])
        s["requests"] += 1
        s["blocks"] += len(blocks)
        s["hit_blocks"] += num_hit
        s["written_blocks"] += len(blocks) - num_hit
        s["tokens"] += int(trace.hashed_tokens[r])
        s["tokens_saved"] += min(num_hit * bt, length)
        s["input_tokens"] += length
        s["inserted_blocks"] += num_new
        for k, name in enumerate(self.names):
            live = sum(1 for blk in self.state.values() if blk.class_index == k)
            stats[name]["peak_blocks"] = max(stats[name]["peak_blocks"], live)
        stats["all"]["peak_blocks"] = max(stats["all"]["peak_blocks"], len(self.state))

    def finish(self) -> dict[str, dict[str, float]]:
        """Resident blocks count to the end; "all" sums the classes (but its own peak)."""
        stats, names = self.stats, self.names
        for blk in self.state.values():
            name = names[blk.class_index]
            stats[name]["block_seconds"] += self.times[-1] - max(blk.born_s, self.window_s)
        for key in _KEYS:
            if key != "peak_blocks":
                stats["all"][key] = sum(stats[n][key] for n in names)
        return stats
