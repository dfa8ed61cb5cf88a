"""A real node process on 127.0.0.1: durability, recovery, integrity, bad input, isolation."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from erasure.codec import make_codec
from erasure.shard import ShardHeader, pack_header
from kvstore.auth import Role, add_principal
from kvstore.config import load_cluster, save_cluster
from kvstore.proto import kvstore_pb2 as pb
from kvstore.store.segments import MIN_HEADER_BYTES
from tests.kvstore.node_harness import (
    DAY_S,
    NodeClient,
    class_stats,
    free_port,
    make_shard,
    version_of,
    write_config,
)

HIT, MISS, CORRUPT = 1, 0, 2


def _address(config_path: Path) -> str:
    return load_cluster(config_path).nodes[0].address


def _segment_files(config_path: Path) -> list[Path]:
    return sorted((config_path.parent / "n0" / "segments").glob("*.seg"))


def _payloads(rng: random.Random, num: int) -> list[bytes]:
    # Edge sizes first; no 0: a node refuses an empty shard (test_node_bad_input.py)
    sizes = [1, 2, 7, 4096, 65_537] + [rng.randrange(1, 40_000) for _ in range(num - 5)]
    return [rng.randbytes(size) for size in sizes]


async def _assert_all_hit(client: NodeClient, key_to_payload: dict[bytes, bytes]) -> None:
    keys = list(key_to_payload)
    results = await client.get(keys)
    for key, result in zip(keys, results, strict=True):
        assert result.status == HIT, f"committed shard {key.hex()} lost: durability bug"
        assert result.shards[0][48:] == key_to_payload[key], "wrong bytes served: index bug"


async def test_round_trip_versions_restart_and_crash(tmp_path: Path, start_node) -> None:
    rng = random.Random(1)
    metrics_port = free_port()
    config = write_config(tmp_path, metrics_port=metrics_port)
    node = start_node(config)
    key_to_payload = {rng.randbytes(16): p for p in _payloads(rng, 300)}
    async with NodeClient(_address(config)) as client:
        items = [(k, make_shard(p)) for k, p in key_to_payload.items()]
        assert await client.put(items[:150]) == 150
        assert await client.put(items) == 150, "re-put of the same version must be idempotent"
        await _assert_all_hit(client, key_to_payload)
        keys = list(key_to_payload)
        rows = await client.read_batch([*keys, b"m" * 16])
        hits = sorted((i, shard[48:]) for i, status, shard in rows if status == HIT)
        assert hits == list(enumerate(key_to_payload.values())), "ReadBatch served wrong shards"
        assert [(i, status) for i, status, _ in rows if status != HIT] == [(len(keys), MISS)]
        key, old = next(iter(key_to_payload.items()))
        new = old + b"v2"
        assert await client.put([(key, make_shard(new))]) == 1
        [newest] = await client.get([key])
        assert [s[48:] for s in newest.shards] == [new], "an overwrite must retire the old version"
        [only_new] = await client.get([key], version=version_of(new))
        assert [s[48:] for s in only_new.shards] == [new], "version filter ignored"
        [retired] = await client.get([key], version=version_of(old))
        assert retired.status == MISS, "the retired version is still served"
        assert (await client.contains([key]))[0] == [version_of(new)]
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics") as reply:
            text = reply.read().decode()
        assert "kvstore_shards 300.0" in text, "shard gauge missing from /metrics"
        assert "kvstore_retired_versions_total 1.0" in text
        assert 'kvstore_class_hits_total{traffic_class="chat"}' in text
        assert 'kvstore_class_youngest_evicted_age_seconds{traffic_class="chat"} +Inf' in text, (
            "nothing was evicted: the youngest evicted age must be +Inf (the minimum of none)"
        )
        assert "process_resident_memory_bytes" in text and "kvstore_build_info{" in text
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/healthz") as reply:
            assert reply.read() == b"ok\n", "/healthz answers health, not metrics"
    node.stop()

    node = start_node(config)
    async with NodeClient(_address(config)) as client:
        key_to_payload.pop(key)
        await _assert_all_hit(client, key_to_payload)
        stats = await client.stats()
        assert stats.shards == 300 and class_stats(stats, "chat").hits >= 600, "stats not kept"
        assert (stats.hits, stats.misses) == (class_stats(stats, "chat").hits, 2)
        assert stats.used_bytes >= stats.bytes > 0
        more = {rng.randbytes(16): rng.randbytes(3000) for _ in range(20)}
        await client.put([(k, make_shard(p)) for k, p in more.items()])
    node.kill()  # crash: no clean shutdown

    start_node(config)
    async with NodeClient(_address(config)) as client:
        await _assert_all_hit(client, {**key_to_payload, **more})


async def test_torn_tail_and_truncated_record_recovery(tmp_path: Path, start_node) -> None:
    rng = random.Random(2)
    config = write_config(tmp_path)
    node = start_node(config)
    key_to_payload = {rng.randbytes(16): rng.randbytes(5000) for _ in range(10)}
    async with NodeClient(_address(config)) as client:
        for key, payload in key_to_payload.items():  # one request each: records in order
            await client.put([(key, make_shard(payload))])
    node.stop()
    [segment] = _segment_files(config)
    committed_bytes = segment.stat().st_size
    with segment.open("ab") as f:  # a crash mid-append: half of an uncommitted record
        f.write(os.urandom(MIN_HEADER_BYTES + 2000))

    node = start_node(config)
    assert segment.stat().st_size == committed_bytes, "torn tail not truncated at start-up"
    async with NodeClient(_address(config)) as client:
        await _assert_all_hit(client, key_to_payload)
    node.stop()

    os.truncate(segment, committed_bytes - 1000)  # lose the end of the last committed record
    last_key = list(key_to_payload)[-1]
    start_node(config)
    async with NodeClient(_address(config)) as client:
        [last] = await client.get([last_key])
        assert last.status == MISS, "a record cut short must not be served"
        await _assert_all_hit(client, {k: p for k, p in key_to_payload.items() if k != last_key})
        assert (await client.stats()).corrupt_shards == 1, "lost record not counted"
        new_key = rng.randbytes(16)
        await client.put([(new_key, make_shard(b"after recovery"))])
        await _assert_all_hit(client, {new_key: b"after recovery"})


async def test_bitrot_is_reported_corrupt_and_repairable(tmp_path: Path, start_node) -> None:
    # Scrub off: a pass that found the flipped byte before the read would have it dropped by
    # the next tick, and the read would see a miss rather than the corrupt shard.
    config = write_config(tmp_path, scrub_bytes_per_s=0)
    start_node(config)
    key_to_payload = {bytes([i]) * 16: bytes([65 + i]) * 3000 for i in range(5)}
    async with NodeClient(_address(config)) as client:
        await client.put([(k, make_shard(p)) for k, p in key_to_payload.items()])
        [segment] = _segment_files(config)
        data = segment.read_bytes()
        where = data.index(bytes([67]) * 3000) + 1234  # inside the payload of key 2
        with segment.open("r+b") as f:
            f.seek(where)
            f.write(bytes([data[where] ^ 0x01]))
        results = await client.get(list(key_to_payload))
        assert [r.status for r in results] == [HIT, HIT, CORRUPT, HIT, HIT], "bitrot served"
        assert results[2].shards == [], "a corrupt shard must never be returned"
        assert (await client.stats()).corrupt_shards == 1, "corrupt shard not counted"
        bad_key = bytes([2]) * 16
        await client.put([(bad_key, make_shard(key_to_payload[bad_key]))])  # a repair
        await _assert_all_hit(client, key_to_payload)


async def test_scrub_finds_bitrot_without_a_read(tmp_path: Path, start_node) -> None:
    metrics_port = free_port()
    config = write_config(tmp_path, metrics_port=metrics_port, scrub_pass_interval_s=0.2)
    start_node(config)
    key_to_payload = {bytes([i]) * 16: bytes([65 + i]) * 3000 for i in range(5)}
    bad_key = bytes([3]) * 16
    async with NodeClient(_address(config)) as client:
        await client.put([(k, make_shard(p)) for k, p in key_to_payload.items()])
        [segment] = _segment_files(config)
        data = bytearray(segment.read_bytes())
        data[data.index(key_to_payload[bad_key]) + 500] ^= 0x01
        segment.write_bytes(bytes(data))
        deadline_s = time.monotonic() + 120.0  # a bound, not a speed: a pass starts each 0.2 s
        while await client.contains([bad_key]) != [[]]:  # found, then dropped by a tick
            assert time.monotonic() < deadline_s, "the scrub did not find the flipped byte"
            await asyncio.sleep(0.1)
        stats = await client.stats()
        assert (stats.corrupt_shards, stats.hits, stats.misses) == (1, 0, 0), (
            "the scrub must report bitrot once and count no read"
        )
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics") as reply:
            text = reply.read().decode()
        assert "kvstore_scrubbed_bytes_total" in text and "kvstore_scrub_passes_total" in text
        [stamp] = [
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("kvstore_scrub_last_full_pass_timestamp_seconds ")
        ]
        assert abs(stamp - time.time()) < 120, "a timestamp metric must be real Unix time"
        assert await client.put([(bad_key, make_shard(key_to_payload[bad_key]))]) == 1
        await _assert_all_hit(client, key_to_payload)


async def _expect_code(call, code: grpc.StatusCode, fragment: str = "") -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code, f"expected {code.name}: {info.value.details()}"
    assert fragment in (info.value.details() or ""), info.value.details()


async def test_bad_input_gets_clear_errors_and_changes_nothing(tmp_path: Path, start_node) -> None:
    config = write_config(tmp_path, max_shard_bytes=64 << 10, max_batch_bytes=256 << 10)
    start_node(config)
    bad = grpc.StatusCode.INVALID_ARGUMENT
    good_key, good = b"k" * 16, make_shard(b"fine")
    corrupt = bytearray(make_shard(b"x" * 100))
    corrupt[-1] ^= 0xFF
    async with NodeClient(_address(config)) as client:
        await _expect_code(client.put([(b"short", good)]), bad, "16 bytes")
        await _expect_code(client.get([b"k" * 17]), bad, "16 bytes")
        await _expect_code(client.contains([b""]), bad, "16 bytes")
        await _expect_code(client.delete([b"k"]), bad, "16 bytes")
        await _expect_code(client.put([(good_key, good)], traffic_class="bulk"), bad, "bulk")
        await _expect_code(client.put([(good_key, b"not a shard")]), bad, "malformed")
        await _expect_code(client.put([(good_key, bytes(corrupt))]), bad, "checksum")
        await _expect_code(client.put([(good_key, make_shard(b"x" * (65 << 10)))]), bad, "at most")
        batch = [(bytes([i]) * 16, make_shard(bytes([i]) * (60 << 10))) for i in range(5)]
        await _expect_code(client.put(batch), bad, "max_batch_bytes")
        huge = [(bytes([i]) * 16, make_shard(bytes(60 << 10))) for i in range(30)]
        await _expect_code(client.put(huge), grpc.StatusCode.RESOURCE_EXHAUSTED)
        await _expect_code(client.get([good_key], version=b"v1"), bad, "version")
        await _expect_code(client.put([(good_key, good), (b"j" * 16, b"junk")]), bad)
        assert await client.contains([good_key, b"j" * 16]) == [[], []], "failed put left state"
        empty = NodeClient(_address(config), tenant="")
        async with empty:
            await _expect_code(empty.put([(good_key, good)]), bad, "tenant")
        raw_put = client.channel.unary_unary("/kvstore.v1.ShardStore/PutShards")
        await _expect_code(raw_put(b"\xff\xff\xff"), bad, "malformed")
        assert await client.put([(good_key, good)]) == 1, "node unusable after bad input"
        assert (await client.stats()).shards == 1


async def test_auth_token_and_injected_delay(tmp_path: Path, start_node) -> None:
    credentials = tmp_path / "credentials.toml"
    token = add_principal(credentials, "acme", Role.TENANT)
    config = write_config(tmp_path, credentials_file=str(credentials))
    start_node(config, extra_args=("--inject-delay-ms", "200"))
    denied = grpc.StatusCode.PERMISSION_DENIED
    async with NodeClient(_address(config)) as anonymous:
        await _expect_code(anonymous.contains([b"k" * 16]), denied, "credential")
        assert await anonymous.now_s() > 0, "Health must answer without a token"
    async with NodeClient(_address(config), token="wrong") as wrong:
        await _expect_code(wrong.stats(), denied)
    async with NodeClient(_address(config), token=token) as tenant_only:
        await _expect_code(tenant_only.stats(), denied, "role")
    async with NodeClient(_address(config), token=token) as client:
        start_s = time.monotonic()
        assert await client.contains([b"k" * 16]) == [[]]
        assert time.monotonic() - start_s >= 0.2, "--inject-delay-ms not applied"


async def test_tenants_never_see_each_other(tmp_path: Path, start_node) -> None:
    config = write_config(tmp_path)
    start_node(config)
    key = b"s" * 16
    async with (
        NodeClient(_address(config), tenant="acme") as acme,
        NodeClient(_address(config), tenant="globex") as globex,
    ):
        await acme.put([(key, make_shard(b"acme secret"))])
        assert (await globex.get([key]))[0].status == MISS, "tenant isolation broken"
        assert await globex.contains([key]) == [[]]
        assert await globex.delete([key]) == 0, "one tenant deleted another's shard"
        await globex.put([(key, make_shard(b"globex data"))])
        assert (await acme.get([key]))[0].shards[0][48:] == b"acme secret"
        assert (await globex.get([key]))[0].shards[0][48:] == b"globex data"
        assert await acme.delete([key]) == 1
        assert (await globex.get([key]))[0].shards[0][48:] == b"globex data"


async def test_byte_limit_evicts_expirable_and_refuses_only_pinned(
    tmp_path: Path, start_node
) -> None:
    classes = {"chat": 7 * DAY_S, "pinned": float("inf")}
    config = write_config(
        tmp_path, classes=classes, max_bytes=1 << 20, high_watermark=0.9, low_watermark=0.5
    )
    start_node(config)
    rng = random.Random(3)
    async with NodeClient(_address(config)) as client:
        for _ in range(100):  # 3 MiB of chat into a 1 MiB node: eviction, never an error
            await client.put([(rng.randbytes(16), make_shard(rng.randbytes(30_000)))])
        chat = class_stats(await client.stats(), "chat")
        assert chat.evicted > 0 and chat.youngest_evicted_age_s >= 0, "no eviction recorded"
        pinned = {}
        with pytest.raises(grpc.aio.AioRpcError) as info:
            for _ in range(100):
                key, payload = rng.randbytes(16), rng.randbytes(30_000)
                await client.put([(key, make_shard(payload))], traffic_class="pinned")
                pinned[key] = payload
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert class_stats(await client.stats(), "chat").blocks == 0, "chat should go first"
        assert 20 < len(pinned) < 35, f"{len(pinned)} pinned shards fit in 1 MiB"
        await _assert_all_hit(client, pinned)  # reads keep working when full
        await client.delete(list(pinned)[:10])
        await client.put([(rng.randbytes(16), make_shard(b"room again"))], traffic_class="chat")


async def test_a_second_process_on_the_same_data_dir_is_refused(tmp_path: Path, start_node) -> None:
    config = write_config(tmp_path)
    start_node(config)
    async with NodeClient(_address(config)) as client:
        await client.put([(b"d" * 16, make_shard(b"mine"))])
        intruder = write_config(tmp_path / "other", data_dir=tmp_path / "n0")
        with pytest.raises(RuntimeError, match="in use by another node process"):
            start_node(intruder)
        await _assert_all_hit(client, {b"d" * 16: b"mine"})


async def test_metrics_can_require_an_admin_token_health_stays_open(
    tmp_path: Path, start_node
) -> None:
    credentials = tmp_path / "credentials.toml"
    admin = add_principal(credentials, "admin", Role.ADMIN)
    tenant = add_principal(credentials, "acme", Role.TENANT)
    metrics_port = free_port()
    config = write_config(
        tmp_path,
        metrics_port=metrics_port,
        credentials_file=str(credentials),
        metrics_auth=True,
    )
    start_node(config)
    base = f"http://127.0.0.1:{metrics_port}"

    def status(path: str, token: str | None) -> int:
        request = urllib.request.Request(base + path)
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request) as reply:
                return reply.status
        except urllib.error.HTTPError as exc:
            return exc.code

    assert await asyncio.to_thread(status, "/metrics", None) == 401
    assert await asyncio.to_thread(status, "/metrics", tenant) == 401, "a tenant read metrics"
    assert await asyncio.to_thread(status, "/metrics", admin) == 200
    assert await asyncio.to_thread(status, "/healthz", None) == 200, "health must stay open"


async def test_a_second_process_on_a_taken_port_is_refused(tmp_path: Path, start_node) -> None:
    config = write_config(tmp_path)
    start_node(config)
    address = _address(config)
    intruder = write_config(tmp_path / "other")  # its own data dir, the same port
    text = intruder.read_text().replace(_address(intruder), address)
    intruder.write_text(text)
    with pytest.raises(RuntimeError, match="the port is taken"):
        start_node(intruder)
    async with NodeClient(address) as client:  # every connection still reaches the first node
        for i in range(20):
            assert await client.put([(bytes([i]) * 16, make_shard(b"first"))]) == 1
        assert (await client.stats()).shards == 20


async def test_shards_that_do_not_fit_the_cluster_are_refused(tmp_path: Path, start_node) -> None:
    config = write_config(tmp_path)  # k=1, m=0, zfec; the node holds shard 0 of every key
    start_node(config)
    payload = b"wrong code"
    wrong_code = ShardHeader("isal", 10, 2, 0, len(payload), version_of(payload), len(payload))
    async with NodeClient(_address(config)) as client:
        shard = pack_header(wrong_code, payload) + payload
        bad = grpc.StatusCode.INVALID_ARGUMENT
        await _expect_code(client.put([(b"c" * 16, shard)]), bad, "coded 10+2")
        await _expect_code(client.put([(b"c" * 16, make_shard(payload, index=1))]), bad)
        assert await client.contains([b"c" * 16]) == [[]], "a refused shard was stored"
        assert await client.put([(b"c" * 16, make_shard(payload))]) == 1


async def test_duplicate_keys_are_read_once_and_the_read_cost_is_bounded_first(
    tmp_path: Path, start_node
) -> None:
    config = write_config(tmp_path, max_batch_bytes=8 << 20)
    start_node(config)
    big, small = b"b" * 16, b"s" * 16
    async with NodeClient(_address(config)) as client:
        await client.put([(big, make_shard(bytes(420_000))), (small, make_shard(b"tiny"))])
        before = await client.stats()
        results = await client.get([small, small, small])
        assert [r.shards[0][48:] for r in results] == [b"tiny"] * 3
        assert (await client.stats()).hits == before.hits + 1, "duplicates were read 3 times"
        await _expect_code(
            client.get([big] * 3000), grpc.StatusCode.INVALID_ARGUMENT, "max_batch_bytes"
        )
        # A read counts a hit per key served: unchanged, the refusal came before any read.
        assert (await client.stats()).hits == before.hits + 1, "a refused request read shards"


def _pair_config(tmp_path: Path, credentials: Path, node_token: str) -> Path:
    """Two nodes n0 and n1 in one group (k=1, m=1) with auth, whose node credential is in
    their peer token file; repair loops off and delete logs pulled only at start, so a delete
    on n0 stays there (n1 keeps the block, as a member that missed the delete would)."""
    token_file = tmp_path / "node.token"
    token_file.write_text(node_token + "\n")
    token_file.chmod(0o600)
    fields = {
        "credentials_file": str(credentials),
        "peer_token_file": str(token_file),
        "repair_bytes_per_s": 0,
        "tombstone_sync_interval_s": 3600.0,
    }
    path = write_config(tmp_path, **fields)
    cluster = load_cluster(path)
    (n0,) = cluster.nodes
    n1 = dataclasses.replace(
        n0, id="n1", address=f"127.0.0.1:{free_port()}", data_dir=str(tmp_path / "n1")
    )
    codec = dataclasses.replace(cluster.codec, k=1, m=1)
    save_cluster(
        dataclasses.replace(cluster, nodes=(n0, n1), groups=(("n0", "n1"),), codec=codec), path
    )
    return path


async def test_repair_rpcs_need_a_node_credential_and_deletes_fence_repair_writes(
    tmp_path: Path, start_node
) -> None:
    # A repair write is taken from a node credential only for a version the other members
    # hold (repair confirmation), and a delete still fences it: a member that missed the
    # delete holds the version, the repair is confirmed, and the store refuses it.
    credentials = tmp_path / "credentials.toml"
    node_token = add_principal(credentials, "peers", Role.NODE)
    acme_token = add_principal(credentials, "acme", Role.TENANT)
    config = _pair_config(tmp_path, credentials, node_token)
    start_node(config, node_id="n1")
    start_node(config)  # n0 after n1: its first pull of n1's delete log finds n1 up
    codec = make_codec(load_cluster(config).codec)
    n1_address = load_cluster(config).nodes[1].address
    key, spare, made_up = b"r" * 16, b"s" * 16, b"t" * 16
    old, new = codec.encode(b"old version"), codec.encode(b"new version")
    denied = grpc.StatusCode.PERMISSION_DENIED
    async with (
        NodeClient(_address(config), token=acme_token) as acme,
        NodeClient(n1_address, token=acme_token) as acme_n1,
        NodeClient(_address(config), token=node_token) as peer,
    ):
        # Serving comes first; the first pull of the peers' delete logs follows in the
        # background (Health repair_ready once it reached the store).
        deadline_s = time.monotonic() + 60
        while not (await peer.stub.Health(pb.HealthRequest(), timeout=10)).repair_ready:
            assert time.monotonic() < deadline_s, "n0 never pulled n1's delete log"
            await asyncio.sleep(0.05)
        listing = pb.ListShardsRequest(group=0, limit=10)
        await _expect_code(acme.stub.ListShards(listing, metadata=acme._metadata()), denied)
        await _expect_code(peer.put([(key, old[0])]), denied, "role node")  # no ordinary puts
        written_at_s = await acme.now_s() - 1.0
        assert await acme.put([(key, old[0])]) == 1
        assert await acme_n1.put([(key, old[1]), (spare, new[1])]) == 2
        assert await acme.delete([key]) == 1  # on n0 only: n1 missed it
        repair = pb.PutShardsRequest(
            tenant="acme", traffic_class="chat", expires_at_s=written_at_s + DAY_S, repair=True
        )
        repair.shards.add(key=key, shard=old[0], written_at_s=written_at_s)
        reply = await peer.stub.PutShards(repair, metadata=peer._metadata(), timeout=10)
        assert (reply.num_stored, reply.num_fenced) == (0, 1), "a repair undid a delete"
        del repair.shards[:]
        repair.shards.add(key=made_up, shard=new[0], written_at_s=written_at_s)
        await _expect_code(
            peer.stub.PutShards(repair, metadata=peer._metadata()),
            denied,
            "re-creates versions the group holds",
        )
        del repair.shards[:]
        repair.shards.add(key=spare, shard=new[0], written_at_s=written_at_s)
        reply = await peer.stub.PutShards(repair, metadata=peer._metadata(), timeout=10)
        assert reply.num_stored == 1, "a node credential must be able to write repairs"
        listed = await peer.stub.ListShards(listing, metadata=peer._metadata(), timeout=10)
        assert [(s.tenant, s.key) for s in listed.shards] == [("acme", spare)]
        assert [r.status for r in await peer.get([spare])] == [HIT]
