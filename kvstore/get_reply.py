"""Hand-written GetShardsReply encoding: byte for byte what protobuf writes, shards copied once.

Layout (proto3; client/wire.py parses it), per result, in order::

    0x0A len(result) [0x08 status]? [0x1A 48 header]? (0x12 len(shard) shard)*

A MISS (status 0, proto3's default) has no status field, as protobuf writes it. The
``ucx_header`` field (0x1A) appears only in replies to UCX deliveries: a HIT then carries the
newest version's 48-byte header, its payload travels over UCX (kvstore/ucx_get.py), and the
inline shards are the older versions.
"""

from __future__ import annotations

from collections.abc import Sequence

from erasure.shard import HEADER_BYTES
from kvstore.proto import kvstore_pb2 as pb
from kvstore.shard_reader import GetResult

_RESULT_TAG, _STATUS_TAG, _SHARD_TAG, _UCX_HEADER_TAG = b"\x0a", b"\x08", b"\x12", b"\x1a"


def encode_get_shards_reply(
    results: Sequence[GetResult], over_ucx: Sequence[bool] | None = None
) -> bytes:
    """A serialized GetShardsReply; a HIT whose ``over_ucx`` entry is true sends its newest
    shard's header in place of the shard (its payload goes over UCX)."""
    parts: list[bytes] = []
    for index, result in enumerate(results):
        fields = [_STATUS_TAG + _varint(int(result.status))] if result.status else []
        shards = list(result.shards)
        if over_ucx is not None and over_ucx[index] and result.status == pb.HIT and shards:
            newest = shards.pop(0)
            fields.append(_UCX_HEADER_TAG + _varint(HEADER_BYTES) + newest[:HEADER_BYTES])
        for shard in shards:
            fields += (_SHARD_TAG + _varint(len(shard)), shard)
        parts += (_RESULT_TAG + _varint(sum(map(len, fields))), *fields)
    return b"".join(parts)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
