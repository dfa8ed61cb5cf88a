"""Encryption at rest, client-side: a block is sealed before erasure coding, opened after.

::

    put:  block --seal--> sealed block --encode--> 12 shards --> nodes
    get:  nodes --> shards --decode--> sealed block --open--> block   (or None: a miss)

Sealed block (AES-256-GCM under the tenant's data key, client/keyring.py)::

    offset  size  field
         0     4  magic b"KVS1"
         4     8  key id: which data key of the tenant sealed it
        12    12  nonce (random per block)
        24     n  ciphertext (n = plaintext bytes)
      24+n    16  GCM tag

Associated data (authenticated, not stored): ``b"kvstore/seal/v1"``, the tenant, the block
key (16 bytes: it already covers the namespace and the whole prefix) and the key id. So
nodes only ever see ciphertext, and a forged block, a block sealed for another key or
tenant, or one swapped in by a malicious node fails its tag: :meth:`BlockSealer.open` returns
None, a miss, like a bad checksum; never wrong bytes. A block whose key was destroyed
(crypto-shredding) is a miss too.

Random 96-bit nonces keep the chance of a repeat under 2^-32 for up to 2^32 blocks per data
key (NIST SP 800-38D); ``Keyring.rotate`` starts a new key long before that.
"""

from __future__ import annotations

import logging
import secrets
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from client.keyring import KEY_ID_BYTES, Keyring
from kvstore.errors import InvalidArgument

log = logging.getLogger(__name__)

MAGIC = b"KVS1"
_NONCE_BYTES = 12
_TAG_BYTES = 16
HEADER_BYTES = len(MAGIC) + KEY_ID_BYTES + _NONCE_BYTES
OVERHEAD_BYTES = HEADER_BYTES + _TAG_BYTES
_AAD_PREFIX = b"kvstore/seal/v1"


class BlockSealer:
    """Seals and opens the blocks of one tenant (see the module docstring)."""

    def __init__(self, tenant: str, keyring: Keyring) -> None:
        self.tenant = tenant
        self._keyring = keyring
        self._tenant_aad = _AAD_PREFIX + struct.pack("<H", len(tenant.encode())) + tenant.encode()
        self._aeads: dict[bytes, AESGCM] = {}
        self.num_open_failures = 0  # forged, swapped or shredded blocks: read as misses

    def _aead(self, key_id: bytes, data_key: bytes) -> AESGCM:
        aead = self._aeads.get(key_id)
        if aead is None:
            aead = self._aeads[key_id] = AESGCM(data_key)
        return aead

    def _aad(self, key: bytes, key_id: bytes) -> bytes:
        return self._tenant_aad + bytes(key) + key_id

    def seal(self, key: bytes, block: memoryview) -> bytearray:
        """The sealed form of ``block`` stored under ``key``."""
        current = self._keyring.current_key(self.tenant, create=True)
        assert current is not None, "create=True always yields a key"
        key_id, data_key = current
        nonce = secrets.token_bytes(_NONCE_BYTES)
        sealed = bytearray(HEADER_BYTES + len(block) + _TAG_BYTES)
        sealed[:HEADER_BYTES] = MAGIC + key_id + nonce
        self._aead(key_id, data_key).encrypt_into(
            nonce, block, self._aad(key, key_id), memoryview(sealed)[HEADER_BYTES:]
        )
        return sealed

    def open(
        self, key: bytes, sealed: bytes | memoryview, out: memoryview | None = None
    ) -> bytes | memoryview | None:
        """The plaintext (written into ``out`` when given), or None when it fails to open.

        Raises InvalidArgument when ``out`` is not exactly the plaintext's size.
        """
        view = memoryview(sealed)
        if len(view) < OVERHEAD_BYTES or view[: len(MAGIC)] != MAGIC:
            return self._failed(key, "not a sealed block (written without encryption?)")
        key_id = bytes(view[len(MAGIC) : len(MAGIC) + KEY_ID_BYTES])
        nonce = bytes(view[len(MAGIC) + KEY_ID_BYTES : HEADER_BYTES])
        plain_bytes = len(view) - OVERHEAD_BYTES
        if out is not None and len(out) != plain_bytes:
            raise InvalidArgument(
                f"get_into buffer is {len(out)} bytes but the block is {plain_bytes} bytes; "
                "pass a writable buffer of exactly the block's size"
            )
        data_key = self._keyring.key(self.tenant, key_id)
        if data_key is None:
            self._aeads.pop(key_id, None)
            return self._failed(key, "its data key is gone (purged: crypto-shredded)")
        aead, aad = self._aead(key_id, data_key), self._aad(key, key_id)
        try:
            if out is None:
                return aead.decrypt(nonce, view[HEADER_BYTES:], aad)
            aead.decrypt_into(nonce, view[HEADER_BYTES:], aad, out)
        except InvalidTag:
            if out is not None:  # no unauthenticated plaintext is left in the caller's buffer
                out[:] = bytes(len(out))
            return self._failed(key, "its tag does not verify (forged, swapped or corrupt)")
        return out

    def _failed(self, key: bytes, why: str) -> None:
        self.num_open_failures += 1
        log.warning("block %s of tenant %r reads as a miss: %s", bytes(key).hex(), self.tenant, why)
        return None
