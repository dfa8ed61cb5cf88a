"""Per-tenant data keys, envelope-wrapped: the keyring file and the key wrappers.

::

    master key file (32 random bytes, mode 0600)  or  an external KMS (kms = "module:factory")
        | wraps (AES-256-GCM, the tenant and key id as associated data)
        v
    keyring file (JSON, mode 0600)   {"tenants": {"acme": {"current": "<key id>",
                                        "keys": {"<key id>": {"wrapped": "<base64>", ...}}}}}
        | unwrapped in the client's memory only
        v
    data key of tenant acme (AES-256) -> seals acme's blocks (client/sealer.py)

A tenant's first sealed put creates its data key (under a lock on the keyring, so two
processes never make two). Destroying the tenant's entry (``kvstore purge --tenant T``) is
crypto-shredding: every block sealed under those keys becomes unreadable wherever its bytes
still lie (an SSD's remapped blocks, a backup, a node that never came back). Clients re-read
the keyring when it changes (checked at most once a second) and forget keys it no longer
holds. The keyring must be one shared file for all client hosts of a tenant (or keep the keys
in a KMS through the hook): a copy left on another host keeps the key alive.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import importlib
import json
import os
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvstore.auth import check_private, write_private
from kvstore.config import EncryptionConfig
from kvstore.errors import InvalidArgument

DATA_KEY_BYTES = 32  # AES-256
KEY_ID_BYTES = 8
RELOAD_CHECK_S = 1.0
_NONCE_BYTES = 12
_WRAP_AAD = b"kvstore/wrap/v1"


class KeyWrapper(Protocol):
    """Wraps and unwraps data keys: the master key file, or an external KMS."""

    def wrap(self, data_key: bytes, context: bytes) -> bytes: ...

    def unwrap(self, wrapped: bytes, context: bytes) -> bytes: ...


class MasterKeyFile:
    """A :class:`KeyWrapper` over a local master key file (32 random bytes, mode 0600)."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        check_private(path)
        key = path.read_bytes()
        if len(key) != DATA_KEY_BYTES:
            raise ValueError(
                f"master key file {path} holds {len(key)} bytes, not {DATA_KEY_BYTES}; make one "
                "with `python -c 'from client.keyring import new_master_key; new_master_key(PATH)'`"
            )
        self._aead = AESGCM(key)

    def wrap(self, data_key: bytes, context: bytes) -> bytes:
        nonce = secrets.token_bytes(_NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, data_key, _WRAP_AAD + context)

    def unwrap(self, wrapped: bytes, context: bytes) -> bytes:
        nonce, sealed = wrapped[:_NONCE_BYTES], wrapped[_NONCE_BYTES:]
        return self._aead.decrypt(nonce, sealed, _WRAP_AAD + context)


