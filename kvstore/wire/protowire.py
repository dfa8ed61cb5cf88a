"""The protobuf wire pieces kvstore writes and reads by hand, where protobuf's classes would
copy the shard bytes: varints and the heads of length-delimited fields. Pure code.

::

    varint               7 bits per byte, least significant group first, high bit = more
    field head (bytes)   varint(number << 3 | 2), varint(length), then the bytes
"""

from __future__ import annotations

_LENGTH_DELIMITED = 2


def encode_varint(value: int) -> bytes:
    """``value`` (>= 0) as a protobuf varint."""
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def decode_varint(view: memoryview, position: int) -> tuple[int, int]:
    """(value, position after it) of the varint at ``position``; ValueError if cut short."""
    value, shift = 0, 0
    while True:
        if position >= len(view) or shift > 63:
            raise ValueError("truncated or overlong varint")
        byte = view[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, position
        shift += 7


def field_head(number: int, size: int) -> bytes:
    """The tag and length in front of a ``size``-byte length-delimited field ``number``."""
    return encode_varint(number << 3 | _LENGTH_DELIMITED) + encode_varint(size)
