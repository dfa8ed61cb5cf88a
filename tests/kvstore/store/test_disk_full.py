"""A store and a node on a really full filesystem (a small tmpfs): clean errors, no crash,
reads and deletes keep working, and the index's own files count inside the byte limit."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.config import NodeConfig, TTLConfig, load_cluster
from kvstore.errors import CapacityExhausted
from kvstore.store.shard_store import ShardStore, Status
from tests.kvstore.disk_harness import mounted_tmpfs
from tests.kvstore.node_harness import NodeClient, make_shard, write_config
from tests.kvstore.store_harness import CLASSES
from ttl.clock import ManualClock

MiB = 1 << 20


def _key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def _node(data_dir: Path, **fields: object) -> NodeConfig:
    return NodeConfig("n0", "127.0.0.1:1", 0, "d0", str(data_dir), fsync=True, **fields)


def test_pinned_data_fills_the_disk_puts_get_capacity_errors_and_reads_go_on(
    tmp_path: Path, clock: ManualClock
) -> None:
    with mounted_tmpfs(tmp_path / "fs", 4 * MiB) as fs:
        ttl = TTLConfig(classes=CLASSES)
        store = ShardStore(_node(fs / "n0"), ttl, clock)
        stored, errors = {}, []
        for i in range(400):  # 400 x 20 kB never-evicted shards onto 4 MiB
            shard = make_shard(os.urandom(20_000))
            try:
                store.put("acme", "pinned", [(_key(i), shard)])
                stored[_key(i)] = shard
            except CapacityExhausted as exc:  # anything else (OSError, lmdb) fails the test
                errors.append(exc)
        assert errors and stored, f"{len(stored)} stored, {len(errors)} refused: never filled"
        assert shutil.disk_usage(fs).free < 64 << 10, "the filesystem did not fill up"
        results = store.get("acme", list(stored))
        assert [r.shards for r in results] == [(s,) for s in stored.values()], (
            "a shard stored before the disk filled up no longer reads back exactly"
        )
        assert store.delete("acme", list(stored)[:3]) == 3, "a delete failed on a full disk"
        store.tick()
        store.close()
        store = ShardStore(_node(fs / "n0"), ttl, clock)  # start-up on the full disk
        try:
            survivors = list(stored)[3:]
            assert all(r.status == Status.HIT for r in store.get("acme", survivors))
        finally:
            store.close()


def test_evictable_data_on_a_full_disk_is_evicted_to_make_room(
    tmp_path: Path, clock: ManualClock
) -> None:
    with mounted_tmpfs(tmp_path / "fs", 4 * MiB) as fs:
        store = ShardStore(_node(fs / "n0"), TTLConfig(classes=CLASSES), clock)
        try:
            last = {}
            for i in range(400):  # 8 MB of chat shards: the oldest are evicted, puts go on
                shard = make_shard(os.urandom(20_000))
                store.put("acme", "chat", [(_key(i), shard)])
                last = {_key(i): shard, **dict(list(last.items())[:20])}
                clock.advance(1.0)
            stats = store.stats()
            assert stats.classes[0].evicted > 0, "nothing was evicted on a full disk"
            assert stats.used_bytes + stats.index_bytes <= 4 * MiB
            results = store.get("acme", list(last))
            assert all(r.status == Status.HIT for r in results), "the newest shards were lost"
        finally:
            store.close()


def test_compaction_on_a_full_disk_waits_and_the_rest_of_upkeep_runs(
    tmp_path: Path, clock: ManualClock
) -> None:
    """A mostly dead segment is compacted by carrying its live records into a new one; a
    full disk has no room for them. The tick goes on (CI's node died at start-up here: its
    first tick raised), and the compaction happens once space is freed."""
    with mounted_tmpfs(tmp_path / "fs", 24 * MiB) as fs:
        node = _node(fs / "n0", segment_max_bytes=8 * MiB)  # the filler goes to later files
        store = ShardStore(node, TTLConfig(classes=CLASSES), clock)
        try:
            keys = [_key(i) for i in range(400)]  # 8 MB pinned, 6.8 MB of it deleted
            for key in keys:
                store.put("acme", "pinned", [(key, make_shard(os.urandom(20_000)))])
            assert store.delete("acme", keys[60:]) == 340
            keys = keys[:60]
            filler = 1000
            with pytest.raises(CapacityExhausted):  # the rest of the disk: pinned too
                while True:
                    store.put("acme", "pinned", [(_key(filler), make_shard(os.urandom(20_000)))])
                    filler += 1
            before = store.stats().compacted_bytes
            store.tick()  # must not raise
            assert store.stats().compacted_bytes == before, "compacted with no room to copy"
            assert all(r.status == Status.HIT for r in store.get("acme", keys))
            assert store.delete("acme", [_key(i) for i in range(1000, filler)]) == filler - 1000
            store.tick()
            assert store.stats().compacted_bytes > before, "space came back, no compaction"
            assert all(r.status == Status.HIT for r in store.get("acme", keys))
        finally:
            store.close()


def test_the_index_counts_inside_max_bytes(tmp_path: Path, clock: ManualClock) -> None:
    store = ShardStore(_node(tmp_path, max_bytes=3 * MiB), TTLConfig(classes=CLASSES), clock)
    try:
        for i in range(2_000):  # small shards: the index is a large share of the bytes
            store.put("acme", "chat", [(_key(i), make_shard(os.urandom(500)))])
            clock.advance(1.0)
        stats = store.stats()
    finally:
        store.close()
    on_disk = sum(p.stat().st_blocks * 512 for p in tmp_path.rglob("*") if p.is_file())
    assert stats.index_bytes > 0 and stats.capacity_bytes + stats.index_bytes == 3 * MiB
    assert on_disk <= 3 * MiB + (64 << 10), (
        f"the node holds {on_disk} bytes on disk with max_bytes = 3 MiB: the index is not "
        "counted inside the limit"
    )


@pytest.mark.slow
async def test_a_node_on_a_full_disk_never_crashes_and_restarts(tmp_path: Path, start_node) -> None:
    with mounted_tmpfs(tmp_path / "fs", 8 * MiB) as fs:
        config = write_config(tmp_path, data_dir=fs / "n0", classes={"pinned": float("inf")})
        node = start_node(config)
        address = load_cluster(config).nodes[0].address
        stored = {}
        async with NodeClient(address) as client:
            for i in range(60):  # 60 x 200 kB pinned onto 8 MiB, 4 shards per request
                items = [(_key(4 * i + j), make_shard(os.urandom(50_000))) for j in range(4)]
                try:
                    await client.put(items, traffic_class="pinned")
                    stored.update(items)
                except Exception as exc:  # grpc.aio.AioRpcError
                    assert "RESOURCE_EXHAUSTED" in str(exc), f"not a clean capacity error: {exc}"
            assert node.proc is not None and node.proc.poll() is None, "the node died"
            results = await client.get(list(stored)[:40])
            assert all(r.status == 1 for r in results), "reads failed on the full disk"
            assert await client.delete(list(stored)[:4]) == 4
        assert node.stop() == 0, "the node did not shut down cleanly on the full disk"
        start_node(config)  # it starts again on the full disk
        async with NodeClient(address) as client:
            results = await client.get(list(stored)[4:40])
            assert all(r.status == 1 for r in results), "reads failed after restarting full"


@pytest.mark.parametrize("free_bytes", [0, 4096, 16384])
def test_a_new_node_on_a_full_disk_exits_with_a_clear_error(tmp_path: Path, free_bytes) -> None:
    # lmdb maps its lock file; a page a full disk cannot back killed the node with SIGBUS
    # (0 bytes free) or a traceback (a few KB), and 12 nodes starting on a filling disk
    # died that way in CI. Now the node says the disk is full and exits with 1.
    with mounted_tmpfs(tmp_path / "fs", 1 * MiB) as fs:
        config = write_config(tmp_path, data_dir=fs / "n0")
        filler = fs / "filler"
        with filler.open("wb") as f:
            os.posix_fallocate(f.fileno(), 0, shutil.disk_usage(fs).free - free_bytes)
        command = [sys.executable, "-m", "kvstore.cli", "node", "--config", str(config)]
        result = subprocess.run(
            [*command, "--id", "n0"], capture_output=True, text=True, timeout=120
        )
    assert result.returncode == 1, f"exit {result.returncode}: {result.stderr[-2000:]}"
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("kvstore node n0: disk full"), result.stderr[-2000:]
