"""A tiny node-side process for the UCX tests: sends shards from a mapped file over UCX.

::

    python -m tests.ucx.shard_server SHARD_FILE SHARD_BYTES [--transports tcp]

SHARD_FILE holds equal-sized shards back to back. The process maps it and prints one JSON
line ``{"address": HEX}`` (its UCX worker address). Then, for each JSON request line on
stdin::

    {"client": HEX, "tag_base": INT, "shards": [i, ...], "delay_s": FLOAT}

it sleeps ``delay_s`` (a straggler), starts sending the payload of the j-th listed shard
with tag ``tag_base + j`` straight from the mapped file, answers at once with the shards'
48-byte headers ``{"headers": [HEX, ...]}`` (the metadata a GetShards reply carries), and
then ``{"ok": BOOL}`` once the sends ended. It exits when stdin closes. A stand-in for the
storage node until the node serves GetShards over UCX.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import sys
from pathlib import Path

from erasure.shard import HEADER_BYTES
from kvstore.node.ucx_server import UcxServer

SEND_TIMEOUT_S = 5.0


def shard_parts(
    mapped: memoryview, shard_bytes: int, shard_ids: list[int]
) -> tuple[list[str], list[memoryview]]:
    """Headers (hex) and payloads (views into the mapped file) of the listed shards."""
    starts = [shard_id * shard_bytes for shard_id in shard_ids]
    headers = [mapped[start : start + HEADER_BYTES].hex() for start in starts]
    payloads = [mapped[start + HEADER_BYTES : start + shard_bytes] for start in starts]
    return headers, payloads


async def handle(server: UcxServer, mapped: memoryview, shard_bytes: int, line: str) -> None:
    request = json.loads(line)
    await asyncio.sleep(request.get("delay_s", 0.0))
    headers, payloads = shard_parts(mapped, shard_bytes, request["shards"])
    client = bytes.fromhex(request["client"])
    sent = server.post(client, request["tag_base"], payloads, SEND_TIMEOUT_S)
    print(json.dumps({"headers": headers}), flush=True)
    print(json.dumps({"ok": await sent}), flush=True)


async def serve(args: argparse.Namespace) -> None:
    with args.shard_file.open("rb") as file:
        # The mapping lives as long as the process: the views sent from it are never freed.
        mapped = memoryview(mmap.mmap(file.fileno(), 0, prot=mmap.PROT_READ))
    server = UcxServer(transports=args.transports)
    print(json.dumps({"address": server.address.hex()}), flush=True)
    while line := await asyncio.to_thread(sys.stdin.readline):
        await handle(server, mapped, args.shard_bytes, line)
    await server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("shard_file", type=Path)
    parser.add_argument("shard_bytes", type=int)
    parser.add_argument("--transports", default=None, help="UCX_TLS for this worker")
    asyncio.run(serve(parser.parse_args()))


if __name__ == "__main__":
    main()
