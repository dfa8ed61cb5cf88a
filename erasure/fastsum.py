"""The shard checksums, natively where ``make native`` built erasure/_fastsum.so (fastsum.c).

Two things run here:

- :func:`shard_checksum` and :func:`block_checksum`: xxh3-64 of a shard (its header fields,
  then its payload) and xxh3-128 of a block, bit-identical whichever way they run.
- :func:`copy_many`: a batch of copies in one call without the GIL (a local node's streamed
  payloads to their places, client/local/link.py; the padded last data shards' real bytes
  to their blocks' tails, client/landing.py). No shard is checked on landing: the block
  checksum covers every byte once, and finds a bad shard only when it fails.
- :func:`verify_blocks`: the block checksums of a whole batch read's blocks against their
  versions, in one call spread over threads without the GIL (client/batch_read.py's one pass
  over every byte); python-xxhash one block at a time without the helper.

Without the library, or with ``KVSTORE_NATIVE=0`` in the environment, the first two run
through python-xxhash and :func:`copy_many` through ctypes.memmove;
docs/data-paths.md, "Native helper", says which runs and why it exists (measured in
docs/runs/local-channel-h200/).
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import xxhash

from erasure.isal_backend import buffer_address

log = logging.getLogger(__name__)

LIBRARY_PATH = Path(__file__).with_name("_fastsum.so")
FIELDS_BYTES = 40


def _load() -> ctypes.CDLL | None:
    if os.environ.get("KVSTORE_NATIVE", "1") == "0" or not LIBRARY_PATH.exists():
        return None
    try:
        lib = ctypes.CDLL(str(LIBRARY_PATH))
    except OSError as exc:
        log.warning("not using %s (%s): checksums run through python-xxhash", LIBRARY_PATH, exc)
        return None
    if not hasattr(lib, "kv_copy_many"):  # built from an older fastsum.c
        log.warning("not using %s: it predates fastsum.c (run make native)", LIBRARY_PATH)
        return None
    lib.kv_copy_many.argtypes = [ctypes.c_size_t, *[ctypes.c_void_p] * 3]
    lib.kv_copy_many.restype = None
    lib.kv_shard_checksum.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    lib.kv_shard_checksum.restype = ctypes.c_uint64
    lib.kv_xxh3_128.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    lib.kv_xxh3_128.restype = None
    lib.kv_verify_blocks.argtypes = [ctypes.c_size_t, *[ctypes.c_void_p] * 4, ctypes.c_size_t]
    lib.kv_verify_blocks.restype = None
    return lib


_lib = _load()
NATIVE = _lib is not None
# Below this many bytes python-xxhash is as fast (the ctypes call costs about a microsecond).
_NATIVE_MIN_BYTES = 16 << 10


def shard_checksum(fields: bytes | memoryview, payload: bytes | memoryview) -> int:
    """xxh3-64 of a shard's 40 header field bytes followed by its payload."""
    if _lib is not None and len(payload) >= _NATIVE_MIN_BYTES and len(fields) == FIELDS_BYTES:
        fields_at = buffer_address(memoryview(fields))
        return int(
            _lib.kv_shard_checksum(fields_at, buffer_address(memoryview(payload)), len(payload))
        )
    hasher = xxhash.xxh3_64(fields)
    hasher.update(payload)
    return hasher.intdigest()


def block_checksum(block: bytes | memoryview) -> bytes:
    """xxh3-128 of a whole block (python-xxhash's ``xxh3_128_digest``)."""
    if _lib is not None and len(block) >= _NATIVE_MIN_BYTES:
        out = ctypes.create_string_buffer(16)
        _lib.kv_xxh3_128(buffer_address(memoryview(block)), len(block), out)
        return out.raw
    return xxhash.xxh3_128_digest(block)


def copy_many(sources: Sequence[int], destinations: Sequence[int], lengths: Sequence[int]) -> None:
    """Copy ``lengths[i]`` bytes from address ``sources[i]`` to ``destinations[i]``, for every
    i: one native call without the GIL (ctypes.memmove each without the helper: a call, and
    a wait for the GIL, per copy). The caller keeps every buffer alive across the call."""
    if _lib is None:
        for source, destination, length in zip(sources, destinations, lengths, strict=True):
            ctypes.memmove(destination, source, length)
        return
    addresses = np.array([*sources, *destinations, *lengths], dtype=np.uint64)
    base, n = addresses.ctypes.data, len(lengths)
    _lib.kv_copy_many(n, base, base + 8 * n, base + 16 * n)


VERIFY_THREADS = min(8, os.cpu_count() or 1)


def verify_blocks(addresses: Sequence[int], lengths: Sequence[int], versions: bytes) -> list[bool]:
    """Per block (``lengths[i]`` bytes at address ``addresses[i]``), whether its xxh3-128 is
    ``versions[16*i : 16*i+16]``: natively in one call over up to VERIFY_THREADS threads, or
    with python-xxhash. The caller keeps every block alive across the call."""
    n = len(addresses)
    if _lib is None:
        return [
            xxhash.xxh3_128_digest((ctypes.c_char * size).from_address(address))
            == versions[16 * i : 16 * i + 16]
            for i, (address, size) in enumerate(zip(addresses, lengths, strict=True))
        ]
    columns = np.array([*addresses, *lengths], dtype=np.uint64)
    ok = np.zeros(n, dtype=np.uint8)
    base = columns.ctypes.data
    _lib.kv_verify_blocks(n, base, base + 8 * n, versions, ok.ctypes.data, VERIFY_THREADS)
    return ok.astype(bool).tolist()
