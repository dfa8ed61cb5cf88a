"""Batch reads over UCX, request and reply included: the frames both ends share, the answer.

A batch read asks each node once; the request and the answer both travel over UCX, gRPC
carries only the control plane (puts, lookups, deletes, stats, and ``Health``, which gives
the node's UCX worker address)::

    client                                              node (listening on REQUEST_TAG)
    expects: reply frame -> tag_base + REPLY_INDEX,
             payload i   -> tag_base + FIRST_PAYLOAD_INDEX + i
    request frame -------- UCX tag REQUEST_TAG ------>  check its MAC; in the executor: one
                                                        index snapshot, one preadv per shard
                                                        into staging (kvstore/store/shard_reader.py)
    <------ tag_base + 0: reply frame (the table) ----
    knows from the table where each payload belongs
    (its place in the caller's block, or scratch)
    <------ tag_base + 1 + i: HIT payload i ----------  sent from the staging region, which
    each received straight into its place                is released once the client took all

UCX has no TLS, so neither frame carries a credential. The client first opens a **session**
over the node's identity-checked gRPC channel (``OpenUcxSession``: its credential checked
there, a session id and a 32-byte key handed back, kvstore/node/ucx_sessions.py). Then:

- Request frame: ``b"KVRS"``, the session id (16 bytes), an HMAC-SHA256 (first 16 bytes,
  keyed by the session key) of magic, session id and body, then the body: a serialized
  ``GetShardsRequest`` whose ``ucx`` field names the client's worker address and tag base.
  The node answers only a frame its session's key signed; the bearer token never crosses.
- Reply frame: ``0x00`` and the batch answer's table (kvstore/wire/batch_answer.py; the payload
  messages are its HIT payloads, in table order), or ``0x01``, a gRPC status code (u8) and a
  UTF-8 message for a request the node refuses; then an HMAC-SHA256 (16 bytes, the session
  key) of ``b"KVRP"``, the request's tag base (u64 LE) and the frame before it. The client
  takes only a reply signed for its own request, so a process that took the node's UCX
  address, which never saw the key, cannot answer as the node: the client reads over gRPC
  instead. A refusal for an unknown session is signed with no key (its MAC is zeros): the
  client drops its session and opens another. The payloads are not signed (the cost would
  be a hash of every byte); they are checked like any other shard (client/integrity.py),
  against the table's sizes, which the reply's MAC covers.

A node that cannot reach the client's worker answers nothing: the client's wait times out
and it reads over gRPC instead. A request frame of the release before sessions (``b"KVRQ"``,
with the token) is refused at once, in that release's reply format, so its client reads over
gRPC during a rolling upgrade without waiting out its UCX timeout.

Why the request goes over UCX too: a grpc.aio round trip costs the client about 0.35 ms of
Python on the 2-core machine, once per node per batch; a UCX send costs less.
"""

from __future__ import annotations

import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from kvstore.errors import InvalidArgument, KVStoreError, Unavailable
from kvstore.grpc_errors import code_from_value, from_grpc_status, status_code
from kvstore.proto import kvstore_pb2 as pb
from kvstore.wire import batch_answer

MAX_REQUEST_BYTES = 1 << 20  # a request holds keys only; larger frames are discarded
REPLY_INDEX, FIRST_PAYLOAD_INDEX = 0, 1  # message indexes in a batch's tag range
SESSION_ID_BYTES, SESSION_KEY_BYTES, MAC_BYTES = 16, 32, 16
_REQUEST_MAGIC, _REPLY_MAGIC = b"KVRS", b"KVRP"
_REQUEST_HEAD = struct.Struct(f"<4s{SESSION_ID_BYTES}s{MAC_BYTES}s")  # magic, session, MAC
_TAG_BASE = struct.Struct("<Q")
_REPLY_OK, _REPLY_ERROR = 0, 1
_UNSIGNED = bytes(MAC_BYTES)  # a refusal for a session the node does not know
_LEGACY_MAGIC, _LEGACY_HEAD = b"KVRQ", struct.Struct("<4sH")  # a token frame (magic, length)


@dataclass(frozen=True)
class RequestFrame:
    """A decoded request frame; trust it only once :meth:`signed_with` the session's key."""

    session_id: bytes
    request: pb.GetShardsRequest
    _mac: bytes
    _body: bytes

    def signed_with(self, key: bytes) -> bool:
        """Whether the frame's MAC is the session key's (in constant time)."""
        expected = _mac(key, _REQUEST_MAGIC, self.session_id, self._body)
        return hmac.compare_digest(self._mac, expected)


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.digest(key, b"".join(parts), "sha256")[:MAC_BYTES]


