"""The shards of one batch read, tallied in numpy per node answer: Python per answer, not per shard.

A healthy batch read gets, for every key, shards of ONE version from 11 nodes. Counting them
needs no object per shard: per key, the version seen first, a bit mask of the shard indexes
held of it (and of those at their place in the caller's block), and the count.
:class:`ShardTable` keeps those as arrays and updates them with a few numpy operations per
answer::

    answer's HIT rows -> key position, shard index, version (the table's columns)
       header fits the codec, transport did not reject it      else: corrupt, counted
       key seen with another version in this read, or twice     -> the key's ShardCollector
         in this answer (a node holding two versions)              (client/shard_tally.py),
                                                                   its earlier rows replayed
       otherwise                                                 -> masks and counts, here

The slow path is exact: a key that leaves the fast path gets a :class:`ShardCollector` fed
every row of it so far, in arrival order, so it holds what a per-shard tally would. Shard
objects (header and payload views) are built only for keys that need them: a parity rebuild,
a recheck after a block checksum failure, or a payload to copy into place.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from client.shard_tally import ShardCollector
from erasure.codec import Codec
from erasure.shard import BACKEND_IDS, FORMAT_VERSION, MAGIC, Shard, ShardHeader, SplitShard
from kvstore.wire import batch_answer

_MAGIC = int.from_bytes(MAGIC, "little")
_HEADER_START = batch_answer.ENTRY_BYTES - 48  # the shard header's place in an entry


def headers_fit(codec: Codec, hits: np.ndarray) -> np.ndarray:
    """Per HIT entry, whether its shard header is one of this codec's (one numpy pass)."""
    return (
        (hits["magic"].view("<u4") == _MAGIC)
        & (hits["format"] == FORMAT_VERSION)
        & (hits["backend"] == BACKEND_IDS[codec.backend])
        & (hits["k"] == codec.k)
        & (hits["m"] == codec.m)
        & (hits["shard_index"] < codec.k + codec.m)
        & (hits["payload_len"] == (hits["block_len"] + (codec.k - 1)) // codec.k)
    )


def row_header(codec: Codec, hit: np.void) -> ShardHeader:
    """The shard header of one HIT entry whose fields fit the codec."""
    return ShardHeader(
        codec.backend,
        codec.k,
        codec.m,
        int(hit["shard_index"]),
        int(hit["block_len"]),
        hit["version"].tobytes(),
        int(hit["payload_len"]),
    )


@dataclass
class TallyRows:
    """One answer's HIT rows as the table took them (``payload(row)``: the row's payload)."""

    hits: np.ndarray  # the HIT entries
    positions: np.ndarray  # per HIT row: its key's batch position
    fast: np.ndarray  # per HIT row: tallied here (not corrupt, not by a collector)
    payload: Callable[[int], memoryview]


class ShardTable:
    """Per key of a batch read of ``num_keys`` keys: the shards landed, by version."""

    def __init__(self, codec: Codec, num_keys: int) -> None:
        self.codec, self.k = codec, codec.k
        self.has_version = np.zeros(num_keys, bool)
        self.version = np.zeros(num_keys, "V16")
        self.block_len = np.zeros(num_keys, np.int64)
        self.payload_len = np.zeros(num_keys, np.int64)
        self.mask = np.zeros(num_keys, np.uint64)  # shard indexes held of the version
        self.placed_mask = np.zeros(num_keys, np.uint64)  # ... of which at their place
        # Codes of more than 64 shards (k + m may reach 255) take the per-shard path.
        self._masks_fit = codec.k + codec.m <= 64
        self.count = np.zeros(num_keys, np.int32)
        self.corrupt = np.zeros(num_keys, np.int32)
        self.collectors: dict[int, ShardCollector] = {}  # keys off the fast path
        self._rows: list[TallyRows] = []

    def add(
        self,
        hits: np.ndarray,
        positions: np.ndarray,
        valid: np.ndarray,
        in_place: np.ndarray,
        payload: Callable[[int], memoryview],
    ) -> list[tuple[int, bytes]]:
        """Tally one answer's HIT rows (``positions``: each row's batch position; ``valid``:
        its header fits; ``in_place``: it landed at its place; no shard checksum checked yet:
        the block's check comes first). Returns (position, version) of
        the keys whose version reached k shards with this answer, in row order."""
        rows = valid.nonzero()[0]
        if len(rows) < len(valid):
            self.corrupt += np.bincount(positions[~valid], minlength=len(self.corrupt)).astype(
                np.int32
            )
        pos = positions[rows]
        # Off the fast path: a key with another version than its first, or twice in this
        # answer (a node holding two versions), and keys already off it.
        clash = self.has_version[pos] & (self.version[pos] != hits["version"][rows])
        off = set(pos[clash].tolist()) if clash.any() else set()
        listed = pos.tolist()
        if not self._masks_fit:
            off |= set(listed)
        if len(set(listed)) < len(listed):
            off |= {p for p, n in Counter(listed).items() if n > 1}
        if off - self.collectors.keys():
            self._leave_fast_path(sorted(off - self.collectors.keys()))
        slow = np.isin(pos, np.fromiter(self.collectors, np.int64, len(self.collectors)))
        fast_rows = rows[~slow]
        done = self._add_fast(hits, fast_rows, positions[fast_rows], in_place)
        fast_all = np.zeros(len(hits), bool)
        fast_all[fast_rows] = True
        self._rows.append(TallyRows(hits, positions, fast_all, payload))
        for row in rows[slow].tolist():
            position = int(positions[row])
            shard = self._shard(hits, row, payload)
            version = self.collectors[position].add_verified(shard[0], shard[1], checked=False)
            if version is not None:
                done.append((position, version))
        return done

    def _add_fast(
        self,
        hits: np.ndarray,
        rows: np.ndarray,
        pos: np.ndarray,
        in_place: np.ndarray,
    ) -> list[tuple[int, bytes]]:
        fresh = ~self.has_version[pos]
        if fresh.any():
            new_pos, new_rows = pos[fresh], rows[fresh]
            self.has_version[new_pos] = True
            self.version[new_pos] = hits["version"][new_rows]
            self.block_len[new_pos] = hits["block_len"][new_rows]
            self.payload_len[new_pos] = hits["payload_len"][new_rows]
        bits = np.left_shift(np.uint64(1), hits["shard_index"][rows].astype(np.uint64))
        new = (self.mask[pos] & bits) == 0  # a second shard of an index is ignored
        pos, rows, bits = pos[new], rows[new], bits[new]
        self.mask[pos] |= bits
        self.placed_mask[pos] |= np.where(in_place[rows], bits, np.uint64(0))
        self.count[pos] += 1
        reached = pos[self.count[pos] == self.k]
        return [(p, self.version[p].tobytes()) for p in reached.tolist()]

    def _shard(
        self, hits: np.ndarray, row: int, payload: Callable[[int], memoryview]
    ) -> tuple[ShardHeader, Shard]:
        raw = hits[row : row + 1].tobytes()
        return row_header(self.codec, hits[row]), SplitShard(raw[_HEADER_START:], payload(row))

    def collectors_for(self, positions: Sequence[int]) -> dict[int, ShardCollector]:
        """The collectors of ``positions``: those still on the fast path get one, fed every
        shard of theirs tallied so far, in arrival order (one pass over the answers for all
        of them: a parity rebuild of many keys after a node was lost)."""
        todo = [p for p in dict.fromkeys(positions) if p not in self.collectors]
        if todo:
            self._leave_fast_path(todo)
        return {p: self.collectors[p] for p in positions}

    def _leave_fast_path(self, positions: list[int]) -> None:
        wanted = np.asarray(positions, np.int64)
        for position in positions:
            collector = self.collectors[position] = ShardCollector(self.codec)
            collector.num_corrupt = int(self.corrupt[position])
        self.corrupt[wanted] = 0
        for answer in self._rows:
            rows = (answer.fast & np.isin(answer.positions, wanted)).nonzero()[0]
            for row in rows.tolist():
                header, shard = self._shard(answer.hits, row, answer.payload)
                self.collectors[int(answer.positions[row])].add_verified(
                    header, shard, checked=False
                )
        self.has_version[wanted] = False
        self.count[wanted] = 0
        self.mask[wanted] = self.placed_mask[wanted] = 0

    # What the rest of the read asks of a key: the same answers for both paths.

    def best_count(self, position: int) -> int:
        collector = self.collectors.get(position)
        return collector.best_count if collector is not None else int(self.count[position])

    def lengths(self, position: int, version: bytes) -> tuple[int, int]:
        """(block_len, payload_len) of the key's ``version``."""
        collector = self.collectors.get(position)
        if collector is not None:
            header = collector.version_to_header[version]
            return header.block_len, header.payload_len
        return int(self.block_len[position]), int(self.payload_len[position])

    def indexes(self, position: int, version: bytes) -> set[int]:
        """The shard indexes held of the key's ``version``."""
        collector = self.collectors.get(position)
        if collector is not None:
            return set(collector.version_to_shards.get(version, {}))
        if not self.has_version[position] or self.version[position].tobytes() != version:
            return set()
        return _bits(int(self.mask[position]))

    def other_indexes(self, position: int, version: bytes) -> set[int]:
        """The shard indexes held of the key's other versions."""
        collector = self.collectors.get(position)
        if collector is None:
            return set()
        return {
            index
            for v, shards in collector.version_to_shards.items()
            if v != version
            for index in shards
        }

    def placed(self, position: int, version: bytes, num_data_shards: int) -> list[bool] | None:
        """Per data shard, whether one of ``version`` is at its place; None: the key is
        off the fast path (ask its collector's shards)."""
        if position in self.collectors:
            return None
        mask = int(self.placed_mask[position])
        return [bool(mask >> i & 1) for i in range(num_data_shards)]

    def num_corrupt(self) -> int:
        return int(self.corrupt.sum()) + sum(c.num_corrupt for c in self.collectors.values())


def _bits(mask: int) -> set[int]:
    return {i for i in range(mask.bit_length()) if mask >> i & 1}
