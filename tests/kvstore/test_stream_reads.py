"""The stream read channel (kvstore/node/stream_server.py, client/stream/) against a real node:
the bytes stored come back over it, into fresh blocks and into the caller's buffers; requests
given up while the node is still reading leave the connection in step; "auto" keeps a node on
this host on the local channel; a node with the channel off is read over gRPC; and the TLS
socket's lock lets one thread receive while another sends."""

from __future__ import annotations

import os
import socket
import ssl
import threading
from pathlib import Path

import pytest

from client import KVClient
from kvstore.certs import init_ca, issue_files
from kvstore.errors import Unavailable
from kvstore.wire.stream_socket import StreamSocket
from tests.kvstore.node_harness import write_config

pytestmark = pytest.mark.timeout(120)
BLOCKS = {os.urandom(16): os.urandom(size) for size in (1, 4096, 1 << 20, (1 << 20) + 7)}


async def _put_all(config: Path) -> None:
    async with KVClient.connect(config, tenant="acme") as kv:
        await kv.put_batch(list(BLOCKS), list(BLOCKS.values()), traffic_class="chat")


async def test_stream_reads_return_the_stored_bytes(tmp_path: Path, start_node) -> None:
    config = write_config(tmp_path)
    start_node(config)
    await _put_all(config)
    keys, blocks = list(BLOCKS), list(BLOCKS.values())
    async with KVClient.connect(config, tenant="acme", transport="stream") as kv:
        assert await kv.get_batch(keys) == blocks
        outs = [bytearray(len(b)) for b in blocks]
        assert all(await kv.get_batch_into(keys, outs))
        assert [bytes(o) for o in outs] == blocks
        assert await kv.get_batch([os.urandom(16)]) == [None], "a miss is a miss"
        replies = kv.replies_by_transport()
        assert replies["stream"] >= 3 and replies["grpc"] == 0, replies
        assert kv.stream is not None and kv.stream.counters.num_fallbacks == 0


async def test_requests_given_up_mid_read_leave_the_connection_in_step(
    tmp_path: Path, start_node
) -> None:
    """Every read outlives its stream wait on a node that delays each request 200 ms: the
    client gives it up (CANCEL) and tries gRPC (delayed too: a miss, never wrong bytes), and
    the node's late answers must not shift what the link reads next."""
    config = write_config(tmp_path, inject_delay_ms=200)
    start_node(config)
    await _put_all(config)
    keys, blocks = list(BLOCKS), list(BLOCKS.values())
    async with KVClient.connect(config, tenant="acme", transport="stream") as kv:
        assert kv.stream is not None
        for _ in range(3):
            got = await kv.get_batch(keys, timeout_s=0.3)
            assert all(g is None or g == b for g, b in zip(got, blocks, strict=True))
        assert kv.stream.counters.num_fallbacks > 0, "no request was given up"
        replies = kv.stream.counters.num_local_replies
        assert await kv.get_batch(keys, timeout_s=10) == blocks
        assert kv.stream.counters.num_local_replies > replies, "the link stopped answering"


async def test_auto_keeps_a_same_host_node_local(tmp_path: Path, start_node) -> None:
    config = write_config(tmp_path)
    start_node(config)
    await _put_all(config)
    async with KVClient.connect(config, tenant="acme", transport="auto") as kv:
        assert await kv.get_batch(list(BLOCKS)) == list(BLOCKS.values())
        replies = kv.replies_by_transport()
        assert replies["local"] > 0 and replies["stream"] == 0, replies


async def test_a_node_with_the_stream_off_is_read_over_grpc(tmp_path: Path, start_node) -> None:
    config = write_config(tmp_path, stream_reads="off")
    start_node(config)
    await _put_all(config)
    with pytest.raises(Unavailable, match="no node offered a stream port"):
        async with KVClient.connect(config, tenant="acme", transport="stream"):
            pass
    async with KVClient.connect(config, tenant="acme", transport="grpc") as kv:
        assert await kv.get_batch(list(BLOCKS)) == list(BLOCKS.values())


def test_a_tls_stream_receives_on_one_thread_while_another_sends(tmp_path: Path) -> None:
    """OpenSSL forbids two threads in one connection at once; StreamSocket's lock must let a
    receiver that waits for data and a sender share it without a deadlock or a lost byte."""
    ca = init_ca(tmp_path)
    cert, key = issue_files(tmp_path, "n0", ["127.0.0.1"], node=True)
    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_context.load_cert_chain(cert, key)
    client_context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client_context.load_verify_locations(ca)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    payload = os.urandom(8 << 20)
    frames_sent = [os.urandom(100) for _ in range(2000)]
    got_frames = bytearray()

    def serve() -> None:
        conn, _ = listener.accept()
        stream = StreamSocket(server_context.wrap_socket(conn, server_side=True))
        receiver = threading.Thread(target=lambda: _recv_all(stream, got_frames, 200_000))
        receiver.start()
        stream.sendall(payload)  # while the client sends its frames to us
        receiver.join()
        stream.close()

    server = threading.Thread(target=serve)
    server.start()
    raw = socket.create_connection(("127.0.0.1", port))
    client = StreamSocket(client_context.wrap_socket(raw, server_hostname="127.0.0.1"))
    received = bytearray()
    receiver = threading.Thread(target=lambda: _recv_all(client, received, len(payload)))
    receiver.start()
    for frame in frames_sent:
        client.sendall(frame)
    receiver.join(timeout=60)
    server.join(timeout=60)
    assert not receiver.is_alive() and not server.is_alive(), "the TLS stream deadlocked"
    assert bytes(received) == payload
    assert bytes(got_frames) == b"".join(frames_sent)
    client.close()
    listener.close()


def _recv_all(stream: StreamSocket, into: bytearray, num_bytes: int) -> None:
    buffer = memoryview(bytearray(1 << 16))
    while len(into) < num_bytes:
        count = stream.recv_into(buffer)
        if not count:
            return
        into += buffer[:count]
