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
