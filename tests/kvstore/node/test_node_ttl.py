"""TTL, expiry and eviction on a real node, with a time-scaled clock (a virtual day per second;
two seconds across a node restart).

Each timeline step leaves at least 0.4 virtual days (0.4 s) between a check and the expiry it
guards, so a busy 2-core machine does not turn scheduling delays into false failures.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import grpc
import pytest

from kvstore.config import load_cluster
from kvstore.proto import kvstore_pb2 as pb
from tests.kvstore.node_harness import DAY_S, NodeClient, class_stats, make_shard, write_config
from tests.kvstore.store_harness import lmdb_index_bytes
from ttl.clock import Clock, make_clock

HIT, MISS = 1, 0


def _node(config_path: Path) -> tuple[str, Clock]:
    cluster = load_cluster(config_path)
    return cluster.nodes[0].address, make_clock(cluster.ttl.time_scale, cluster.ttl.origin_unix_s)


async def _at(clock: Clock, when_s: float) -> None:
    """Sleep until the cluster clock reads ``when_s``; fail if it is already well past."""
    wait_s = when_s - clock.now()
    assert wait_s > -0.3 * DAY_S, "test fell behind its timeline (machine busy?)"
    await asyncio.sleep(max(0.0, wait_s / clock.time_scale))  # type: ignore[attr-defined]


async def _eventually_stats(client: NodeClient, condition, what: str, timeout_s: float = 10.0):
    """The node's Stats once ``condition(stats)`` holds: upkeep ticks reclaim what expired
    within a second when idle, much later on a loaded 2-core machine."""
    deadline_s = asyncio.get_running_loop().time() + timeout_s
    while True:
        stats = await client.stats()
        if condition(stats):
            return stats
        assert asyncio.get_running_loop().time() < deadline_s, f"{what}: {stats}"
        await asyncio.sleep(0.1)


async def test_agent_gone_after_3_days_chat_hit_extends_contains_does_not(
    tmp_path: Path, start_node
) -> None:
    """Each check is timed from the expiry the node recorded (InspectShards), not from when
    the test sent a put: a put a loaded machine answers a virtual day late must not move the
    timeline (it once made "agent block outlived 3 days" fail at load 40)."""
    config = write_config(tmp_path, time_scale=DAY_S / 2, expiry_window_s=3600.0)
    start_node(config)
    address, clock = _node(config)
    agent, agent2, chat = b"a" * 16, b"A" * 16, b"c" * 16
    async with NodeClient(address) as client:
        await client.put([(agent, make_shard(b"agent"))], traffic_class="agent")
        await client.put([(chat, make_shard(b"chat"))], traffic_class="chat")
        lives = await _listed_lives(client, [agent, chat])
        assert lives[agent][1] - lives[agent][0] == 3 * DAY_S, "agent TTL is not 3 days"
        assert lives[chat][1] - lives[chat][0] == 7 * DAY_S, "chat TTL is not 7 days"
        agent_dies, chat_dies = lives[agent][1], lives[chat][1]
        await _at(clock, agent_dies - 0.5 * DAY_S)
        assert [len(v) for v in await client.contains([agent, chat])] == [1, 1]
        await _at(clock, agent_dies + 0.4 * DAY_S)
        assert (await client.get([agent]))[0].status == MISS, "agent block outlived 3 days"
        assert await client.contains([agent, chat]) == [[], [(await _version(client, chat))]]
        await client.put([(agent2, make_shard(b"agent2"))], traffic_class="agent")
        agent2_dies = (await _listed_lives(client, [agent2]))[agent2][1]
        await _at(clock, chat_dies - 2.0 * DAY_S)
        assert (await client.get([chat]))[0].status == HIT
        refreshed_dies = (await _listed_lives(client, [chat]))[chat][1]
        assert refreshed_dies >= chat_dies + 2.0 * DAY_S, "the hit did not extend chat"
        await _at(clock, agent2_dies - 0.4 * DAY_S)
        assert len((await client.contains([agent2]))[0]) == 1
        await _at(clock, max(agent2_dies, chat_dies) + 0.4 * DAY_S)
        assert await client.contains([agent2]) == [[]], "contains() extended an agent block"
        assert len((await client.contains([chat]))[0]) == 1, "the hit did not extend chat"
        await _at(clock, refreshed_dies - 0.4 * DAY_S)
        assert len((await client.contains([chat]))[0]) == 1
        await _at(clock, refreshed_dies + 0.4 * DAY_S)
        assert await client.contains([chat]) == [[]], "chat block outlived its refreshed TTL"
        stats = await _eventually_stats(
            client,
            lambda s: class_stats(s, "agent").expired == 2 and class_stats(s, "chat").expired == 1,
            "upkeep did not count the expired blocks",
        )
        assert stats.segments == 0 and stats.shards == 0, "expired segment files not freed"


async def _version(client: NodeClient, key: bytes) -> bytes:
    [versions] = await client.contains([key])
    return versions[0]


async def _listed_lives(client: NodeClient, keys: list[bytes]) -> dict[bytes, tuple[float, float]]:
    """Key -> (written_at_s, expires_at_s) of each of ``keys`` the node holds unexpired
    (InspectShards: not an access, so no refresh), once the node answers (a restarted node may
    still be opening its store)."""
    loop = asyncio.get_running_loop()
    deadline_s = loop.time() + 120.0
    request = pb.InspectShardsRequest(tenant=client.tenant, keys=keys)
    while True:
        try:
            reply = await client.stub.InspectShards(
                request, metadata=client._metadata(), timeout=30
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or loop.time() > deadline_s:
                raise
            await asyncio.sleep(0.1)
            continue
        return {
            key: (found.shards[0].written_at_s, found.shards[0].expires_at_s)
            for key, found in zip(keys, reply.results, strict=True)
            if found.shards
        }


async def _listed_expiry(client: NodeClient, keys: list[bytes]) -> dict[bytes, float]:
    """Key -> expires_at_s of each of ``keys`` the node holds unexpired (:func:`_listed_lives`)."""
    return {key: expires_s for key, (_, expires_s) in (await _listed_lives(client, keys)).items()}


async def test_restart_keeps_expiry_and_refreshes(tmp_path: Path, start_node) -> None:
    """A restart keeps each block's expiry time, and after it blocks still expire and hits
    still refresh. The expiry times are read from the node (InspectShards) before and after
    the restart, so however long a loaded machine takes to
    restart the node (32 s was seen), nothing here depends on it."""
    config = write_config(
        tmp_path,
        classes={"chat": 100 * DAY_S, "agent": 3 * DAY_S},
        time_scale=DAY_S / 2,  # two real seconds per virtual day
        expiry_window_s=3600.0,
    )
    node = start_node(config)
    address, clock = _node(config)
    agent, chat = b"a" * 16, b"c" * 16
    async with NodeClient(address) as client:
        t0 = clock.now()
        await client.put([(agent, make_shard(b"agent"))], traffic_class="agent")
        await client.put([(chat, make_shard(b"chat"))], traffic_class="chat")
        before = await _listed_expiry(client, [agent, chat])
    assert set(before) == {agent, chat}
    assert 3 * DAY_S <= before[agent] - t0 < 3.5 * DAY_S, "agent TTL is not 3 days"
    node.stop()
    start_node(config)
    async with NodeClient(address) as client:
        after = await _listed_expiry(client, [agent, chat])
        # A restart slower than the agent block's 6 s lets it expire (expired entries are
        # not inspected): then the node's clock must be past its kept expiry time.
        if agent not in after:
            assert clock.now() >= before[agent], "restart lost a block"
            after[agent] = before[agent]
        assert set(after) == {agent, chat}, "restart lost a block"
        assert after == pytest.approx(before, abs=1e-3), "expiry time not kept across restart"
        # Expiry runs after the restart: once the node's clock is past the agent block's
        # expiry it is gone (and counted), the chat block is not.
        wait_s = (before[agent] + 0.4 * DAY_S - clock.now()) / clock.time_scale  # type: ignore[attr-defined]
        await asyncio.sleep(max(0.0, wait_s))
        assert await client.contains([agent]) == [[]], "expiry time not kept across restart"
        assert len((await client.contains([chat]))[0]) == 1
        await _eventually_stats(
            client, lambda s: class_stats(s, "agent").expired == 1, "expiry stopped after restart"
        )
        # A hit after the restart refreshes: the chat block now lives 100 days from now.
        hit_s = clock.now()
        assert (await client.get([chat]))[0].status == HIT
        refreshed = (await _listed_expiry(client, [chat]))[chat]
        assert refreshed > before[chat] and refreshed >= hit_s + 100 * DAY_S - 3600.0, (
            "a hit after the restart did not refresh the chat block's expiry"
        )


# A byte limit that leaves 1 MiB for segment data: the index's files count inside max_bytes,
# and with a reserve it does not outgrow here its allocation stays what a fresh index holds.
_INDEX_RESERVE_BYTES = 1 << 20


def _mib_of_data(tmp_path: Path) -> dict[str, int]:
    index_bytes = lmdb_index_bytes(tmp_path / "probe", _INDEX_RESERVE_BYTES)
    return {"max_bytes": (1 << 20) + index_bytes, "index_reserve_bytes": _INDEX_RESERVE_BYTES}


async def _fill_past_the_byte_limit(
    client: NodeClient, rng: random.Random
) -> tuple[list[bytes], list[bytes], list[bytes]]:
    """Put 10 agent, 10 chat and 40 filler chat blocks of 20 kB, one request each (distinct
    access times), reading agent 0 after the first two fillers; returns the three key lists."""
    agents = [rng.randbytes(16) for _ in range(10)]
    chats = [rng.randbytes(16) for _ in range(10)]
    fillers = [rng.randbytes(16) for _ in range(40)]
    for key in agents:
        await client.put([(key, make_shard(rng.randbytes(20_000)))], traffic_class="agent")
    for key in chats + fillers[:2]:
        await client.put([(key, make_shard(rng.randbytes(20_000)))], traffic_class="chat")
    assert (await client.get([agents[0]]))[0].status == HIT  # a0 is now the newest agent
    for key in fillers[2:]:
        await client.put([(key, make_shard(rng.randbytes(20_000)))], traffic_class="chat")
    return agents, chats, fillers


async def test_eviction_order_under_a_byte_limit(tmp_path: Path, start_node) -> None:
    config = write_config(
        tmp_path,
        eviction_order="expiry",
        high_watermark=0.9,
        low_watermark=0.5,
        **_mib_of_data(tmp_path),
    )
    start_node(config)
    address, _ = _node(config)
    async with NodeClient(address) as client:
        agents, chats, fillers = await _fill_past_the_byte_limit(client, random.Random(4))
        expected_order = agents[1:] + agents[:1] + chats + fillers
        present = [len(v) > 0 for v in await client.contains(expected_order)]
        num_evicted = present.index(True)
        assert not any(present[:num_evicted]) and all(present[num_evicted:]), (
            f"evicted set is not a prefix of earliest-expiry order: {present}"
        )
        assert 10 < num_evicted < 40, f"{num_evicted} evicted: agents must go first, then some"
        stats = await client.stats()
        assert class_stats(stats, "agent").evicted == 10
        assert class_stats(stats, "chat").evicted == num_evicted - 10
        assert stats.capacity_bytes == 1 << 20, "the index's files must count inside max_bytes"


async def test_lru_eviction_under_a_byte_limit(tmp_path: Path, start_node) -> None:
    config = write_config(  # every hit counts: the read comes a moment after the puts
        tmp_path,
        refresh_granularity_s=0.0,
        high_watermark=0.9,
        low_watermark=0.5,
        **_mib_of_data(tmp_path),
    )
    assert load_cluster(config).ttl.eviction_order == "lru", "LRU must be the default order"
    start_node(config)
    address, _ = _node(config)
    async with NodeClient(address) as client:
        agents, chats, fillers = await _fill_past_the_byte_limit(client, random.Random(4))
        expected_order = agents[1:] + chats + fillers[:2] + agents[:1] + fillers[2:]
        present = [len(v) > 0 for v in await client.contains(expected_order)]
        num_evicted = present.index(True)
        assert not any(present[:num_evicted]) and all(present[num_evicted:]), (
            f"evicted set is not a prefix of least-recently-accessed order: {present}"
        )
        assert 9 < num_evicted <= 9 + 10 + 2, (
            f"{num_evicted} evicted: chat blocks written before the read of agent 0 must go "
            "before it (and agent 0 must stay)"
        )
        stats = await client.stats()
        assert class_stats(stats, "agent").evicted == 9, "the read hit did not protect agent 0"
        assert class_stats(stats, "chat").evicted == num_evicted - 9
