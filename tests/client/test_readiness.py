"""Readiness: data shards in, completed blocks and layers out (client/readiness.py)."""

from __future__ import annotations

import itertools
import random

import pytest

from client.readiness import Readiness


def test_a_block_completes_with_its_last_data_shard_and_is_reported_once():
    calls: list[list[int]] = []
    readiness = Readiness(3, block_bytes=1000, k=10, on_blocks=calls.append)
    assert readiness.landed([(0, i) for i in range(9)] + [(1, 0)]) == []
    assert calls == []  # nothing completed: no call
    assert readiness.landed([(0, 9), (0, 9), (2, 10), (1, 1)]) == [0]  # parity shards ignored
    assert readiness.landed([(0, 3)]) == []  # a shard again changes nothing
    assert calls == [[0]]
    assert readiness.block_complete(0) and not readiness.block_complete(1)


def test_one_answer_completing_many_blocks_makes_one_call():
    calls: list[list[int]] = []
    readiness = Readiness(4, block_bytes=1000, k=10, on_blocks=calls.append)
    readiness.landed([(b, i) for b in range(4) for i in range(1, 10)])
    assert calls == []
    assert readiness.landed([(b, 0) for b in (3, 1, 0, 2)]) == [3, 1, 0, 2]
    assert calls == [[3, 1, 0, 2]]


def _segments_by_brute_force(readiness: Readiness, shard_sets: list[set[int]]) -> list[int]:
    """Per segment, how many blocks hold every shard that covers it (from the definition)."""
    counts = []
    for segment in range(readiness.num_segments):
        start = segment * readiness.segment_bytes
        end = min(start + readiness.segment_bytes, 1000)
        payload = readiness.payload_bytes
        covering = set(range(start // payload, (end - 1) // payload + 1))
        counts.append(sum(covering <= shards for shards in shard_sets))
    return counts


@pytest.mark.parametrize("segment_bytes", [1, 37, 100, 130, 333, 1000])
def test_layer_counts_match_their_definition_in_any_arrival_order(segment_bytes):
    rng = random.Random(segment_bytes)
    num_blocks = 5
    readiness = Readiness(num_blocks, block_bytes=1000, k=10, segment_bytes=segment_bytes)
    pairs = list(itertools.product(range(num_blocks), range(12)))
    rng.shuffle(pairs)
    held: list[set[int]] = [set() for _ in range(num_blocks)]
    for start in range(0, len(pairs), 7):
        batch = pairs[start : start + 7] + pairs[start : start + 2]  # repeats too
        readiness.landed(batch)
        for block, index in batch:
            if index < readiness.num_data_shards:
                held[block].add(index)
        expected = _segments_by_brute_force(readiness, held)
        assert readiness.num_blocks_with_segment == expected
    assert all(readiness.segment_everywhere(s) for s in range(readiness.num_segments))


def test_pairs_may_count_blocks_from_a_base() -> None:
    readiness = Readiness(50, 1000, 10)  # pairs of a chunk that starts at block 40
    assert readiness.landed([(1, i) for i in range(10)], base=40) == [41]
    assert readiness.any_landed(41) and not readiness.any_landed(40)
    assert readiness.landed([(2, 0), (0, 0)], base=40) == []
    assert readiness.any_landed(40) and readiness.any_landed(42) and not readiness.any_landed(1)
