"""Keyed block versions (client/integrity.py) through the codec: pure, no cluster.

What a node can do with shards it holds, and what a reader of an integrity tenant then gets:
a block it made up, one moved from another key, a flag it flipped: each fails the keyed check.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from client.integrity import XXH3_CHECK, BlockIntegrity, ensure_key, load_key
from erasure.codec import make_codec
from erasure.config import CodecConfig
from erasure.errors import ChecksumMismatch, ShardHeaderError
from erasure.shard import HEADER_BYTES, KEYED, block_checksum, parse_header
from kvstore.errors import InvalidArgument

KEY_A, KEY_B = b"a" * 16, b"b" * 16
BLOCK = os.urandom(100_000)


def _encode(block: bytes, version: bytes | None) -> list[bytes]:
    codec = make_codec(CodecConfig())
    spare = memoryview(bytearray(codec.spare_bytes(len(block))))
    return [bytes(h) + bytes(p) for h, p in codec.encode_into(block, spare, keyed_version=version)]


def test_the_version_binds_key_material_tenant_block_key_and_bytes() -> None:
    acme = BlockIntegrity("acme", bytes(32))
    version = acme.version(KEY_A, BLOCK)
    assert len(version) == 16 and version == acme.version(KEY_A, memoryview(BLOCK))
    others = {
        "another key": BlockIntegrity("acme", bytes(31) + b"\x01").version(KEY_A, BLOCK),
        "another tenant": BlockIntegrity("globex", bytes(32)).version(KEY_A, BLOCK),
        "another block key": acme.version(KEY_B, BLOCK),
        "other bytes": acme.version(KEY_A, BLOCK[:-1] + bytes([BLOCK[-1] ^ 1])),
    }
    same = [what for what, v in others.items() if v == version]
    assert not same, f"the keyed version does not depend on {same}"


def test_a_reader_needs_the_keyed_check_and_a_node_can_only_skip_it() -> None:
    codec = make_codec(CodecConfig())
    acme = BlockIntegrity("acme", os.urandom(32))
    shards = _encode(BLOCK, acme.version(KEY_A, BLOCK))
    assert parse_header(shards[0]).keyed
    assert bytes(codec.decode(shards[:10], digest=acme.digest_for(KEY_A))) == BLOCK
    with pytest.raises(ChecksumMismatch):  # the block moved to another key
        codec.decode(shards[:10], digest=acme.digest_for(KEY_B))
    with pytest.raises(ChecksumMismatch):  # a plain (xxh3) reader never passes keyed shards
        codec.decode(shards[:10])
    assert bytes(codec.decode(shards[2:], digest=None)) == BLOCK, "a node's repair decode"


def test_bytes_a_node_made_up_read_as_a_failure() -> None:
    codec = make_codec(CodecConfig())
    acme = BlockIntegrity("acme", os.urandom(32))
    forged = os.urandom(len(BLOCK))
    for version in (acme.version(KEY_A, BLOCK), os.urandom(16), None):
        shards = _encode(forged, version)  # valid shard checksums, flagged KEYED or not
        with pytest.raises(ChecksumMismatch):
            codec.decode(shards[:10], digest=acme.digest_for(KEY_A))
    plain = _encode(forged, None)
    assert bytes(codec.decode(plain[:10], digest=None)) == forged  # xxh3 checked: it matches


def test_unknown_header_flags_are_refused() -> None:
    shard = bytearray(_encode(BLOCK, None)[0])
    shard[9] = KEYED | 0x04
    with pytest.raises(ShardHeaderError, match="flags"):
        parse_header(bytes(shard[:HEADER_BYTES]) + bytes(shard[HEADER_BYTES:]))


def test_key_file_holds_one_key_per_tenant_readable_by_its_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "integrity.json"
    assert ensure_key(path, "acme") and not ensure_key(path, "acme"), "a key was replaced"
    ensure_key(path, "globex")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_key(path, "acme") != load_key(path, "globex")
    with pytest.raises(InvalidArgument, match="add-tenant"):
        load_key(path, "initech")


def test_block_checks_verify_blocks_against_their_versions() -> None:
    """The batch read's strategies (client/batch_read.py ``block_check``): xxh3-128 for
    plain tenants, the keyed version for integrity tenants; neither takes the other's."""
    acme = BlockIntegrity("acme", os.urandom(32))
    block = memoryview(bytearray(BLOCK))
    keyed, plain = acme.version(KEY_A, block), block_checksum(block)
    assert XXH3_CHECK.verify([KEY_A, KEY_A], [block, block], [plain, keyed]) == [True, False]
    assert acme.verify([KEY_A, KEY_B, KEY_A], [block] * 3, [keyed, keyed, plain]) == [
        True,
        False,
        False,
    ]
