"""Wait until every node of each key's group holds its shard: the precondition of a test that
then takes two nodes away (corrupts, hangs or kills them) and expects every block to read.

A put succeeds at its write quorum (11 of 12), and on a loaded machine the 12th shard may come
later, by repair (client/write_path.py): with two nodes gone, such a block has 9 good shards,
fewer than k, and reads as a miss by design, not by a fault of the read."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from client import KVClient
from kvstore.proto import kvstore_pb2 as pb


async def every_node_holds(toml: Path, keys: Iterable[bytes], timeout_s: float) -> None:
    """Return once each node of every key's group lists a shard of it (one InspectShards per
    node per round); fail naming the nodes still missing some at ``timeout_s``."""
    deadline_s = time.monotonic() + timeout_s
    async with KVClient.connect(toml, tenant="acme") as kv:
        node_to_keys: dict[str, list[bytes]] = defaultdict(list)
        for key in keys:
            for node in kv.config.groups[kv.placement.group_index(key)]:
                node_to_keys[node].append(key)
        while True:
            missing = await _nodes_missing_shards(kv, node_to_keys)
            if not missing:
                return
            assert time.monotonic() < deadline_s, f"repair never stored the shards on {missing}"
            await asyncio.sleep(0.5)


async def _nodes_missing_shards(kv: KVClient, node_to_keys: dict[str, list[bytes]]) -> list[str]:
    async def missing(node: str, keys: list[bytes]) -> bool:
        request = pb.InspectShardsRequest(tenant=kv.tenant, keys=keys)
        try:
            reply = await kv.conns[node].call("InspectShards", request, 60.0)
        except Exception:  # a node still starting: ask again next round
            return True
        return any(not result.shards for result in reply.results)

    nodes = sorted(node_to_keys)
    answers = await asyncio.gather(*(missing(n, node_to_keys[n]) for n in nodes))
    return [node for node, is_missing in zip(nodes, answers, strict=True) if is_missing]
