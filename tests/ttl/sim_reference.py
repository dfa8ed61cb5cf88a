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
    group_of = group_of or (lambda b: 0)
    names = trace.class_names
    ttls = [ttl_by_class[n] for n in names]
    times = trace.time_s.tolist()
    window_s = times[0] + warmup_fraction * (times[-1] - times[0])
    keys = (
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
    stats = {n: dict.fromkeys(keys, 0) for n in (*names, "all")}
    state: dict[int, _Block] = {}

    def die(b: int, death_s: float, counted: bool, kind: str) -> None:
        blk = state.pop(b)
        if counted:
            name = names[blk.class_index]
            seconds = max(0.0, death_s - max(blk.born_s, window_s))
            stats[name]["block_seconds"] += seconds
            if kind == "evicted" or death_s >= window_s:
                stats[name][kind + "_blocks"] += 1

    for r, now in enumerate(times):
        counted = now >= window_s
        c = int(trace.class_ids[r])
        for b in [
            b for b, blk in state.items() if is_expired(blk.last_s + ttls[blk.class_index], now)
        ]:
            blk = state[b]
            die(b, blk.last_s + ttls[blk.class_index], counted, "expired")
        blocks = trace.blocks(r).tolist()
        num_hit = 0
        for b in blocks:
            if b not in state:
                break
            num_hit += 1
        num_new = 0
        for position, b in enumerate(blocks):
            blk = state.get(b)
            if blk is None:
                state[b] = _Block(c, now, r, position, now)
                num_new += 1
            elif blk.last_request != r:
                blk.last_s, blk.last_request, blk.position = now, r, position
        for g in range(num_groups):
            limit = partition_capacity(capacity_blocks, num_groups, g)
            while limit is not None and sum(group_of(b) == g for b in state) > limit:

                def key(b: int) -> tuple:
                    blk = state[b]
                    expires = blk.last_s + ttls[blk.class_index]
                    priority = eviction.priority(blk.last_s, expires)
                    return (priority, blk.class_index, blk.last_request, blk.position)

                victim = min((b for b in state if group_of(b) == g), key=key)
                die(victim, now, counted, "evicted")
        if counted:
            s = stats[names[c]]
            bt, length = trace.block_tokens, int(trace.input_tokens[r])
            s["requests"] += 1
            s["blocks"] += len(blocks)
            s["hit_blocks"] += num_hit
            s["written_blocks"] += len(blocks) - num_hit
            s["tokens"] += int(trace.hashed_tokens[r])
            s["tokens_saved"] += min(num_hit * bt, length)
            s["input_tokens"] += length
            s["inserted_blocks"] += num_new
            for k, name in enumerate(names):
                live = sum(1 for blk in state.values() if blk.class_index == k)
                stats[name]["peak_blocks"] = max(stats[name]["peak_blocks"], live)
            stats["all"]["peak_blocks"] = max(stats["all"]["peak_blocks"], len(state))
    end_s = times[-1]
    for blk in state.values():
        stats[names[blk.class_index]]["block_seconds"] += end_s - max(blk.born_s, window_s)
    for key in keys:
        if key != "peak_blocks":
            stats["all"][key] = sum(stats[n][key] for n in names)
    return stats
