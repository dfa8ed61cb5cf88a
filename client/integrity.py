"""End-to-end block integrity: block versions that only a tenant's clients can compute.

A block's version (the 16-byte block checksum every shard header carries, erasure/shard.py)
is, for a tenant under integrity, a keyed digest instead of xxh3-128::

    version = BLAKE3(key = the tenant's integrity key,
                     b"kvstore/integrity/v1" | u16 len | tenant | block key (16) | block)[:16]

The writer computes it in place of the xxh3 pass (erasure/codec.py ``encode_into``) and the
shards are flagged KEYED; a reader computes it over the decoded block in its one pass, in place
of xxh3 (``Codec.decode(digest=...)``), and requires it whatever flag a shard carries. Nodes
never hold the key: they store versions as opaque, repair relies on shard checksums, and a
node, the node credential or an operator with disk access can destroy or withhold a block,
or serve an older version the tenant wrote, but any bytes no client of the tenant wrote under
that key fail the check and read as a miss. The tenant and the block key are inside the
digest, so a block moved to another key or tenant fails too.

Keys: 32 random bytes per tenant in the integrity key file (JSON, mode 0600, on client hosts
only: ``[integrity] key_file`` in cluster.toml, which ``cluster up --auth`` sets), made by
``kvstore cluster add-tenant`` or by the tenant's first client. Sealed tenants
(client/sealer.py) need none: their blocks' GCM tag, under data keys the nodes never hold,
authenticates tenant, key and bytes in the pass that opens them, so a keyed version would only
add a second pass.

BLAKE3 (PyPI ``blake3``, SIMD, releases the GIL) costs more CPU per byte than xxh3; the
measurement is in docs/security.md (``kvstore bench integrity``).
"""

from __future__ import annotations

import hmac
import json
import secrets
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import blake3

from erasure import fastsum
from erasure.isal_backend import buffer_address
from erasure.shard import block_checksum
from kvstore.auth import check_private, locked, write_private
from kvstore.errors import InvalidArgument

DOMAIN = b"kvstore/integrity/v1"
KEY_BYTES = 32
VERSION_BYTES = 16
THREADED_BYTES = 1 << 20  # a block this large is hashed by BLAKE3's own threads too

BlockDigest = Callable[[bytes | memoryview], bytes]


class BlockCheck(Protocol):
    """How a reader checks a block against its version: the one pass over its bytes
    (client/batch_read.py calls it where it verifies blocks)."""

    def verify(
        self, keys: Sequence[bytes], blocks: Sequence[memoryview], versions: Sequence[bytes]
    ) -> list[bool]:
        """Per block, whether it is the version its shards named (blocks stay alive)."""
        ...

    def digest_for(self, key: bytes) -> BlockDigest:
        """``block -> version`` for one block key (``Codec.decode(digest=...)``)."""
        ...


class Xxh3Check:
    """A plain tenant's check: xxh3-128, one native call for many blocks, threads without the
    GIL (erasure.fastsum.verify_blocks)."""

    def verify(
        self, keys: Sequence[bytes], blocks: Sequence[memoryview], versions: Sequence[bytes]
    ) -> list[bool]:
        addresses = [buffer_address(block) for block in blocks]
        lengths = [len(block) for block in blocks]
        return fastsum.verify_blocks(addresses, lengths, b"".join(versions))

    def digest_for(self, key: bytes) -> BlockDigest:
        return block_checksum


XXH3_CHECK = Xxh3Check()


class BlockIntegrity:
    """The keyed versions of one tenant's blocks (see the module docstring)."""

    def __init__(self, tenant: str, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise InvalidArgument(f"an integrity key is {KEY_BYTES} bytes, got {len(key)}")
        self.tenant = tenant
        self._key = key
        encoded = tenant.encode()
        self._prefix = DOMAIN + struct.pack("<H", len(encoded)) + encoded

    def version(self, block_key: bytes, block: bytes | memoryview) -> bytes:
        """The 16-byte keyed version of ``block`` stored under ``block_key``."""
        threads = blake3.blake3.AUTO if len(block) >= THREADED_BYTES else 1
        hasher = blake3.blake3(self._prefix + bytes(block_key), key=self._key, max_threads=threads)
        hasher.update(block)
        return hasher.digest(VERSION_BYTES)

    def digest_for(self, block_key: bytes) -> BlockDigest:
        """``block -> version`` for one block key (what ``Codec.decode(digest=...)`` takes)."""
        return lambda block: self.version(block_key, block)

    def verify(
        self, keys: Sequence[bytes], blocks: Sequence[memoryview], versions: Sequence[bytes]
    ) -> list[bool]:
        """:class:`BlockCheck`: each block's keyed version, compared in constant time."""
        return [
            hmac.compare_digest(self.version(key, block), version)
            for key, block, version in zip(keys, blocks, versions, strict=True)
        ]


def load_key(path: str | Path, tenant: str) -> bytes:
    """``tenant``'s integrity key from the key file; InvalidArgument (with advice) without."""
    path = Path(path)
    try:
        check_private(path)
        tenants = json.loads(path.read_text()).get("tenants", {})
    except FileNotFoundError:
        raise InvalidArgument(f"no integrity key file at {path} ([integrity] key_file)") from None
    except (ValueError, OSError) as exc:
        raise InvalidArgument(f"[integrity] key_file {path}: {exc}") from None
    if tenant not in tenants:
        raise InvalidArgument(
            f"no integrity key for tenant {tenant!r} in {path}: this cluster checks every "
            "block end to end; `kvstore cluster add-tenant` makes the tenant's key"
        )
    return bytes.fromhex(tenants[tenant])


def tenant_key(path: str | Path, tenant: str) -> bytes:
    """``tenant``'s integrity key, made on first use (as a sealed tenant's data key is,
    client/keyring.py): the key file lives on client hosts only, and a key made anew makes
    older blocks misses, never wrong bytes."""
    ensure_key(path, tenant)
    return load_key(path, tenant)


def ensure_key(path: str | Path, tenant: str) -> bool:
    """Make ``tenant``'s integrity key in the key file unless it has one; True if made.
    A key is never replaced: blocks written under it would read as misses."""
    path = Path(path)
    with locked(path):
        doc = json.loads(path.read_text()) if path.exists() else {"tenants": {}}
        if tenant in doc["tenants"]:
            return False
        doc["tenants"][tenant] = secrets.token_bytes(KEY_BYTES).hex()
        write_private(path, json.dumps(doc, indent=1, sort_keys=True))
    return True
