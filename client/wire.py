"""Zero-copy parsing of ``GetShardsReply``: shards as memoryviews into the received bytes.

The generated protobuf classes copy every ``bytes`` field twice on the way to Python (into the
message's arena on parse, and into a new ``bytes`` object on each field access). Shards are the
bulk of a read, so the client parses this one reply itself. Wire layout (proto3, see
kvstore/proto/kvstore.proto)::

    GetShardsReply:  repeated ShardResult results = 1   -> tag 0x0A, varint length, message
    ShardResult:     ShardStatus status = 1              -> tag 0x08, varint
                     repeated bytes shards = 2           -> tag 0x12, varint length, bytes

Unknown fields are skipped (so the node may add fields); a truncated or malformed message
raises ValueError. Pure code.
"""

from __future__ import annotations

from typing import NamedTuple

from kvstore.wire.protowire import decode_varint

_WIRE_VARINT, _WIRE_FIXED64, _WIRE_LEN, _WIRE_FIXED32 = 0, 1, 2, 5
_RESULTS_TAG = (1 << 3) | _WIRE_LEN
_STATUS_TAG = (1 << 3) | _WIRE_VARINT
_SHARDS_TAG = (2 << 3) | _WIRE_LEN


class ShardResultView(NamedTuple):
    """One key's result: ``status`` as in kvstore_pb2.ShardStatus, shards newest first."""

    status: int
    shards: list[memoryview]


def parse_get_shards_reply(data: bytes) -> list[ShardResultView]:
    """The ``results`` of a serialized GetShardsReply, shards viewing ``data`` (no copies)."""
    view = memoryview(data)
    results = []
    for tag, value in _fields(view):
        if tag == _RESULTS_TAG:
            results.append(_parse_result(value))
    return results


def _parse_result(view: memoryview) -> ShardResultView:
    status, shards = 0, []
    for tag, value in _fields(view):
        if tag == _STATUS_TAG:
            status = value
        elif tag == _SHARDS_TAG:
            shards.append(value)
    return ShardResultView(status, shards)


def _fields(view: memoryview) -> list[tuple[int, memoryview | int]]:
    """(tag, value) pairs of one message: ints for varints, memoryviews for the rest."""
    fields: list[tuple[int, memoryview | int]] = []
    position, end = 0, len(view)
    while position < end:
        tag, position = decode_varint(view, position)
        wire_type = tag & 7
        if wire_type == _WIRE_VARINT:
            value, position = decode_varint(view, position)
            fields.append((tag, value))
            continue
        if wire_type == _WIRE_LEN:
            size, position = decode_varint(view, position)
        elif wire_type in (_WIRE_FIXED64, _WIRE_FIXED32):
            size = 8 if wire_type == _WIRE_FIXED64 else 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire_type} at byte {position}")
        if position + size > end:
            raise ValueError(f"truncated field: {size} bytes at {position}, message is {end}")
        fields.append((tag, view[position : position + size]))
        position += size
    return fields
