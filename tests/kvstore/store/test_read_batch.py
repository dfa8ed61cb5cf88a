"""The node's batch read (ShardStore.read_batch), its answer format and its staging arena."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from kvstore.byte_arena import ByteArena
from kvstore.errors import InvalidArgument
from kvstore.store.segments import SegmentFiles
from kvstore.store.shard_store import ShardStore
from kvstore.wire import batch_answer
from tests.kvstore.node_harness import DAY_S, make_shard, version_of
from tests.kvstore.store_harness import MakeStore
from ttl.clock import ManualClock


def _key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def _answer(store: ShardStore, keys: list[bytes], version: bytes = b"") -> list[tuple]:
    """(key index, status, whole shard) per table entry, decoded as a client would."""
    arena = ByteArena(1 << 24)
    read = store.read_batch("acme", keys, version, arena.take)
    try:
        table = batch_answer.encode_table(read.entries)
        entries, payload_bytes = batch_answer.decode_table(table, len(keys))
        assert payload_bytes == read.payload_bytes, "table total disagrees with the staging"
        rows, start, raw = [], 0, entries.tobytes()
        for row, entry in enumerate(entries):
            size = int(entry["payload_bytes"])
            header = raw[row * 64 + 16 : (row + 1) * 64]
            shard = header + bytes(read.payloads[start : start + size]) if size else b""
            rows.append((int(entry["key_index"]), int(entry["status"]), shard))
            start += size
    finally:
        read.release()
    assert arena.num_free_bytes == arena.capacity_bytes, "staging leaked after release"
    return rows


def test_batch_read_serves_what_get_serves(make_store: MakeStore) -> None:
    store = make_store()
    rng = random.Random(1)
    items = [(_key(i), make_shard(rng.randbytes(rng.randint(1, 50_000)))) for i in range(40)]
    store.put("acme", "chat", items)
    keys = [k for k, _ in items] + [_key(999), items[3][0]]  # a miss and a repeated key
    rows = _answer(store, keys)
    hits = {(i, shard) for i, status, shard in rows if status == batch_answer.HIT}
    expected = {(i, shard) for i, (_, shard) in enumerate(items)} | {(41, items[3][1])}
    assert hits == expected, "read_batch served other bytes than were stored"
    assert [(i, s) for i, s, _ in rows if s != batch_answer.HIT] == [(40, batch_answer.MISS)]
    stats = store.stats()
    assert (stats.hits, stats.misses) == (40, 1), "a key read once per request, counted once"


def test_the_reply_size_is_bounded_before_any_byte_is_read(make_store: MakeStore) -> None:
    store = make_store()
    store.put("acme", "chat", [(_key(1), make_shard(bytes(50_000)))])
    arena = ByteArena(1 << 20)
    with pytest.raises(InvalidArgument, match="max_batch_bytes"):
        store.read_batch("acme", [_key(1)] * 1000, b"", arena.take, max_reply_bytes=1 << 20)
    assert store.stats().hits == 0, "a refused request read shards"
    assert arena.num_free_bytes == arena.capacity_bytes
    read = store.read_batch("acme", [_key(1)] * 3, b"", arena.take, max_reply_bytes=1 << 20)
    try:
        assert [e.key_index for e in read.entries] == [0, 1, 2]
        assert read.payload_bytes == 3 * 50_000
    finally:
        read.release()
    assert store.stats().hits == 1


def test_only_the_newest_version_is_served_and_the_version_filter_holds(
    make_store: MakeStore, clock: ManualClock
) -> None:
    store = make_store()
    store.put("acme", "chat", [(_key(1), make_shard(b"old" * 100))])
    clock.advance(10)
    store.put("acme", "chat", [(_key(1), make_shard(b"new" * 100))])
    rows = _answer(store, [_key(1)])
    assert [shard[48:] for _, _, shard in rows] == [b"new" * 100], "an old version was served"
    only_new = _answer(store, [_key(1)], version_of(b"new" * 100))
    assert [shard[48:] for _, _, shard in only_new] == [b"new" * 100], "version filter ignored"
    retired = _answer(store, [_key(1)], version_of(b"old" * 100))
    assert retired[0][1] == batch_answer.MISS, "the overwrite did not retire the old version"
    assert _answer(store, [_key(1)], version=b"\x07" * 16)[0][1] == batch_answer.MISS
    assert _answer(store, [_key(1)])[0][1] == batch_answer.HIT, "filter changed the store"


def test_a_corrupt_shard_is_never_served_and_the_rest_is(
    make_store: MakeStore, tmp_path: Path
) -> None:
    store = make_store()
    store.put("acme", "chat", [(_key(i), make_shard(bytes([65 + i]) * 1000)) for i in range(3)])
    [segment] = (tmp_path / "segments").glob("*.seg")
    data = bytearray(segment.read_bytes())
    data[data.index(b"B" * 1000) + 10] ^= 1
    segment.write_bytes(bytes(data))
    rows = _answer(store, [_key(0), _key(1), _key(2)])
    assert sorted((i, s) for i, s, _ in rows) == [
        (0, batch_answer.HIT),
        (1, batch_answer.CORRUPT),
        (2, batch_answer.HIT),
    ]
    assert {shard[48:] for _, s, shard in rows if s == batch_answer.HIT} == {
        b"A" * 1000,
        b"C" * 1000,
    }
    assert store.stats().corrupt_shards == 1


def test_expired_blocks_are_misses(make_store: MakeStore, clock: ManualClock) -> None:
    store = make_store()
    store.put("acme", "agent", [(_key(1), make_shard(b"a" * 100))])
    store.put("acme", "chat", [(_key(2), make_shard(b"c" * 100))])
    clock.advance(4 * DAY_S)  # past the agent TTL, not chat's; nothing reclaimed yet
    rows = _answer(store, [_key(1), _key(2)])
    assert sorted((i, s) for i, s, _ in rows) == [(0, batch_answer.MISS), (1, batch_answer.HIT)]


def test_a_segment_freed_during_the_read_is_looked_up_again(
    make_store: MakeStore, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Expiry (or compaction) may delete a segment between the index snapshot and the read:
    its keys are looked up once more; a key that is gone is a miss, never stale bytes."""
    store = make_store()
    store.put("acme", "agent", [(_key(1), make_shard(b"a" * 100))])
    store.put("acme", "chat", [(_key(2), make_shard(b"c" * 100))])
    real_open = SegmentFiles.open_reader
    calls: list[int] = []

    def expire_first(files: SegmentFiles, segment_id: int) -> int:
        if not calls:  # the first segment opened vanishes under the read (expiry ran)
            clock.advance(4 * DAY_S)
            store.expire()
        calls.append(segment_id)
        return real_open(files, segment_id)

    monkeypatch.setattr(SegmentFiles, "open_reader", expire_first)
    rows = _answer(store, [_key(1), _key(2)])
    assert sorted((i, s) for i, s, _ in rows) == [(0, batch_answer.MISS), (1, batch_answer.HIT)]
    assert [shard[48:] for _, s, shard in rows if s == batch_answer.HIT] == [b"c" * 100]


