"""``PutShardsRequest`` on the wire, written and read by hand so that protobuf never copies a
shard: the client copies each shard once, into the request; the node copies none. Pure code.

::

    PutShardsRequest  tenant = 1, traffic_class = 2 (strings), shards = 3 (repeated ShardPut),
                      expires_at_s = 5 (double), repair = 6 (bool), ttl_s = 7 (double), and
                      whatever is added later
    ShardPut          key = 1 (bytes, 16), shard = 2 (bytes: codec header + payload),
                      written_at_s = 3 (double, wire type 1: 8 bytes little-endian)

    on the wire: tag varint (field << 3 | wire type), then a varint, 8 bytes (double), or a
    varint length and that many bytes (strings, bytes, messages)

:func:`encode_put_request` writes exactly what protobuf would. :func:`parse_put_request` walks
the top-level fields once: each ``shards`` entry is read by hand into a :class:`ShardPutView`
whose shard is a memoryview of the received bytes; every other field goes to protobuf
(``PutShardsRequest`` with no shards), so a field added to the message later reaches the
node's handler as any protobuf field does. A message that does not parse raises ValueError.

Why: protobuf's Python classes copy a ``bytes`` field twice (into the message on parse, into a
new object on access); for a batch of 8 shards of a 4 MiB block that was 0.3 CPU-seconds per
GB on the node, more than the node's own bookkeeping (docs/data-paths.md, "Storage benchmark").
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NamedTuple

from google.protobuf.message import DecodeError

from kvstore.proto import kvstore_pb2 as pb
from kvstore.wire.protowire import decode_varint, encode_varint

_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5
_SHARDS_TAG = 3 << 3 | _LEN
_KEY_TAG = 1 << 3 | _LEN
_SHARD_TAG = 2 << 3 | _LEN
_WRITTEN_AT_TAG = 3 << 3 | _FIXED64
_TTL_TAG = 7 << 3 | _FIXED64  # PutShardsRequest.ttl_s
_ZERO_DOUBLE = bytes(8)
_DOUBLE = struct.Struct("<d")


class ShardPutView(NamedTuple):
    """One ``ShardPut``: its shard views the request's bytes (valid while they live)."""

    key: bytes
    shard: memoryview
    written_at_s: float


class PutRequestView(NamedTuple):
    """A parsed PutShards request: ``fields`` holds every field but the shards."""

    fields: pb.PutShardsRequest
    shards: list[ShardPutView]


def encode_put_request(
    tenant: str,
    traffic_class: str,
    items: Sequence[tuple[bytes, Sequence[bytes | memoryview]]],
    written_at_s: float = 0.0,
    ttl_s: float = 0.0,
) -> bytes:
    """A serialized PutShardsRequest, byte for byte what protobuf writes; each shard is given
    as pieces (its header, its payload) and copied once, into the request. ``written_at_s``:
    when the block versions were written (every ``ShardPut.written_at_s``; 0 = the node's
    now), which orders a key's versions on the nodes. ``ttl_s``: the blocks' own TTL (0 =
    their class's)."""
    parts: list[bytes | memoryview] = [
        _field(1, tenant.encode()),
        _field(2, traffic_class.encode()),
    ]
    # protobuf leaves out a double whose bits are all zero (so -0.0 is written)
    written_at = bytes([_WRITTEN_AT_TAG]) + _DOUBLE.pack(written_at_s)
    if written_at[1:] == _ZERO_DOUBLE:
        written_at = b""
    for key, pieces in items:
        shard_bytes = sum(len(p) for p in pieces)
        key_field = _field(1, key)
        shard_head = bytes([_SHARD_TAG]) + encode_varint(shard_bytes) if shard_bytes else b""
        body_bytes = len(key_field) + len(shard_head) + shard_bytes + len(written_at)
        parts += (bytes([_SHARDS_TAG]) + encode_varint(body_bytes) + key_field + shard_head,)
        parts += pieces
        if written_at:
            parts.append(written_at)
    if _DOUBLE.pack(ttl_s) != _ZERO_DOUBLE:  # PutShardsRequest.ttl_s, after the shards
        parts.append(bytes([_TTL_TAG]) + _DOUBLE.pack(ttl_s))  # (protobuf: fields in order)
    return b"".join(parts)


def parse_put_request(raw: bytes) -> PutRequestView:
    """The request in ``raw`` with its shards as views of ``raw`` (module docstring); ValueError
    if it is not a well-formed PutShardsRequest."""
    view = memoryview(raw)
    shards: list[ShardPutView] = []
    rest: list[memoryview] = []
    position, end = 0, len(view)
    while position < end:
        start = position
        tag, position = _varint(view, position)
        if tag == _SHARDS_TAG:
            size, position = _varint(view, position)
            _check_inside(position, size, end)
            shards.append(_parse_shard_put(view[position : position + size]))
            position += size
            continue
        position = _skip_value(view, tag, position)
        rest.append(view[start:position])
    try:
        fields = pb.PutShardsRequest.FromString(b"".join(rest))
    except DecodeError as exc:
        raise ValueError(str(exc)) from None
    return PutRequestView(fields, shards)


def _parse_shard_put(view: memoryview) -> ShardPutView:
    """One ShardPut; unknown fields are skipped, a repeated field's last value wins (as in
    protobuf)."""
    key, shard, written_at_s = b"", view[:0], 0.0
    position, end = 0, len(view)
    while position < end:
        tag, position = _varint(view, position)
        if tag in (_KEY_TAG, _SHARD_TAG):
            size, position = _varint(view, position)
            _check_inside(position, size, end)
            value = view[position : position + size]
            position += size
            if tag == _KEY_TAG:
                key = bytes(value)
            else:
                shard = value
        elif tag == _WRITTEN_AT_TAG:
            _check_inside(position, 8, end)
            (written_at_s,) = _DOUBLE.unpack_from(view, position)
            position += 8
        else:
            position = _skip_value(view, tag, position)
    return ShardPutView(key, shard, written_at_s)


def _skip_value(view: memoryview, tag: int, position: int) -> int:
    """The position after the value of a field with ``tag`` that starts at ``position``."""
    wire_type, end = tag & 7, len(view)
    if tag >> 3 == 0:
        raise ValueError(f"field number 0 at byte {position}")
    if wire_type == _VARINT:
        return decode_varint(view, position)[1]
    if wire_type == _LEN:
        size, position = decode_varint(view, position)
    elif wire_type in (_FIXED64, _FIXED32):
        size = 8 if wire_type == _FIXED64 else 4
    else:
        raise ValueError(f"unsupported protobuf wire type {wire_type} at byte {position}")
    _check_inside(position, size, end)
    return position + size


def _varint(view: memoryview, position: int) -> tuple[int, int]:
    """:func:`decode_varint` with a fast path for one byte (every tag and key length)."""
    if position < len(view) and (byte := view[position]) < 0x80:
        return byte, position + 1
    return decode_varint(view, position)


def _check_inside(position: int, size: int, end: int) -> None:
    if position + size > end:
        raise ValueError(f"truncated field: {size} bytes at {position}, message is {end}")


def _field(number: int, value: bytes) -> bytes:
    """A length-delimited field; protobuf leaves out an empty one."""
    if not value:
        return b""
    return encode_varint(number << 3 | _LEN) + encode_varint(len(value)) + value
