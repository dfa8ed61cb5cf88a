"""PutShardsRequest written and read by hand: byte for byte protobuf's encoding, shards parsed
as views of the received bytes, every other field through protobuf, malformed input refused."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.proto import kvstore_pb2 as pb
from kvstore.wire.put_request import encode_put_request, parse_put_request

keys = st.binary(min_size=0, max_size=20)
shards = st.binary(max_size=400)
items = st.lists(st.tuples(keys, shards, st.integers(0, 3)), max_size=6)
times_s = st.one_of(st.just(0.0), st.floats(allow_nan=False, allow_infinity=False))


@settings(max_examples=50, deadline=None)
@given(st.text(max_size=10), st.text(max_size=10), items, times_s)
def test_encoding_is_protobufs(tenant: str, traffic_class: str, drawn, written_at_s) -> None:
    pieces = [(key, [shard[:cut], memoryview(shard)[cut:]]) for key, shard, cut in drawn]
    raw = encode_put_request(tenant, traffic_class, pieces, written_at_s)
    expected = pb.PutShardsRequest(
        tenant=tenant,
        traffic_class=traffic_class,
        shards=[
            pb.ShardPut(key=key, shard=shard, written_at_s=written_at_s) for key, shard, _ in drawn
        ],
    )
    assert raw == expected.SerializeToString(), "hand-written PutShards differs from protobuf's"


@settings(max_examples=50, deadline=None)
@given(
    st.text(max_size=10),
    items,
    times_s,
    st.floats(allow_nan=False),
    st.booleans(),
)
def test_parse_reads_what_protobuf_wrote(
    tenant: str, drawn, written_at_s: float, expires_at_s: float, repair: bool
) -> None:
    message = pb.PutShardsRequest(
        tenant=tenant,
        traffic_class="chat",
        shards=[
            pb.ShardPut(key=key, shard=shard, written_at_s=written_at_s) for key, shard, _ in drawn
        ],
        expires_at_s=expires_at_s,
        repair=repair,
    )
    raw = message.SerializeToString()
    parsed = parse_put_request(raw)
    assert (parsed.fields.tenant, parsed.fields.traffic_class) == (tenant, "chat")
    assert (parsed.fields.expires_at_s, parsed.fields.repair) == (expires_at_s, repair)
    assert not parsed.fields.shards, "shards must come as views, not protobuf copies"
    assert [(s.key, bytes(s.shard), s.written_at_s) for s in parsed.shards] == [
        (key, shard, written_at_s) for key, shard, _ in drawn
    ]
    for shard in parsed.shards:
        assert shard.shard.obj is raw, "a shard was copied out of the received bytes"


def test_unknown_and_repeated_fields_behave_as_in_protobuf() -> None:
    """A field the node does not know is skipped; a repeated singular field's last value wins
    (a newer client may send fields this node predates)."""
    shard_put = pb.ShardPut(key=b"k" * 16, shard=b"abc", written_at_s=2.0).SerializeToString()
    unknown = bytes([9 << 3 | 0, 7]) + bytes([10 << 3 | 2, 2]) + b"zz"  # varint 9, bytes 10
    again = pb.ShardPut(key=b"j" * 16).SerializeToString()
    body = shard_put + unknown + again
    raw = bytes([3 << 3 | 2, len(body)]) + body + unknown
    raw += pb.PutShardsRequest(tenant="acme").SerializeToString()
    parsed = parse_put_request(raw)
    assert parsed.fields.tenant == "acme"
    assert [(s.key, bytes(s.shard), s.written_at_s) for s in parsed.shards] == [
        (b"j" * 16, b"abc", 2.0)
    ]


@pytest.mark.parametrize(
    "raw",
    [
        b"\xff\xff\xff",  # a varint cut short
        bytes([3 << 3 | 2, 50]) + b"short",  # a shard put longer than the message
        bytes([3 << 3 | 2, 3, 2 << 3 | 2, 9, 0]),  # a shard longer than its ShardPut
        bytes([3 << 3 | 2, 2, 3 << 3 | 1, 0]),  # a written_at_s cut short
        bytes([1 << 3 | 2, 2]) + b"\xff\xfe",  # a tenant that is not utf-8
        bytes([7 << 3 | 3]),  # a group (wire type 3)
        bytes([0, 0]),  # field number 0
    ],
)
def test_malformed_requests_raise_value_error(raw: bytes) -> None:
    with pytest.raises(ValueError):
        parse_put_request(raw)
