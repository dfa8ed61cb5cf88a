"""A node's answer to one batch read: a table of shard entries, then their payloads. Pure code.

Both transports carry the same bytes (over UCX the table is the reply frame and the payloads
one message, kvstore/wire/ucx_frames.py; over gRPC the whole answer is one ``ReadBatch`` stream of
chunks)::

    answer   = table | payloads
    table    = u32 num_entries | u32 payload_bytes | num_entries x 64-byte entries
    entry    offset size field                                   (little-endian)
             ------ ---- ----------------------------------------------------------
                  0    4 key index: position of the key in the request
                  4    1 status: 0 MISS, 1 HIT, 2 CORRUPT (kvstore_pb2.ShardStatus)
                  5    1 placed: 1 = the payload went to its place in the client's landing
                         pool (kvstore/wire/landing.py), not into ``payloads``
                  6    2 reserved, zero
                  8    4 payload bytes in ``payloads`` (HIT and not placed; 0 otherwise)
                 12    4 reserved, zero
                 16   48 the shard's header (erasure/shard.py; HIT only, zeros otherwise)
    payloads = the HIT entries' payloads back to back, in table order

Over gRPC the answer is cut into chunks of at most ``CHUNK_BYTES``, each one ``ReadBatchChunk``
message (``0x0A``, a varint length, the bytes): the node copies its staging into them once,
and the client lands each chunk's bytes where they belong as it arrives.

Every requested key has at least one entry: one MISS or CORRUPT entry, or one HIT entry
for the newest version the node holds (or the version asked for; a node keeps one version
per key, kvstore/store/group_commit.py). A key named twice in a request has its entry twice. A
client learns from the table, before any payload lands, where each payload will go and which
bytes it must be (the header names the shard index, the block length and the version), so a
payload is never written anywhere it does not belong; it still verifies every shard checksum
once the payloads are in place.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from erasure.shard import HEADER_BYTES
from kvstore.wire.protowire import decode_varint, field_head

ENTRY_BYTES = 64
TABLE_HEAD = struct.Struct("<II")  # num_entries, payload_bytes
_ENTRY = struct.Struct("<IBB2xI4x")  # key index, status, placed, payload bytes (then the header)
assert _ENTRY.size + HEADER_BYTES == ENTRY_BYTES
MISS, HIT, CORRUPT = 0, 1, 2
CHUNK_BYTES = 4 << 20
_CHUNK_FIELD = 1  # ReadBatchChunk.data

# The entry layout as numpy sees it, shard header fields included (erasure/shard.py).
ENTRY_DTYPE = np.dtype(
    [
        ("key_index", "<u4"),
        ("status", "u1"),
        ("placed", "u1"),
        ("_reserved", "V2"),
        ("payload_bytes", "<u4"),
        ("_reserved2", "V4"),
        ("magic", "V4"),
        ("format", "u1"),
        ("backend", "u1"),
        ("k", "u1"),
        ("m", "u1"),
        ("shard_index", "u1"),
        ("_reserved3", "V3"),
        ("block_len", "<u8"),
        ("version", "V16"),
        ("payload_len", "<u4"),
        ("checksum", "<u8"),
    ]
)
assert ENTRY_DTYPE.itemsize == ENTRY_BYTES


class Entry(NamedTuple):
    """One row of the table as the node builds it."""

    key_index: int
    status: int
    header: bytes  # the shard's 48 header bytes (HIT), else b""
    payload_bytes: int  # in the payload stream (0 for a placed payload)
    placed: bool = False  # the payload is at its place in the client's landing pool


def encode_table(entries: Sequence[Entry]) -> bytes:
    """The table of ``entries`` (payloads follow it in the same order)."""
    parts = [TABLE_HEAD.pack(len(entries), sum(e.payload_bytes for e in entries))]
    for entry in entries:
        parts.append(_ENTRY.pack(entry.key_index, entry.status, entry.placed, entry.payload_bytes))
        parts.append(entry.header or bytes(HEADER_BYTES))
    return b"".join(parts)


def table_bytes(buffer: bytes | memoryview) -> int:
    """How long the table at the start of ``buffer`` is (its head must be there)."""
    num_entries, _ = TABLE_HEAD.unpack_from(buffer)
    return TABLE_HEAD.size + num_entries * ENTRY_BYTES


def decode_table(table: bytes | memoryview, num_keys: int) -> tuple[np.ndarray, int]:
    """(entries as an ENTRY_DTYPE array, payload bytes) of a table; ValueError if malformed.

    Checks what the client relies on before it lands anything: the sizes add up, every key
    index names a requested key, and HIT entries carry a payload of their header's length in
    the stream (none when placed in the client's pool; only HIT entries are placed).
    """
    view = memoryview(table)
    if len(view) < TABLE_HEAD.size:
        raise ValueError(f"batch answer table of {len(view)} bytes has no head")
    num_entries, payload_bytes = TABLE_HEAD.unpack_from(view)
    if len(view) != TABLE_HEAD.size + num_entries * ENTRY_BYTES:
        raise ValueError(f"batch answer table is {len(view)} bytes for {num_entries} entries")
    entries = np.frombuffer(view, ENTRY_DTYPE, num_entries, TABLE_HEAD.size)
    hits = entries["status"] == HIT
    placed = entries["placed"] != 0
    streamed = hits & ~placed
    if num_entries and int(entries["key_index"].max()) >= num_keys:
        raise ValueError(f"batch answer names a key beyond the {num_keys} asked for")
    if np.any(placed & ~hits) or np.any(entries["placed"] > 1):
        raise ValueError("batch answer places a payload that is no HIT")
    if np.any(entries["payload_bytes"][streamed] != entries["payload_len"][streamed]) or np.any(
        entries["payload_bytes"][~streamed]
    ):
        raise ValueError("batch answer entries disagree with their shard headers' lengths")
    if int(entries["payload_bytes"].sum(dtype=np.uint64)) != payload_bytes:
        raise ValueError("batch answer payload total disagrees with its entries")
    return entries, payload_bytes


def encode_chunks(
    table: bytes, payloads: memoryview, chunk_bytes: int = CHUNK_BYTES
) -> list[bytes]:
    """The answer (``table`` then ``payloads``) as serialized ReadBatchChunk messages."""
    pieces = [memoryview(table), payloads]
    chunks: list[bytes] = []
    current: list[memoryview] = []
    room = chunk_bytes
    for piece in pieces:
        while len(piece):
            part, piece = piece[:room], piece[room:]
            current.append(part)
            room -= len(part)
            if not room:
                chunks.append(_chunk(current))
                current, room = [], chunk_bytes
    if current:
        chunks.append(_chunk(current))
    return chunks


def _chunk(parts: list[memoryview]) -> bytes:
    size = sum(len(p) for p in parts)
    return b"".join([field_head(_CHUNK_FIELD, size), *parts])


def chunk_data(message: bytes) -> memoryview:
    """The answer bytes a serialized ReadBatchChunk carries (a view, no copy)."""
    view = memoryview(message)
    if not len(view) or view[0] != field_head(_CHUNK_FIELD, 0)[0]:
        raise ValueError("not a ReadBatchChunk message")
    size, start = decode_varint(view, 1)
    if start + size != len(view):
        raise ValueError(f"ReadBatchChunk says {size} bytes but holds {len(view) - start}")
    return view[start:]
