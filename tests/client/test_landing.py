"""Where a batch answer lands (client/landing.py): pure code over real codec shards."""

from __future__ import annotations

import random

import pytest

from client.landing import StreamLander, Wanted, fill_tails, landing_regions
from erasure.codec import Codec
from erasure.config import CodecConfig
from kvstore.wire import batch_answer

K, M = 4, 2
CODEC = Codec(CodecConfig(k=K, m=M))


def _answer(blocks: list[bytes], shard_indexes: list[int]) -> tuple[bytes, bytes]:
    """(table, payloads) of a node holding shard ``shard_indexes[j]`` of ``blocks[j]``."""
    entries, payloads = [], []
    for key_index, (block, index) in enumerate(zip(blocks, shard_indexes, strict=True)):
        shard = CODEC.encode(block)[index]
        entries.append(batch_answer.Entry(key_index, batch_answer.HIT, shard[:48], len(shard) - 48))
        payloads.append(shard[48:])
    return batch_answer.encode_table(entries), b"".join(payloads)


def test_data_shards_land_in_place_and_the_rest_apart() -> None:
    rng = random.Random(1)
    blocks = [rng.randbytes(4000), rng.randbytes(4001), rng.randbytes(4000), rng.randbytes(3)]
    indexes = [1, 3, 4, 3]  # in place; the padded last data shard; parity; a shard of padding
    table, _ = _answer(blocks, indexes)
    entries, _ = batch_answer.decode_table(table, len(blocks))
    outs = [memoryview(bytearray(len(b))) for b in blocks]
    regions = landing_regions(entries, Wanted([0, 1, 2, 3], indexes), outs, K)
    assert regions[0] is not None and regions[0].obj is outs[0].obj
    assert [r is None for r in regions] == [False, True, True, True]
    wrong_size = [memoryview(bytearray(len(blocks[0]) + 1)), *outs[1:]]
    wrong_place = Wanted([0, 1, 2, 3], [2, 3, 4, 3])  # the node holds index 1, not 2
    assert landing_regions(entries, Wanted([0, 1, 2, 3], indexes), wrong_size, K)[0] is None
    assert landing_regions(entries, wrong_place, outs, K)[0] is None
    assert landing_regions(entries, Wanted([0, 1, 2, 3], indexes), [None] * 4, K) == [None] * 4


def test_a_padded_last_data_shard_fills_its_blocks_tail() -> None:
    rng = random.Random(2)
    blocks = [rng.randbytes(4001), rng.randbytes(3), rng.randbytes(4001)]
    indexes = [3, 3, 4]  # the padded last data shard; a shard of padding only; parity
    table, payloads = _answer(blocks, indexes)
    entries, _ = batch_answer.decode_table(table, len(blocks))
    outs = [memoryview(bytearray(len(b))) for b in blocks]
    tails: list[tuple[int, memoryview]] = []
    regions = landing_regions(entries, Wanted([0, 1, 2], indexes), outs, K, tails=tails)
    assert regions == [None, None, None], "a padded shard must not land whole in the block"
    assert [(row, len(tail)) for row, tail in tails] == [(0, 4001 - 3 * 1001)]
    apart = [memoryview(bytearray(payloads[:1001]))]  # row 0's payload, where it landed
    in_place = [False, False, False]
    fill_tails(tails, apart, in_place)
    assert in_place == [True, False, False]
    assert bytes(outs[0][3 * 1001 :]) == blocks[0][3 * 1001 :], "the tail holds the wrong bytes"
    assert bytes(outs[0][: 3 * 1001]) == bytes(3 * 1001), "bytes before the tail were written"
    placed = memoryview(bytearray(4001))  # a tail the node placed itself: not copied again
    fill_tails([(0, placed[3 * 1001 :])], apart, [True])
    assert bytes(placed) == bytes(4001), "a payload already in place was copied over"


@pytest.mark.parametrize("chunk_bytes", [1, 100, 1 << 20])
def test_a_chunked_stream_lands_every_payload_whatever_the_chunking(chunk_bytes: int) -> None:
    rng = random.Random(chunk_bytes)
    blocks = [rng.randbytes(4000), rng.randbytes(4000)]
    indexes = [0, 5]
    table, payloads = _answer(blocks, indexes)
    outs = [memoryview(bytearray(4000)), memoryview(bytearray(4000))]
    lander = StreamLander(Wanted([0, 1], indexes), outs, K)
    for chunk in batch_answer.encode_chunks(table, memoryview(payloads), chunk_bytes):
        lander.feed(batch_answer.chunk_data(chunk))
    answer = lander.finish()
    shards = CODEC.encode(blocks[0])
    assert bytes(outs[0][:1000]) == shards[0][48:], "data payload not at its place in the block"
    assert answer.in_place == [True, False]
    assert bytes(answer.payloads[1]) == CODEC.encode(blocks[1])[5][48:], "parity payload lost"


def test_a_chunked_stream_fills_a_padded_blocks_tail() -> None:
    block = random.Random(4).randbytes(4001)  # 4 data shards of 1001 bytes, the last padded
    table, payloads = _answer([block], [3])
    out = memoryview(bytearray(4001))
    lander = StreamLander(Wanted([0], [3]), [out], K)
    for chunk in batch_answer.encode_chunks(table, memoryview(payloads), 100):
        lander.feed(batch_answer.chunk_data(chunk))
    answer = lander.finish()
    assert answer.in_place == [True], "the padded shard's block was not made whole"
    assert bytes(out[3 * 1001 :]) == block[3 * 1001 :] and bytes(out[: 3 * 1001]) == bytes(3003)
    assert bytes(answer.payloads[0]) == CODEC.encode(block)[3][48:], "the payload itself changed"


def test_a_stream_that_ends_early_or_runs_long_is_refused() -> None:
    table, payloads = _answer([bytes(4000)], [0])
    lander = StreamLander(Wanted([0], [0]), [None], K)
    lander.feed(memoryview(table + payloads[:-1]))
    with pytest.raises(ValueError, match="ended before"):
        lander.finish()
    lander = StreamLander(Wanted([0], [0]), [None], K)
    with pytest.raises(ValueError, match="beyond its payloads"):
        lander.feed(memoryview(table + payloads + b"!"))
