"""The synchronous shard store with a manual clock: TTL, expiry, eviction, integrity."""

from __future__ import annotations

import errno
import os
import random
import threading
import time
from pathlib import Path

import pytest

import kvstore.store.segments
from erasure.shard import ShardHeader, block_checksum, pack_header
from kvstore.config import NodeConfig, TTLConfig
from kvstore.errors import CapacityExhausted, InvalidArgument, UnknownTrafficClass
from kvstore.store.index_codec import Entry
from kvstore.store.read_state import refresh_due
from kvstore.store.shard_store import (
    INF_WINDOW,
    PutOptions,
    ShardStore,
    Status,
    window_end_s,
    window_id,
)
from tests.kvstore.node_harness import DAY_S, make_shard, version_of
from tests.kvstore.store_harness import (
    CLASSES,
    STRESS_INDEX_RESERVE_BYTES,
    MakeStore,
    lmdb_index_bytes,
)
from ttl.clock import ManualClock

MINUTE_S = TTLConfig.refresh_granularity_s  # a hit sooner than this after the last restarts no TTL


def _key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def _segment_ids(tmp_path: Path) -> set[int]:
    return {int(p.stem) for p in (tmp_path / "segments").glob("*.seg")}


def test_window_math() -> None:
    assert window_id(7199.9, 3600.0) == 1 and window_end_s(1, 3600.0) == 7200.0
    assert window_id(float("inf"), 3600.0) == INF_WINDOW
    assert window_end_s(INF_WINDOW, 3600.0) == float("inf")


def test_put_get_contains_delete(make_store: MakeStore) -> None:
    store = make_store()
    items = [(_key(i), make_shard(bytes([i]) * i)) for i in range(1, 51)]  # no empty block
    assert store.put("acme", "chat", items + items[:5]).num_stored == 50, "duplicates stored twice"
    assert store.put("acme", "chat", items).num_stored == 0, "a re-put must be idempotent"
    results = store.get("acme", [k for k, _ in items] + [_key(999)])
    assert [r.shards for r in results[:50]] == [(s,) for _, s in items]
    assert results[50].status == Status.MISS
    assert store.contains("acme", [_key(1)]) == [[version_of(b"\x01")]]
    assert store.contains("globex", [_key(1)]) == [[]], "tenant isolation broken"
    assert store.delete("globex", [_key(1)]) == 0 and store.delete("acme", [_key(1)]) == 1
    assert store.get("acme", [_key(1)])[0].status == Status.MISS
    stats = store.stats()
    assert (stats.num_shards, stats.hits, stats.misses) == (49, 50, 2)


def test_bad_input_raises_before_anything_is_stored(make_store: MakeStore) -> None:
    store = make_store(max_shard_bytes=1000)
    good = (_key(1), make_shard(b"good"))
    with pytest.raises(UnknownTrafficClass, match="bulk"):
        store.put("acme", "bulk", [good])
    with pytest.raises(InvalidArgument, match="tenant"):
        store.put("", "chat", [good])
    with pytest.raises(InvalidArgument, match="16 bytes"):
        store.put("acme", "chat", [good, (b"short", make_shard(b"x"))])
    with pytest.raises(InvalidArgument, match="at most"):
        store.put("acme", "chat", [good, (_key(2), make_shard(bytes(1001)))])
    with pytest.raises(InvalidArgument, match="malformed"):
        store.put("acme", "chat", [good, (_key(3), make_shard(b"abc")[:-1])])
    assert store.contains("acme", [_key(1)]) == [[]], "a refused put left state behind"


def test_ttl_per_class_read_refreshes_contains_does_not(
    make_store: MakeStore, clock: ManualClock
) -> None:
    store = make_store()
    store.put("acme", "agent", [(_key(1), make_shard(b"agent"))])
    store.put("acme", "chat", [(_key(2), make_shard(b"chat"))])
    clock.advance(3 * DAY_S - 1)
    assert store.get("acme", [_key(1)])[0].status == Status.HIT  # refreshed: dies at 6d - 1
    clock.advance(1)
    assert store.contains("acme", [_key(1), _key(2)]) != [[], []]
    clock.advance(2 * DAY_S)  # day 5
    assert store.get("acme", [_key(2)])[0].status == Status.HIT  # chat now lives to day 12
    clock.advance(DAY_S - 2)  # day 6 - 2 s: the agent's last second
    assert len(store.contains("acme", [_key(1)])[0]) == 1
    clock.advance(1)
    assert store.contains("acme", [_key(1)]) == [[]], "contains() refreshed an agent block"
    clock.advance(6 * DAY_S)  # day 12 - 1 s
    assert len(store.contains("acme", [_key(2)])[0]) == 1, "the day-5 hit did not extend chat"
    clock.advance(1)
    assert store.get("acme", [_key(2)])[0].status == Status.MISS, "served after expiry"
    assert store.expire() == 2
    assert store.stats().num_segments == 0


