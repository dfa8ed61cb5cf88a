"""client/wire.py parses GetShardsReply exactly like protobuf, without copying shards."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from client.wire import parse_get_shards_reply
from kvstore.proto import kvstore_pb2 as pb

results_strategy = st.lists(
    st.tuples(st.sampled_from([0, 1, 2]), st.lists(st.binary(max_size=300), max_size=3)),
    max_size=6,
)


@settings(max_examples=200, deadline=None)
@given(results_strategy)
def test_parse_matches_protobuf(results: list[tuple[int, list[bytes]]]) -> None:
    reply = pb.GetShardsReply(
        results=[pb.ShardResult(status=status, shards=shards) for status, shards in results]
    )
    parsed = parse_get_shards_reply(reply.SerializeToString())
    assert [(r.status, [bytes(s) for s in r.shards]) for r in parsed] == results


def test_shards_are_views_of_the_reply_and_unknown_fields_are_skipped() -> None:
    result = pb.ShardResult(status=1, shards=[b"abc" * 10]).SerializeToString()
    unknown = b"\x18\x05" + b"\x25\x01\x02\x03\x04" + b"\x29" + bytes(8)  # fields 3, 4, 5
    data = b"\x0a" + bytes([len(result) + len(unknown)]) + result + unknown + b"\x10\x07"
    (parsed,) = parse_get_shards_reply(data)
    assert parsed.status == 1 and bytes(parsed.shards[0]) == b"abc" * 10
    assert parsed.shards[0].obj is data, "the shard should be a view, not a copy"


@pytest.mark.parametrize("data", [b"\x0a\x05ab", b"\x0a", b"\x0a\xff", b"\x0b\x00", b"\xff" * 11])
def test_malformed_replies_raise_value_error(data: bytes) -> None:
    with pytest.raises(ValueError):
        parse_get_shards_reply(data)
