"""The UCX data path between real processes: a node-side process sends erasure-coded shards
from a mapped file. As in the proposed GetShards-over-UCX exchange, shard headers come back on
the control pipe and payloads over UCX, straight into their places in a buffer-pool slot, so
the block needs no decode and no copy; every checksum is verified on arrival.

Runs over UCX's own choice (shared memory + CMA) and over forced TCP; covers a node that
dies and restarts with a new worker address, and a straggler whose late reply is discarded.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import numpy as np
import pytest

from client.buffer_pool import BufferPool
from client.ucx.transport import UcxTransport
from erasure.codec import Codec
from erasure.config import CodecConfig
from erasure.shard import HEADER_BYTES, block_checksum, shard_checksum, shard_version
from kvstore.wire.ucx_worker import ucx_available

if not ucx_available():
    pytest.skip("the optional ucx extra (ucxx) is not installed", allow_module_level=True)

REPO_ROOT = Path(__file__).resolve().parents[2]
BLOCK_BYTES = 1_000_003  # not a multiple of k: the last data shard carries padding
K, M = 10, 2
WAIT_S = 10.0


class ShardServer:
    """A running tests/ucx/shard_server.py process and its JSON-lines control pipe."""

    def __init__(self, proc: asyncio.subprocess.Process, address: bytes) -> None:
        self.proc = proc
        self.address = address

    @classmethod
    async def start(cls, shard_file: Path, shard_bytes: int, transports: str | None) -> ShardServer:
        args = [str(shard_file), str(shard_bytes)]
        args += ["--transports", transports] if transports else []
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.ucx.shard_server", *args,
            cwd=REPO_ROOT, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        line = await asyncio.wait_for(proc.stdout.readline(), WAIT_S)
        assert line, f"shard server exited before printing its address (code {proc.returncode})"
        return cls(proc, bytes.fromhex(json.loads(line)["address"]))

    async def request(
        self, client: UcxTransport, tag_base: int, shards: list[int], delay_s: float = 0.0
    ) -> None:
        line = {"client": client.address.hex(), "tag_base": tag_base, "shards": shards}
        self.proc.stdin.write(json.dumps(line | {"delay_s": delay_s}).encode() + b"\n")
        await self.proc.stdin.drain()

    async def reply(self) -> dict:
        line = await asyncio.wait_for(self.proc.stdout.readline(), WAIT_S)
        return json.loads(line)

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
        await self.proc.wait()


@pytest.fixture
def shard_file(tmp_path: Path) -> tuple[Path, bytes, int]:
    """k+m shards of one seeded random block, back to back in a file: (path, block, shard size)."""
    block = np.random.default_rng(8).integers(0, 256, BLOCK_BYTES, dtype=np.uint8).tobytes()
    shards = Codec(CodecConfig(k=K, m=M)).encode(block)
    path = tmp_path / "shards.bin"
    path.write_bytes(b"".join(shards))
    return path, block, len(shards[0])


@pytest.fixture
async def start_server() -> AsyncIterator[Callable[..., asyncio.Future[ShardServer]]]:
    started: list[ShardServer] = []

    async def start(
        shard_file: Path, shard_bytes: int, transports: str | None = None
    ) -> ShardServer:
        server = await ShardServer.start(shard_file, shard_bytes, transports)
        started.append(server)
        return server

    yield start
    for server in started:
        await server.stop()


class BlockRead:
    """One read of the k data shards: payload i lands at offset i * payload_bytes."""

    def __init__(self, pool: BufferPool, payload_bytes: int) -> None:
        self.slot = pool.try_acquire()
        assert self.slot is not None
        self.payload_bytes = payload_bytes
        self.payloads = [self.slot.view[i * payload_bytes :][:payload_bytes] for i in range(K)]

    def verified_block(self, hex_headers: list[str], block_len: int) -> bytes:
        """The block, after checking every shard checksum and the block checksum."""
        headers = [bytes.fromhex(h) for h in hex_headers]
        for i, (header, payload) in enumerate(zip(headers, self.payloads, strict=True)):
            stored = int.from_bytes(header[40:HEADER_BYTES], "little")
            assert shard_checksum(header[:40], payload) == stored, f"shard {i} arrived corrupt"
        block = bytes(self.slot.view[:block_len])
        assert block_checksum(block) == shard_version(headers[0]), "block checksum mismatch"
        return block


def _pool(payload_bytes: int) -> BufferPool:
    return BufferPool(slot_bytes=K * payload_bytes, num_slots=2)


@pytest.mark.parametrize("transports", [None, "tcp"], ids=["shm", "tcp"])
async def test_block_lands_in_place_from_a_mapped_file(
    shard_file: tuple[Path, bytes, int], start_server: Callable, transports: str | None
) -> None:
    path, block, shard_bytes = shard_file
    payload_bytes = shard_bytes - HEADER_BYTES
    server = await start_server(path, shard_bytes, transports)
    client = UcxTransport(transports=transports, seed=1)
    try:
        for _ in range(2):  # the second read reuses the node's cached endpoint
            read = BlockRead(_pool(payload_bytes), payload_bytes)
            batch = client.new_batch(read.payloads)
            await server.request(client, batch.tag_base, list(range(K)))
            headers = (await server.reply())["headers"]
            assert await batch.wait(None, WAIT_S) == [payload_bytes] * K, "payloads missing"
            assert (await server.reply())["ok"], "the node must see every send taken"
            assert read.verified_block(headers, len(block)) == block, "UCX delivered wrong bytes"
    finally:
        await client.close()


async def test_node_restart_is_detected_and_reads_resume(
    shard_file: tuple[Path, bytes, int], start_server: Callable
) -> None:
    path, block, shard_bytes = shard_file
    payload_bytes = shard_bytes - HEADER_BYTES
    pool = _pool(payload_bytes)
    client = UcxTransport(seed=2)
    try:
        server = await start_server(path, shard_bytes)
        assert not client.observe_node("n00", server.address)
        read = BlockRead(pool, payload_bytes)
        batch = client.new_batch(read.payloads)
        await server.request(client, batch.tag_base, list(range(K)), delay_s=30.0)
        await server.stop()  # killed before it sends: the read must end, not hang
        assert await batch.wait(None, timeout_s=0.2) == [None] * K
        read.slot.release()  # safe: wait() cancelled every receive it reported missing

        server = await start_server(path, shard_bytes)
        assert client.observe_node("n00", server.address), "a restart must be detected"
        read = BlockRead(pool, payload_bytes)
        batch = client.new_batch(read.payloads)
        await server.request(client, batch.tag_base, list(range(K)))
        headers = (await server.reply())["headers"]
        assert None not in await batch.wait(None, WAIT_S)
        assert read.verified_block(headers, len(block)) == block
    finally:
        await client.close()


async def test_straggler_reply_after_cancel_is_discarded(
    shard_file: tuple[Path, bytes, int], start_server: Callable
) -> None:
    path, _, shard_bytes = shard_file
    payload_bytes = shard_bytes - HEADER_BYTES
    server = await start_server(path, shard_bytes)
    client = UcxTransport(seed=3)
    try:
        read = BlockRead(_pool(payload_bytes), payload_bytes)
        batch = client.new_batch(read.payloads)
        await server.request(client, batch.tag_base, list(range(K)), delay_s=0.3)
        assert await batch.wait(None, timeout_s=0.05) == [None] * K
        read.slot.view[:] = b"\xee" * len(read.slot.view)  # the slot is reused at once
        assert "headers" in await server.reply()
        assert (await server.reply())["ok"], "late sends must still complete (discarded unread)"
        assert read.slot.view == b"\xee" * len(read.slot.view), "a late shard overwrote a slot"
    finally:
        await client.close()