def test_a_hit_soon_after_the_last_access_rewrites_nothing(
    make_store: MakeStore, clock: ManualClock
) -> None:
    """Hits within ``[ttl] refresh_granularity_s`` (a minute) of the last access buffer no
    refresh, so a flush writes no index entry for them; the first hit past it restarts the
    TTL as before."""
    store = make_store()
    store.put("acme", "agent", [(_key(1), make_shard(b"agent"))])
    clock.advance(30)
    store.get("acme", [_key(1)])
    assert store._reads._refreshed == {}, "a hit 30 s after the put buffered a refresh"
    clock.advance(MINUTE_S - 30)  # a minute after the put
    store.get("acme", [_key(1)])
    store.touch("acme", [_key(1)])  # touched right after the hit: nothing more to buffer
    assert len(store._reads._refreshed) == 1
    store.flush()  # persisted: the entry's last access is now the hit's
    clock.advance(MINUTE_S / 2)
    store.touch("acme", [_key(1)])
    assert store._reads._refreshed == {}, "a touch half a minute after a hit was buffered"
    clock.advance(3 * DAY_S - MINUTE_S / 2 - 1)  # 1 s before the refreshed expiry
    assert len(store.contains("acme", [_key(1)])[0]) == 1, "the minute-old hit did not refresh"
    clock.advance(2)
    assert store.contains("acme", [_key(1)]) == [[]]


def test_refresh_due_scales_with_the_ttl_up_to_a_minute() -> None:
    entry = Entry("acme", b"k" * 16, b"v" * 16, "chat", 1, 0, 5, 0, 1000.0, 1000.0, 4600.0)
    assert not refresh_due(entry, 1003.5, 60.0) and refresh_due(entry, 1003.6, 60.0)
    long_lived = entry.accessed(1000.0, 1000.0 + 7 * DAY_S)
    assert not refresh_due(long_lived, 1059.9, 60.0) and refresh_due(long_lived, 1060.0, 60.0)
    assert refresh_due(long_lived, 1000.0, 0.0), "granularity 0: every hit refreshes"


def test_expiry_frees_whole_files_and_leaves_live_ones_alone(
    make_store: MakeStore, clock: ManualClock, tmp_path: Path
) -> None:
    store = make_store()
    store.put("acme", "chat", [(_key(i), make_shard(b"c" * 100)) for i in range(20)])
    chat_files = _segment_ids(tmp_path)
    store.put("acme", "agent", [(_key(100 + i), make_shard(b"a" * 100)) for i in range(20)])
    chat_stat = [(tmp_path / "segments" / f"{i:012d}.seg").stat() for i in chat_files]
    clock.advance(4 * DAY_S)
    assert store.expire() == 20
    assert _segment_ids(tmp_path) == chat_files, "agent window files not deleted whole"
    after = [(tmp_path / "segments" / f"{i:012d}.seg").stat() for i in chat_files]
    assert [(s.st_size, s.st_mtime_ns) for s in after] == [
        (s.st_size, s.st_mtime_ns) for s in chat_stat
    ], "expiry touched a live segment"
    assert store.stats().classes[1].expired == 20


def test_refreshed_block_is_carried_forward_when_its_window_passes(
    make_store: MakeStore, clock: ManualClock, tmp_path: Path
) -> None:
    store = make_store()
    items = [(_key(i), make_shard(bytes([i]) * 500)) for i in range(10)]
    store.put("acme", "agent", items)
    [old_segment] = _segment_ids(tmp_path)
    clock.advance(2 * DAY_S)
    store.get("acme", [_key(3)])  # lives to day 5; its segment's window ends at day 3
    clock.advance(1.5 * DAY_S)
    assert store.expire() == 9
    assert old_segment not in _segment_ids(tmp_path), "passed window's file not freed"
    assert store.get("acme", [_key(3)])[0].shards == (items[3][1],), "carried block lost"
    clock.advance(3 * DAY_S)  # that get refreshed it once more
    assert store.expire() == 1 and _segment_ids(tmp_path) == set()


