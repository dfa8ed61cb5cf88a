"""Property tests of the erasure codec, run against both backends."""

from __future__ import annotations

import itertools
import random
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from erasure.codec import Codec, make_codec
from erasure.config import CodecConfig
from erasure.errors import (
    ChecksumMismatch,
    CodecError,
    InvalidCodecInput,
    MixedVersions,
    ShardHeaderError,
    TooFewShards,
)
from erasure.shard import HEADER_BYTES, SplitShard, block_checksum, parse_header

BACKENDS = ["isal", "zfec"]
SEEDED = settings(derandomize=True, deadline=None, database=None)

# Sizes that hit every padding case of k=10 and k=3: empty, one byte, shorter than k,
# exact multiples, one over, and payloads longer than ISA-L's 32/64-byte SIMD thresholds.
EDGE_SIZES = [0, 1, 2, 3, 9, 10, 11, 29, 30, 31, 100, 319, 320, 321, 641, 4097]
sizes = st.one_of(st.sampled_from(EDGE_SIZES), st.integers(0, 5000))


def codec(backend: str, k: int = 10, m: int = 2, **kwargs: int) -> Codec:
    return make_codec(CodecConfig(k=k, m=m, backend=backend, **kwargs))


def block_of(num_bytes: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(num_bytes)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("k", "m"), [(10, 2), (3, 2), (1, 1), (4, 0), (2, 3)])
@settings(SEEDED, max_examples=30)
@given(num_bytes=sizes, seed=st.integers(0, 2**32))
def test_every_k_subset_reconstructs_exactly(
    backend: str, k: int, m: int, num_bytes: int, seed: int
) -> None:
    c = codec(backend, k, m)
    block = block_of(num_bytes, seed)
    shards = c.encode(block)
    assert len(shards) == k + m
    for subset in itertools.combinations(range(k + m), k):
        chosen = [shards[i] for i in subset]
        assert c.decode(chosen) == block, f"{backend} {k}+{m}: subset {subset} decoded wrong bytes"
        out = bytearray(num_bytes)
        assert c.decode(chosen[::-1], out=out) == block, f"out= path wrong for subset {subset}"
        assert out == block, f"out= buffer not filled for subset {subset}"


@pytest.mark.parametrize("backend", BACKENDS)
@settings(SEEDED, max_examples=40)
@given(num_bytes=sizes, seed=st.integers(0, 2**32), data=st.data())
def test_more_than_k_shards_in_any_order_with_duplicates(
    backend: str, num_bytes: int, seed: int, data: st.DataObject
) -> None:
    c = codec(backend)
    block = block_of(num_bytes, seed)
    shards = c.encode(block)
    chosen = data.draw(st.lists(st.sampled_from(shards), min_size=13, max_size=20))
    if len({parse_header(s).index for s in chosen}) >= c.k:
        assert c.decode(chosen) == block, "decode of >k shards (with repeats) gave wrong bytes"


@pytest.mark.parametrize("backend", BACKENDS)
@settings(SEEDED, max_examples=150)
@given(num_bytes=sizes, seed=st.integers(0, 2**32), data=st.data())
def test_a_flipped_byte_anywhere_in_any_shard_is_detected(
    backend: str, num_bytes: int, seed: int, data: st.DataObject
) -> None:
    c = codec(backend)
    block = block_of(num_bytes, seed)
    shards = c.encode(block)
    victim = data.draw(st.integers(0, c.num_shards - 1), label="shard")
    position = data.draw(st.integers(0, len(shards[victim]) - 1), label="byte")
    corrupt = bytearray(shards[victim])
    corrupt[position] ^= data.draw(st.integers(1, 255), label="xor")
    tampered = [bytes(corrupt) if i == victim else s for i, s in enumerate(shards)]
    others = [i for i in range(c.num_shards) if i != victim]
    subset = [victim, *data.draw(st.permutations(others))[: c.k - 1]]
    for offered in (tampered, [tampered[i] for i in subset]):
        with pytest.raises((ChecksumMismatch, ShardHeaderError)):
            c.decode(offered)
    with pytest.raises((ChecksumMismatch, ShardHeaderError)):
        c.verify(bytes(corrupt))


