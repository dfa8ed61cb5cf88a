"""Deletion inside one store (both index backends): records destroyed in place, the delete
log, peers' tombstones applied by time, the erase queue surviving a failed erase."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.store.index_codec import Tombstone
from kvstore.store.shard_store import ShardStore, Status
from tests.kvstore.node_harness import make_shard
from tests.kvstore.store_harness import MakeStore
from ttl.clock import ManualClock


def _disk(store: ShardStore) -> bytes:
    return b"".join(p.read_bytes() for p in Path(store.node.data_dir, "segments").glob("*.seg"))


def test_delete_destroys_the_record_and_logs_a_tombstone(make_store: MakeStore) -> None:
    store = make_store()
    doomed, kept = make_shard(b"D" * 5000), make_shard(b"K" * 5000)
    store.put("acme", "chat", [(b"d" * 16, doomed), (b"k" * 16, kept)])
    assert doomed[48:] in _disk(store)
    assert store.delete("acme", [b"d" * 16, b"never-put-key..."]) == 1
    assert b"D" * 64 not in _disk(store), "the deleted record's bytes are still in the file"
    assert store.get("acme", [b"k" * 16])[0].shards == (kept,), "a neighbour was damaged"
    log, last_seq = store.tombstones(0, 10)
    assert [(t.tenant, t.key) for t in log] == [("acme", b"d" * 16), ("acme", b"never-put-key...")]
    assert last_seq == 2 and store.tombstones(1, 10)[0] == log[1:]


def test_peer_tombstones_delete_older_versions_only(
    make_store: MakeStore, clock: ManualClock
) -> None:
    store = make_store()
    store.put("acme", "chat", [(b"a" * 16, make_shard(b"old"))])
    delete_at = clock.now()
    clock.advance(10.0)
    store.put("acme", "chat", [(b"b" * 16, make_shard(b"written after the delete"))])
    store.put("globex", "chat", [(b"a" * 16, make_shard(b"globex"))])
    erased = store.apply_tombstones(
        [Tombstone(7, "acme", b"a" * 16, delete_at), Tombstone(8, "acme", b"", delete_at)]
    )
    assert erased.num_shards == 1, "a tombstone deleted a block written after it"
    assert store.get("acme", [b"a" * 16])[0].status == Status.MISS
    assert store.get("acme", [b"b" * 16])[0].status == Status.HIT
    assert store.get("globex", [b"a" * 16])[0].status == Status.HIT, "another tenant's block"
    assert store.tombstones(0, 10)[0] == [], "applied tombstones must not be logged again"


def test_purge_and_a_failed_erase_retried(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = make_store()
    store.put("acme", "chat", [(bytes([i]) * 16, make_shard(b"P" * 3000)) for i in range(5)])
    calls = []

    def failing_erase(*args: object) -> None:
        calls.append(args)
        raise OSError("I/O error")

    real_erase = store._files.erase
    monkeypatch.setattr(store._files, "erase", failing_erase)
    erased = store.purge("acme")
    assert erased.num_shards == 5 and erased.num_bytes > 5 * 3000 and calls
    assert b"P" * 64 in _disk(store), "test set-up: the erase should have failed"
    monkeypatch.setattr(store._files, "erase", real_erase)
    store.tick()  # the queued erases run again
    assert b"P" * 64 not in _disk(store), "a failed erase was not retried by the tick"
    assert [t.key for t in store.tombstones(0, 10)[0]] == [b""], "purge logs one tombstone"