def test_refreshes_and_counters_survive_a_restart(tmp_path: Path, clock: ManualClock) -> None:
    node = NodeConfig("n0", "127.0.0.1:1", 0, "d0", str(tmp_path), fsync=True)
    ttl = TTLConfig(classes=CLASSES)
    store = ShardStore(node, ttl, clock)
    store.put("acme", "agent", [(_key(1), make_shard(b"agent"))])
    clock.advance(2 * DAY_S)
    store.get("acme", [_key(1), _key(2)])
    store.close()
    clock.advance(2 * DAY_S)  # day 4: alive only thanks to the day-2 hit
    store = ShardStore(node, ttl, clock)
    assert len(store.contains("acme", [_key(1)])[0]) == 1, "a persisted refresh was lost"
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.classes[1].hits) == (1, 1, 1)
    store.close()


def test_eviction_order_is_earliest_expiry_first(make_store: MakeStore, clock: ManualClock) -> None:
    store = make_store(
        eviction_order="expiry", max_bytes=100_000, high_watermark=0.9, low_watermark=0.5
    )
    shard_of = {i: make_shard(bytes([i]) * 3_972) for i in range(40)}  # records of ~4088 bytes
    for i in range(5):  # agents 0-4, chats 10-14, one second apart
        store.put("acme", "agent", [(_key(i), shard_of[i])])
        clock.advance(1)
    for i in range(10, 15):
        store.put("acme", "chat", [(_key(i), shard_of[i])])
        clock.advance(1)
    clock.advance(MINUTE_S)  # a hit sooner than this after the put refreshes nothing
    store.get("acme", [_key(0), _key(10)])  # newest accesses of their classes
    clock.advance(100)
    for i in range(20, 34):  # 24 records of 4088 bytes: over 90 kB, eviction to 50 kB
        store.put("acme", "chat", [(_key(i), shard_of[i])])
    order = [1, 2, 3, 4, 0, 11, 12, 13, 14, 10, *range(20, 34)]
    present = [len(v) == 1 for v in store.contains("acme", [_key(i) for i in order])]
    num_evicted = present.index(True)
    assert present == [False] * num_evicted + [True] * (len(order) - num_evicted), present
    assert num_evicted == 11, f"{num_evicted} evicted: need 11 to get under 50 kB with room"
    agent = store.stats().classes[1]
    assert agent.evicted == 5 and agent.youngest_evicted_age_s == 100.0, (
        "youngest_evicted_age_s must be now - last access of the freshest evicted agent"
    )
    assert store.stats().used_bytes <= 90_000


def test_put_refused_only_when_space_is_pinned(make_store: MakeStore) -> None:
    store = make_store(max_bytes=50_000, high_watermark=0.9, low_watermark=0.5)
    pinned = [(_key(i), make_shard(bytes([i]) * 4_000)) for i in range(13)]
    for item in pinned[:12]:  # 12 records of 4088 bytes fit in 50 kB, 13 do not
        store.put("acme", "pinned", [item])
    with pytest.raises(CapacityExhausted, match="cannot be evicted"):
        store.put("acme", "chat", [pinned[12]])
    statuses = [r.status for r in store.get("acme", [k for k, _ in pinned])]
    assert statuses == [Status.HIT] * 12 + [Status.MISS], "reads must work when full"


@pytest.mark.parametrize("failure", ["short write", "ENOSPC"])
def test_disk_full_mid_put_leaves_no_trace(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, failure: str
) -> None:
    """The batch's one pwritev lands part of its records, then the disk is full: a short
    write, or ENOSPC after the part was written. Nothing of the put stays."""
    store = make_store()
    store.put("acme", "chat", [(_key(0), make_shard(b"before"))])
    size_before = {i: store._files.size(i) for i in _segment_ids(tmp_path)}
    real_pwritev = os.pwritev

    def pwritev_part(fd: int, buffers: list, offset: int) -> int:
        written = real_pwritev(fd, buffers[:3], offset)  # record 1, and record 2's header
        if failure == "ENOSPC":
            raise OSError(errno.ENOSPC, "No space left on device")
        return written

    monkeypatch.setattr(kvstore.store.segments.os, "pwritev", pwritev_part)
    items = [(_key(i), make_shard(bytes([i]) * 100)) for i in range(1, 6)]
    with pytest.raises(CapacityExhausted, match="disk full"):
        store.put("acme", "chat", items)
    monkeypatch.undo()
    assert store.contains("acme", [k for k, _ in items]) == [[]] * 5, "partial put visible"
    assert {i: store._files.size(i) for i in _segment_ids(tmp_path)} == size_before
    assert store.get("acme", [_key(0)])[0].status == Status.HIT
    assert store.put("acme", "chat", items).num_stored == 5