@pytest.mark.parametrize("backend", BACKENDS)
def test_shard_layout_and_header_fields(backend: str) -> None:
    c = codec(backend)
    block = block_of(1001, seed=1)
    for index, shard in enumerate(c.encode(block)):
        header = c.verify(shard)
        assert len(shard) == HEADER_BYTES + c.payload_bytes(1001) == HEADER_BYTES + 101
        assert (header.index, header.k, header.m, header.backend) == (index, 10, 2, backend)
        assert header.block_len == 1001 and header.block_checksum == block_checksum(block)
        if index < c.k:
            assert shard[HEADER_BYTES:] == block[index * 101 : (index + 1) * 101].ljust(101, b"\0")


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_versions_raise(backend: str) -> None:
    c = codec(backend)
    old, new = c.encode(block_of(5000, seed=1)), c.encode(block_of(5000, seed=2))
    with pytest.raises(MixedVersions):
        c.decode(old[:6] + new[6:])
    shorter = c.encode(block_of(10, seed=3))
    with pytest.raises(MixedVersions):
        c.decode(old[:11] + shorter[11:])


@pytest.mark.parametrize("backend", BACKENDS)
def test_too_few_shards_raise(backend: str) -> None:
    c = codec(backend)
    shards = c.encode(block_of(4096, seed=1))
    for offered in ([], shards[:9], shards[3:], [shards[0]] * 12, [*shards[:9], shards[8]]):
        with pytest.raises(TooFewShards):
            c.decode(offered)


def test_backends_are_not_interchangeable() -> None:
    block = block_of(4096, seed=1)
    isal, zfec = codec("isal"), codec("zfec")
    isal_shards, zfec_shards = isal.encode(block), zfec.encode(block)
    assert isal_shards[10][HEADER_BYTES:] != zfec_shards[10][HEADER_BYTES:], (
        "the two backends' parity should differ; if equal, the header's backend field is moot"
    )
    with pytest.raises(ShardHeaderError, match="a cluster uses one"):
        isal.decode(zfec_shards)
    with pytest.raises(ShardHeaderError):
        codec("isal", 3, 2).decode(isal_shards)


@pytest.mark.parametrize("backend", BACKENDS)
def test_systematic_fast_path_skips_the_matrix_decode(backend: str) -> None:
    c = codec(backend)
    block = block_of(100_003, seed=1)
    shards = c.encode(block)
    assert c.decode(shards[:10]) == block
    assert c.decode(shards[::-1]) == block
    assert c.decode(shards[:10], out=bytearray(len(block))) == block
    assert c.num_matrix_decodes == 0, "decode with every data shard ran the matrix decoder"
    assert c.decode(shards[1:11]) == block
    assert c.num_matrix_decodes == 1, "decode without data shard 0 did not use the decoder"


@pytest.mark.parametrize("backend", BACKENDS)
def test_shards_past_the_block_end_are_not_needed_as_data(backend: str) -> None:
    c = codec(backend)
    shards = c.encode(b"x")  # only data shard 0 holds block bytes; 1..9 are padding
    assert c.decode([shards[0], *shards[3:12]]) == b"x"
    assert c.num_matrix_decodes == 0, "padding-only data shards were reconstructed needlessly"


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_buffer_contract(backend: str) -> None:
    c = codec(backend)
    block = block_of(12_345, seed=1)
    shards = c.encode(block)
    out = np.zeros(12_345, np.uint8)
    result = c.decode(shards[2:], out=out)
    assert isinstance(result, memoryview) and bytes(result) == block
    assert out.tobytes() == block, "decode did not write into the caller's numpy buffer"
    for wrong in (bytearray(12_344), bytearray(12_346), bytes(12_345)):
        with pytest.raises(InvalidCodecInput, match="exactly the block length"):
            c.decode(shards, out=wrong)


@pytest.mark.parametrize("backend", BACKENDS)
def test_encode_accepts_bytes_like_and_enforces_the_maximum(backend: str) -> None:
    c = codec(backend, max_block_bytes=1000)
    block = block_of(1000, seed=1)
    as_array = np.frombuffer(block, np.uint8).reshape(10, 100)
    for given_block in (bytearray(block), memoryview(block), as_array):
        assert c.encode(given_block) == c.encode(block)
    with pytest.raises(InvalidCodecInput, match="max_block_bytes"):
        c.encode(bytes(1001))
    with pytest.raises(InvalidCodecInput, match="bytes-like"):
        c.encode("text")  # type: ignore[arg-type]
    with pytest.raises(InvalidCodecInput, match="C-contiguous"):
        c.encode(as_array[:, ::2])


@pytest.mark.parametrize(
    ("k", "m", "backend"),
    [(0, 2, "isal"), (10, -1, "zfec"), (200, 56, "zfec"), (5, 6, "isal"), (22, 4, "isal")],
)
def test_invalid_k_m_raise_value_error_with_advice(k: int, m: int, backend: str) -> None:
    with pytest.raises(ValueError, match="k=10, m=2"):
        codec(backend, k, m)


