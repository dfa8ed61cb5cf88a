"""The native checksum helper (erasure/_fastsum.so, `make native`) against python-xxhash, and
the python-xxhash fallback that runs where the library is not built."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from erasure import fastsum

SIZES = [0, 1, 40, (16 << 10) - 1, 16 << 10, (16 << 10) + 1, (32 << 10) + 5, (1 << 20) + 3]
native_only = pytest.mark.skipif(
    not fastsum.NATIVE, reason="erasure/_fastsum.so is not built (make native)"
)


def _python_shard_checksum(fields: bytes, payload: bytes) -> int:
    hasher = xxhash.xxh3_64(fields)
    hasher.update(payload)
    return hasher.intdigest()


@pytest.mark.parametrize("num_bytes", SIZES)
def test_checksums_equal_python_xxhash(checksum_backend: str, num_bytes: int) -> None:
    rng = np.random.default_rng(num_bytes)
    fields = rng.integers(0, 256, fastsum.FIELDS_BYTES, dtype=np.uint8).tobytes()
    payload = rng.integers(0, 256, num_bytes, dtype=np.uint8).tobytes()
    assert fastsum.shard_checksum(fields, payload) == _python_shard_checksum(fields, payload), (
        f"{checksum_backend} shard checksum differs from python-xxhash: stored shards fail"
    )
    assert fastsum.shard_checksum(fields, memoryview(payload)) == _python_shard_checksum(
        fields, payload
    )
    assert fastsum.block_checksum(payload) == xxhash.xxh3_128_digest(payload), (
        f"{checksum_backend} block checksum differs from python-xxhash: version ids change"
    )


def _address(buffer: bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def test_copy_many_copies_each_range_and_nothing_else(checksum_backend: str) -> None:
    rng = np.random.default_rng(3)
    sources = [bytearray(rng.integers(0, 256, n, dtype=np.uint8).tobytes()) for n in SIZES[1:]]
    targets = [bytearray(len(source) + 8) for source in sources]
    lengths = [len(source) - len(source) // 3 for source in sources]  # a prefix of each
    fastsum.copy_many([_address(s) for s in sources], [_address(t) for t in targets], lengths)
    for source, target, length in zip(sources, targets, lengths, strict=True):
        assert target[:length] == source[:length], f"{checksum_backend}: wrong bytes copied"
        assert target[length:] == bytes(len(target) - length), "bytes past the range written"
    fastsum.copy_many([], [], [])  # an empty batch is a no-op


@native_only
def test_copy_verify_copies_and_flags_each_mismatch() -> None:
    rng = np.random.default_rng(7)
    sizes = [0, 100, (32 << 10) + 1, 300_000]
    sources = [bytearray(rng.integers(0, 256, n, dtype=np.uint8).tobytes()) for n in sizes]
    fields = rng.integers(0, 256, fastsum.FIELDS_BYTES * len(sizes), dtype=np.uint8).tobytes()
    expected = np.array(
        [
            _python_shard_checksum(fields[40 * i : 40 * i + 40], bytes(src))
            for i, src in enumerate(sources)
        ],
        dtype=np.uint64,
    )
    expected[2] ^= 1  # shard 2's stored checksum no longer matches its bytes
    destinations = [bytearray(n) for n in sizes]
    # Shard 3 is checked where it lies (destination 0): nothing is copied for it.
    targets = [_address(d) if n else 0 for d, n in zip(destinations[:3], sizes, strict=False)]
    targets.append(0)
    ok = fastsum.copy_verify(
        [_address(s) if n else 0 for s, n in zip(sources, sizes, strict=True)],
        targets,
        sizes,
        fields,
        expected,
    )
    assert ok == [True, True, False, True], "copy_verify's verdicts are wrong"
    assert destinations[1] == sources[1] and destinations[2] == sources[2], "payload not copied"
    assert destinations[3] == bytearray(sizes[3]), "a payload checked in place was copied"


def test_the_fallback_runs_without_the_library() -> None:
    """KVSTORE_NATIVE=0 (or no library): python-xxhash, same results."""
    code = (
        "import xxhash; from erasure import fastsum; assert not fastsum.NATIVE; "
        "f = bytes(range(40)); p = bytes(70000); h = xxhash.xxh3_64(f); h.update(p); "
        "assert fastsum.shard_checksum(f, p) == h.intdigest(); "
        "assert fastsum.block_checksum(p) == xxhash.xxh3_128_digest(p)"
    )
    env = {**os.environ, "KVSTORE_NATIVE": "0"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"the python-xxhash fallback failed: {done.stderr}"
