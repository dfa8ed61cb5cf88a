"""The local read channel's frames: what a client and a node on the same host exchange.

A client on the node's host reads over a Unix-domain socket instead of gRPC or UCX, and the
shard payloads travel through memory, not the socket: the client owns an arena in a sealed
memfd (kvstore/byte_arena.py, ``ByteArena.shared``) that it passes to the node once, and each
read names a region of it where the node ``preadv``s the payloads (kvstore/node/local_server.py
serves it, client/local/ reads it)::

    client                                               node (one thread per connection)
    HELLO(token, tenant, arena bytes[, pool bytes])  ---> authenticate, derive the tenant,
      + arena memfd [+ landing pool memfd]               check each memfd is sealed against
                                                         shrinking, map them
    <--------------------------------------------------- WELCOME, or REFUSED(code, message)
    READ(id, region offset, region bytes, version, keys  -> one index snapshot, one native
         [, permit, a place in the pool per key])           read loop: payloads into their
                                                            places in the pool (data shards
                                                            the places fit) or arena[region]
    <--------------------------------------------------- ANSWER(id, OK, batch answer table)
    placed payloads are where they belong already;            (streamed payloads lie back to
    copy the rest from arena[region] (client/landing.py),      back from the region's start)
    free the region
    CANCEL(id) -----------------------------------------> a request not yet read is answered
                                                         CANCELLED; one being read finishes

Every frame::

    u32 body bytes | u8 kind | body                      (little-endian)
    HELLO     u16 token bytes | token | u16 tenant bytes | tenant | u64 arena bytes |
              [u64 landing pool bytes]   (the memfds travel as SCM_RIGHTS: arena, then pool)
    WELCOME   (empty)
    REFUSED   u8 gRPC status code | UTF-8 message        (the node closes the connection)
    READ      u64 request id | u64 region offset | u64 region bytes | u8 has version |
              16 B version | u32 num keys | num keys x 16 B keys |
              [u32 permit index | u32 permit ARMED value |
               num keys x (u64 place offset, NO_PLACE = none | u64 capacity bytes |
                           u32 payload bytes | u8 shard index | 3 B zero)]
    ANSWER    u64 request id | u8 status | OK: the table (kvstore/wire/batch_answer.py)
                                           TIMED: u64 read start ns | u64 read end ns
                                                  (CLOCK_MONOTONIC) | the table
                                           ERROR: u8 gRPC status code | UTF-8 message
                                           TOO_BIG: u64 payload bytes the answer needs
                                           CANCELLED: (empty)
    CANCEL    u64 request id

The arena's first ``PERMIT_AREA_BYTES`` hold the permit words (kvstore/wire/landing.py): a
READ that names places names a word there, and the node writes into the pool only while it
holds that word, so nothing lands in a slot after the client revoked the request.

Why the client owns the arena: the region of a request stays the client's until the node
answered it, so a late answer of a cancelled (hedged) request lands only in memory nobody
reads, and the node never leases anything; the arena holds only what this connection's
tenant was served, so no client can see another tenant's payloads; the seal keeps the node
from faulting on a mapping the client shrank. The landing pool is the client's too, and
sealed the same way; it may hold several tenants' blocks (the engine's one pool serves
every tenant's client), which is why a node writes there only at the places a READ of this
connection names, under its permit.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

import numpy as np

from kvstore.config import KEY_BYTES
from kvstore.errors import InvalidArgument
from kvstore.wire.landing import PLACE_DTYPE, Place, places_from_rows

HELLO, WELCOME, REFUSED, READ, ANSWER, CANCEL = 1, 2, 3, 4, 5, 6
OK, ERROR, TOO_BIG, CANCELLED, TIMED = 0, 1, 2, 3, 4  # ANSWER statuses
MAX_FRAME_BYTES = 1 << 20  # a READ holds keys only, an ANSWER's table 64 bytes per entry
MAX_ARENA_BYTES = 1 << 40
PERMIT_AREA_BYTES = 64 << 10  # the arena's first bytes: permit words, 4 bytes each
NUM_PERMITS = PERMIT_AREA_BYTES // 4

_HEAD = struct.Struct("<IB")  # body bytes, kind
_READ = struct.Struct("<QQQB16sI")
_PERMIT = struct.Struct("<II")
_ANSWER = struct.Struct("<QB")
_CODE = struct.Struct("<B")
_U64 = struct.Struct("<Q")
_TIMES = struct.Struct("<QQ")
_U16 = struct.Struct("<H")
HEAD_BYTES = _HEAD.size


@dataclass(frozen=True)
class ReadRequest:
    """One batch read as the node sees it."""

    request_id: int
    region_offset: int
    region_bytes: int
    version: bytes  # b"" = every version held
    keys: list[bytes]
    places: list[Place | None] | None = None  # per key, where its payload goes in the pool
    permit_index: int = 0  # the request's permit word (with places)
    permit_armed: int = 0  # its ARMED value


def frame(kind: int, body: bytes) -> bytes:
    return _HEAD.pack(len(body), kind) + body


def encode_hello(token: str | None, tenant: str, arena_bytes: int, pool_bytes: int = 0) -> bytes:
    """HELLO; ``pool_bytes`` > 0 when a landing pool's memfd travels after the arena's."""
    token_bytes, tenant_bytes = (token or "").encode(), tenant.encode()
    tail = _U64.pack(arena_bytes) + (_U64.pack(pool_bytes) if pool_bytes else b"")
    return frame(
        HELLO,
        b"".join(
            (
                _U16.pack(len(token_bytes)),
                token_bytes,
                _U16.pack(len(tenant_bytes)),
                tenant_bytes,
                tail,
            )
        ),
    )


def decode_hello(body: bytes) -> tuple[str, str, int, int]:
    """(token, tenant, arena bytes, pool bytes or 0); InvalidArgument if malformed."""
    try:
        (token_len,) = _U16.unpack_from(body, 0)
        token = body[2 : 2 + token_len].decode()
        start = 2 + token_len
        (tenant_len,) = _U16.unpack_from(body, start)
        tenant = body[start + 2 : start + 2 + tenant_len].decode()
        tail = body[start + 2 + tenant_len :]
        if len(tail) not in (8, 16):
            raise ValueError(f"{len(tail)} bytes after the tenant, expected 8 or 16")
        arena_bytes = _U64.unpack_from(tail)[0]
        pool_bytes = _U64.unpack_from(tail, 8)[0] if len(tail) == 16 else 0
    except (struct.error, UnicodeDecodeError, ValueError) as exc:
        raise InvalidArgument(f"malformed local HELLO frame: {exc}") from None
    return token, tenant, arena_bytes, pool_bytes


def encode_refused(code: int, message: str) -> bytes:
    return frame(REFUSED, _CODE.pack(code) + message.encode())


def decode_status(body: bytes | memoryview) -> tuple[int, str]:
    """(gRPC status code value, message) of a REFUSED or ERROR body."""
    if not len(body):
        return 2, "empty error frame"  # UNKNOWN
    return body[0], bytes(body[1:]).decode(errors="replace")


def encode_read(
    request_id: int,
    region_offset: int,
    region_bytes: int,
    version: bytes,
    keys: list[bytes],
    places: np.ndarray | None = None,
    permit: tuple[int, int] = (0, 0),
) -> bytes:
    """A READ; ``places`` (one PLACE_DTYPE row per key) and ``permit`` (index, ARMED value)
    when it names places in the client's landing pool."""
    head = _READ.pack(
        request_id,
        region_offset,
        region_bytes,
        int(bool(version)),
        version or bytes(16),
        len(keys),
    )
    parts = [head, *keys]
    if places is not None:
        parts.append(_PERMIT.pack(*permit))
        parts.append(places.astype(PLACE_DTYPE, copy=False).tobytes())
    return frame(READ, b"".join(parts))


