"""The local read channel's client link against a real LocalServer whose reads the test
writes: an honest node, a node that sends wrong bytes or a lying table, a node that refuses,
one that dies with a read in flight, and a read cancelled before its late answer. The same
tests run over the stream channel (a StreamServer and a StreamLink, over TCP), except those
about the shared arena and the socket's name, which only the local channel has.

Whatever the node does, nothing lands in the caller's buffer after a cancel, and a lying
table is refused. The link checks no shard's bytes: the batch read checks each block once
(tests/client/test_landing_pool.py changes landed bytes under it). The landing test runs with
the native copy helper (where `make native` built it) and with its ctypes fallback.
"""

from __future__ import annotations

import array
import asyncio
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from client.landing import Wanted
from client.local.link import LocalLink, PendingRead, RegionTooSmall
from client.stream.link import StreamLink
from erasure.codec import make_codec
from erasure.config import CodecConfig
from kvstore.byte_arena import Region
from kvstore.errors import BadReply, InvalidArgument, PermissionDenied, Unavailable
from kvstore.node.local_server import LocalServer, LocalSession, ReadHandler
from kvstore.node.stream_server import StreamServer
from kvstore.wire import batch_answer
from kvstore.wire import local_frames as frames

pytestmark = pytest.mark.timeout(60)

CODEC = make_codec(CodecConfig())
BLOCK = os.urandom(1 << 20)
SHARDS = CODEC.encode(BLOCK)
SHARD_INDEX = 3
PAYLOAD = memoryview(SHARDS[SHARD_INDEX])[48:]
KEY = bytes(range(16))
ARENA_BYTES = 64 << 20
WAIT_S = 20.0  # generous: the machine may be loaded; every wait below ends on an event

# read(request, region) -> the ANSWER table, payloads written into region.
Read = Callable[[frames.ReadRequest, memoryview], bytes]


class Node:
    """A LocalServer (``kind`` "local") or a StreamServer ("stream") whose READs
    ``self.read`` answers (replace it per test)."""

    def __init__(
        self,
        open_session: Callable[[str, str], LocalSession] | None = None,
        kind: str = "local",
    ) -> None:
        self.read: Read = honest
        self.kind = kind
        opener = open_session or (lambda token, tenant: LocalSession(token, tenant))
        answer: ReadHandler = lambda session, request, region: self.read(request, region)  # noqa: E731
        self.server: LocalServer = (
            LocalServer("n00", opener, answer)
            if kind == "local"
            else StreamServer("n00", "127.0.0.1", 0, opener, answer, lambda: None)
        )

    def close(self) -> None:
        self.server.close()


@pytest.fixture(params=["local", "stream"])
def node(request: pytest.FixtureRequest) -> Iterator[Node]:
    node = Node(kind=request.param)
    yield node
    node.close()


def honest(request: frames.ReadRequest, region: memoryview) -> bytes:
    """Shard SHARD_INDEX of BLOCK for the one key asked."""
    region[: len(PAYLOAD)] = PAYLOAD
    header = bytes(memoryview(SHARDS[SHARD_INDEX])[:48])
    return batch_answer.encode_table(
        [batch_answer.Entry(0, batch_answer.HIT, header, len(PAYLOAD))]
    )


async def _open(node: Node, tenant: str = "acme") -> LocalLink:
    if isinstance(node.server, StreamServer):
        return await asyncio.to_thread(
            StreamLink.open_stream,
            "n00",
            "127.0.0.1",
            node.server.port,
            None,
            tenant,
            ARENA_BYTES,
            CODEC,
            None,
        )
    return await asyncio.to_thread(
        LocalLink.open,
        "n00",
        node.server.socket_name,
        None,
        tenant,
        ARENA_BYTES,
        CODEC,
        node_pid=os.getpid(),  # the LocalServer runs in this process
    )


async def _read(link: LocalLink, out: bytearray) -> PendingRead:
    region = link.arena.try_take(2 * len(PAYLOAD))
    assert region is not None
    return link.submit([KEY], b"", Wanted([0], [SHARD_INDEX]), [memoryview(out)], region)


async def test_an_honest_answer_lands_in_place(node: Node, checksum_backend: str) -> None:
    link = await _open(node)
    try:
        out = bytearray(len(BLOCK))
        pending = await _read(link, out)
        answer = await asyncio.wait_for(pending.future, WAIT_S)
        start = SHARD_INDEX * len(PAYLOAD)
        assert answer.in_place == [True], "a data shard did not land at its place"
        landed = out[start : start + len(PAYLOAD)]
        assert landed == PAYLOAD, f"wrong bytes landed ({checksum_backend})"
        assert int(answer.entries["shard_index"][0]) == SHARD_INDEX
        answer.release()
    finally:
        await asyncio.to_thread(link.close)


async def test_a_table_larger_than_the_region_is_a_bad_reply(node: Node) -> None:
    def too_long(request: frames.ReadRequest, region: memoryview) -> bytes:
        header = bytes(memoryview(SHARDS[SHARD_INDEX])[:48])
        entries = [batch_answer.Entry(0, batch_answer.HIT, header, len(PAYLOAD))] * 3
        return batch_answer.encode_table(entries)  # 3 payloads in a 2-payload region

    node.read = too_long
    link = await _open(node)
    try:
        # The stream node sends no payload bytes it did not read: the answer is TOO_BIG.
        refusal = BadReply if node.kind == "local" else RegionTooSmall
        with pytest.raises(refusal, match=r"region|needs"):
            await asyncio.wait_for((await _read(link, bytearray(len(BLOCK)))).future, WAIT_S)
        assert link.alive, "one bad answer must not end the link"
    finally:
        await asyncio.to_thread(link.close)