def test_corrupt_shard_is_reported_then_dropped(make_store: MakeStore, tmp_path: Path) -> None:
    store = make_store()
    store.put("acme", "chat", [(_key(i), make_shard(bytes([65 + i]) * 1000)) for i in range(3)])
    [segment] = (tmp_path / "segments").glob("*.seg")
    data = bytearray(segment.read_bytes())
    data[data.index(b"B" * 1000) + 10] ^= 1
    segment.write_bytes(bytes(data))
    statuses = [r.status for r in store.get("acme", [_key(0), _key(1), _key(2)])]
    assert statuses == [Status.HIT, Status.CORRUPT, Status.HIT]
    assert store.stats().corrupt_shards == 1
    store.flush()
    assert store.get("acme", [_key(1)])[0].status == Status.MISS, "corrupt entry not dropped"
    assert store.stats().corrupt_shards == 1, "one corrupt shard counted twice"


def test_random_operations_match_a_dict_model(make_store: MakeStore, clock: ManualClock) -> None:
    """A seeded random walk of puts, gets, deletes, time and expiry against a plain dict."""
    store = make_store(segment_max_bytes=20_000)
    rng = random.Random(7)
    model: dict[bytes, tuple[bytes, float]] = {}  # key -> (shard, expires_at_s)
    for _ in range(400):
        key, op = _key(rng.randrange(30)), rng.random()
        now = clock.now()
        live = key in model and model[key][1] > now
        if op < 0.4 and not live:
            shard = make_shard(rng.randbytes(rng.randrange(1, 3000)))
            store.put("acme", "agent", [(key, shard)])
            model[key] = (shard, now + 3 * DAY_S)
        elif op < 0.7:
            [result] = store.get("acme", [key])
            assert result.shards == ((model[key][0],) if live else ()), "store != model"
            if live:
                model[key] = (model[key][0], now + 3 * DAY_S)
        elif op < 0.8:
            assert store.delete("acme", [key]) == (1 if key in model else 0)
            model.pop(key, None)
        elif op < 0.95:
            clock.advance(rng.uniform(0, DAY_S))
        else:
            store.expire()
            model = {k: v for k, v in model.items() if v[1] > clock.now()}


def test_concurrent_reads_never_see_wrong_bytes(tmp_path: Path, clock: ManualClock) -> None:
    """Readers race puts, refreshes, expiry, carry-forward and compaction: a hit is exact."""
    node = NodeConfig(
        "n0",
        "127.0.0.1:1",
        0,
        "d0",
        str(tmp_path),
        fsync=False,
        max_bytes=150_000 + lmdb_index_bytes(tmp_path / "probe", STRESS_INDEX_RESERVE_BYTES),
        segment_max_bytes=40_000,
        index_reserve_bytes=STRESS_INDEX_RESERVE_BYTES,
    )
    store = ShardStore(node, TTLConfig(classes=CLASSES, expiry_window_s=3600.0), clock)
    payload_of = {i: i.to_bytes(4, "big") * (100 + i % 500) for i in range(300)}
    stop, wrong, hits = threading.Event(), [], [0]

    def read() -> None:
        rng = random.Random(threading.get_ident())
        while not stop.is_set():
            keys = rng.sample(range(300), 20)
            for i, result in zip(keys, store.get("acme", [_key(i) for i in keys]), strict=True):
                if result.status == Status.HIT:
                    hits[0] += 1
                    if [s[48:] for s in result.shards] != [payload_of[i]]:
                        wrong.append(i)

    readers = [threading.Thread(target=read) for _ in range(3)]
    for thread in readers:
        thread.start()
    rng = random.Random(8)
    try:
        for step in range(300):
            i = rng.randrange(300)
            store.put("acme", rng.choice(["agent", "chat"]), [(_key(i), make_shard(payload_of[i]))])
            if step % 20 == 0:
                clock.advance(rng.uniform(0, DAY_S))
                store.tick()
    finally:
        stop.set()
        for thread in readers:
            thread.join()
        store.close()
    assert not wrong, f"wrong bytes served for keys {wrong[:5]}: a read raced a move"
    assert hits[0] > 0, "the readers never hit: the test did not exercise anything"