def decode_read(body: bytes) -> ReadRequest:
    """A READ body; InvalidArgument if malformed (keys are always KEY_BYTES long)."""
    if len(body) < _READ.size:
        raise InvalidArgument(f"local READ frame of {len(body)} bytes is cut short")
    request_id, offset, num_bytes, has_version, version, num_keys = _READ.unpack_from(body)
    keys_end = _READ.size + num_keys * KEY_BYTES
    with_places = keys_end + _PERMIT.size + num_keys * PLACE_DTYPE.itemsize
    if len(body) not in (keys_end, with_places):
        raise InvalidArgument(
            f"local READ frame of {len(body)} bytes does not hold {num_keys} keys of "
            f"{KEY_BYTES} bytes (and their places)"
        )
    keys = [body[start : start + KEY_BYTES] for start in range(_READ.size, keys_end, KEY_BYTES)]
    request = ReadRequest(request_id, offset, num_bytes, version if has_version else b"", keys)
    if len(body) == keys_end:
        return request
    permit_index, permit_armed = _PERMIT.unpack_from(body, keys_end)
    if permit_index >= NUM_PERMITS:
        raise InvalidArgument(f"permit {permit_index} lies outside the {NUM_PERMITS} permits")
    rows = np.frombuffer(body, PLACE_DTYPE, num_keys, keys_end + _PERMIT.size)
    places = places_from_rows(rows)
    return ReadRequest(
        request_id, offset, num_bytes, request.version, keys, places, permit_index, permit_armed
    )


