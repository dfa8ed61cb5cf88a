"""Batch reads over UCX, request and reply included: the frames both ends share, the answer.

A batch read asks each node once; the request and the answer both travel over UCX, gRPC
carries only the control plane (puts, lookups, deletes, stats, and ``Health``, which gives
the node's UCX worker address)::

    client                                              node (listening on REQUEST_TAG)
    expects: reply frame -> tag_base + REPLY_INDEX,
             payload i   -> tag_base + FIRST_PAYLOAD_INDEX + i
    request frame -------- UCX tag REQUEST_TAG ------>  check token; in the executor: one
                                                        index snapshot, one preadv per shard
                                                        into staging (kvstore/store/shard_reader.py)
    <------ tag_base + 0: reply frame (the table) ----
    knows from the table where each payload belongs
    (its place in the caller's block, or scratch)
    <------ tag_base + 1 + i: HIT payload i ----------  sent from the staging region, which
    each received straight into its place                is released once the client took all

Request frame: ``b"KVRQ"``, the token's length (u16 LE), the token (UTF-8, may be empty), then
a serialized ``GetShardsRequest`` whose ``ucx`` field names the client's worker address and
tag base. Reply frame: ``0x00`` and the batch answer's table (kvstore/wire/batch_answer.py; the
payload messages are its HIT payloads, in table order); or ``0x01``, a gRPC status
code (u8) and a UTF-8 message, for a request the node refuses (bad token, malformed request).
A node that cannot reach the client's worker answers nothing: the client's wait times out and
it reads over gRPC instead.

Why the request goes over UCX too: a grpc.aio round trip costs the client about 0.35 ms of
Python on the 2-core machine, once per node per batch; a UCX send costs less.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from google.protobuf.message import DecodeError

from kvstore.errors import InvalidArgument, KVStoreError, Unavailable
from kvstore.grpc_errors import code_from_value, from_grpc_status, status_code
from kvstore.proto import kvstore_pb2 as pb
from kvstore.wire import batch_answer

MAX_REQUEST_BYTES = 1 << 20  # a request holds keys only; larger frames are discarded
REPLY_INDEX, FIRST_PAYLOAD_INDEX = 0, 1  # message indexes in a batch's tag range
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


def encode_reply(entries: Sequence[batch_answer.Entry]) -> bytes:
    """The reply frame of an answered request: the batch answer's table."""
    return bytes((_REPLY_OK,)) + batch_answer.encode_table(entries)


def decode_reply(frame: bytes | memoryview) -> memoryview:
    """The batch answer's table a reply frame carries; the node's error raised as the
    kvstore.errors exception for its status code."""
    view = memoryview(frame)
    if len(view) and view[0] == _REPLY_OK:
        return view[1:]
    if len(view) >= 2 and view[0] == _REPLY_ERROR:
        raise from_grpc_status(code_from_value(view[1]), bytes(view[2:]).decode(errors="replace"))
    raise Unavailable("malformed UCX reply frame")