async def test_a_region_outside_the_arena_is_refused_by_the_node() -> None:
    node = Node()
    link = await _open(node)
    try:
        outside = Region(None, ARENA_BYTES - 4096, memoryview(bytearray(1 << 20)))
        pending = link.submit([KEY], b"", Wanted([0], [SHARD_INDEX]), [None], outside)
        with pytest.raises(InvalidArgument, match="outside"):
            await asyncio.wait_for(pending.future, WAIT_S)
    finally:
        await asyncio.to_thread(link.close)
        node.close()


@pytest.mark.parametrize("kind", ["local", "stream"])
async def test_the_node_refuses_a_tenant_the_token_may_not_act_for(kind: str) -> None:
    def open_session(token: str, tenant: str) -> LocalSession:
        raise PermissionDenied(f"token may not act for tenant {tenant!r}")

    node = Node(open_session, kind)
    try:
        with pytest.raises(PermissionDenied, match="acme"):
            await _open(node)
    finally:
        node.close()


def test_the_node_refuses_an_arena_that_is_not_sealed() -> None:
    """An unsealed memfd could shrink under the node's mapping (SIGBUS): REFUSED."""
    node = Node()
    fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.ftruncate(fd, 1 << 20)
        sock.settimeout(WAIT_S)
        sock.connect("\0" + node.server.socket_name[1:])
        hello = frames.encode_hello(None, "acme", 1 << 20)
        sock.sendmsg(
            [hello], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]).tobytes())]
        )
        received = frames.recv_frame(sock, bytearray(frames.HEAD_BYTES))
        assert received is not None and received[0] == frames.REFUSED, "unsealed arena accepted"
        assert "sealed" in frames.decode_status(received[1])[1]
    finally:
        sock.close()
        os.close(fd)
        node.close()


@pytest.mark.parametrize("kind", ["local", "stream"])
async def test_a_node_that_dies_mid_read_fails_the_read_and_the_link(kind: str) -> None:
    reading = threading.Event()
    hold = threading.Event()

    def stuck(request: frames.ReadRequest, region: memoryview) -> bytes:
        reading.set()
        hold.wait(WAIT_S)
        return honest(request, region)

    node = Node(kind=kind)
    node.read = stuck
    link = await _open(node)
    try:
        pending = await _read(link, bytearray(len(BLOCK)))
        assert await asyncio.to_thread(reading.wait, WAIT_S), "the node never got the READ"
        closing = asyncio.ensure_future(asyncio.to_thread(node.close))
        with pytest.raises(Unavailable, match="lost"):
            await asyncio.wait_for(asyncio.shield(pending.future), WAIT_S)
        assert not link.alive, "a lost connection must mark the link dead"
        with pytest.raises(Unavailable):
            await _read(link, bytearray(len(BLOCK)))
    finally:
        hold.set()
        await closing
        await asyncio.to_thread(link.close)


async def test_nothing_lands_after_a_cancel(node: Node) -> None:
    """A hedged read gives up on a slow node; its late answer must not touch the buffer."""
    hold = threading.Event()
    answered = threading.Event()

    def late(request: frames.ReadRequest, region: memoryview) -> bytes:
        hold.wait(WAIT_S)
        try:
            return honest(request, region)
        finally:
            answered.set()

    node.read = late
    link = await _open(node)
    try:
        out = bytearray(len(BLOCK))
        pending = await _read(link, out)
        assert not link.abandon(pending), "nothing was landing yet"
        hold.set()
        assert await asyncio.to_thread(answered.wait, WAIT_S)
        # The late ANSWER frees the request's region: wait for that, not a fixed time.
        deadline_s = time.monotonic() + WAIT_S
        idle_free_bytes = link.arena.capacity_bytes - frames.PERMIT_AREA_BYTES  # permit words
        while link.arena.num_free_bytes != idle_free_bytes:
            assert time.monotonic() < deadline_s, "the cancelled request's region never came back"
            await asyncio.sleep(0.01)
        assert out == bytearray(len(BLOCK)), "a cancelled read wrote into the caller's buffer"
        assert not pending.future.done(), "a cancelled read was resolved"
    finally:
        await asyncio.to_thread(link.close)


def test_no_token_reaches_a_process_that_took_the_nodes_socket_name() -> None:
    """The socket name comes from the node's Health reply over the identity-checked gRPC
    channel, and so does the node's pid. A process that listens on that name first (here:
    this one, while the node is another process) must get no HELLO, so no token."""
    impostor = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = f"@kvstore-test-impostor-{os.getpid()}"
    impostor.bind("\0" + name[1:])
    impostor.listen(1)
    impostor.settimeout(WAIT_S)
    try:
        node_pid = os.getppid()  # the real node: any live process other than the listener
        with pytest.raises(Unavailable, match=f"held by pid {os.getpid()}"):
            LocalLink.open(
                "n00", name, "secret-token", "acme", ARENA_BYTES, CODEC, node_pid=node_pid
            )
        conn, _ = impostor.accept()  # the client connected, checked, and hung up
        with conn:
            conn.settimeout(WAIT_S)
            assert conn.recv(1 << 16) == b"", "the client sent the impostor its HELLO"
    finally:
        impostor.close()
