"""What a heterogeneous cluster keeps: a fill of blocks through per-node capacity eviction.

Pure code: no clock, no I/O, no kvstore imports (the caller places the blocks, with the same
placement the store uses: bench/capacity_fill_bench.py). It models what issue 38 measured on a
real cluster: each node holds one shard of every block of its groups, and evicts, past
``high_watermark`` of its capacity, its least recently written blocks down to
``low_watermark``, each for its whole group (kvstore/store/eviction.py: a block lives or dies
as a group). So the node that fills first, relative to its share, decides what the cluster
keeps; capacity-aware placement (kvstore/placement_weights.py) gives each node a share in
proportion to its capacity so that none fills first. A fill writes each block once, in order,
then every block is read once: the hit ratio is the fraction still held.

The planner's figure for the same effect is :func:`usable_fraction`: the share of the raw
capacity a cluster fills before its first node evicts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence


def fill_hit_ratio(
    node_capacity_shards: Sequence[int],
    group_members: Sequence[Sequence[int]],
    block_groups: Sequence[int],
    high_watermark: float = 0.95,
    low_watermark: float = 0.85,
) -> float:
    """Fraction of the blocks (``block_groups[i]``: block i's group, in write order) still
    held after the fill; nodes are indexes into ``node_capacity_shards``."""
    num_nodes = len(node_capacity_shards)
    held = [0] * num_nodes
    queues: list[deque[int]] = [deque() for _ in range(num_nodes)]
    alive = [True] * len(block_groups)
    high = [high_watermark * c for c in node_capacity_shards]
    low = [low_watermark * c for c in node_capacity_shards]
    for block, group in enumerate(block_groups):
        for node in group_members[group]:
            queues[node].append(block)
            held[node] += 1
        for node in group_members[group]:
            if held[node] > high[node]:
                _evict(node, low[node], queues, held, alive, group_members, block_groups)
    return sum(alive) / max(1, len(alive))


def _evict(
    node: int,
    low: float,
    queues: list[deque[int]],
    held: list[int],
    alive: list[bool],
    group_members: Sequence[Sequence[int]],
    block_groups: Sequence[int],
) -> None:
    """The node's oldest blocks go, each from every node of its group, until it is at low."""
    queue = queues[node]
    while held[node] > low and queue:
        block = queue.popleft()
        if not alive[block]:
            continue  # evicted earlier through another member: already uncounted here
        alive[block] = False
        for member in group_members[block_groups[block]]:
            held[member] -= 1


def usable_fraction(node_bytes: Mapping[str, float], node_shares: Mapping[str, float]) -> float:
    """Fraction of the nodes' total bytes a cluster fills before its first node is full:
    node ``n`` fills when the data reaches ``bytes_n / share_n`` (``share_n``: its fraction of
    all shards, kvstore/placement_weights.py ``share_report``). 1.0 when shares follow bytes."""
    total = sum(node_bytes.values())
    return min(node_bytes[n] / (share * total) for n, share in node_shares.items() if share > 0)