def test_unknown_backend_raises_value_error() -> None:
    with pytest.raises(ValueError, match="'isal' or 'zfec'"):
        make_codec(CodecConfig(backend="jerasure"))


def test_zfec_decodes_codes_that_isal_rejects() -> None:
    c = codec("zfec", 5, 6)
    block = block_of(999, seed=1)
    shards = c.encode(block)
    for subset in itertools.combinations(range(11), 5):
        assert c.decode([shards[i] for i in subset]) == block, f"zfec 5+6 subset {subset}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_threads_share_one_codec_safely(backend: str) -> None:
    c = codec(backend)
    blocks = [block_of(n, seed=n) for n in (70_001, 100_000, 3, 250_000)]

    def round_trip(block: bytes) -> bool:
        shards = c.encode(block)
        return all(c.decode(shards[i : i + 10]) == block for i in range(3))

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(round_trip, blocks * 8)), "concurrent encode/decode mixed buffers"


@pytest.mark.parametrize("backend", BACKENDS)
@settings(SEEDED, max_examples=100)
@given(num_bytes=sizes, seed=st.integers(0, 2**32), data=st.data())
def test_verified_decode_of_a_corrupt_shard_never_returns_wrong_bytes(
    backend: str, num_bytes: int, seed: int, data: st.DataObject
) -> None:
    c = codec(backend)
    block = block_of(num_bytes, seed)
    shards = [bytearray(s) for s in c.encode(block)]
    victim = data.draw(st.integers(0, c.num_shards - 1), label="shard")
    shards[victim][data.draw(st.integers(0, len(shards[victim]) - 1))] ^= data.draw(
        st.integers(1, 255)
    )
    subset = data.draw(st.permutations(range(c.num_shards)))[: data.draw(st.integers(10, 12))]
    try:
        decoded = c.decode([shards[i] for i in subset], verified=True)
    except CodecError:
        return  # refused: fine
    assert decoded == block, "verified=True decode returned wrong bytes for a corrupt shard"


@pytest.mark.parametrize("backend", BACKENDS)
def test_verified_decode_still_checks_the_block(backend: str) -> None:
    c = codec(backend)
    block = block_of(5000, seed=1)
    shards = [bytearray(s) for s in c.encode(block)]
    assert c.decode(shards, verified=True) == block
    shards[3][HEADER_BYTES + 7] ^= 1  # data payload: only the block checksum can notice
    with pytest.raises(ChecksumMismatch, match="does not match its version"):
        c.decode(shards[:10], verified=True)
    assert c.decode(shards[:3] + shards[4:], verified=True) == block


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_bytes", [4000, 4093])  # whole payloads; a padded last one
def test_split_shards_with_payloads_in_place_decode_into_out(backend: str, num_bytes: int) -> None:
    """A UCX get_into: data payloads already sit at their place in ``out``, headers apart."""
    c = codec(backend)
    block = block_of(num_bytes, 5)
    shards = c.encode(block)
    payload_len = c.payload_bytes(num_bytes)
    for lost in ([], [3], [0, 7]):  # with every data shard; recovering one or two into out
        out = bytearray(num_bytes)
        view = memoryview(out)
        split = []
        for index, shard in enumerate(shards):
            start = index * payload_len
            if index in lost:
                continue
            if index < c.k and start + payload_len <= num_bytes:
                view[start : start + payload_len] = shard[HEADER_BYTES:]  # as UCX lands it
                payload = view[start : start + payload_len]
            else:
                payload = memoryview(shard)[HEADER_BYTES:]
            split.append(SplitShard(shard[:HEADER_BYTES], payload))
        for shard in split:
            c.verify(shard)
        assert c.decode(split, out=out, verified=True) == block, f"lost {lost}: wrong bytes"
        assert out == block, f"lost {lost}: out not filled"


def test_split_shard_corruption_and_bad_headers_are_caught() -> None:
    c = codec("isal")
    shard = c.encode(block_of(1000, 6))[4]
    payload = bytearray(shard[HEADER_BYTES:])
    payload[17] ^= 1
    with pytest.raises(ChecksumMismatch):
        c.verify(SplitShard(shard[:HEADER_BYTES], memoryview(payload)))
    with pytest.raises(ShardHeaderError, match="header is 47 bytes"):
        c.verify(SplitShard(shard[:47], memoryview(shard)[HEADER_BYTES:]))
    with pytest.raises(ShardHeaderError, match="header says"):
        c.verify(SplitShard(shard[:HEADER_BYTES], memoryview(shard)[HEADER_BYTES:-1]))