def test_staging_larger_than_the_arena_falls_back_to_a_buffer(make_store: MakeStore) -> None:
    store = make_store()
    store.put("acme", "chat", [(_key(i), make_shard(bytes([i]) * 10_000)) for i in range(4)])
    arena = ByteArena(16_384)
    read = store.read_batch("acme", [_key(i) for i in range(4)], b"", arena.take)
    assert read.payload_bytes == 40_000 and arena.num_fallbacks == 1
    assert bytes(read.payloads[:10_000]) == bytes(10_000), "fallback staging lost bytes"
    read.release()


def test_arena_regions_are_disjoint_and_merge_back() -> None:
    arena = ByteArena(64 * 4096)
    rng = random.Random(2)
    taken = [arena.take(rng.randint(1, 20_000)) for _ in range(8)]
    spans = sorted((r.offset, r.offset + len(r.view)) for r in taken)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), "regions overlap"
    for region in rng.sample(taken, len(taken)):
        region.release()
        region.release()  # a second release is a no-op, never a double free
    assert arena.num_free_bytes == arena.capacity_bytes
    assert len(arena.take(64 * 4096).view) == 64 * 4096, "free runs were not merged back"


@pytest.mark.parametrize("chunk_bytes", [7, 64, 1 << 20])
def test_chunks_carry_the_answer_and_parse_back(chunk_bytes: int) -> None:
    entries = [batch_answer.Entry(0, batch_answer.HIT, make_shard(b"x" * 300)[:48], 300)]
    table = batch_answer.encode_table(entries)
    payloads = memoryview(b"x" * 300)
    chunks = batch_answer.encode_chunks(table, payloads, chunk_bytes)
    assert all(len(batch_answer.chunk_data(c)) <= chunk_bytes for c in chunks)
    assert b"".join(bytes(batch_answer.chunk_data(c)) for c in chunks) == table + b"x" * 300


@pytest.mark.parametrize(
    ("mangle", "match"),
    [
        (lambda t: t[:-1], "bytes for"),
        (lambda t: t[:4] + (999).to_bytes(4, "little") + t[8:], "payload total"),
        (lambda t: t[:8] + (5).to_bytes(4, "little") + t[12:], "beyond"),
        (lambda t: t[:16] + (301).to_bytes(4, "little") + t[20:], "lengths"),
    ],
)
def test_malformed_tables_are_refused(mangle: object, match: str) -> None:
    entry = batch_answer.Entry(0, batch_answer.HIT, make_shard(b"x" * 300)[:48], 300)
    table = batch_answer.encode_table([entry])
    with pytest.raises(ValueError, match=match):
        batch_answer.decode_table(mangle(table), 1)  # type: ignore[operator]
