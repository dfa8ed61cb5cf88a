"""How repair sees a group: every member's listing of it, paged and merged into key order, and
the members' entries of one key (a hint's look, a repair write's confirmation). The repair
service (repair_service.py) plans and rebuilds from what these return.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from kvstore.errors import KVStoreError
from kvstore.node.peers import Peers
from kvstore.node.repair import Listed
from kvstore.proto import kvstore_pb2 as pb
from kvstore.store.index_codec import tenant_hash

log = logging.getLogger(__name__)

LIST_PAGE = 512
_U32_BYTES = 4


@dataclass
class _GroupListing:
    """One member's paged listing of a group, consumed in key order."""

    node_id: str
    position: int
    after: bytes = b""
    buffer: list[pb.ListedShard] = field(default_factory=list)
    done: bool = False


async def list_group(
    peers: Peers, group: int, members: Sequence[str]
) -> AsyncIterator[tuple[str, bytes, list[Listed], list[int]]]:
    """(tenant, key, every member's entries of it, positions up) for each key of a group,
    in key order, merging the members' paged listings."""
    listings = [_GroupListing(node_id, p) for p, node_id in enumerate(members)]
    up = list(range(len(members)))
    while True:
        for listing in listings:
            needs_page = not listing.done and len(listing.buffer) < LIST_PAGE // 2
            if needs_page and not await _fetch_page(peers, group, listing):
                up = [p for p in up if p != listing.position]
        pending = [listing for listing in listings if not listing.done and listing.buffer]
        bound = min((_sort_key(listing.buffer[-1]) for listing in pending), default=None)
        by_key: dict[tuple[bytes, bytes, str], list[Listed]] = {}
        for listing in listings:
            keep = []
            for shard in listing.buffer:
                sort_key = _sort_key(shard)
                if bound is not None and sort_key >= bound:
                    keep.append(shard)
                    continue
                by_key.setdefault(sort_key, []).append(listed_entry(listing.position, shard))
            listing.buffer = keep
        for (_, key, tenant), entries in sorted(by_key.items()):
            yield tenant, key, entries, up
        if all(listing.done and not listing.buffer for listing in listings):
            return


async def _fetch_page(peers: Peers, group: int, listing: _GroupListing) -> bool:
    """Append the member's next page; False (and done) if the member does not answer."""
    try:
        reply = await peers.list_shards(listing.node_id, group, listing.after, LIST_PAGE)
    except KVStoreError as exc:
        log.info("repair: %s did not list group %d: %s", listing.node_id, group, exc)
        listing.done = True
        return False
    listing.buffer.extend(reply.shards)
    listing.after = reply.next_after
    listing.done = not reply.next_after
    return True


async def list_key(
    peers: Peers,
    group: int,
    positioned: Sequence[tuple[int, str]],
    tenant: str,
    key: bytes,
) -> dict[int, list[pb.ListedShard]]:
    """Each answering member's entries of (tenant, key), by its position in the group (in the
    order of ``positioned``: (position, node id) pairs); a member that did not answer is absent."""
    start_after = group.to_bytes(_U32_BYTES, "big") + tenant_hash(tenant) + key
    replies = await asyncio.gather(
        *(peers.list_shards(m, group, start_after, 8) for _, m in positioned),
        return_exceptions=True,
    )
    return {
        position: [s for s in reply.shards if s.key == key and s.tenant == tenant]
        for (position, _), reply in zip(positioned, replies, strict=True)
        if not isinstance(reply, BaseException)
    }


def _sort_key(shard: pb.ListedShard) -> tuple[bytes, bytes, str]:
    """A listed entry's place in a group's key order (tenant hash, key: the nodes' order)."""
    return (tenant_hash(shard.tenant), shard.key, shard.tenant)


def listed_entry(position: int, shard: pb.ListedShard) -> Listed:
    """A member's listed entry as the repair planner takes it (kvstore/node/repair.py)."""
    return Listed(
        position=position,
        version=shard.version,
        shard_index=shard.shard_index,
        written_at_s=shard.written_at_s,
        expires_at_s=shard.expires_at_s,
        traffic_class=shard.traffic_class,
        shard_bytes=shard.shard_bytes,
    )
