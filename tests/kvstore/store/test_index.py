"""One conformance suite for the index, run against lmdb and the in-memory twin."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from kvstore.store.index import USED_BYTES, Index, class_counter
from kvstore.store.index_backends import LmdbBackend, MemoryBackend
from kvstore.store.index_codec import Entry, decode_entry, encode_entry
from kvstore.store.segments import record_bytes


@pytest.fixture(params=["lmdb", "memory"])
def index(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Index]:
    backend = LmdbBackend(tmp_path / "idx", sync=False) if request.param == "lmdb" else None
    idx = Index(backend or MemoryBackend())
    yield idx
    idx.close()


def _entry(
    key: int,
    version: int = 0,
    *,
    tenant: str = "acme",
    expires: float = 100.0,
    segment: int = 1,
    offset: int = 0,
    cls: str = "chat",
) -> Entry:
    return Entry(
        tenant,
        bytes([key]) * 16,
        bytes([version]) * 16,
        cls,
        segment,
        offset,
        shard_bytes=1000,
        shard_checksum=7,
        created_s=float(version),
        last_access_s=expires - 50,
        expires_at_s=expires,
    )


def _with_segments(index: Index, *segment_ids: int) -> None:
    with index.write() as w:
        for segment_id in segment_ids:
            w.add_segment(segment_id, window_id=segment_id)
            w.set_committed_bytes(segment_id, 10 * record_bytes(1000, "acme", "chat"))


def test_entry_encoding_round_trip() -> None:
    entry = _entry(3, 4, tenant="tenant-é", expires=math.inf, cls="agent")
    assert decode_entry(entry.index_key, encode_entry(entry)) == entry


def test_versions_are_per_tenant_and_key(index: Index) -> None:
    _with_segments(index, 1)
    with index.write() as w:
        for entry in [_entry(1, 1), _entry(1, 2), _entry(2, 1), _entry(1, 1, tenant="globex")]:
            assert w.put_entry(entry) is None
    with index.read() as view:
        assert {e.version[0] for e in view.versions("acme", bytes([1]) * 16)} == {1, 2}
        assert [e.tenant for e in view.versions("globex", bytes([1]) * 16)] == ["globex"]
        assert view.versions("initech", bytes([1]) * 16) == []
        assert view.entry("acme", bytes([2]) * 16, bytes([1]) * 16) == _entry(2, 1)
        assert view.entry("acme", bytes([2]) * 16, bytes([9]) * 16) is None


def test_expiry_order_and_segment_membership(index: Index) -> None:
    _with_segments(index, 1, 2)
    entries = [
        _entry(k, expires=e, segment=1 + k % 2)
        for k, e in [(1, 300.0), (2, 100.0), (3, math.inf), (4, 200.0)]
    ]
    with index.write() as w:
        for entry in entries:
            w.put_entry(entry)
    with index.read() as view:
        assert [e.key[0] for e in view.by_expiry(math.inf, 10)] == [2, 4, 1], "inf is never due"
        assert [e.key[0] for e in view.by_expiry(250.0, 10)] == [2, 4]
        assert [e.key[0] for e in view.by_expiry(math.inf, 1)] == [2]
        assert {e.key[0] for e in view.in_segment(2, 10)} == {1, 3}
        assert {e.key[0] for e in view.in_segment(1, 10)} == {2, 4}


def _keys(batch: list[tuple[bytes, Entry]]) -> list[int]:
    return [e.key[0] for _, e in batch]


def test_eviction_orders_skip_entries_that_never_expire(index: Index) -> None:
    _with_segments(index, 1)
    with index.write() as w:  # last access = expiry - 50, so both orders agree here
        for key, expires in [(1, 300.0), (2, 100.0), (3, math.inf), (4, 200.0)]:
            w.put_entry(_entry(key, expires=expires))
    with index.read() as view:
        assert _keys(view.evictable_by_expiry(b"", 10)) == [2, 4, 1], "inf must never be evicted"
        assert _keys(view.evictable_by_access(b"", 10)) == [2, 4, 1], "inf must never be evicted"
        first = view.evictable_by_access(b"", 1)
        assert _keys(view.evictable_by_access(first[0][0] + b"\x00", 10)) == [4, 1], "resume"


def test_access_order_follows_refreshes_and_deletes(index: Index) -> None:
    _with_segments(index, 1)
    a, b = _entry(1, expires=100.0), _entry(2, expires=500.0, cls="agent")
    with index.write() as w:
        w.put_entry(a)
        w.put_entry(b)
    with index.read() as view:
        assert _keys(view.evictable_by_access(b"", 10)) == [1, 2]
        assert _keys(view.evictable_by_expiry(b"", 10)) == [1, 2]
    with index.write() as w:  # a read hit on 1, persisted: it moves behind 2 in LRU order
        w.put_entry(replace(a, last_access_s=600.0, expires_at_s=650.0))
    with index.read() as view:
        assert _keys(view.evictable_by_access(b"", 10)) == [2, 1], "refresh not in LRU order"
    with index.write() as w:
        w.delete_entry(b)
    with index.read() as view:
        assert _keys(view.evictable_by_access(b"", 10)) == [1], "a deleted entry stays in LRU"


def test_by_group_lists_a_groups_entries_in_key_order_and_resumes() -> None:
    idx = Index(MemoryBackend(), group_of=lambda key: key[0] % 3)
    _with_segments(idx, 1)
    with idx.write() as w:
        for key in range(12):
            w.put_entry(_entry(key))
        w.delete_entry(_entry(3))
    seen, position = [], b""
    with idx.read() as view:
        while batch := view.by_group(0, position, 2):
            seen += [e.key[0] for _, e in batch]
            position = batch[-1][0] + b"\x00"
        assert [e.key[0] for _, e in view.by_group(1, b"", 10)] == [1, 4, 7, 10]
    assert seen == [0, 6, 9], "a group's listing skipped, repeated or kept a deleted entry"


def test_newest_version_and_retiring_older_ones(index: Index) -> None:
    _with_segments(index, 1)
    with index.write() as w:
        for version in (1, 3, 2):
            w.put_entry(_entry(5, version))
        assert w.newest("acme", bytes([5]) * 16) == _entry(5, 3)
        retired = w.retire_older(_entry(5, 3))
    assert sorted(e.version[0] for e in retired) == [1, 2]
    with index.read() as view:
        assert [e.version[0] for e in view.versions("acme", bytes([5]) * 16)] == [3]
        assert view.segment(1).num_live == 1, "retired versions still counted live"


def test_deletes_are_noted_per_tenant_and_pruned_with_the_delete_log(index: Index) -> None:
    key = bytes([7]) * 16
    with index.write() as w:
        w.note_deleted("acme", key, 10.0)
        w.note_deleted("acme", key, 20.0)  # a second delete moves it
        w.note_deleted("acme", key, 5.0)  # an older one (a peer's, pulled late) does not
        w.note_deleted("globex", bytes([8]) * 16, 15.0)
    with index.read() as view:
        assert view.deleted_at("acme", key) == 20.0
        assert view.deleted_at("globex", key) is None, "a delete leaked across tenants"
    with index.write() as w:
        w.note_deleted("globex", b"", 12.0)  # a purge of the whole tenant
    with index.read() as view:
        assert view.deleted_at("globex", key) == 12.0
        assert view.deleted_at("globex", key, tenant_wide=False) is None
    with index.write() as w:
        w.prune_tombstones(before_s=18.0)
    with index.read() as view:
        assert view.deleted_at("globex", bytes([8]) * 16) is None
        assert view.deleted_at("acme", key) == 20.0


def test_by_segment_walks_every_entry_in_segment_order_and_resumes(index: Index) -> None:
    _with_segments(index, 1, 2, 3)
    with index.write() as w:
        for key in range(9):
            w.put_entry(_entry(key, segment=3 - key % 3))
    seen, position = [], b""
    with index.read() as view:
        while batch := view.by_segment(position, 2):
            seen += [e for _, e in batch]
            position = batch[-1][0] + b"\x00"
    assert [e.segment_id for e in seen] == [1, 1, 1, 2, 2, 2, 3, 3, 3], "not in segment order"
    assert sorted(e.key[0] for e in seen) == list(range(9)), "a resumed scan skipped or repeated"


def test_replace_and_delete_keep_derived_figures_exact(index: Index) -> None:
    _with_segments(index, 1, 2)
    entry = _entry(1, expires=100.0)
    with index.write() as w:
        w.put_entry(entry)
        moved = replace(entry, segment_id=2, expires_at_s=500.0)
        assert w.put_entry(moved) == entry
    with index.read() as view:
        assert [e.expires_at_s for e in view.by_expiry(math.inf, 10)] == [500.0]
        assert view.in_segment(1, 10) == [] and view.in_segment(2, 10) == [moved]
        assert (view.segment(1).num_live, view.segment(2).num_live) == (0, 1)
        assert view.segment(2).live_bytes == record_bytes(1000, "acme", "chat")
        assert view.counter(class_counter("chat", "blocks")) == 1
        assert view.counter(class_counter("chat", "bytes")) == 1000
    with index.write() as w:
        assert w.delete_entry(moved) and not w.delete_entry(moved)
        w.delete_segment(1)
    with index.read() as view:
        assert view.by_expiry(math.inf, 10) == [] and view.in_segment(2, 10) == []
        assert view.counter(class_counter("chat", "blocks")) == 0
        assert [m.segment_id for m in view.segments()] == [2]
        assert view.used_bytes() == 10 * record_bytes(1000, "acme", "chat")
        assert view.next_segment_id() == 3


def test_a_failed_transaction_changes_nothing(index: Index) -> None:
    _with_segments(index, 1)
    with index.write() as w:
        w.put_entry(_entry(1))
    with pytest.raises(RuntimeError), index.write() as w:
        w.put_entry(_entry(2))
        w.delete_entry(_entry(1))
        w.add_segment(9, 9)
        w.add("x", 5)
        raise RuntimeError("crash before commit")
    with index.read() as view:
        assert view.versions("acme", bytes([1]) * 16) == [_entry(1)]
        assert view.versions("acme", bytes([2]) * 16) == []
        assert view.segment(9) is None and view.counter("x") is None
        assert view.segment(1).num_live == 1 and view.used_bytes() == 10 * record_bytes(
            1000, "acme", "chat"
        )


def test_counters_add_and_min(index: Index) -> None:
    with index.write() as w:
        w.add("hits", 2)
        w.add("hits", 3)
        w.set_min("youngest", 50.0)
        w.set_min("youngest", 70.0)
        w.set_min("youngest", 20.0)
    with index.read() as view:
        assert view.counters() == {"hits": 5.0, "youngest": 20.0}
        assert view.counter(USED_BYTES) is None


def _snapshot(index: Index) -> dict[str, list]:
    """Every row of the index's sub-databases an entry touches, and every counter."""
    with index.read() as view:
        txn = view._txn
        rows = {db: txn.scan(db, b"", None, 1 << 20) for db in ("entries", "expiry", "access")}
        rows.update({db: txn.scan(db, b"", None, 1 << 20) for db in ("by_seg", "by_group")})
        rows["segments"] = view.segments()
        rows["counters"] = sorted(view.counters().items())
    return rows


