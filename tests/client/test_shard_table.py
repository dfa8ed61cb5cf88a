"""The batch read's numpy tally (client/shard_table.py) against the per-shard one it replaces
(client/shard_tally.py's ShardCollector fed row by row): the same keys complete with the same
version at the same answer, the same best counts, held indexes and corrupt counts, and a key
taken off the fast path holds exactly the shards a per-shard tally would, in any arrival order
with second versions, repeated indexes, corrupt rows and several versions in one answer."""

from __future__ import annotations

import random

import numpy as np
import pytest

from client.shard_table import ShardTable, headers_fit
from client.shard_tally import ShardCollector
from erasure.codec import make_codec
from erasure.config import CodecConfig
from erasure.shard import parse_header, shard_payload
from kvstore.wire import batch_answer

CODEC = make_codec(CodecConfig(k=10, m=2, backend="zfec"))
NUM_KEYS = 6


def _answer(rng: random.Random, shards: dict[tuple[int, int], list[bytes]]) -> list[tuple]:
    """Up to NUM_KEYS rows (key position, shard bytes, corrupt header): a node's answer."""
    rows = []
    for position in rng.sample(range(NUM_KEYS), rng.randint(1, NUM_KEYS)):
        version = rng.choice([0, 0, 0, 1])  # mostly one version, sometimes a second
        index = rng.randrange(12)
        rows.append((position, shards[position, version][index], rng.random() < 0.05))
        if rng.random() < 0.1:  # the same node holds another version of the key
            rows.append((position, shards[position, 1 - version][index], False))
    return rows


def _entries(rows: list[tuple]) -> np.ndarray:
    entries = [
        batch_answer.Entry(i, batch_answer.HIT, bytes(shard[:48]), len(shard) - 48)
        for i, (_, shard, _) in enumerate(rows)
    ]
    table, _ = batch_answer.decode_table(batch_answer.encode_table(entries), len(rows))
    table = table.copy()
    for i, (_, _, corrupt) in enumerate(rows):
        if corrupt:
            table["k"][i] = 3  # a header that is not this codec's
    return table


@pytest.mark.parametrize("seed", range(40))
def test_the_numpy_tally_counts_as_the_per_shard_one(seed: int) -> None:
    rng = random.Random(seed)
    shards = {
        (position, version): CODEC.encode(rng.randbytes(rng.choice([1000, 4096, 10_000])))
        for position in range(NUM_KEYS)
        for version in (0, 1)
    }
    table = ShardTable(CODEC, NUM_KEYS)
    reference = [ShardCollector(CODEC) for _ in range(NUM_KEYS)]
    for _ in range(rng.randint(8, 30)):
        rows = _answer(rng, shards)
        hits = _entries(rows)
        payloads = [shard_payload(shard) for _, shard, _ in rows]
        valid = headers_fit(CODEC, hits)
        in_place = np.array([rng.random() < 0.8 for _ in rows])
        positions = np.array([position for position, _, _ in rows], np.int64)
        reached = table.add(hits, positions, valid, in_place, payloads.__getitem__)
        expected = []
        for i, (position, shard, _) in enumerate(rows):
            if not valid[i]:
                reference[position].num_corrupt += 1
                continue
            version = reference[position].add_verified(parse_header(shard), shard, checked=False)
            if version is not None:
                expected.append((position, version))
        assert sorted(reached) == sorted(expected)
        for position in range(NUM_KEYS):
            assert table.best_count(position) == reference[position].best_count
            for version in reference[position].version_to_shards:
                held = set(reference[position].version_to_shards[version])
                assert table.indexes(position, version) == held
                assert table.lengths(position, version) == (
                    reference[position].version_to_header[version].block_len,
                    reference[position].version_to_header[version].payload_len,
                )
        if rng.random() < 0.2:  # a key leaves the fast path mid-read (a recheck, a rebuild)
            table.collectors_for([rng.randrange(NUM_KEYS)])
    assert table.num_corrupt() == sum(c.num_corrupt for c in reference)
    collectors = table.collectors_for(list(range(NUM_KEYS)))
    for position, collector in collectors.items():
        want = reference[position]
        assert collector.best_count == want.best_count
        for version, index_to_shard in want.version_to_shards.items():
            got = collector.version_to_shards[version]
            assert sorted(got) == sorted(index_to_shard)
            for index, shard in index_to_shard.items():
                assert bytes(shard_payload(got[index])) == bytes(shard_payload(shard))
            assert collector.recheck(version) == 0, "a good shard failed its recheck"


def test_a_code_of_more_than_64_shards_is_tallied_per_shard() -> None:
    codec = make_codec(CodecConfig(k=60, m=10, backend="zfec"))
    shards = codec.encode(bytes(range(256)) * 40)
    table = ShardTable(codec, 1)
    reached = []
    for shard in shards[10:]:  # one node's answer each; shard indexes 64-69 among them
        hits = _entries([(0, shard, False)])
        reached += table.add(
            hits,
            np.zeros(1, np.int64),
            headers_fit(codec, hits),
            np.ones(1, bool),
            [shard_payload(shard)].__getitem__,
        )
    assert reached == [(0, parse_header(shards[0]).block_checksum)]
    assert table.best_count(0) == 60
    assert table.indexes(0, reached[0][1]) == set(range(10, 70))
