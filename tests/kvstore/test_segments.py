"""The segment record format and segment file operations."""

from __future__ import annotations

from pathlib import Path

import pytest

from erasure.errors import ChecksumMismatch
from kvstore.segments import (
    RECORD_HEADER_BYTES,
    SegmentFiles,
    check_record_header,
    pack_record_header,
    record_bytes,
)

KEY, TENANT_HASH = bytes(range(16)), b"tenant!!"


def test_record_header_round_trip_and_mismatches() -> None:
    header = pack_record_header(KEY, TENANT_HASH, 1234)
    assert len(header) == RECORD_HEADER_BYTES == record_bytes(0)
    check_record_header(header, KEY, TENANT_HASH, 1234)
    for key, tenant_hash, size in [
        (bytes(16), TENANT_HASH, 1234),  # another key's record
        (KEY, b"other!!!", 1234),  # another tenant's record
        (KEY, TENANT_HASH, 1235),  # another length
    ]:
        with pytest.raises(ChecksumMismatch):
            check_record_header(header, key, tenant_hash, size)


@pytest.mark.parametrize("position", range(0, RECORD_HEADER_BYTES, 3))
def test_record_header_detects_a_flipped_byte(position: int) -> None:
    header = bytearray(pack_record_header(KEY, TENANT_HASH, 99))
    header[position] ^= 0x40
    with pytest.raises(ChecksumMismatch):
        check_record_header(bytes(header), KEY, TENANT_HASH, 99)


def test_append_read_truncate_remove(tmp_path: Path) -> None:
    files = SegmentFiles(tmp_path, fsync=True)
    first, second = b"a" * 100, b"b" * 50
    files.append(7, 0, [pack_record_header(KEY, TENANT_HASH, 100), first])
    files.append(7, record_bytes(100), [pack_record_header(KEY, TENANT_HASH, 50), second])
    files.sync([7])
    assert files.read_shard(7, 0, 100, KEY, TENANT_HASH) == first
    assert files.read_shard(7, record_bytes(100), 50, KEY, TENANT_HASH) == second
    files.truncate(7, record_bytes(100) + 60)  # cut inside the second record
    with pytest.raises(ChecksumMismatch):
        files.read_shard(7, record_bytes(100), 50, KEY, TENANT_HASH)
    assert files.ids_on_disk() == {7} and files.size(7) == record_bytes(100) + 60
    files.remove(7)
    assert files.size(7) is None and files.ids_on_disk() == set()
    with pytest.raises(FileNotFoundError):
        files.read_shard(7, 0, 100, KEY, TENANT_HASH)
    files.close()
