"""The HTTP front's limits against slow and oversized clients, on a real uvicorn server with
the front's own protocol and middleware around a tiny echo app, over raw sockets.

Timeouts here are short (a fraction of a second) so the tests are quick; what is asserted on
time is only from below (the server did not close before its timeout) or a generous bound
far above it (it did close, not hang).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

uvicorn = pytest.importorskip("uvicorn")

from engine_adapter.serving.http_limits import (  # noqa: E402
    BodyLimits,
    FrontLimits,
    guarded_h11_protocol,
)

LIMITS = FrontLimits(
    max_connections=8, header_timeout_s=0.5, body_timeout_s=0.8, max_body_bytes=1000
)
CLOSE_BOUND_S = 30.0  # "closed, not hung": far above every timeout here


async def _echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Reads the whole body and answers its length."""
    body = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    reply = json.dumps({"num_bytes": len(body)}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(reply))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": reply})


@contextlib.asynccontextmanager
async def _server() -> AsyncIterator[tuple[int, list[str]]]:
    """A server on a free port; (port, reasons of the connections it closed)."""
    closed: list[str] = []
    app = BodyLimits(_echo, LIMITS, closed.append)
    protocol = guarded_h11_protocol(LIMITS, closed.append)
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, log_level="warning", lifespan="off", http=protocol
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield server.servers[0].sockets[0].getsockname()[1], closed
    finally:
        server.should_exit = True
        await task


async def _connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def _post(writer: asyncio.StreamWriter, body: bytes) -> None:
    head = f"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n\r\n"
    writer.write(head.encode() + body)
    await writer.drain()


async def _status(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One response: status, headers, body (by its content-length)."""
    status_line = await asyncio.wait_for(reader.readline(), CLOSE_BOUND_S)
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", 0)))
    return int(status_line.split()[1]), headers, body


async def _closed_by_server(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sent until it closed the connection (bounded wait)."""
    return await asyncio.wait_for(reader.read(), CLOSE_BOUND_S)


async def test_keep_alive_connection_serves_several_requests():
    async with _server() as (port, closed):
        reader, writer = await _connect(port)
        for size in (0, 10, 999):
            await _post(writer, b"x" * size)
            status, _, body = await _status(reader)
            assert status == 200 and json.loads(body) == {"num_bytes": size}
        writer.close()
    assert closed == []


async def test_headers_never_finished_are_closed_at_the_header_timeout():
    async with _server() as (port, closed):
        reader, writer = await _connect(port)
        start_s = time.monotonic()
        writer.write(b"POST /echo HTTP/1.1\r\nhost: x\r\n")  # no blank line: never finished
        await writer.drain()
        other_reader, other_writer = await _connect(port)  # a normal client meanwhile
        await _post(other_writer, b"hello")
        assert (await _status(other_reader))[0] == 200
        sent = await _closed_by_server(reader)
        assert time.monotonic() - start_s >= LIMITS.header_timeout_s * 0.9
        assert sent.startswith(b"HTTP/1.1 408") and b"header_timeout" in sent
        idle_reader, _ = await _connect(port)  # a connection that never sends a byte
        assert (await _closed_by_server(idle_reader)).startswith(b"HTTP/1.1 408")
    assert closed == ["header_timeout", "header_timeout"]


async def test_a_trickling_body_gets_408_at_the_body_timeout():
    async with _server() as (port, closed):
        reader, writer = await _connect(port)
        writer.write(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 500\r\n\r\n")
        start_s = time.monotonic()

        async def trickle() -> None:
            with contextlib.suppress(ConnectionError):
                for _ in range(500):
                    writer.write(b"x")
                    await writer.drain()
                    await asyncio.sleep(0.05)

        trickling = asyncio.create_task(trickle())
        try:  # the 408 comes first, unless a byte sent after the close made the kernel reset
            sent = await _closed_by_server(reader)
            assert sent.startswith(b"HTTP/1.1 408") and b"body_timeout" in sent
        except ConnectionResetError:
            pass
        trickling.cancel()
        assert time.monotonic() - start_s >= LIMITS.body_timeout_s * 0.9
    assert closed == ["body_timeout"]


async def test_an_oversized_body_is_refused_before_it_is_read():
    async with _server() as (port, closed):
        reader, writer = await _connect(port)
        # Only the headers go out: the 413 must come without the server reading a byte of it.
        writer.write(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 10000000\r\n\r\n")
        await writer.drain()
        status, headers, body = await _status(reader)
        assert status == 413 and b"body_too_large" in body and headers["connection"] == "close"
        chunked_reader, chunked_writer = await _connect(port)  # no length given: counted
        chunked_writer.write(
            b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        for _ in range(3):
            chunked_writer.write(b"200\r\n" + b"y" * 0x200 + b"\r\n")
        await chunked_writer.drain()
        status, _, body = await _status(chunked_reader)
        assert status == 413 and b"body_too_large" in body
    assert closed == ["body_too_large", "body_too_large"]


async def test_connections_over_the_limit_get_503_and_are_closed():
    async with _server() as (port, closed):
        held = [await _connect(port) for _ in range(LIMITS.max_connections)]
        reader, _ = await _connect(port)
        sent = await _closed_by_server(reader)
        assert sent.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in sent
        for _, writer in held:
            writer.close()
    assert "connection_limit" in closed
