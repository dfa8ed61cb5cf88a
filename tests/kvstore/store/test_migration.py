"""A data directory written before the format bump (index format 1, KVR1 records) is migrated:
every shard still reads, piled-up versions go, and its records are rewritten in format 2.

The writer below lays the old format out byte by byte as that version wrote it: 40-byte KVR1
record headers, and index entries without record format or shard index, no ``access`` order
(older still) and no ``by_group`` order.
"""

from __future__ import annotations

import math
import os
import shutil
import struct
from pathlib import Path

import xxhash

from kvstore.config import NodeConfig, TTLConfig
from kvstore.store.index import class_counter
from kvstore.store.index_backends import LmdbBackend
from kvstore.store.index_codec import tenant_hash
from kvstore.store.shard_store import ShardStore, Status
from tests.kvstore.node_harness import DAY_S, make_shard
from tests.kvstore.store_harness import CLASSES, T0
from ttl.clock import ManualClock

_U64 = struct.Struct(">Q")


def _key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def _time_key(time_s: float) -> bytes:
    return _U64.pack((1 << 64) - 1 if math.isinf(time_s) else int(time_s * 1e6))


def write_format_1(data_dir: Path, items: list[tuple[bytes, bytes, float, str]]) -> None:
    """A node's data dir in format 1: (key, shard, written_at_s, class) for tenant acme, all
    in segment 1 (window 0), as the pre-bump store wrote them."""
    (data_dir / "segments").mkdir(parents=True)
    th = tenant_hash("acme")
    records, entries, offset = [], [], 0
    for key, shard, written_at_s, traffic_class in items:
        fields = struct.pack("<4sI16s8s", b"KVR1", len(shard), key, th)
        header = fields + struct.pack("<Q", xxhash.xxh3_64_intdigest(fields))
        records.append(header + shard)
        expires_at_s = written_at_s + CLASSES.ttl_s(traffic_class)
        checksum = int.from_bytes(shard[40:48], "little")
        cls = traffic_class.encode()
        value = (
            struct.pack(
                "<QQIQdddB",
                1,
                offset,
                len(shard),
                checksum,
                written_at_s,
                written_at_s,
                expires_at_s,
                len(cls),
            )
            + cls
            + b"acme"
        )
        entries.append((th + key + shard[20:36], value, expires_at_s, traffic_class, len(shard)))
        offset += len(header) + len(shard)
    (data_dir / "segments" / "000000000001.seg").write_bytes(b"".join(records))
    backend = LmdbBackend(data_dir / "index", sync=False)
    with backend.begin(write=True) as txn:
        counters: dict[str, float] = {"node/used_bytes": offset, "node/next_segment_id": 2}
        for index_key, value, expires_at_s, traffic_class, shard_bytes in entries:
            txn.put("entries", index_key, value)
            txn.put("expiry", _time_key(expires_at_s) + index_key, b"")
            txn.put("by_seg", _U64.pack(1) + index_key, b"")
            for name, delta in (("blocks", 1), ("bytes", shard_bytes)):
                counter = class_counter(traffic_class, name)
                counters[counter] = counters.get(counter, 0) + delta
        txn.put("segments", _U64.pack(1), struct.pack("<qQQQ", 0, offset, offset, len(entries)))
        for name, value in counters.items():
            txn.put("counters", name.encode(), struct.pack("<d", value))
    backend.close()


def test_a_format_1_node_is_migrated_and_its_records_rewritten(tmp_path: Path) -> None:
    clock = ManualClock(T0)
    items, newest = [], {}
    for i in range(30):
        shard = make_shard(os.urandom(500 + i), index=0)
        items.append((_key(i), shard, T0 - 100 + i, "chat" if i % 2 else "agent"))
        newest[_key(i)] = shard
    for version in range(150):  # a key overwritten 150 times: format 1 kept every version
        shard = make_shard(version.to_bytes(4, "big") * 1000)
        items.append((_key(99), shard, T0 - 50 + version, "chat"))
    newest[_key(99)] = shard
    write_format_1(tmp_path, items)
    node = NodeConfig("n0", "127.0.0.1:1", 0, "d0", str(tmp_path), fsync=False)
    ttl = TTLConfig(classes=CLASSES)
    store = ShardStore(node, ttl, clock)
    try:
        results = store.get("acme", list(newest))
        assert [r.shards for r in results] == [(s,) for s in newest.values()], (
            "a shard written in format 1 does not read back after the migration"
        )
        assert store.stats().retired_versions == 149, "piled-up versions were not retired"
        assert store.stats().num_shards == 31
        entries, _ = store.list_group(0, b"", 100)
        assert len(entries) == 31, "the migration did not file entries for the repair listing"
        store.tick()  # rewrites the format-1 segment
        segments = sorted((tmp_path / "segments").iterdir())
        assert segments and all(p.read_bytes()[:4] == b"KVR2" for p in segments), (
            "format-1 records were not rewritten in format 2"
        )
        clock.advance(2.9 * DAY_S)
        assert store.get("acme", [_key(1)])[0].status == Status.HIT
    finally:
        store.close()
    shutil.rmtree(tmp_path / "index")  # now a lost index can be rebuilt from the records
    store = ShardStore(node, ttl, clock)
    try:
        results = store.get("acme", list(newest))
        live = [r.status for r in results]
        assert live.count(Status.HIT) >= 16, f"the rebuild lost migrated shards: {live}"
        assert results[-1].shards == (newest[_key(99)],)
    finally:
        store.close()