def encode_answer(request_id: int, status: int, body: bytes = b"") -> bytes:
    return frame(ANSWER, _ANSWER.pack(request_id, status) + body)


def encode_error(request_id: int, code: int, message: str) -> bytes:
    return encode_answer(request_id, ERROR, _CODE.pack(code) + message.encode())


def encode_too_big(request_id: int, payload_bytes: int) -> bytes:
    return encode_answer(request_id, TOO_BIG, _U64.pack(payload_bytes))


def decode_answer(body: memoryview) -> tuple[int, int, memoryview]:
    """(request id, status, rest of the body); ValueError if cut short."""
    if len(body) < _ANSWER.size:
        raise ValueError(f"local ANSWER frame of {len(body)} bytes is cut short")
    request_id, status = _ANSWER.unpack_from(body)
    return request_id, status, body[_ANSWER.size :]


def encode_timed(request_id: int, start_ns: int, end_ns: int, table: bytes) -> bytes:
    """An OK answer that also says when the node's read ran (CLOCK_MONOTONIC, which every
    process of the host shares: the client's read timeline lines it up with its own)."""
    return encode_answer(request_id, TIMED, _TIMES.pack(start_ns, end_ns) + table)


def decode_timed(body: memoryview) -> tuple[int, int, memoryview]:
    """(read start ns, read end ns, the table) of a TIMED body; ValueError if cut short."""
    if len(body) < _TIMES.size:
        raise ValueError(f"local TIMED answer of {len(body)} bytes is cut short")
    start_ns, end_ns = _TIMES.unpack_from(body)
    return start_ns, end_ns, body[_TIMES.size :]


def decode_too_big(body: memoryview) -> int:
    return int(_U64.unpack_from(body)[0])


def encode_cancel(request_id: int) -> bytes:
    return frame(CANCEL, _U64.pack(request_id))


def decode_cancel(body: bytes) -> int:
    if len(body) != _U64.size:
        raise InvalidArgument(f"local CANCEL frame of {len(body)} bytes, expected {_U64.size}")
    return int(_U64.unpack(body)[0])


def recv_exactly(sock: socket.socket, into: memoryview) -> bool:
    """Fill ``into`` from ``sock`` (blocking); False if the peer closed first."""
    filled = 0
    while filled < len(into):
        num_read = sock.recv_into(into[filled:])
        if not num_read:
            return False
        filled += num_read
    return True


def recv_frame(sock: socket.socket, head: bytearray) -> tuple[int, bytearray] | None:
    """The next (kind, body) from ``sock`` (blocking; ``head`` is a HEAD_BYTES scratch), or
    None once the peer closed; InvalidArgument for a frame over MAX_FRAME_BYTES."""
    if not recv_exactly(sock, memoryview(head)):
        return None
    size, kind = _HEAD.unpack(head)
    if size > MAX_FRAME_BYTES:
        raise InvalidArgument(f"local frame of {size} bytes exceeds {MAX_FRAME_BYTES}")
    body = bytearray(size)
    if not recv_exactly(sock, memoryview(body)):
        return None
    return kind, body


def boot_id() -> str:
    """This host's boot id: a client and a node with the same one run on the same host."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""