def test_concurrent_puts_group_commit_counts_each_shard_once(make_store: MakeStore) -> None:
    store = make_store()
    shards = {i: make_shard(bytes([i]) * 2000) for i in range(40)}
    num_stored: list[int] = []

    def put_all(offset: int) -> None:
        for j in range(40):
            i = (j + offset) % 40  # every thread puts every key, in a different order
            num_stored.append(store.put("acme", "chat", [(_key(i), shards[i])]).num_stored)

    threads = [threading.Thread(target=put_all, args=(n * 5,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sum(num_stored) == 40, "a shard put concurrently was stored twice or not at all"
    results = store.get("acme", [_key(i) for i in range(40)])
    assert [r.shards for r in results] == [(shards[i],) for i in range(40)]


def test_a_batch_is_one_pwritev_per_segment(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = make_store()
    real_pwritev, calls = os.pwritev, []

    def counted(fd: int, buffers: list, offset: int) -> int:
        calls.append(len(buffers))
        return real_pwritev(fd, buffers, offset)

    monkeypatch.setattr(kvstore.store.segments.os, "pwritev", counted)
    items = [(_key(i), make_shard(bytes([i]) * 3000)) for i in range(8)]
    assert store.put("acme", "chat", items).num_stored == 8
    assert calls == [16], "a put's records must go down in one pwritev (header, shard, ...)"
    assert [r.shards for r in store.get("acme", [k for k, _ in items])] == [(s,) for _, s in items]


def _group_commit(store: ShardStore, puts: list[tuple[list, float]]) -> None:
    """Run ``puts`` ((items, written_at_s) each) so that one group commit stores them all:
    each waits queued while the test holds the write lock."""
    threads = [
        threading.Thread(
            target=store.put, args=("acme", "chat", items, PutOptions([at] * len(items)))
        )
        for items, at in puts
    ]
    with store._write_lock:
        for thread in threads:
            thread.start()
        while len(store._puts._queue) < len(threads):
            time.sleep(0.001)
    for thread in threads:
        thread.join()


def test_one_group_commit_keeps_the_newest_of_two_versions(
    make_store: MakeStore, clock: ManualClock
) -> None:
    """Two versions of a fresh key in one group commit, and a newer version of a held key:
    each key ends with its newest version only (the retire scan runs where it is needed)."""
    store = make_store()
    old, new = make_shard(b"old" * 100), make_shard(b"new" * 100)
    store.put("acme", "chat", [(_key(2), old)], PutOptions([clock.now() - 20]))
    _group_commit(
        store,
        [
            ([(_key(1), new), (_key(2), new)], clock.now() - 5),
            ([(_key(1), old)], clock.now() - 10),
        ],
    )
    assert store.contains("acme", [_key(1), _key(2)]) == [[version_of(b"new" * 100)]] * 2
    assert store.stats().num_shards == 2, "an older version outlived the commit of a newer one"


def _two_shard(payload: bytes, index: int) -> bytes:
    """A shard of a 1+1 block (so index 1 exists) whose bytes are ``payload``."""
    header = ShardHeader("zfec", 1, 1, index, len(payload), block_checksum(payload), len(payload))
    return pack_header(header, payload) + payload


def test_a_map_change_moves_a_shard_index_and_drops_what_moved_away(
    tmp_path: Path, clock: ManualClock
) -> None:
    node = NodeConfig("n0", "127.0.0.1:1", 0, "d0", str(tmp_path), fsync=False)
    ttl = TTLConfig(classes=CLASSES)
    store = ShardStore(node, ttl, clock, group_of=lambda key: key[-1] % 2)
    try:
        keys = [_key(i) for i in range(8)]  # groups 0 and 1 alternate
        assert store.put("acme", "chat", [(k, _two_shard(k, 0)) for k in keys]).num_stored == 8
        # The node moved from position 0 to 1 of group 0: the same version, the new index.
        moved = store.put("acme", "chat", [(keys[0], _two_shard(keys[0], 1))])
        assert moved.num_stored == 1, "a shard of another index must replace the held one"
        assert store.stats().num_shards == 8
        assert store.drop_moved({0: 1}, num_groups=2) == 7, (
            "the settled map places only group 0's index 1 here: everything else goes"
        )
        (kept,) = store.get("acme", [keys[0]])[0].shards
        assert kept == _two_shard(keys[0], 1)
        assert store.stats().num_shards == 1
        assert store.contains("acme", [keys[1]]) == [[]]
    finally:
        store.close()
