"""Batched gets over one GetShardsStream per node, against a real node process.

Replies are matched to requests by position, so the bugs these tests catch are shifted replies
(a shard handed to the wrong key), a stream error reaching requests it was not about, and a
broken stream that is never reopened.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from client.get_stream import GetStream
from client.node_conn import NodeConn
from kvstore.config import load_cluster
from kvstore.errors import InvalidArgument
from kvstore.proto import kvstore_pb2 as pb
from tests.kvstore.node_harness import NodeClient, NodeProcess, make_shard, write_config

pytestmark = pytest.mark.timeout(120)
TENANT = "acme"
NUM_KEYS = 40


def _key(number: int) -> bytes:
    return number.to_bytes(16, "big")


def _shard(number: int) -> bytes:
    return make_shard(bytes([number % 251]) * (1000 + number))


@pytest.fixture
def node(tmp_path: Path) -> Iterator[NodeProcess]:
    process = NodeProcess(write_config(tmp_path, fsync=False)).start()
    try:
        yield process
    finally:
        process.stop()


async def _stored_conn(node: NodeProcess) -> NodeConn:
    node_config = load_cluster(node.config_path).node("n0")
    async with NodeClient(node_config.address, tenant=TENANT) as client:
        await client.put([(_key(n), _shard(n)) for n in range(NUM_KEYS)])
    return NodeConn(node_config, TENANT, token=None)


async def test_concurrent_gets_get_their_own_shards(node: NodeProcess) -> None:
    conn = await _stored_conn(node)
    try:
        for _ in range(3):  # several waves: batches pipeline on one long-lived stream
            numbers = list(range(NUM_KEYS + 5))  # the last five are misses
            results = await asyncio.gather(*(conn.get_shard(_key(n), 10.0) for n in numbers))
            for number, result in zip(numbers, results, strict=True):
                if number >= NUM_KEYS:
                    assert result.status == pb.MISS, "a missing key got a stream reply's shards"
                    continue
                assert result.status == pb.HIT
                assert [bytes(s) for s in result.shards] == [_shard(number)], (
                    "stream replies matched to the wrong requests"
                )
        assert conn.use_get_stream and conn._get_stream is not None and conn._get_stream.is_open, (
            "gets did not travel over the stream"
        )
    finally:
        await conn.close()


async def test_cancelled_waiter_does_not_shift_later_replies(node: NodeProcess) -> None:
    conn = await _stored_conn(node)
    stream = GetStream(conn._open_get_stream)
    try:
        futures = [
            stream.send(pb.GetShardsRequest(tenant=TENANT, keys=[_key(n)])) for n in range(3)
        ]
        futures[0].cancel()
        for number in (1, 2):
            (result,) = await asyncio.wait_for(futures[number], 10.0)
            assert [bytes(s) for s in result.shards] == [_shard(number)], (
                "a cancelled request's reply was handed to the next request"
            )
    finally:
        await stream.close()
        await conn.close()


async def test_stream_error_reaches_only_its_request(node: NodeProcess) -> None:
    """A malformed key aborts the node's stream; requests behind it are retried over unary."""
    conn = await _stored_conn(node)
    try:
        bad = conn.get_shard(b"too short", 10.0)
        await asyncio.sleep(0)  # its own batch, sent ahead of the good one
        good = conn.get_shard(_key(7), 10.0)
        with pytest.raises(InvalidArgument):
            await bad
        result = await good
        assert [bytes(s) for s in result.shards] == [_shard(7)], (
            "a request behind a failed one on the stream was lost or got the error"
        )
        result = await conn.get_shard(_key(8), 10.0)
        assert [bytes(s) for s in result.shards] == [_shard(8)], "no new stream after a break"
        assert conn._get_stream is not None and conn._get_stream.is_open
    finally:
        await conn.close()


async def test_stream_reopens_after_node_restart(node: NodeProcess) -> None:
    conn = await _stored_conn(node)
    try:
        assert (await conn.get_shard(_key(1), 10.0)).status == pb.HIT
        node.stop()
        node.start()
        for _ in range(100):  # the channel reconnects within its 100 ms-1 s backoff
            try:
                result = await conn.get_shard(_key(2), 2.0)
                break
            except Exception:
                await asyncio.sleep(0.1)
        else:
            pytest.fail("gets never succeeded again after the node restarted")
        assert [bytes(s) for s in result.shards] == [_shard(2)]
        assert conn.use_get_stream, "a restart must not switch the connection to unary for good"
    finally:
        await conn.close()
