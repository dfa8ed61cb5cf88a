"""The shard format: a fixed 48-byte header followed by the shard's payload.

::

    offset size  field                                   (little-endian)
    ------ ----  ----------------------------------------------------------
         0    4  magic b"KVSH"
         4    1  format version (1)
         5    1  backend: 1 = zfec, 2 = isal (the encodings are not interchangeable)
         6    1  k (data shards)
         7    1  m (parity shards)
         8    1  shard index, 0 .. k+m-1 (0 .. k-1 hold the block's bytes in order)
         9    1  flags: bit 0 KEYED = the version is a keyed digest (below); others zero
        10    2  reserved, zero
        12    8  block length in bytes
        20   16  block checksum = the block's *version*: xxh3-128 of the whole block, or
                 with KEYED a keyed digest of the tenant's (client/integrity.py)
        36    4  payload length in bytes
        40    8  shard checksum: xxh3-64 of bytes [0, 40) followed by the payload
        48    .  payload

The shard checksum covers the header fields and the payload, so a flipped byte anywhere in a
shard is caught before decoding; the block checksum catches a wrong reconstruction and tells
apart two writers' versions of the same key. A KEYED version is one only the tenant's clients
can compute (end-to-end integrity): a node treats it as opaque, and its codec, holding no key,
leaves the block unchecked against it (the shard checksums still guard each shard); a reader
of that tenant checks it whatever the flag says (erasure/codec.py ``Codec.decode``).

A shard is one buffer (header then payload) or a :class:`SplitShard` whose header and payload
live apart: a UCX read lands each payload straight at its place in the caller's block while its
header comes over gRPC. Every function here takes both. This module is pure: bytes in, bytes
out.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from erasure import fastsum
from erasure.errors import ChecksumMismatch, ShardHeaderError

MAGIC = b"KVSH"
FORMAT_VERSION = 1
HEADER_BYTES = 48
VERSION_BYTES = 16
BACKEND_IDS = {"zfec": 1, "isal": 2}
BACKEND_NAMES = {v: k for k, v in BACKEND_IDS.items()}

_FIELDS = struct.Struct("<4sBBBBBB2xQ16sI")  # bytes [0, 40): everything but the shard checksum
KEYED = 0x01  # flags: the version is a keyed digest (client/integrity.py)
_CHECKSUM = struct.Struct("<Q")
_VERSION_SLICE = slice(20, 36)
assert _FIELDS.size + _CHECKSUM.size == HEADER_BYTES


@dataclass(frozen=True)
class ShardHeader:
    backend: str
    k: int
    m: int
    index: int
    block_len: int
    block_checksum: bytes  # 16 bytes; the block's version
    payload_len: int
    flags: int = 0

    @property
    def keyed(self) -> bool:
        """The version is a keyed digest that only the tenant's clients can compute."""
        return bool(self.flags & KEYED)


def block_checksum(block: bytes | memoryview) -> bytes:
    """xxh3-128 of a whole block: its content checksum and its version id."""
    return fastsum.block_checksum(block)


def shard_checksum(fields: bytes | memoryview, payload: bytes | memoryview) -> int:
    """xxh3-64 of the header's first 40 bytes followed by the payload."""
    return fastsum.shard_checksum(fields, payload)


def pack_header(header: ShardHeader, payload: bytes | memoryview) -> bytes:
    """The 48 header bytes for ``payload`` (which must be ``header.payload_len`` long)."""
    if len(payload) != header.payload_len:
        raise ShardHeaderError(f"payload is {len(payload)} bytes, header says {header.payload_len}")
    fields = _FIELDS.pack(
        MAGIC,
        FORMAT_VERSION,
        BACKEND_IDS[header.backend],
        header.k,
        header.m,
        header.index,
        header.flags,
        header.block_len,
        header.block_checksum,
        header.payload_len,
    )
    return fields + _CHECKSUM.pack(shard_checksum(fields, payload))


class SplitShard(NamedTuple):
    """A shard whose 48-byte header and payload are separate buffers."""

    header: bytes | memoryview
    payload: memoryview


Shard = bytes | bytearray | memoryview | SplitShard


def split_shard(shard: Shard) -> tuple[memoryview, memoryview]:
    """A shard's header and payload views; ShardHeaderError if the header is cut short."""
    if isinstance(shard, SplitShard):
        header, payload = memoryview(shard.header), memoryview(shard.payload)
        if len(header) != HEADER_BYTES:
            raise ShardHeaderError(f"shard header is {len(header)} bytes, not {HEADER_BYTES}")
        return header, payload
    view = memoryview(shard)
    if len(view) < HEADER_BYTES:
        raise ShardHeaderError(
            f"shard of {len(view)} bytes is shorter than the {HEADER_BYTES}-byte header"
        )
    return view[:HEADER_BYTES], view[HEADER_BYTES:]


def parse_header(shard: Shard) -> ShardHeader:
    """Parse (but do not checksum) a shard header; raise ShardHeaderError if malformed."""
    header, payload = split_shard(shard)
    fields = _FIELDS.unpack_from(header)
    magic, fmt, backend_id, k, m, index, flags, block_len, version, payload_len = fields
    if magic != MAGIC or fmt != FORMAT_VERSION:
        raise ShardHeaderError(f"not a kvstore shard (magic {magic!r}, format {fmt})")
    if flags & ~KEYED:
        raise ShardHeaderError(f"bad shard header: unknown flags {flags:#x}")
    if backend_id not in BACKEND_NAMES or index >= k + m or k == 0:
        raise ShardHeaderError(
            f"bad shard header: backend {backend_id}, k={k}, m={m}, index {index}"
        )
    if len(payload) != payload_len:
        raise ShardHeaderError(
            f"shard is {HEADER_BYTES + len(payload)} bytes, header says "
            f"{HEADER_BYTES + payload_len}"
        )
    return ShardHeader(
        BACKEND_NAMES[backend_id], k, m, index, block_len, version, payload_len, flags
    )


def verify_shard(shard: Shard) -> ShardHeader:
    """Parse the header and check the shard checksum; raise on any mismatch."""
    parsed = parse_header(shard)
    header, payload = split_shard(shard)
    (stored,) = _CHECKSUM.unpack_from(header, _FIELDS.size)
    if shard_checksum(header[: _FIELDS.size], payload) != stored:
        raise ChecksumMismatch(
            f"shard {parsed.index} of block version "
            f"{parsed.block_checksum.hex()} fails its checksum"
        )
    return parsed


def shard_version(shard: Shard) -> bytes:
    """The 16-byte block version recorded in a shard header (no validation)."""
    return bytes(split_shard(shard)[0][_VERSION_SLICE])


def shard_payload(shard: Shard) -> memoryview:
    return split_shard(shard)[1]


def pack_headers(
    backend: str,
    k: int,
    m: int,
    block_len: int,
    version: bytes,
    payloads: Sequence[bytes | memoryview],
    flags: int = 0,
) -> list[bytes]:
    """The 48-byte headers of one block's shards whose checksum is ``version``; shard i
    carries ``payloads[i]``.

    The encoder's fast path: the same bytes as ``pack_header(ShardHeader(...), p)`` for each
    payload, without building a ShardHeader per shard.
    """
    backend_id = BACKEND_IDS[backend]
    headers = []
    for index, payload in enumerate(payloads):
        fields = _FIELDS.pack(
            MAGIC, FORMAT_VERSION, backend_id, k, m, index, flags, block_len, version, len(payload)
        )
        headers.append(fields + _CHECKSUM.pack(shard_checksum(fields, payload)))
    return headers
