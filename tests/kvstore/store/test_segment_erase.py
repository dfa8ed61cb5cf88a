"""Erasing records in place: every filesystem block that holds only erased bytes is freed, the
blocks records share with their neighbours included, and no live byte changes."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from kvstore.store.segments import SegmentFiles

RECORD_BYTES = 13_000  # about a 128 KiB block's shard with its header: never page-aligned


def _allocated_bytes(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def test_records_erased_one_by_one_free_every_block_and_leave_live_bytes_alone(tmp_path: Path):
    files = SegmentFiles(tmp_path, fsync=False)
    rng = random.Random(5)
    records = [rng.randbytes(RECORD_BYTES) for _ in range(40)]
    path = files.path(1)
    path.write_bytes(b"".join(records))
    before = _allocated_bytes(path)
    order = list(range(len(records)))
    rng.shuffle(order)
    erased = set()
    for index in order[:30]:
        files.erase(1, index * RECORD_BYTES, RECORD_BYTES)
        erased.add(index)
    if not files.punches_holes:
        pytest.skip(f"{tmp_path}'s filesystem does not punch holes")
    data = path.read_bytes()
    for index, record in enumerate(records):
        got = data[index * RECORD_BYTES : (index + 1) * RECORD_BYTES]
        assert got == (bytes(RECORD_BYTES) if index in erased else record), index
    block = os.stat(path).st_blksize
    live_blocks = {
        b
        for index in set(range(len(records))) - erased
        for b in range(index * RECORD_BYTES // block, -(-(index + 1) * RECORD_BYTES // block))
    }
    # What stays allocated is the blocks live records touch, no more (before the fix: also
    # one block per boundary between two erased records).
    assert _allocated_bytes(path) <= len(live_blocks) * block < before
    for index in order[30:]:
        files.erase(1, index * RECORD_BYTES, RECORD_BYTES)
    assert path.read_bytes() == bytes(len(data))
    assert _allocated_bytes(path) == 0, "blocks shared by erased neighbours stayed allocated"