def encode_request(request: pb.GetShardsRequest, session_id: bytes, key: bytes) -> bytes:
    """The request frame for ``request`` (its ``ucx`` field says where to reply), signed with
    the session's key."""
    body = request.SerializeToString()
    mac = _mac(key, _REQUEST_MAGIC, session_id, body)
    return _REQUEST_HEAD.pack(_REQUEST_MAGIC, session_id, mac) + body


def decode_request(frame: bytes | memoryview) -> RequestFrame:
    """The parts of a request frame; InvalidArgument if it is malformed (its MAC unchecked)."""
    view = memoryview(frame)
    if len(view) < _REQUEST_HEAD.size:
        raise InvalidArgument(f"UCX request of {len(view)} bytes is shorter than its header")
    magic, session_id, mac = _REQUEST_HEAD.unpack_from(view)
    if magic != _REQUEST_MAGIC:
        raise InvalidArgument("not a kvstore UCX request frame (or one from an older client)")
    body = bytes(view[_REQUEST_HEAD.size :])
    try:
        request = pb.GetShardsRequest.FromString(body)
    except DecodeError as exc:
        raise InvalidArgument(f"malformed UCX request: {exc}") from None
    if not request.HasField("ucx"):
        raise InvalidArgument("a UCX request must say where to reply (its ucx field)")
    return RequestFrame(session_id, request, mac, body)


def legacy_reply_address(frame: bytes | memoryview) -> pb.UcxDelivery | None:
    """Where a request frame of an earlier release (``b"KVRQ"``, a u16 token length, the
    token, the request) wants its reply, or None if it is not one. The node refuses such a
    request at once (:func:`encode_legacy_refusal`), so an old client reads over gRPC
    without waiting out its UCX timeout during a rolling upgrade."""
    view = memoryview(frame)
    if len(view) < _LEGACY_HEAD.size or bytes(view[:4]) != _LEGACY_MAGIC:
        return None
    start = _LEGACY_HEAD.size + _LEGACY_HEAD.unpack_from(view)[1]
    try:
        request = pb.GetShardsRequest.FromString(bytes(view[start:]))
    except DecodeError:
        return None
    return request.ucx if request.HasField("ucx") and start <= len(view) else None


def encode_legacy_refusal(error: KVStoreError) -> bytes:
    """A reply frame in an earlier release's format (no MAC): its client raises ``error``."""
    return bytes((_REPLY_ERROR, status_code(error).value[0])) + str(error).encode()


def encode_error(error: KVStoreError, key: bytes | None, tag_base: int) -> bytes:
    """The reply frame refusing a request; ``key`` None: a session the node does not know."""
    body = bytes((_REPLY_ERROR, status_code(error).value[0])) + str(error).encode()
    return _signed_reply(body, key, tag_base)


def encode_reply(entries: Sequence[batch_answer.Entry], key: bytes, tag_base: int) -> bytes:
    """The reply frame of an answered request: the batch answer's table, signed."""
    return _signed_reply(bytes((_REPLY_OK,)) + batch_answer.encode_table(entries), key, tag_base)


def _signed_reply(body: bytes, key: bytes | None, tag_base: int) -> bytes:
    mac = _UNSIGNED if key is None else _mac(key, _REPLY_MAGIC, _TAG_BASE.pack(tag_base), body)
    return body + mac


def verify_reply(frame: bytes | memoryview, key: bytes, tag_base: int) -> None:
    """Raise UnverifiedReply unless the session's ``key`` signed ``frame`` for the request
    of ``tag_base`` (``unknown_session``: the node refused, unsigned, a session it does not
    know)."""
    view = memoryview(frame)
    if len(view) <= MAC_BYTES:
        raise UnverifiedReply(False)
    body, mac = view[:-MAC_BYTES], bytes(view[-MAC_BYTES:])
    if not hmac.compare_digest(mac, _mac(key, _REPLY_MAGIC, _TAG_BASE.pack(tag_base), body)):
        raise UnverifiedReply(mac == _UNSIGNED)


def decode_reply(frame: bytes | memoryview) -> memoryview:
    """The batch answer's table a (verified) reply frame carries; the node's error raised as
    the kvstore.errors exception for its status code."""
    view = memoryview(frame)[:-MAC_BYTES]
    if len(view) and view[0] == _REPLY_OK:
        return view[1:]
    if len(view) >= 2 and view[0] == _REPLY_ERROR:
        raise from_grpc_status(code_from_value(view[1]), bytes(view[2:]).decode(errors="replace"))
    raise Unavailable("malformed UCX reply frame")


class UnverifiedReply(Unavailable):
    """A UCX reply not signed with this session's key for this request: not the node's, or
    the node no longer knows the session (it restarted, or the session expired)."""

    def __init__(self, unknown_session: bool) -> None:
        what = "refused an unknown session" if unknown_session else "is not signed by the node"
        super().__init__(f"the UCX reply {what}; reading over gRPC")
        self.unknown_session = unknown_session
