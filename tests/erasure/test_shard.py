"""The shard header format: the encoder's batch packer agrees with the reference one."""

from __future__ import annotations

import random

import pytest

from erasure.shard import ShardHeader, pack_header, pack_headers, verify_shard


@pytest.mark.parametrize("payload_len", [0, 1, 4097])
def test_pack_headers_matches_pack_header(payload_len: int) -> None:
    rng = random.Random(payload_len)
    payloads = [rng.randbytes(payload_len) for _ in range(5)]
    version = rng.randbytes(16)
    headers = pack_headers("zfec", 3, 2, 3 * payload_len, version, payloads)
    for index, (packed, payload) in enumerate(zip(headers, payloads, strict=True)):
        header = ShardHeader("zfec", 3, 2, index, 3 * payload_len, version, payload_len)
        assert packed == pack_header(header, payload), "batch packer drifted from the format"
        assert verify_shard(packed + payload) == header
