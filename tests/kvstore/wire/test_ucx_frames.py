"""The UCX read request and reply frames (kvstore/wire/ucx_frames.py): pure code, no UCX needed."""

from __future__ import annotations

import pytest

from kvstore.errors import InvalidArgument, PermissionDenied, Unavailable
from kvstore.proto import kvstore_pb2 as pb
from kvstore.wire.ucx_frames import decode_reply, decode_request, encode_error, encode_request


def _request() -> pb.GetShardsRequest:
    delivery = pb.UcxDelivery(worker_address=b"addr", tag_base=7 << 20)
    return pb.GetShardsRequest(tenant="acme", keys=[bytes(16), b"k" * 16], ucx=delivery)


@pytest.mark.parametrize("token", [None, "", "s3cret", "tökén"])
def test_request_round_trips_with_its_token(token: str | None) -> None:
    offered, request = decode_request(encode_request(_request(), token))
    assert offered == (token or "") and request == _request()


@pytest.mark.parametrize(
    ("frame", "match"),
    [
        (b"", "shorter than its header"),
        (b"XXXX\x00\x00", "not a kvstore UCX request"),
        (b"KVRQ\xff\x00abc", "not a kvstore UCX request"),  # token longer than the frame
        (b"KVRQ\x00\x00\xff\xff\xff", "malformed"),
        (encode_request(pb.GetShardsRequest(tenant="a", keys=[bytes(16)]), None), "reply"),
    ],
)
def test_malformed_requests_are_refused(frame: bytes, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        decode_request(frame)


def test_replies_carry_the_reply_or_the_nodes_error() -> None:
    assert bytes(decode_reply(b"\x00reply bytes")) == b"reply bytes"
    with pytest.raises(PermissionDenied, match="wrong token"):
        decode_reply(encode_error(PermissionDenied("wrong token")))
    with pytest.raises(InvalidArgument, match="too many keys"):
        decode_reply(encode_error(InvalidArgument("too many keys")))
    for garbage in (b"", b"\x07", b"\x01"):
        with pytest.raises(Unavailable, match="malformed"):
            decode_reply(garbage)