def new_master_key(path: str | Path) -> Path:
    """Write a fresh master key file (mode 0600) unless one exists; return its path."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(DATA_KEY_BYTES))
        tmp.replace(path)
    return path


def make_wrapper(config: EncryptionConfig) -> KeyWrapper:
    """The configured wrapper: ``kms = "module:factory"`` (called with the config), else the
    master key file."""
    if config.kms:
        module_name, _, name = config.kms.partition(":")
        factory = getattr(importlib.import_module(module_name), name or "make_wrapper")
        return factory(config)
    return MasterKeyFile(config.master_key_file)


def _context(tenant: str, key_id: bytes) -> bytes:
    return len(tenant.encode()).to_bytes(2, "little") + tenant.encode() + key_id


class Keyring:
    """The keyring file and the data keys unwrapped from it (see the module docstring)."""

    def __init__(self, path: str | Path, wrapper: KeyWrapper) -> None:
        self.path = Path(path)
        self._wrapper = wrapper
        self._lock = threading.Lock()
        self._doc: dict[str, Any] = {"tenants": {}}
        self._mtime_ns = -1
        self._checked_s = -RELOAD_CHECK_S
        self._key_id_to_key: dict[tuple[str, bytes], bytes] = {}

    def current_key(self, tenant: str, *, create: bool) -> tuple[bytes, bytes] | None:
        """(key id, data key) that seals ``tenant``'s new blocks; made when ``create``."""
        entry = self._document()["tenants"].get(tenant)
        if entry is None:
            if not create:
                return None
            entry = self._create(tenant)
        key_id = bytes.fromhex(entry["current"])
        key = self.key(tenant, key_id)
        return None if key is None else (key_id, key)

    def key(self, tenant: str, key_id: bytes) -> bytes | None:
        """The data key ``key_id`` of ``tenant``, or None if the keyring does not hold it."""
        entry = self._document()["tenants"].get(tenant)
        record = entry["keys"].get(key_id.hex()) if entry else None
        if record is None:
            return None
        cache_key = (tenant, key_id)
        if cache_key not in self._key_id_to_key:
            wrapped = base64.b64decode(record["wrapped"])
            try:
                key = self._wrapper.unwrap(wrapped, _context(tenant, key_id))
            except InvalidTag:
                raise InvalidArgument(
                    f"data key {key_id.hex()} of tenant {tenant!r} in {self.path} does not "
                    "unwrap: this is not the master key (or KMS) that wrapped it"
                ) from None
            self._key_id_to_key[cache_key] = key
        return self._key_id_to_key[cache_key]

    def rotate(self, tenant: str) -> bytes:
        """A new current key for ``tenant`` (older keys still open older blocks); its id."""
        with self._locked() as doc:
            entry = doc["tenants"].setdefault(tenant, {"keys": {}})
            return self._add_key(doc, tenant, entry)

    def destroy(self, tenant: str) -> bool:
        """Delete every data key of ``tenant`` (crypto-shredding); False if it had none."""
        with self._locked() as doc:
            existed = doc["tenants"].pop(tenant, None) is not None
            if existed:
                self._save(doc)
        return existed

    def _create(self, tenant: str) -> dict[str, Any]:
        with self._locked() as doc:
            entry = doc["tenants"].get(tenant)
            if entry is None:  # nobody made it while we waited for the lock
                entry = doc["tenants"].setdefault(tenant, {"keys": {}})
                self._add_key(doc, tenant, entry)
            return entry

    def _add_key(self, doc: dict[str, Any], tenant: str, entry: dict[str, Any]) -> bytes:
        key_id = secrets.token_bytes(KEY_ID_BYTES)
        wrapped = self._wrapper.wrap(secrets.token_bytes(DATA_KEY_BYTES), _context(tenant, key_id))
        entry["keys"][key_id.hex()] = {
            "wrapped": base64.b64encode(wrapped).decode(),
            "created_unix_s": time.time(),
        }
        entry["current"] = key_id.hex()
        self._save(doc)
        return key_id

    def _save(self, doc: dict[str, Any]) -> None:
        write_private(self.path, json.dumps(doc, indent=1, sort_keys=True))
        self._install(doc, self.path.stat().st_mtime_ns)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        """The freshly read document, under an exclusive lock across processes."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path.with_name(self.path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._checked_s = -RELOAD_CHECK_S
            yield self._document(force=True)
        finally:
            os.close(fd)

    def _document(self, *, force: bool = False) -> dict[str, Any]:
        """The keyring as last read; re-read when the file changed (checked once a second)."""
        now_s = time.monotonic()
        if not force and now_s - self._checked_s < RELOAD_CHECK_S:
            return self._doc
        with self._lock:
            self._checked_s = now_s
            try:
                mtime_ns = self.path.stat().st_mtime_ns
            except FileNotFoundError:
                self._install({"tenants": {}}, -1)
                return self._doc
            if mtime_ns != self._mtime_ns:
                check_private(self.path)
                self._install(json.loads(self.path.read_text()), mtime_ns)
        return self._doc

    def _install(self, doc: dict[str, Any], mtime_ns: int) -> None:
        """Use ``doc``; forget unwrapped keys it no longer holds (a destroyed tenant's)."""
        self._doc, self._mtime_ns = doc, mtime_ns
        held = {(t, bytes.fromhex(k)) for t, e in doc["tenants"].items() for k in e["keys"]}
        self._key_id_to_key = {k: v for k, v in self._key_id_to_key.items() if k in held}


def open_keyring(config: EncryptionConfig) -> Keyring:
    """The keyring the cluster's ``[encryption]`` names, with its wrapper."""
    return Keyring(config.keyring_file, make_wrapper(config))
