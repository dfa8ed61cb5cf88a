"""Eviction keeps a block whole: a node that evicts under pressure logs a tombstone that every
member of the group applies, counts it, and fences repairs of it; background compaction
reclaims dead versions; a scrub that finds the index damaged says so (IndexUnusable)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.errors import IndexUnusable
from kvstore.store.compaction import (
    COMPACT_MIN_DEAD_BYTES,
    Compactor,
    compaction_candidates,
)
from kvstore.store.index_codec import SegmentMeta
from kvstore.store.shard_store import PutOptions
from tests.kvstore.node_harness import make_shard
from tests.kvstore.store_harness import MakeStore
from ttl.clock import ManualClock

PRESSURE = {"max_bytes": 100_000, "high_watermark": 0.9, "low_watermark": 0.5}
MiB = 1 << 20


def _key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_an_evicted_shard_takes_its_block_out_of_the_whole_group(
    make_store: MakeStore, clock: ManualClock, tmp_path: Path
) -> None:
    full, peer = make_store(**PRESSURE), make_store(data_dir=tmp_path / "peer")
    written_at = {}
    for i in range(30):  # about 4 kB records: the 23rd passes the high watermark
        written_at[i] = clock.now()
        shard = make_shard(bytes([i]) * 3_972)
        full.put("acme", "chat", [(_key(i), shard)], PutOptions(written_at_s=[written_at[i]]))
        peer.put("acme", "chat", [(_key(i), shard)], PutOptions(written_at_s=[written_at[i]]))
        clock.advance(1)
    gone = [i for i, v in enumerate(full.contains("acme", [_key(i) for i in range(30)])) if not v]
    assert gone, "nothing was evicted: the test exercised nothing"
    stats = full.stats()
    assert stats.evicted_blocks == len(gone), "the evicted blocks were not counted"
    records, _ = full.tombstones(0, 100)
    assert sorted(int.from_bytes(t.key, "big") for t in records) == gone, (
        "an evicted shard left no tombstone: the other members would believe the block whole"
    )
    erased = peer.apply_tombstones(records)  # what a member pulling the log does
    assert erased.num_shards == len(gone)
    assert peer.contains("acme", [_key(i) for i in gone]) == [[]] * len(gone)
    assert peer.stats().peer_removed_shards == len(gone)
    kept = [i for i in range(30) if i not in gone]
    assert all(peer.contains("acme", [_key(i) for i in kept])), "a member dropped a kept block"
    i = gone[0]
    repair = PutOptions(written_at_s=[written_at[i]], repair=True)
    result = full.put("acme", "chat", [(_key(i), make_shard(bytes([i]) * 3_972))], repair)
    assert result.num_fenced == 1, "a repair put an evicted block back on the evicting node"


def test_compaction_candidates_are_mostly_dead_and_worth_a_copy() -> None:
    mostly_dead = SegmentMeta(1, 0, committed_bytes=10 * MiB, live_bytes=1 * MiB, num_live=2)
    half_live = SegmentMeta(2, 0, committed_bytes=10 * MiB, live_bytes=6 * MiB, num_live=9)
    small = SegmentMeta(3, 0, committed_bytes=MiB, live_bytes=0, num_live=0)
    more_dead = SegmentMeta(4, 0, committed_bytes=20 * MiB, live_bytes=MiB, num_live=1)
    got = compaction_candidates([mostly_dead, half_live, small, more_dead])
    assert [m.segment_id for m in got] == [4, 1]
    assert small.dead_bytes < COMPACT_MIN_DEAD_BYTES


def test_overwrites_of_one_key_are_compacted_away_in_the_background(
    make_store: MakeStore, clock: ManualClock
) -> None:
    store = make_store()
    key, shard_bytes = _key(7), 420_000  # one shard of a 4 MiB block
    for version in range(200):
        options = PutOptions(written_at_s=[clock.now()])
        shard = make_shard(bytes([version % 251]) * shard_bytes)
        store.put("acme", "chat", [(key, shard)], options)
        clock.advance(0.001)
        if version % 10 == 9:
            store.tick()  # the node's upkeep runs about once a second meanwhile
    store.tick()
    stats = store.stats()
    assert stats.num_shards == 1
    assert stats.used_bytes <= 4 * 10 * shard_bytes, (
        f"{stats.used_bytes} segment bytes after 200 overwrites of one {shard_bytes}-byte "
        "shard: dead versions still count against capacity"
    )
    assert stats.compacted_bytes > 50 * shard_bytes
    assert [r.shards[0][-4:] for r in store.get("acme", [key])] == [bytes([199 % 251]) * 4]


def test_compaction_is_rate_limited(make_store: MakeStore, clock: ManualClock) -> None:
    store = make_store()
    for version in range(30):
        store.put("acme", "chat", [(_key(1), make_shard(bytes([version]) * 400_000))])
        clock.advance(0.001)  # each write newer than the last: it retires the one before
    now = [0.0]
    compactor = Compactor(store._index, store._reclaimer, 1_000.0, lambda: now[0])
    assert compactor.step() > 0, "the first step (a full burst) compacted nothing"
    assert compactor.step() == 0, "a second step with the bucket overdrawn compacted"


def test_a_scrub_that_finds_the_index_damaged_raises_index_unusable(make_store: MakeStore) -> None:
    store = make_store()
    for i in range(10):
        store.put("acme", "chat", [(_key(i), make_shard(bytes([i]) * 100))])
    with store._index.backend.begin(write=True) as txn:  # a damaged page: an entry lost
        (index_key, _), *_ = txn.scan("entries", b"", None, 1)
        txn.delete("entries", index_key)
    with pytest.raises(IndexUnusable, match="damaged"):
        while not store.scrub(1 << 30).pass_done:
            pass
