"""Reads over UCX, request and reply included: the frames both ends share, the node's answer.

A read of one batch of keys from one node goes over UCX both ways; gRPC carries only the
control plane (puts, lookups, deletes, stats, and ``Health``, which gives the node's UCX
worker address)::

    client                                              node (listening on REQUEST_TAG)
    registers receives: payload i -> slot i,
    reply -> message len(keys) of the batch
    request frame -------- UCX tag REQUEST_TAG ------>  check token, look the keys up
                                                        post payload i of each HIT with tag
                                                        tag_base + i (from the bytes it read),
    <----- UCX tag_base + i: payload i (HITs only) ---  and the reply frame with tag
    <----- UCX tag_base + len(keys): reply frame -----  tag_base + len(keys)

Request frame: ``b"KVRQ"``, the token's length (u16 LE), the token (UTF-8, may be empty), then
a serialized ``GetShardsRequest`` whose ``ucx`` field names the client's worker address and
tag base. Reply frame: ``0x00`` and a serialized ``GetShardsReply`` in which each HIT carries
its newest version's 48-byte header (``ucx_header``; the payload is message i) and older
versions inline; or ``0x01``, a gRPC status code (u8) and a UTF-8 message, for a request the
node refuses (bad token, malformed request). A node that cannot reach the client's worker
answers nothing: the client's wait times out and it reads over gRPC instead.

Why not one gRPC call per batch with only the payloads over UCX (our first version): a
grpc.aio round trip costs the client about 0.35 ms of Python on the 2-core machine, and a
read makes 11 of them, so that version could not beat gRPC by much. Sending the request over
UCX removes that round trip, but a UCX send to a sleeping node still cost the client about
0.18 ms there, and cluster reads stay near 1 GB/s on either transport (README, "UCX data
path", has the figures and the commands).
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Sequence

from google.protobuf.message import DecodeError

from erasure.shard import HEADER_BYTES
from kvstore.errors import InvalidArgument, KVStoreError, Unavailable
from kvstore.get_reply import encode_get_shards_reply
from kvstore.grpc_errors import code_from_value, from_grpc_status, status_code
from kvstore.proto import kvstore_pb2 as pb
from kvstore.shard_reader import GetResult
from kvstore.ucx_server import UcxServer

log = logging.getLogger(__name__)

# How long a node keeps a posted payload for a client that does not take it.
UCX_SEND_TIMEOUT_S = 30.0
MAX_REQUEST_BYTES = 1 << 20  # a request holds keys only; larger frames are discarded
# Smaller payloads travel inside the reply frame: a UCX message costs both ends tens of
# microseconds of Python, more than copying a shard of this size (see the module doc).
MIN_MESSAGE_PAYLOAD_BYTES = 128 << 10
_REQUEST_MAGIC = b"KVRQ"
_REQUEST_HEAD = struct.Struct("<4sH")  # magic, token length
_REPLY_OK, _REPLY_ERROR = 0, 1


def encode_request(request: pb.GetShardsRequest, token: str | None) -> bytes:
    """The request frame for ``request`` (its ``ucx`` field says where to reply)."""
    token_bytes = (token or "").encode()
    return b"".join(
        (
            _REQUEST_HEAD.pack(_REQUEST_MAGIC, len(token_bytes)),
            token_bytes,
            request.SerializeToString(),
        )
    )


def decode_request(frame: bytes | memoryview) -> tuple[str, pb.GetShardsRequest]:
    """(token, request) of a request frame; InvalidArgument if it is malformed."""
    view = memoryview(frame)
    if len(view) < _REQUEST_HEAD.size:
        raise InvalidArgument(f"UCX request of {len(view)} bytes is shorter than its header")
    magic, token_len = _REQUEST_HEAD.unpack_from(view)
    start = _REQUEST_HEAD.size + token_len
    if magic != _REQUEST_MAGIC or start > len(view):
        raise InvalidArgument("not a kvstore UCX request frame")
    try:
        token = bytes(view[_REQUEST_HEAD.size : start]).decode()
        request = pb.GetShardsRequest.FromString(bytes(view[start:]))
    except (UnicodeDecodeError, DecodeError) as exc:
        raise InvalidArgument(f"malformed UCX request: {exc}") from None
    if not request.HasField("ucx"):
        raise InvalidArgument("a UCX request must say where to reply (its ucx field)")
    return token, request


def encode_error(error: KVStoreError) -> bytes:
    """The reply frame refusing a request."""
    return bytes((_REPLY_ERROR, status_code(error).value[0])) + str(error).encode()


def decode_reply(frame: bytes | memoryview) -> memoryview:
    """The serialized GetShardsReply a reply frame carries; the node's error raised as the
    kvstore.errors exception for its status code."""
    view = memoryview(frame)
    if len(view) and view[0] == _REPLY_OK:
        return view[1:]
    if len(view) >= 2 and view[0] == _REPLY_ERROR:
        raise from_grpc_status(code_from_value(view[1]), bytes(view[2:]).decode(errors="replace"))
    raise Unavailable("malformed UCX reply frame")


def answer(server: UcxServer, delivery: pb.UcxDelivery, results: Sequence[GetResult]) -> None:
    """Post each HIT's newest payload and then the reply frame to the client.

    Raises InvalidArgument or Unavailable if the client's worker cannot be reached; the
    client then times out and reads over gRPC. The payloads are the bytes the store read
    for this request: the post keeps them alive until the client took them or gave up.
    """
    payloads: list[memoryview | bytes | None] = [_newest_payload(r) for r in results]
    over_ucx = [payload is not None for payload in payloads]
    reply = bytes((_REPLY_OK,)) + encode_get_shards_reply(results, over_ucx)
    server.post(delivery.worker_address, delivery.tag_base, [*payloads, reply], UCX_SEND_TIMEOUT_S)


def refuse(server: UcxServer, delivery: pb.UcxDelivery, num_keys: int, error: KVStoreError) -> None:
    """Send the reply frame that refuses a request (nothing if the client is unreachable)."""
    try:
        server.post(
            delivery.worker_address,
            delivery.tag_base,
            [*([None] * num_keys), encode_error(error)],
            UCX_SEND_TIMEOUT_S,
        )
    except (InvalidArgument, Unavailable) as exc:
        log.debug("cannot refuse a UCX request: the client is unreachable: %s", exc)


def _newest_payload(result: GetResult) -> memoryview | None:
    """What goes as a message of its own: a HIT's newest payload, unless it is small."""
    if result.status != pb.HIT or not result.shards:
        return None
    payload = memoryview(result.shards[0])[HEADER_BYTES:]
    return payload if len(payload) >= MIN_MESSAGE_PAYLOAD_BYTES else None