def test_put_entries_is_put_entry_of_each(tmp_path: Path) -> None:
    """The batch form (a group commit's) writes the same rows and derived figures as one
    put_entry per entry, replacements (records moved to another segment) included."""
    held = [_entry(1, segment=1), _entry(2, expires=math.inf, segment=2)]
    batch = [
        _entry(3, segment=1, offset=10),
        _entry(4, tenant="globex", segment=2, cls="agent"),
        replace(held[0], segment_id=2, offset=20),  # moved: replaces the held entry
        _entry(5, expires=math.inf, segment=2),
    ]
    indexes = [Index(MemoryBackend(), lambda key: key[0] % 3) for _ in range(2)]
    for index in indexes:
        _with_segments(index, 1, 2)
        with index.write() as w:
            for entry in held:
                w.put_entry(entry)
    with indexes[0].write() as w:
        assert w.put_entries(batch) == [None, None, held[0], None]
    with indexes[1].write() as w:
        for entry in batch:
            w.put_entry(entry)
    assert _snapshot(indexes[0]) == _snapshot(indexes[1]), "batch and one-by-one writes differ"


def test_put_entries_refuses_repeated_entries(index: Index) -> None:
    _with_segments(index, 1)
    with pytest.raises(ValueError, match="distinct"), index.write() as w:
        w.put_entries([_entry(1), replace(_entry(1), offset=5)])


# Exit 0: the exclusive lock lmdb's first opener takes on lock.mdb's byte 0 was refused.
_FIRST_OPENER_PROBE = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
try:
    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, 0)
except OSError:
    sys.exit(0)
sys.exit(1)
"""


def test_another_process_never_takes_an_open_index_for_unused(tmp_path: Path) -> None:
    """lmdb's first opener resets lock.mdb (reader table, write mutex); it knows it is first
    when it gets an exclusive fcntl lock. Closing any descriptor of lock.mdb drops this
    process's shared lock, and the scrub's check (another process) then reset the table under
    an open write transaction: readers lost their slots, and the writer's robust mutex was
    left on its thread's list, to crash the next lmdb call after the index closed."""
    path = tmp_path / "idx"
    backend = LmdbBackend(path, sync=False)
    with backend.begin(write=True) as txn:
        txn.put("counters", b"k", b"v")
    probe = [sys.executable, "-c", _FIRST_OPENER_PROBE, str(path / "lock.mdb")]
    try:
        locked = subprocess.run(probe, check=False).returncode
    finally:
        backend.close()
    assert locked == 0, "another process could take the open index's lock.mdb as unused"
    assert subprocess.run(probe, check=False).returncode == 1, "the probe cannot lock a free file"
