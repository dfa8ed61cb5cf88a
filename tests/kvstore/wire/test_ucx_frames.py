"""The UCX read request and reply frames (kvstore/wire/ucx_frames.py): pure code, no UCX needed."""

from __future__ import annotations

import struct

import grpc
import pytest

from kvstore.errors import InvalidArgument, PermissionDenied, Unavailable
from kvstore.proto import kvstore_pb2 as pb
from kvstore.wire import batch_answer
from kvstore.wire.ucx_frames import (
    UnverifiedReply,
    decode_reply,
    decode_request,
    encode_error,
    encode_legacy_refusal,
    encode_reply,
    encode_request,
    legacy_reply_address,
    verify_reply,
)

SESSION, KEY, OTHER_KEY = b"s" * 16, b"k" * 32, b"o" * 32
TAG_BASE = 7 << 20


def _request() -> pb.GetShardsRequest:
    delivery = pb.UcxDelivery(worker_address=b"addr", tag_base=TAG_BASE)
    return pb.GetShardsRequest(tenant="acme", keys=[bytes(16), b"k" * 16], ucx=delivery)


def test_a_request_carries_its_session_and_no_token() -> None:
    frame = encode_request(_request(), SESSION, KEY)
    decoded = decode_request(frame)
    assert decoded.session_id == SESSION and decoded.request == _request()
    assert decoded.signed_with(KEY) and not decoded.signed_with(OTHER_KEY)
    assert KEY not in frame, "the session key crossed in the frame"


def test_a_changed_request_is_no_longer_signed() -> None:
    frame = bytearray(encode_request(_request(), SESSION, KEY))
    frame[-1] ^= 1  # the last key's last byte
    decoded = decode_request(bytes(frame))
    assert not decoded.signed_with(KEY), "a request changed on the way passed its MAC"
    other_session = bytes(frame[:4]) + b"t" * 16 + bytes(frame[20:])
    assert not decode_request(other_session).signed_with(KEY), "the MAC does not bind the id"


@pytest.mark.parametrize(
    ("frame", "match"),
    [
        (b"", "shorter than its header"),
        (b"XXXX" + bytes(40), "not a kvstore UCX request"),
        (b"KVRQ" + bytes(40), "older client"),  # the token frame of earlier releases
        (b"KVRS" + bytes(32) + b"\xff\xff\xff", "malformed"),
        (encode_request(pb.GetShardsRequest(tenant="a", keys=[bytes(16)]), SESSION, KEY), "reply"),
    ],
)
def test_malformed_requests_are_refused(frame: bytes, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        decode_request(frame)


def test_replies_carry_the_reply_or_the_nodes_error() -> None:
    reply = encode_reply([], KEY, TAG_BASE)
    verify_reply(reply, KEY, TAG_BASE)
    entries, payload_bytes = batch_answer.decode_table(decode_reply(reply), 0)
    assert (len(entries), payload_bytes) == (0, 0)
    refusal = encode_error(PermissionDenied("wrong tenant"), KEY, TAG_BASE)
    verify_reply(refusal, KEY, TAG_BASE)
    with pytest.raises(PermissionDenied, match="wrong tenant"):
        decode_reply(refusal)
    with pytest.raises(InvalidArgument, match="too many keys"):
        decode_reply(encode_error(InvalidArgument("too many keys"), KEY, TAG_BASE))
    for garbage in (bytes(16), b"\x07" + bytes(16), b"\x01" + bytes(16)):
        with pytest.raises(Unavailable, match="malformed"):
            decode_reply(garbage)


def test_only_a_reply_signed_for_this_request_is_taken() -> None:
    reply = encode_reply([], KEY, TAG_BASE)
    for key, tag_base in ((OTHER_KEY, TAG_BASE), (KEY, TAG_BASE + (1 << 20))):
        with pytest.raises(UnverifiedReply) as raised:
            verify_reply(reply, key, tag_base)  # another session's, or a replayed reply
        assert not raised.value.unknown_session
    for frame in (b"", b"\x00", bytes(16)):
        with pytest.raises(UnverifiedReply):
            verify_reply(frame, KEY, TAG_BASE)
    unknown = encode_error(PermissionDenied("unknown or expired UCX session"), None, TAG_BASE)
    with pytest.raises(UnverifiedReply) as raised:
        verify_reply(unknown, KEY, TAG_BASE)
    assert raised.value.unknown_session, "an unsigned refusal says the node lost the session"


def _legacy_frame(request: pb.GetShardsRequest, token: bytes = b"s3cret") -> bytes:
    """A request frame of the release before sessions: magic, token length, token, request."""
    return b"KVRQ" + struct.pack("<H", len(token)) + token + request.SerializeToString()


def test_an_old_clients_frame_gets_a_refusal_in_its_format() -> None:
    assert legacy_reply_address(_legacy_frame(_request())) == _request().ucx
    no_address = pb.GetShardsRequest(tenant="a", keys=[bytes(16)])
    for frame in (b"", b"KVRQ", _legacy_frame(no_address), b"KVRQ\xff\xff" + bytes(8)):
        assert legacy_reply_address(frame) is None, frame
    assert legacy_reply_address(encode_request(_request(), SESSION, KEY)) is None
    refusal = encode_legacy_refusal(Unavailable("upgrade the client"))
    assert refusal[:2] == bytes((1, grpc.StatusCode.UNAVAILABLE.value[0]))
    assert refusal[2:] == b"upgrade the client"
