"""encode_get_shards_reply (kvstore/node/get_reply.py) writes exactly what protobuf writes."""

from __future__ import annotations

import random

import pytest

from client.wire import parse_get_shards_reply
from kvstore.node.get_reply import encode_get_shards_reply
from kvstore.proto import kvstore_pb2 as pb
from kvstore.store.shard_reader import GetResult, Status


def _random_results(rng: random.Random) -> list[GetResult]:
    results = []
    for _ in range(rng.randrange(0, 6)):
        status = rng.choice(list(Status))
        sizes = [rng.choice([0, 1, 127, 128, 16_383, 16_384, 420_000, 2_200_000])]
        sizes = sizes * rng.randrange(1, 3) if status is Status.HIT else []
        results.append(GetResult(status, tuple(rng.randbytes(n) for n in sizes)))
    return results


@pytest.mark.parametrize("seed", range(20))
def test_encoding_matches_protobuf_and_parses_back(seed: int) -> None:
    results = _random_results(random.Random(seed))
    expected = pb.GetShardsReply(
        results=[pb.ShardResult(status=int(r.status), shards=r.shards) for r in results]
    ).SerializeToString()
    encoded = encode_get_shards_reply(results)
    assert encoded == expected, "hand-written GetShardsReply encoding differs from protobuf's"
    parsed = parse_get_shards_reply(encoded)
    assert [(p.status, [bytes(s) for s in p.shards]) for p in parsed] == [
        (int(r.status), list(r.shards)) for r in results
    ], "client parser does not read back what the node encodes"
