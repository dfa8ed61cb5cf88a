"""Hand-written GetShardsReply encoding: byte for byte what protobuf writes, shards copied once.

Layout (proto3; client/wire.py parses it), per result, in order::

    0x0A len(result) [0x08 status]? (0x12 len(shard) shard)*

A MISS (status 0, proto3's default) has no status field, as protobuf writes it.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.store.shard_reader import GetResult
from kvstore.wire.protowire import encode_varint

_RESULT_TAG, _STATUS_TAG, _SHARD_TAG = b"\x0a", b"\x08", b"\x12"


def encode_get_shards_reply(results: Sequence[GetResult]) -> bytes:
    """A serialized GetShardsReply."""
    parts: list[bytes] = []
    for result in results:
        fields = [_STATUS_TAG + encode_varint(int(result.status))] if result.status else []
        for shard in result.shards:
            fields += (_SHARD_TAG + encode_varint(len(shard)), shard)
        parts += (_RESULT_TAG + encode_varint(sum(map(len, fields))), *fields)
    return b"".join(parts)
