"""One block's rebuild: read k verified shards of the planned version from its holders,
decode, encode again as the writer did, and put each missing shard on its member, all at the
repair rate (a token bucket over bytes read and written)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from erasure.codec import Codec
from erasure.shard import parse_header
from kvstore.errors import CodecError, KVStoreError
from kvstore.node.peers import Peers
from kvstore.node.repair import BlockPlan
from kvstore.node.repair_backlog import RateMeter, TokenBucket
from kvstore.proto import kvstore_pb2 as pb

log = logging.getLogger(__name__)


class Throttle:
    """:meth:`spend` waits until the rate allows ``num_bytes`` more (a TokenBucket)."""

    def __init__(self, bytes_per_s: float) -> None:
        self.bytes_per_s = bytes_per_s
        self._bucket = TokenBucket(bytes_per_s, time.monotonic())

    async def spend(self, num_bytes: int) -> None:
        if (wait_s := self._bucket.take(num_bytes, time.monotonic())) > 0:
            await asyncio.sleep(wait_s)


class Rebuilder:
    """Rebuilds planned blocks; ``count(**deltas)`` adds to the service's RepairStats
    (read_bytes, rebuilt_shards, rebuilt_bytes, fenced) as the bytes move."""

    def __init__(
        self, codec: Codec, throttle: Throttle, rate: RateMeter, count: Callable[..., None]
    ) -> None:
        self._codec = codec
        self._throttle = throttle
        self._rate = rate
        self._count = count

    async def rebuild(self, peers: Peers, members: Sequence[str], plan: BlockPlan) -> int:
        """Rebuild ``plan``'s missing shards and store each on its member; return how many
        members answered (stored it, held it already, hold a newer version, or fenced it)."""
        started_s = time.monotonic()
        read = await self._read_block(peers, members, plan)
        if read is None:
            return 0
        shards = self._encode_again(*read, plan.version)
        request = pb.PutShardsRequest(
            tenant=plan.tenant,
            traffic_class=plan.traffic_class,
            expires_at_s=plan.expires_at_s,
            repair=True,
        )
        num_answered = 0
        for position in plan.missing:
            await self._throttle.spend(len(shards[position]))
            try:
                reply = await _put(
                    peers, members[position], request, plan.key, shards[position], plan.written_at_s
                )
            except KVStoreError as exc:
                log.info("repair of %s on %s failed: %s", plan.key.hex(), members[position], exc)
                continue
            num_answered += 1
            self._count(
                rebuilt_shards=reply.num_stored,
                rebuilt_bytes=reply.num_stored * len(shards[position]),
                fenced=reply.num_fenced,
            )
        self._rate.add(plan.cost_bytes, time.monotonic() - started_s)
        return num_answered

    def _encode_again(self, block: bytes, keyed: bool, version: bytes) -> list[bytes]:
        """The shards of ``block`` at ``version``, as its writer encoded them: a keyed version
        (client/integrity.py) is carried as it is, since a node cannot compute it (encoding
        with the xxh3 version would make a version no member holds, and the members refuse
        it: repair confirmation)."""
        if not keyed:
            return self._codec.encode(block)
        spare = memoryview(bytearray(self._codec.spare_bytes(len(block))))
        pairs = self._codec.encode_into(block, spare, keyed_version=version)
        return [header + payload for header, payload in pairs]

    async def _read_block(
        self, peers: Peers, members: Sequence[str], plan: BlockPlan
    ) -> tuple[bytes, bool] | None:
        """The block, from k verified shards of the plan's version, and whether that version
        is keyed (None if they are gone).

        Asks k holders at once, and more holders only for those that fail.
        """
        shards: dict[int, bytes] = {}
        candidates = list(plan.holders)
        while len(shards) < plan.k and candidates:
            wave = candidates[: plan.k - len(shards)]
            candidates = candidates[len(wave) :]
            got = await asyncio.gather(
                *(self._survivor(peers, members[p], p, plan) for p in wave),
                return_exceptions=True,
            )
            shards.update({p: g for p, g in zip(wave, got, strict=True) if isinstance(g, bytes)})
        if len(shards) < plan.k:
            return None
        try:
            # digest=None: a keyed version (client/integrity.py) is the tenant's to check; the
            # shard checksums verified in _survivor guard what is rebuilt here.
            survivors = [shards[p] for p in sorted(shards)]
            block = bytes(self._codec.decode(survivors, verified=True, digest=None))
        except CodecError as exc:
            log.warning("repair of %s: survivors do not decode: %s", plan.key.hex(), exc)
            return None
        return block, parse_header(survivors[0]).keyed

    async def _survivor(
        self, peers: Peers, node_id: str, position: int, plan: BlockPlan
    ) -> bytes | None:
        """The plan's version's shard from one holder, verified, or None."""
        try:
            shard = await peers.get_shard(node_id, plan.tenant, plan.key, plan.version)
        except KVStoreError:
            return None
        await self._throttle.spend(len(shard))
        self._count(read_bytes=len(shard))
        try:
            header = self._codec.verify(shard)
        except CodecError:
            return None
        if header.block_checksum != plan.version or header.index != position:
            return None
        return shard


async def _put(
    peers: Peers,
    node_id: str,
    template: pb.PutShardsRequest,
    key: bytes,
    shard: bytes,
    written_at_s: float,
) -> pb.PutShardsReply:
    request = pb.PutShardsRequest()
    request.CopyFrom(template)
    return await peers.put_shards(node_id, request, [(key, shard, written_at_s)])
