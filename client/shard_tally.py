"""Counting shards by block version: the pure core of reads and existence checks.

Two writers may store different bytes under one key, and a node may hold several versions of
a key at once. A block is only ever rebuilt from ``k`` shards of ONE version (the version is
the block's xxh3-128, recorded in every shard header), so both tallies here group by version.

* :class:`ShardCollector` takes shard bytes as they arrive for one key, verifies each one
  (``Codec.verify``: header fits the codec, shard checksum) or takes a shard whose checksum
  is left to the block's (``checked=False``: the one-pass read, client/batch_read.py), skips
  and counts bad ones, and says when some version has ``k`` distinct shard indices. After a
  block checksum failure :meth:`ShardCollector.recheck` finds the unchecked shards to blame.
* :class:`PresenceTally` takes per-node version lists from ``Contains`` replies for many keys
  and decides, key by key, whether some version is on at least ``k`` nodes.

Both can also tell early that the goal is out of reach: a node contributes at most one shard
per version, so with ``best`` shards of the leading version and ``pending`` nodes still to
answer, ``best + pending < k`` means no version can complete.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from erasure.codec import Codec
from erasure.shard import Shard, ShardHeader
from kvstore.errors import CodecError


def can_complete(best_count: int, num_pending: int, k: int) -> bool:
    """Whether some version can still reach ``k`` shards (one per pending node at most)."""
    return best_count + num_pending >= k


class ShardCollector:
    """Valid shards of one key grouped by version, until one version has ``k`` of them."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self.version_to_shards: dict[bytes, dict[int, Shard]] = {}
        self.version_to_header: dict[bytes, ShardHeader] = {}
        self.num_corrupt = 0
        self._dropped: set[bytes] = set()
        self._unchecked: dict[bytes, set[int]] = {}  # version -> indexes not checksummed
        self.best_count = 0  # shards held of the version with the most shards

    def add(self, shard: Shard) -> bytes | None:
        """Offer one shard; return its version if that version now has ``k`` shards.

        A shard that fails its checksum or does not fit the codec is counted in
        ``num_corrupt`` and ignored; a duplicate index of a version is ignored.
        """
        try:
            header = self.codec.verify(shard)
        except CodecError:
            self.num_corrupt += 1
            return None
        return self.add_verified(header, shard)

    def add_verified(
        self, header: ShardHeader, shard: Shard, *, checked: bool = True
    ) -> bytes | None:
        """:meth:`add` for a shard whose header the caller parsed and checked already
        (``header`` describes exactly these bytes); ``checked=False``: its shard checksum
        was not verified (the block checksum will be, and :meth:`recheck` after a failure)."""
        # Called per shard of a key off the batch read's fast path (client/shard_table.py).
        version, index = header.block_checksum, header.index
        shards = self.version_to_shards.get(version)
        if shards is None:
            if version in self._dropped:
                return None
            shards = self.version_to_shards[version] = {}
            self.version_to_header[version] = header
        elif index in shards:
            return None
        shards[index] = shard
        num_shards = len(shards)
        if num_shards > self.best_count:
            self.best_count = num_shards
        if not checked:
            unchecked = self._unchecked.get(version)
            if unchecked is None:
                unchecked = self._unchecked[version] = set()
            unchecked.add(index)
        return version if num_shards == self.codec.k else None

    def recheck(self, version: bytes) -> int:
        """Verify the shard checksums of ``version``'s unchecked shards and forget those that
        fail (counted in ``num_corrupt``); how many were dropped."""
        shards = self.version_to_shards.get(version, {})
        num_dropped = 0
        for index in sorted(self._unchecked.pop(version, ())):
            try:
                self.codec.verify(shards[index])
            except CodecError:
                del shards[index]
                num_dropped += 1
        self.num_corrupt += num_dropped
        self._recount()
        return num_dropped

    def shards(self, version: bytes) -> list[Shard]:
        """The collected shards of ``version``, by shard index (data shards first)."""
        index_to_shard = self.version_to_shards[version]
        return [index_to_shard[i] for i in sorted(index_to_shard)]

    def drop(self, version: bytes) -> None:
        """Forget a version that failed to decode, and ignore its shards from now on."""
        self._dropped.add(version)
        self.version_to_shards.pop(version, None)
        self._recount()

    def _recount(self) -> None:
        self.best_count = max((len(s) for s in self.version_to_shards.values()), default=0)


class PresenceTally:
    """Per key: is some version present on at least ``k`` of the nodes asked?"""

    def __init__(self, num_nodes_per_key: Sequence[int], k: int) -> None:
        self.k = k
        self.num_pending = list(num_nodes_per_key)
        self.version_counts: list[Counter[bytes]] = [Counter() for _ in num_nodes_per_key]
        self.readable: list[bool | None] = [None] * len(num_nodes_per_key)
        self.num_undecided = len(num_nodes_per_key)
        for position in range(len(num_nodes_per_key)):
            self._decide(position)

    def add_reply(self, position: int, versions: Sequence[bytes]) -> None:
        """One node answered for the key at ``position`` with the versions it holds."""
        self.version_counts[position].update(set(versions))
        self._node_finished(position)

    def add_no_reply(self, position: int) -> None:
        """One node failed to answer for the key at ``position``: it counts as absent."""
        self._node_finished(position)

    def _node_finished(self, position: int) -> None:
        self.num_pending[position] -= 1
        self._decide(position)

    def _decide(self, position: int) -> None:
        if self.readable[position] is not None:
            return
        best = max(self.version_counts[position].values(), default=0)
        if best >= self.k:
            self.readable[position] = True
        elif not can_complete(best, self.num_pending[position], self.k):
            self.readable[position] = False
        else:
            return
        self.num_undecided -= 1

    @property
    def all_decided(self) -> bool:
        return self.num_undecided == 0
