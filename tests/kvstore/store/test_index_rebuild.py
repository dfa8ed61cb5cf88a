"""A lost or damaged index is rebuilt from the segment records; bytes no record accounts for
are never deleted; a node is not serving while its index is unusable."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from kvstore.config import NodeConfig, TTLConfig, load_cluster
from kvstore.errors import IndexUnusable
from kvstore.node.store_holder import StoreHolder
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto.kvstore_pb2_grpc import ShardStoreStub
from kvstore.store.shard_store import ShardStore, Status
from tests.kvstore.node_harness import DAY_S, REPO_ROOT, NodeClient, make_shard, write_config
from tests.kvstore.store_harness import CLASSES, damage_index_pages
from ttl.clock import ManualClock


def _key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def _node(data_dir: Path, **fields: object) -> NodeConfig:
    return NodeConfig("n0", "127.0.0.1:1", 0, "d0", str(data_dir), fsync=False, **fields)


def _fill(store: ShardStore, clock: ManualClock) -> dict[bytes, bytes]:
    """Shards of three classes, an overwritten key, a refreshed one, and expired ones."""
    expected = {}
    for i in range(60):
        cls = ("chat", "agent", "pinned")[i % 3]
        shard = make_shard(os.urandom(100 + 37 * i))
        store.put("acme", cls, [(_key(i), shard)])
        expected[_key(i)] = shard
    clock.advance(1.0)
    newer = make_shard(b"the newer version")
    store.put("acme", "chat", [(_key(0), newer)])  # the older version is retired
    expected[_key(0)] = newer
    store.put("globex", "chat", [(_key(1), make_shard(b"another tenant"))])
    clock.advance(2.5 * DAY_S)
    store.get("acme", [_key(i) for i in range(1, 30, 3)])  # half the agent blocks refreshed
    clock.advance(1.0 * DAY_S)  # the agent blocks never read (3d TTL) expire now
    store.tick()
    return expected


def test_a_deleted_index_is_rebuilt_from_the_segments(tmp_path: Path, clock: ManualClock) -> None:
    ttl = TTLConfig(classes=CLASSES, expiry_window_s=3600.0)
    store = ShardStore(_node(tmp_path), ttl, clock)
    expected = _fill(store, clock)
    before = {k: r for k, r in zip(expected, store.get("acme", list(expected)), strict=True)}
    segments_before = sorted(p.name for p in (tmp_path / "segments").iterdir())
    store.close()
    shutil.rmtree(tmp_path / "index")  # lost
    store = ShardStore(_node(tmp_path), ttl, clock)
    try:
        after = dict(zip(expected, store.get("acme", list(expected)), strict=True))
        assert sorted(p.name for p in (tmp_path / "segments").iterdir()) == segments_before, (
            "start-up deleted segment files of a lost index (they hold every shard)"
        )
        assert {k: r.status for k, r in after.items()} == {
            k: r.status for k, r in before.items()
        }, "the rebuilt index serves another set of shards than the lost one"
        assert all(r.shards == before[k].shards for k, r in after.items()), "wrong bytes"
        [other] = store.get("globex", [_key(1)])
        assert other.shards[0][48:] == b"another tenant", "a tenant's shard was lost or mixed"
        assert store.contains("acme", [_key(0)]) == [[before[_key(0)].shards[0][20:36]]], (
            "the rebuild brought back a retired version"
        )
    finally:
        store.close()


def test_bytes_no_record_accounts_for_are_quarantined_not_deleted(
    tmp_path: Path, clock: ManualClock
) -> None:
    ttl = TTLConfig(classes=CLASSES)
    store = ShardStore(_node(tmp_path), ttl, clock)
    shards = {_key(i): make_shard(bytes([i]) * 5000) for i in range(6)}
    for key, shard in shards.items():
        store.put("acme", "chat", [(key, shard)])
    store.close()
    [segment] = sorted((tmp_path / "segments").iterdir())
    data = bytearray(segment.read_bytes())
    where = data.index(bytes([2]) * 5000) - 100  # inside the record header of key 2
    data[where : where + 8] = b"\xde\xad\xbe\xef" * 2
    segment.write_bytes(bytes(data))
    stray = tmp_path / "segments" / "000000009999.seg"  # a file no record makes sense of
    stray.write_bytes(os.urandom(3000))
    shutil.rmtree(tmp_path / "index")
    store = ShardStore(_node(tmp_path), ttl, clock)
    try:
        results = store.get("acme", list(shards))
        statuses = [r.status for r in results]
        assert statuses == [Status.HIT] * 2 + [Status.MISS] + [Status.HIT] * 3, statuses
        quarantine = tmp_path / "quarantine"
        assert [p.name for p in quarantine.iterdir()] == ["000000009999.seg.no-records"]
        store.delete("acme", list(shards))
        store.tick()  # the damaged segment is now empty: freed, so it moves to quarantine/
        names = sorted(p.name for p in quarantine.iterdir())
        assert names == [f"{segment.name}.unaccounted", "000000009999.seg.no-records"], names
        kept = (quarantine / f"{segment.name}.unaccounted").read_bytes()
        assert len(kept) == len(data)
        damaged = slice(where, data.index(bytes([2]) * 5000) + 5000)
        assert kept[damaged] == data[damaged], "the bytes no record accounts for were not kept"
        assert bytes([4]) * 5000 not in kept, "a deleted record's bytes went to quarantine"
        assert store.stats().quarantined_bytes == len(data) + 3000
    finally:
        store.close()


def test_a_damaged_index_is_moved_aside_and_rebuilt(tmp_path: Path, clock: ManualClock) -> None:
    ttl = TTLConfig(classes=CLASSES)
    store = ShardStore(_node(tmp_path), ttl, clock)
    shards = {_key(i): make_shard(os.urandom(2000)) for i in range(200)}
    store.put("acme", "chat", list(shards.items()))
    store.close()
    data_mdb = tmp_path / "index" / "data.mdb"
    with data_mdb.open("r+b") as f:  # garbage over the pages after lmdb's two meta pages
        f.seek(2 * 4096)
        f.write(os.urandom(data_mdb.stat().st_size - 2 * 4096))
    store = ShardStore(_node(tmp_path), ttl, clock)
    try:
        results = store.get("acme", list(shards))
        assert [r.shards for r in results] == [(s,) for s in shards.values()]
        assert list(tmp_path.glob("index.damaged-*")), "the damaged index was not kept aside"
    finally:
        store.close()


def test_a_damaged_leaf_is_moved_aside_at_open_without_killing_the_process(
    tmp_path: Path, clock: ManualClock
) -> None:
    """A leaf past the first one damaged: lmdb's cursor aborts the process that steps onto it,
    so a node that read its index through in-process died at every start instead of
    rebuilding it."""
    ttl = TTLConfig(classes=CLASSES)
    store = ShardStore(_node(tmp_path), ttl, clock)
    shards = {_key(i): make_shard(os.urandom(200)) for i in range(400)}
    store.put("acme", "chat", list(shards.items()))
    store.close()
    assert damage_index_pages(tmp_path, _key(300)) > 0
    store = ShardStore(_node(tmp_path), ttl, clock)
    try:
        assert list(tmp_path.glob("index.damaged-*")), "the damaged index was not kept aside"
        results = store.get("acme", list(shards))
        assert [r.shards for r in results] == [(s,) for s in shards.values()]
    finally:
        store.close()


async def test_an_index_failing_while_serving_is_rebuilt(
    tmp_path: Path, clock: ManualClock
) -> None:
    ttl = TTLConfig(classes=CLASSES)
    node = _node(tmp_path)
    shards = {_key(i): make_shard(os.urandom(1000)) for i in range(50)}
    seed = ShardStore(node, ttl, clock)
    seed.put("acme", "chat", list(shards.items()))
    seed.close()
    executor = ThreadPoolExecutor(2)
    holder = StoreHolder(lambda: ShardStore(node, ttl, clock), node, executor)
    try:
        await holder.open()
        holder.rebuild_after(IndexUnusable("pages no longer read (test)"))
        assert holder.store is None and holder.state == "rebuilding index"
        while holder.store is None:
            await asyncio.sleep(0.01)
        results = holder.require().get("acme", list(shards))
        assert [r.shards for r in results] == [(s,) for s in shards.values()]
        assert holder.state == "serving" and list(tmp_path.glob("index.damaged-*"))
    finally:
        await holder.close()
        executor.shutdown()


async def test_a_node_says_not_serving_until_its_lost_index_is_rebuilt(
    tmp_path: Path, start_node
) -> None:
    config = write_config(tmp_path)
    node = start_node(config)
    address = load_cluster(config).nodes[0].address
    # Enough shards that the rebuild (each one read and verified) outlasts the first polls.
    shards = {_key(i): make_shard(os.urandom(500)) for i in range(4_000)}
    async with NodeClient(address) as client:
        items = list(shards.items())
        for start in range(0, len(items), 2000):
            await client.put(items[start : start + 2000])
    node.stop()
    shutil.rmtree(tmp_path / "n0" / "index")
    command = [sys.executable, "-m", "kvstore.cli", "node", "--config", str(config), "--id", "n0"]
    proc = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.DEVNULL)
    states = set()
    try:
        deadline_s = time.monotonic() + 60
        # Reconnect fast: gRPC's default backoff after the first refused dial could outlast
        # the whole rebuild.
        options = [("grpc.initial_reconnect_backoff_ms", 20), ("grpc.max_reconnect_backoff_ms", 50)]
        with grpc.insecure_channel(address, options=options) as channel:
            stub = ShardStoreStub(channel)
            while time.monotonic() < deadline_s:
                try:
                    reply = stub.Health(pb.HealthRequest(), timeout=1.0)
                except grpc.RpcError:
                    time.sleep(0.005)
                    continue
                states.add((reply.serving, reply.state))
                if reply.serving:
                    break
                try:
                    stub.GetShards(pb.GetShardsRequest(tenant="acme", keys=[_key(0)]), timeout=1)
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
        assert (False, "recovering") in states, f"never seen not serving: {states}"
        assert (True, "serving") in states, f"never serving after the rebuild: {states}"
        async with NodeClient(address) as client:
            results = await client.get(list(shards)[:200])
            assert [r.shards[0] for r in results] == list(shards.values())[:200]
    finally:
        proc.terminate()
        proc.wait(15)
