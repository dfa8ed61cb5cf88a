"""The block sealer alone: AES-GCM with the tenant, key and key id bound as associated data."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from client.keyring import Keyring, MasterKeyFile, new_master_key, open_keyring
from client.sealer import HEADER_BYTES, OVERHEAD_BYTES, BlockSealer
from kvstore.config import EncryptionConfig
from kvstore.errors import InvalidArgument

KEY_A, KEY_B = b"a" * 16, b"b" * 16


@pytest.fixture
def keyring(tmp_path: Path) -> Keyring:
    return Keyring(tmp_path / "keyring.json", MasterKeyFile(new_master_key(tmp_path / "m.key")))


def test_roundtrip_into_a_buffer_and_the_overhead(keyring: Keyring) -> None:
    sealer = BlockSealer("acme", keyring)
    block = bytes(range(256)) * 40
    sealed = sealer.seal(KEY_A, memoryview(block))
    assert len(sealed) == len(block) + OVERHEAD_BYTES
    assert block[:64] not in bytes(sealed), "plaintext visible in the sealed block"
    out = bytearray(len(block))
    assert sealer.open(KEY_A, sealed, memoryview(out)) is not None and bytes(out) == block
    assert sealer.open(KEY_A, sealed) == block
    with pytest.raises(InvalidArgument, match="exactly the block's size"):
        sealer.open(KEY_A, sealed, memoryview(bytearray(10)))


@settings(max_examples=60, deadline=None)
@given(position=st.integers(0, 10_000), flip=st.integers(1, 255))
def test_any_flipped_byte_fails_to_open(tmp_path_factory, position: int, flip: int) -> None:
    root = tmp_path_factory.mktemp("flip")
    keyring = Keyring(root / "k.json", MasterKeyFile(new_master_key(root / "m.key")))
    sealer = BlockSealer("acme", keyring)
    sealed = sealer.seal(KEY_A, memoryview(b"x" * 4000))
    sealed[position % len(sealed)] ^= flip
    out = bytearray(4000)
    assert sealer.open(KEY_A, sealed) is None, "a forged block opened"
    assert sealer.open(KEY_A, sealed, memoryview(out)) is None
    assert out == bytearray(4000), "unauthenticated plaintext left in the caller's buffer"


def test_swapped_key_other_tenant_and_shredded_key_fail(keyring: Keyring) -> None:
    acme, globex = BlockSealer("acme", keyring), BlockSealer("globex", keyring)
    sealed = acme.seal(KEY_A, memoryview(b"acme's KV" * 100))
    assert acme.open(KEY_B, sealed) is None, "a block swapped to another key opened"
    assert globex.open(KEY_A, sealed) is None, "another tenant opened acme's block"
    assert acme.open(KEY_A, bytes(sealed[:HEADER_BYTES]) + b"\0" * 40) is None
    keyring.rotate("acme")
    assert acme.open(KEY_A, sealed) is not None, "rotation made older blocks unreadable"
    assert keyring.destroy("acme")
    assert acme.open(KEY_A, sealed) is None, "a block opened after its tenant's keys were destroyed"


def test_keyring_is_shared_between_processes_and_keys_are_wrapped(tmp_path: Path) -> None:
    master = new_master_key(tmp_path / "m.key")
    first = Keyring(tmp_path / "k.json", MasterKeyFile(master))
    second = Keyring(tmp_path / "k.json", MasterKeyFile(master))
    sealed = BlockSealer("acme", first).seal(KEY_A, memoryview(b"shared" * 10))
    assert BlockSealer("acme", second).open(KEY_A, sealed) == b"shared" * 10
    assert (tmp_path / "k.json").stat().st_mode & 0o077 == 0
    other_master = MasterKeyFile(new_master_key(tmp_path / "other.key"))
    with pytest.raises(InvalidArgument, match="not the master key"):
        Keyring(tmp_path / "k.json", other_master).current_key("acme", create=False)


class _RecordingKms:
    """A KMS stand-in behind the hook: wraps with its own key and records each call."""

    def __init__(self, config: EncryptionConfig) -> None:
        self.inner = MasterKeyFile(config.master_key_file)
        self.calls: list[str] = []

    def wrap(self, data_key: bytes, context: bytes) -> bytes:
        self.calls.append("wrap")
        return self.inner.wrap(data_key, context)

    def unwrap(self, wrapped: bytes, context: bytes) -> bytes:
        self.calls.append("unwrap")
        return self.inner.unwrap(wrapped, context)


def make_recording_kms(config: EncryptionConfig) -> _RecordingKms:
    return _RecordingKms(config)


def test_the_kms_hook_replaces_the_master_key(tmp_path: Path) -> None:
    config = EncryptionConfig(
        ("acme",),
        str(tmp_path / "k.json"),
        str(new_master_key(tmp_path / "kms.key")),
        kms="tests.client.test_sealer:make_recording_kms",
    )
    keyring = open_keyring(config)
    sealed = BlockSealer("acme", keyring).seal(KEY_A, memoryview(b"via kms"))
    assert BlockSealer("acme", open_keyring(config)).open(KEY_A, sealed) == b"via kms"
    kms = keyring._wrapper
    assert isinstance(kms, _RecordingKms) and kms.calls[0] == "wrap", "the hook was not used"
