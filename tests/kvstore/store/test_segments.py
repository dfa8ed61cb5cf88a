"""The segment record format and segment file operations."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from erasure.errors import ChecksumMismatch
from kvstore.errors import CapacityExhausted
from kvstore.store.segments import (
    LEGACY_HEADER_BYTES,
    ScannedRecord,
    SegmentFiles,
    UnaccountedBytes,
    check_record_header,
    header_bytes,
    pack_record_header,
    parse_record_header,
    record_bytes,
)

KEY, TENANT_HASH, TENANT, CLASS = bytes(range(16)), b"tenant!!", "acme-é", "chat"


def _header(shard_bytes: int, key: bytes = KEY, **fields: object) -> bytes:
    values: dict = {
        "tenant": TENANT,
        "traffic_class": CLASS,
        "shard_index": 3,
        "written_at_s": 12.5,
        "expires_at_s": math.inf,
    }
    values.update(fields)
    return pack_record_header(key, TENANT_HASH, shard_bytes, **values)


def test_record_header_round_trip_and_mismatches() -> None:
    header = _header(1234)
    assert len(header) == header_bytes(TENANT, CLASS) == record_bytes(0, TENANT, CLASS)
    parsed = check_record_header(header, KEY, TENANT_HASH, TENANT, 1234)
    assert (parsed.tenant, parsed.traffic_class, parsed.shard_index) == (TENANT, CLASS, 3)
    assert (parsed.written_at_s, parsed.expires_at_s, parsed.record_format) == (12.5, math.inf, 2)
    for key, tenant_hash, tenant, size in [
        (bytes(16), TENANT_HASH, TENANT, 1234),  # another key's record
        (KEY, b"other!!!", TENANT, 1234),  # another tenant's record (hash)
        (KEY, TENANT_HASH, "globex", 1234),  # another tenant whose hash collides
        (KEY, TENANT_HASH, TENANT, 1235),  # another length
    ]:
        with pytest.raises(ChecksumMismatch):
            check_record_header(header, key, tenant_hash, tenant, size)


def test_legacy_record_headers_still_parse() -> None:
    import struct

    import xxhash

    fields = struct.pack("<4sI16s8s", b"KVR1", 99, KEY, TENANT_HASH)
    legacy = fields + struct.pack("<Q", xxhash.xxh3_64_intdigest(fields))
    parsed = check_record_header(legacy, KEY, TENANT_HASH, "anyone", 99)
    assert (parsed.record_format, parsed.header_bytes) == (1, LEGACY_HEADER_BYTES)


@pytest.mark.parametrize("position", range(0, 64, 3))
def test_record_header_detects_a_flipped_byte(position: int) -> None:
    header = bytearray(_header(99))
    header[position % len(header)] ^= 0x40
    with pytest.raises(ChecksumMismatch):
        check_record_header(bytes(header), KEY, TENANT_HASH, TENANT, 99)


def test_append_read_truncate_remove(tmp_path: Path) -> None:
    files = SegmentFiles(tmp_path, fsync=True)
    first, second = b"a" * 100, b"b" * 50
    size = header_bytes(TENANT, CLASS)
    files.append(7, 0, [_header(100), first])
    files.append(7, size + 100, [_header(50), second])
    files.sync([7])
    assert files.read_shard(7, 0, size, 100, KEY, TENANT, TENANT_HASH) == first
    assert files.read_shard(7, size + 100, size, 50, KEY, TENANT, TENANT_HASH) == second
    files.truncate(7, size + 100 + 60)  # cut inside the second record
    with pytest.raises(ChecksumMismatch):
        files.read_shard(7, size + 100, size, 50, KEY, TENANT, TENANT_HASH)
    assert files.ids_on_disk() == {7} and files.size(7) == size + 160
    files.remove(7)
    assert files.size(7) is None and files.ids_on_disk() == set()
    with pytest.raises(FileNotFoundError):
        files.read_shard(7, 0, size, 100, KEY, TENANT, TENANT_HASH)
    files.close()


def test_scan_finds_records_and_the_bytes_between_them(tmp_path: Path) -> None:
    files = SegmentFiles(tmp_path, fsync=False)
    size = header_bytes(TENANT, CLASS)
    records = [(bytes([i]) * 16, bytes([i]) * (100 + i)) for i in range(4)]
    offset, offsets = 0, []
    for key, shard in records:
        files.append(1, offset, [_header(len(shard), key), shard])
        offsets.append(offset)
        offset += size + len(shard)
    files.close()
    path = files.path(1)
    with open(path, "r+b") as f:  # damage the second record's header, leave a torn tail
        f.seek(offsets[1] + 10)
        f.write(b"\xff\xff")
        f.seek(0, os.SEEK_END)
        f.write(_header(500, bytes([9]) * 16)[:30])
    found = list(files.scan(1))
    assert [type(f).__name__ for f in found] == [
        "ScannedRecord",
        "UnaccountedBytes",
        "ScannedRecord",
        "ScannedRecord",
        "UnaccountedBytes",
    ], "the scan did not resynchronize at the next intact header"
    assert [f.header.key[0] for f in found if isinstance(f, ScannedRecord)] == [0, 2, 3]
    gaps = [f for f in found if isinstance(f, UnaccountedBytes)]
    assert gaps[0] == UnaccountedBytes(offsets[1], offsets[2] - offsets[1])
    assert gaps[1].num_bytes == 30
    assert parse_record_header(_header(5)).record_bytes == size + 5


def test_short_write_is_capacity_exhausted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = SegmentFiles(tmp_path, fsync=False)
    monkeypatch.setattr(os, "pwritev", lambda fd, chunks, offset: 3)
    with pytest.raises(CapacityExhausted, match="wrote 3 of"):
        files.append(1, 0, [b"abcdefgh"])
    files.close()
